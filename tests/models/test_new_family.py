"""A family written here, in the test, and registered for its duration: hook validation, the test
strategies and the bench pick it up with nothing else edited. The toy has no Megatron class
(Megatron has none for a stack of bare MLP blocks) and its record says so, which ``check --impl
megatron`` reports. The throwaway packages of tests/models/throwaway, driven through every command
by test_throwaway_families.py, show the rest."""

from __future__ import annotations

import dataclasses
import sys
import types
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mmparity.models import registry as families
from mmparity.models.spec import (
    Case, ConfigHooks, FamilyHooks, NoMegatron, NoMegatronClass, Pair, Parity, Side, tokens_2d)
from mmparity.cli.main import main
from mmparity.mapping.ops import fuse_gate_up
from mmparity.mapping.rules import ConverterSpec, Rule, RuleSet, rename
from mmparity.parity import bench, harness
from tests.strategies import config_and_tp, family_configs


@dataclass
class ToyConfig:
    """Stands in for an HF config: a stack of gated MLP blocks."""

    hidden_size: int = 6
    intermediate_size: int = 4
    num_hidden_layers: int = 2
    model_type: str = "toy"


class ReferenceBlock(torch.nn.Module):
    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.gate_proj = torch.nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = torch.nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = torch.nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return x + self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class ReferenceToy(torch.nn.Module):
    """The "HF" side: separate gate / up projections, HF-style names."""

    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.layers = torch.nn.ModuleList(ReferenceBlock(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, x):
        for block in self.layers:
            x = block(x)
        return x


class NativeLayer(torch.nn.Module):
    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.linear_fc1 = torch.nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.linear_fc2 = torch.nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        gate, up = self.linear_fc1(x).chunk(2, dim=-1)
        return x + self.linear_fc2(torch.nn.functional.silu(gate) * up)


class NativeToy(torch.nn.Module):
    """The "mcore" side: fused ``[gate; up]`` as ``linear_fc1``, mcore-style names."""

    def __init__(self, cfg: ToyConfig):
        super().__init__()
        self.decoder = torch.nn.Module()
        self.decoder.layers = torch.nn.ModuleList(NativeLayer(cfg) for _ in range(cfg.num_hidden_layers))

    def forward(self, x):
        for layer in self.decoder.layers:
            x = layer(x)
        return x


def rule_set(cfg: ToyConfig, hf_format: str) -> RuleSet:
    mc, hf = "decoder.layers.{i}.", "layers.{i}."
    return RuleSet(
        rules=(Rule(mc + "linear_fc1.weight", (hf + "gate_proj.weight", hf + "up_proj.weight"),
                    fuse_gate_up(), "gated"),
               rename(mc + "linear_fc2.weight", hf + "down_proj.weight", "row")),
        variables={"i": cfg.num_hidden_layers}, hf_format=hf_format,
        validate_tp=lambda tp: [f"tp={tp} does not divide intermediate_size={cfg.intermediate_size}"]
        if tp > 0 and cfg.intermediate_size % tp else [])


SPEC = ConverterSpec(formats=("hf",), rule_set=rule_set)


def build_reference(cfg):
    return ReferenceToy(cfg).eval()


def state_shapes(cfg):
    with torch.device("meta"):
        return {k: tuple(v.shape) for k, v in build_reference(cfg).state_dict().items()}


def cases(cfg, seed, image_sizes=None):
    x = torch.randn(5, cfg.hidden_size, generator=torch.Generator().manual_seed(seed))
    return [Case("tokens", {"x": x}, description="5 random tokens")]


def run(model, case):
    param = next(model.parameters())
    return {"last_hidden_state": model(case.data["x"].to(param.device, param.dtype))}


def reference_pairs(model, cfg):
    return [Pair(f"layer.{i}", block, tokens_2d) for i, block in enumerate(model.layers)]


def native_pairs(model, cfg):
    return [Pair(f"layer.{i}", layer, tokens_2d) for i, layer in enumerate(model.decoder.layers)]


def no_component(name, model, cfg, seed):
    raise KeyError(name)


def random_config(pick) -> ToyConfig:
    return ToyConfig(hidden_size=pick([2, 3, 6]), intermediate_size=pick([1, 2, 4, 6]),
                     num_hidden_layers=pick([1, 2, 3]))


def hooks(towers) -> FamilyHooks:
    return FamilyHooks(
        config=ConfigHooks(tiny=ToyConfig, family_config=family_config, random=random_config,
                           image_size_multiple=lambda cfg: 1),
        reference=Side(run, reference_pairs, no_component, build_reference),
        native=Side(run, native_pairs, no_component,
                    lambda cfg, params_dtype=torch.float32: NativeToy(cfg).to(params_dtype)),
        converter=SPEC, parity=Parity(cases), megatron=NO_MEGATRON)


NO_MEGATRON = NoMegatron("Megatron has no class for a stack of bare gated MLP blocks (a test toy)")


def family_config(cfg):
    return cfg


# The toy's modules, as a real family has them: what conversion reads without the models
# (config, shapes, key tables) and the hooks.
MODULES = {
    "mmparity.models.toy.reference": dict(tiny_config=ToyConfig, vision_config=family_config,
                                   state_shapes=state_shapes, build=build_reference),
    "mmparity.models.toy.mapping": dict(SPEC=SPEC),
    "mmparity.models.toy.cases": dict(hooks=hooks),
}


@pytest.fixture
def toy(monkeypatch):
    """Registers the toy family's modules plus one registry entry, for one test."""
    for name, contents in MODULES.items():
        module = types.ModuleType(name)
        module.__dict__.update(contents)
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setitem(families._REGISTRY, "toy", families.Family(
        name="toy", summary="a stack of gated MLP blocks", reference_classes=("ReferenceToy",)))
    return families.get("toy")


def test_the_registry_lists_and_validates_it(toy):
    assert "toy" in families.names()
    assert toy.hooks.converter.formats == ("hf",)
    # The registry's converter is the module's SPEC plus the layout transformers' mapping gives.
    assert toy.converter.formats == SPEC.formats + (families.TRANSFORMERS_LAYOUT,)
    assert toy.converter.detect_format is SPEC.detect_format
    assert toy.state_shapes(toy.tiny_config())["layers.1.down_proj.weight"] == (6, 4)


def test_strategies_draw_from_its_record(toy):
    @settings(max_examples=5, deadline=None)
    @given(data=st.data())
    def property_(data):
        cfg, tp = data.draw(config_and_tp("toy"))
        assert isinstance(cfg, ToyConfig) and cfg.intermediate_size % tp == 0

    property_()
    assert family_configs("toy") is not None


def test_the_bench_leaves_its_flops_uncounted_and_unpublished(toy):
    assert bench.tower_shape(toy, toy.tiny_config()) is None
    assert "toy" not in bench.published_families()


def test_a_missing_required_hook_fails_naming_the_family(monkeypatch):
    def incomplete(towers):
        return dataclasses.replace(hooks(towers), converter=None)

    def missing(towers):
        fields = {f.name: getattr(hooks(towers), f.name) for f in dataclasses.fields(FamilyHooks)}
        del fields["parity"]
        return FamilyHooks(**fields)

    def missing_cases(towers):  # a group left without one of its own required hooks
        return dataclasses.replace(hooks(towers), parity=Parity())

    def mistyped_in_a_group(towers):
        return dataclasses.replace(hooks(towers), config=dataclasses.replace(hooks(towers).config, random=3))

    def no_builder(towers):  # a side's template, without the family's builder
        return dataclasses.replace(hooks(towers), native=Side(run, native_pairs, no_component))

    def silent_on_megatron(towers):  # neither a Megatron class nor the reason it has none
        fields = {f.name: getattr(hooks(towers), f.name) for f in dataclasses.fields(FamilyHooks)}
        del fields["megatron"]
        return FamilyHooks(**fields)

    def empty_megatron(towers):
        return dataclasses.replace(hooks(towers), megatron={})

    for name, make, hook in (("toy_bad", incomplete, "converter"), ("toy_missing", missing, "parity"),
                             ("toy_no_cases", missing_cases, "cases"), ("toy_typo", mistyped_in_a_group, "random"),
                             ("toy_unbuilt", no_builder, "native.build"),
                             ("toy_silent", silent_on_megatron, "megatron"), ("toy_empty", empty_megatron, "megatron")):
        module = types.ModuleType(f"mmparity.models.{name}.cases")
        module.hooks = make
        monkeypatch.setitem(sys.modules, f"mmparity.models.{name}.cases", module)
        monkeypatch.setitem(families._REGISTRY, name, families.Family(name=name, summary="", reference_classes=()))
        with pytest.raises(families.FamilyError, match=f"{name}.*{hook}"):
            families.get(name).hooks



def test_no_megatron_class_is_reported_with_the_records_reason(toy, capsys):
    with pytest.raises(NoMegatronClass, match="bare gated MLP blocks"):
        toy.megatron_class()
    with pytest.raises(harness.InputError, match="family 'toy' has no Megatron class: Megatron has no class"):
        harness.check("toy", impl="megatron")
    capsys.readouterr()
    assert main(["check", "toy", "--impl", "megatron"]) == 2
    err = capsys.readouterr().err
    assert "toy" in err and "bare gated MLP blocks" in err and "Traceback" not in err
    with pytest.raises(TypeError, match="reason"):
        NoMegatron(" ")
