"""What a family hands the generic machinery: its parity cases and paired modules, and the record
of every hook the registry, the harness, the converter pipeline, the bench and the tests read.

Framework-free: plain tensors, dataclasses and callables.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional, Sequence

from mmparity.converters.rules import ConverterSpec


@dataclass
class Case:
    """``name`` identifies the check; ``data`` holds plain tensors and lists both sides read."""

    name: str
    data: dict
    outputs: tuple = ("last_hidden_state",)
    description: str = ""


# Extracts a canonical (tokens, features) tensor from a hooked module's output for one case.
Extractor = Callable[[Any, Case], Any]


@dataclass
class Pair:
    """One module on one side whose output is compared with its counterpart of the same ``name``."""

    name: str
    module: Any
    extract: Extractor = field(default=None)
    # Copy the output when it is produced: the model later adds to it in place (mcore's
    # bias-dropout-add on an attention output), so the tensor read after the run is not it.
    snapshot: bool = False


def first_tensor(output):
    while isinstance(output, (tuple, list)):
        output = output[0]
    if hasattr(output, "last_hidden_state"):
        output = output.last_hidden_state
    return output


def tokens_2d(output, case: Case):
    """Any (…, features) tensor -> (tokens, features) in its stored order."""
    t = first_tensor(output)
    return t.reshape(-1, t.shape[-1])


def sbh_tokens_2d(output, case: Case):
    """mcore layer outputs are [seq, batch, hidden]: batch-major before flattening."""
    t = first_tensor(output)
    return t.transpose(0, 1).reshape(-1, t.shape[-1])


def routing_tensor(weights, scores=None):
    """What a router pair's extractor returns, ``[tokens, experts, 2]``: the routing weights (zero
    where an expert was not chosen) and the scores the choice was made on (zeros where a side
    does not expose them); :mod:`mmparity.parity.router` judges such pairs token by token."""
    import torch

    scores = torch.zeros_like(weights) if scores is None else scores.to(weights.dtype)
    return torch.stack([weights, scores], dim=-1)


def keep_case(case: Case, cfg) -> Case:
    return case


def recording_patch(patch_size: Callable[[Any], int]) -> Callable[[Case, Any], Case]:
    """A ``prepare_case`` that records ``patch_size(cfg)`` in the case, for extractors that
    crop patch grids."""
    def prepare_case(case: Case, cfg) -> Case:
        case.data.setdefault("patch", patch_size(cfg))
        return case

    return prepare_case


def no_problems(*unused) -> list:
    return []


@dataclass(frozen=True)
class Side:
    """How the harness drives one side's model: ``run(model, case) -> {output: tensor}``,
    ``pairs(model, cfg) -> [Pair]`` and ``component(name, model, cfg, seed) -> tensor``."""

    run: Callable
    pairs: Callable
    component: Callable


@dataclass(frozen=True)
class TowerShape:
    """What the bench's FLOP count needs from a config. ``merger``: (in, out) linears applied to
    each merged token (``merge`` x ``merge`` patches); ``head``: ``"attention_pool"`` for SigLIP's."""

    hidden: int
    layers: int
    heads: int
    groups: int
    head_dim: int
    ffn: int
    gated: bool
    patch: int
    channels: int
    temporal: int = 1
    class_tokens: int = 0
    merge: int = 1
    merger: tuple = ()
    head: Optional[str] = None


@dataclass(frozen=True)
class Published:
    """A family's released vision config for the bench: ``vision`` kwargs for the class of the
    family's own vision config, ``parent`` dotted overrides of a whole-model tiny config
    (``text_config.…``), and the benchmark's default batch."""

    source: str
    vision: dict
    images: int
    image_size: tuple
    parent: dict = field(default_factory=dict)
    note: str = ""
    # ``--mixed``: sizes cycled over ``mixed_images`` images (default one of each), chosen so that
    # the packed batch carries about as many tokens as the uniform one and the two timings compare.
    mixed: tuple = ()
    mixed_images: Optional[int] = None


@dataclass(frozen=True)
class LlavaTower:
    """What LLaVA needs of a vision family to use it as its tower.

    ``model_type``: the ``vision_config.model_type`` that selects it; ``class_token_len``: tokens
    the tower prepends to the patches; ``variable_size``: HF's LLaVA forward takes images of
    several sizes at once (with ``image_sizes``), else only the configured size;
    ``v4_checkpoint_root``: the extra root transformers 4 saved the tower under.
    """

    model_type: str
    class_token_len: int = 0
    variable_size: bool = False
    v4_checkpoint_root: str = ""


# ``pick(options)`` returns one of ``options``; a family's ``random_config(pick)`` builds a config
# from such choices, so tests can drive it with hypothesis and the library needs none.
Pick = Callable[[Sequence], Any]


@dataclass(frozen=True)
class FamilyHooks:
    """Every hook of one family. The first block is required; the rest default to "none"."""

    tiny_config: Callable[[], Any]
    family_config: Callable[[Any], Any]  # the family's config inside a (possibly whole-VLM) config
    build_reference: Callable[[Any], Any]
    build_native: Callable[..., Any]  # (cfg, params_dtype=float32) -> mcore module
    converter: ConverterSpec
    cases: Callable[..., list]  # (cfg, seed, image_sizes=None) -> [Case]
    reference: Side
    native: Side
    random_config: Callable[[Pick], Any]

    components: tuple = ()
    # Components the native side computes on the last pipeline stage (the rest on the first).
    last_stage_components: tuple = ()
    prepare_case: Callable[[Case, Any], Case] = keep_case
    # Image sides must be multiples of this; None: the patch size, times the merge size if any.
    image_size_multiple: Optional[Callable[[Any], int]] = None
    image_size_problems: Callable[[Any, Sequence], list] = no_problems
    pipeline_problems: Callable[[Any, int], list] = no_problems
    # The bench: a FLOP formula (``shape(cfg, base) -> TowerShape``) and a released size.
    flop_shape: Optional[Callable[[Any, TowerShape], TowerShape]] = None
    published: Optional[Published] = None
    llava_tower: Optional[LlavaTower] = None

    def check(self, family: str) -> None:
        """Raise naming ``family`` and the hook when a required hook is missing or mistyped."""
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "converter":
                ok = isinstance(value, ConverterSpec)
            elif f.name in ("reference", "native"):
                ok = isinstance(value, Side)
            elif f.name == "published":
                ok = value is None or isinstance(value, Published)
            elif f.name == "llava_tower":
                ok = value is None or isinstance(value, LlavaTower)
            elif f.name in ("components", "last_stage_components"):
                ok = isinstance(value, tuple) and all(isinstance(n, str) for n in value)
            else:
                ok = callable(value) or (value is None and f.default is None)
            if not ok:
                raise TypeError(f"family {family!r}: hook {f.name!r} is {value!r}, which does not fit")


def module_hooks(reference_module, native_module, converter: ConverterSpec, /, **hooks) -> FamilyHooks:
    """The usual record: the config, builders and converter from the family's reference module
    (``tiny_config``, ``vision_config``, ``build``), native module (``build_native``) and
    converter spec; every other hook as given."""
    return FamilyHooks(tiny_config=reference_module.tiny_config, family_config=reference_module.vision_config,
                       build_reference=reference_module.build, build_native=native_module.build_native,
                       converter=converter, **hooks)


# How a composite family (LLaVA) finds the registered family of a vision tower: given the whole
# config, that tower family's hooks; ``ValueError`` naming the registered towers otherwise.
TowerLookup = Callable[[Any], FamilyHooks]
