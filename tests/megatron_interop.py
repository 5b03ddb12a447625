"""The interop study: HF weights -> the converter (Megatron's layout) -> Megatron's own class.

For a family: seeded HF weights, ``Family.hf_to_mcore`` (the real converter, which writes
Megatron's layout with what it has no place for aside), a strict load
(``upstream.models.load_strict``) of its mcore state into the class its Megatron record (the
family's hooks' ``megatron``) builds, a forward on the cases that record gives, and the comparison with HF's outputs, output by output and
module by module. ``check --impl megatron`` does the same through the parity harness; this driver
keeps the raw per-output numbers and the Kimi projection variants for ``tests/models/test_upstream.py``
and ``scripts/megatron_parity.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from mmparity.models import registry as families
from mmparity.parallel import runtime
from mmparity.models.core import inputs
from mmparity.models.spec import Case, MegatronClass, NoMegatron
from mmparity.models.llava.megatron import llava_clip_config
from mmparity.parity.metrics import compare, fp32_tolerance
from mmparity.parity import harness
from mmparity.models.core import megatron_classes as models

TOLERANCE = fp32_tolerance().rel_l2
# Megatron's class name in the study -> (the mmparity family it is fed from, its Megatron class).
CLASS_OF = {"clip_vit": ("clip", "ViTModel")}
load_strict = models.load_strict


def source(family: str) -> str:
    return CLASS_OF.get(family, (family,))[0]


def megatron_class(family: str) -> MegatronClass:
    return families.megatron_class(*CLASS_OF.get(family, (family, None)))[1]


def whole_class_families() -> list[str]:
    """The registered families whose default Megatron class holds their whole mcore state dict,
    in registry order: each has a recorded layout (``tests/data/megatron_layout/<family>.json``)."""
    out = []
    for name in families.names():
        classes = families.get(name).hooks.megatron
        if not isinstance(classes, NoMegatron) and not next(iter(classes.values())).holds:
            out.append(name)
    return out


def needs_megatron_lm_main(family: str) -> bool:
    """Whether the family's default Megatron class is one of Megatron-LM main's (``vit_model``)."""
    return getattr(megatron_class(family).build, "needs_vit_model", False)


def stock_and_main_families() -> tuple[list[str], list[str]]:
    """:func:`whole_class_families` split into those stock megatron-core builds and those that
    need Megatron-LM main."""
    whole = whole_class_families()
    return ([f for f in whole if not needs_megatron_lm_main(f)], [f for f in whole if needs_megatron_lm_main(f)])


def layout_config(family: str):
    """The HF config a family's default Megatron class is measured and checked on: the record's
    ``default_config`` where the family's tiny config has no Megatron class (LLaVA's), else it."""
    record = families.megatron_class(family)[1]
    return record.default_config() if record.default_config is not None else families.get(family).tiny_config()


def hf_model(family: str, cfg, seed: int):
    """The HF reference with seeded, non-constant weights (the native check's recipe)."""
    fam = families.get(source(family))
    ref = fam.build_reference(cfg)
    ref.load_state_dict(inputs.random_like_state(ref.state_dict(), seed), strict=True)
    return ref


# Kimi's projector constructions (``mmparity.models.kimi_k25.megatron.KIMI_PROJECTIONS``): the converter's keys each
# one has no place for. The converter writes the proposal, a fused norm over the merged vector.
KIMI_UNPLACED = {"fused_norm_over_merged": (),
                 "drop_pre_norm": ("vision_projection.encoder.linear_fc1.layer_norm_weight",
                                   "vision_projection.encoder.linear_fc1.layer_norm_bias")}
# The studies of a projector construction other than the one the converter writes, by run name.
PROJECTION_STUDIES = {f"kimi_k25/{name}": {"kimi_projection": name} for name in KIMI_UNPLACED
                      if name != "fused_norm_over_merged"}


def megatron_state(family: str, cfg, hf_state: dict, tp: int,
                   kimi_projection: str = "fused_norm_over_merged") -> tuple[list, list]:
    """(per-rank state dicts Megatron's class loads, the keys kept out of them): the converter's
    mcore state, less what the Kimi projector construction asked for has no place for."""
    shards = families.get(source(family)).hf_to_mcore(hf_state, cfg, tp_size=tp)
    unplaced = KIMI_UNPLACED[kimi_projection] if family == "kimi_k25" else ()
    states = [megatron_class(family).state({k: v for k, v in shard.items() if k not in unplaced})
              for shard in shards]
    return states, list(shards.side[0]) + [k for k in unplaced if k in shards[0]]


def family_cases(family: str, cfg, seed: int) -> list[Case]:
    hooks = families.get(source(family)).hooks
    return [hooks.parity.prepare_case(c, cfg) for c in megatron_class(family).cases(hooks, cfg, seed, None)]


def hf_outputs(family: str, ref, case: Case) -> dict:
    with torch.no_grad():
        return families.get(source(family)).hooks.reference.run(ref, case)


def megatron_outputs(family: str, model, case: Case, cfg) -> dict:
    """Megatron's outputs under the names of the HF outputs they correspond to. An HF output with
    no Megatron counterpart (CLIP's pooled ``ln_post``, SigLIP's head) is absent."""
    with torch.no_grad():
        out = megatron_class(family).run(model, case, cfg)
    return {k: v for k, v in out.items() if k in case.outputs}


def _capture(pairs, first: bool) -> tuple[dict, list]:
    seen: dict = {}
    handles = []
    for pair in pairs:
        # A snapshot pair's output is changed in place later (mcore's bias-dropout-add adds the
        # residual into the attention and MLP outputs): it is copied when produced, as the harness does.
        def hook(m, a, out, name=pair.name, copy=pair.snapshot):
            out = harness._snapshot(out) if copy else out
            if first:
                seen.setdefault(name, out)
            else:
                seen[name] = out
        handles.append(pair.module.register_forward_hook(hook))
    return seen, handles


def module_divergence(family: str, model, ref, cfg, case: Case) -> list[dict]:
    """Per paired module on ``case``: rel_l2 / max_abs of Megatron's output against HF's."""
    mclass = megatron_class(family)
    hf_pairs = {p.name: p for p in mclass.reference_pairs(
        families.get(source(family)).hooks.reference.pairs(ref, cfg), cfg)}
    mg_pairs = [p for p in mclass.pairs(model, cfg) if p.name in hf_pairs]
    hf_seen, hf_handles = _capture([hf_pairs[p.name] for p in mg_pairs], first=True)
    mg_seen, mg_handles = _capture(mg_pairs, first=True)
    try:
        hf_outputs(family, ref, case)
        megatron_outputs(family, model, case, cfg)
    finally:
        for h in hf_handles + mg_handles:
            h.remove()
    rows = []
    for pair in mg_pairs:
        if pair.name not in hf_seen or pair.name not in mg_seen:
            continue
        hf_t = hf_pairs[pair.name].extract(hf_seen[pair.name], case)
        mg_t = pair.extract(mg_seen[pair.name], case)
        if hf_t.shape != mg_t.shape:
            rows.append({"module": pair.name, "error": f"shape {tuple(mg_t.shape)} vs HF {tuple(hf_t.shape)}"})
            continue
        m = compare(mg_t, hf_t)
        rows.append({"module": pair.name, "rel_l2": m.rel_l2, "max_abs": m.max_abs})
    return rows


def first_divergence(rows: list[dict], tolerance: float = TOLERANCE) -> Optional[dict]:
    for row in rows:
        if "error" in row or row["rel_l2"] > tolerance:
            return row
    return None


# --- one family, one TP size ----------------------------------------------------------------------

@dataclass
class Study:
    family: str
    tp: int
    side_keys: list
    tolerated_missing: list
    outputs: dict = field(default_factory=dict)  # "case/output" -> {rel_l2, max_abs}
    errors: dict = field(default_factory=dict)  # "case" -> the error Megatron raised
    modules: list = field(default_factory=list)  # static case, per module


def _run_cases(family, model, cfg, cases):
    results, errors = {}, {}
    for case in cases:
        try:
            results[case.name] = megatron_outputs(family, model, case, cfg)
        except Exception as exc:  # a Megatron failure on an input is a finding, recorded as such
            errors[case.name] = f"{type(exc).__name__}: {exc}"
    return results, errors


def _tp_rank(rank: int, world: int, family: str, cfg, seed: int, options: dict):
    runtime.init_parallel(world, 1)
    try:
        ref = hf_model(family, cfg, seed)
        shards, side = megatron_state(family, cfg, ref.state_dict(), world, **_map_options(options))
        model = models.build(megatron_class(family).build, cfg, **_build_options(family, options))
        tolerated = load_strict(model, shards[rank])
        results, errors = _run_cases(family, model, cfg, family_cases(family, cfg, seed))
        return {"tolerated": tolerated, "side": list(side), "results": results, "errors": errors}
    finally:
        runtime.teardown_parallel()


def _map_options(options: dict) -> dict:
    return {k: v for k, v in options.items() if k == "kimi_projection"}


def _build_options(family: str, options: dict) -> dict:
    if family == "kimi_k25" and "kimi_projection" in options:
        return {"projection": options["kimi_projection"]}
    return {}


def study(family: str, cfg=None, *, tp: int = 1, seed: int = 0, modules: bool = True,
          **options) -> Study:
    """Convert, map, load strictly, run, compare. TP > 1 runs Megatron on spawned gloo ranks."""
    cfg = cfg if cfg is not None else families.get(source(family)).tiny_config()
    ref = hf_model(family, cfg, seed)
    cases = family_cases(family, cfg, seed)
    expected = {c.name: hf_outputs(family, ref, c) for c in cases}
    if tp == 1:
        if runtime.current_layout() is None:
            runtime.init_parallel(1, 1)
        shards, side = megatron_state(family, cfg, ref.state_dict(), 1, **_map_options(options))
        model = models.build(megatron_class(family).build, cfg, **_build_options(family, options))
        tolerated = load_strict(model, shards[0])
        results, errors = _run_cases(family, model, cfg, cases)
        side_keys = list(side)
    else:
        ranks = runtime.spawn(_tp_rank, tp, family, cfg, seed, options)
        tolerated, side_keys = ranks[0]["tolerated"], ranks[0]["side"]
        results, errors = ranks[0]["results"], ranks[0]["errors"]
        model = None
    out = Study(family, tp, side_keys, tolerated, errors=errors)
    for name, produced in results.items():
        for key, tensor in produced.items():
            metrics = compare(tensor, expected[name][key])
            out.outputs[f"{name}/{key}"] = {"rel_l2": metrics.rel_l2, "max_abs": metrics.max_abs}
    if modules and model is not None:
        static = [c for c in cases if c.name == "static"]
        if static and "static" in results:
            out.modules = module_divergence(family, model, ref, cfg, static[0])
    return out


def worst(s: Study) -> float:
    return max((v["rel_l2"] for v in s.outputs.values()), default=float("nan"))
