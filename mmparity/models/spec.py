"""What a family hands the generic machinery: its parity cases and paired modules, and the record
of every hook the registry, the harness, the converter pipeline, the bench and the tests read.

Framework-free: plain tensors, dataclasses and callables.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from mmparity.mapping.rules import VOCAB_MULTIPLE, ConverterSpec


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

    def under(self, prefix: str) -> "Pair":
        """This pair named inside a bigger model (``vision_model.`` + its name), all else kept."""
        return replace(self, name=prefix + self.name)


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


def _refuse(hook: str, value) -> None:
    raise TypeError(f"hook {hook!r} is {value!r}, which does not fit")


def _callables(record, *names: str, optional: tuple = ()) -> None:
    """TypeError naming the first of ``names`` (or of ``optional``, which may be None) that is not
    callable: a family's hooks fail where they are built, naming the hook."""
    for name in names + optional:
        value = getattr(record, name)
        if not (callable(value) or (value is None and name in optional)):
            _refuse(name, value)


def _names(hook: str, value) -> None:
    if not (isinstance(value, tuple) and all(isinstance(n, str) for n in value)):
        _refuse(hook, value)


@dataclass(frozen=True)
class Side:
    """How the harness drives one side's model: ``run(model, case) -> {output: tensor}``,
    ``pairs(model, cfg) -> [Pair]`` and ``component(name, model, cfg, seed) -> tensor``; ``build``
    makes the model for a config (the reference: ``build(cfg)``, fp32 in eval mode; the native
    side: ``build(cfg, params_dtype=float32)``). A side without ``build`` is a template a family
    shares (SigLIP drives its native model as CLIP's); the family's record names the builder."""

    run: Callable
    pairs: Callable
    component: Callable
    build: Optional[Callable[..., Any]] = None

    def __post_init__(self):
        _callables(self, "run", "pairs", "component", optional=("build",))


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
    ``v4_checkpoint_root``: the extra root transformers 4 saved the tower under; ``max_patches``:
    how many patches per image side the tower takes, for its vision config; ``megatron_type``:
    Megatron-LM's ``LLaVAModel`` ``vision_model_type`` for the tower (empty: it has none);
    ``vit_model``: that tower is Megatron-LM main's ``vit_model.ViTModel``, which ``LLaVAModel``
    cannot be built with (the whole VLM is then checked and loaded part by part);
    ``megatron_config(vc, params_dtype, num_layers)``: the tower family's recipe of the
    ``TransformerConfig`` Megatron's classes build its tower with (None: it has none).
    """

    model_type: str
    class_token_len: int = 0
    variable_size: bool = False
    v4_checkpoint_root: str = ""
    megatron_type: str = ""
    vit_model: bool = False
    megatron_config: Optional[Callable] = None
    # (vision config) -> the layer spec Megatron's LLaVAModel builds the tower's layers with (None:
    # Megatron-LM's ViT layer with TE, CLIP's and SigLIP's).
    megatron_layer_spec: Optional[Callable] = None
    # Patches per image side the tower takes for its vision config (None: any number).
    max_patches: Optional[Callable[[Any], int]] = None


def keep_reference_pairs(pairs: list, cfg) -> list:
    return pairs


def keep_reference_outputs(outputs: dict, case: Case, cfg, tp: int, *, divisible_by: int = VOCAB_MULTIPLE) -> dict:
    return outputs


@dataclass(frozen=True)
class MegatronClass:
    """One Megatron class a family's converted weights load into (``check --impl megatron``,
    ``verify --load``); a family lists its own in its hooks' ``megatron``.

    ``build(cfg, params_dtype, **options)``: the builder of :mod:`mmparity.models.core.megatron_classes` (a
    builder marked ``needs_vit_model`` needs Megatron-LM main);
    ``cases(hooks, cfg, seed, image_sizes)``: the family's cases it accepts;
    ``run(model, case, cfg)``: its outputs under the HF output names (an HF output it has no
    counterpart for is absent); ``pairs(model, cfg)``: its submodules named as the reference's pairs;
    ``reference_pairs(pairs, cfg)``: the reference's pairs as set against this class;
    ``reference_outputs(outputs, case, cfg, tp, divisible_by=N)``: the reference's outputs as this
    class computes them by design, for a class built with vocabulary divisor ``N`` (``note`` says
    how, in each result's description);
    ``module_cases``: the cases whose per-module outputs are compared (Megatron's packed paths call
    some modules once per image, where HF calls them once);
    ``default_config``: the config ``check`` uses (and the recorded layout is measured on) when none
    is given, where the family's tiny one has no Megatron class; ``renamed``: ``(mcore key, this
    class's key)`` pairs where a class other than the family's default spells a tensor differently
    (the converter writes the default's);
    ``pipelined``: Megatron builds the class in pipeline stages (``LLaVAModel``'s language model),
    so a PP > 1 checkpoint loads into it stage by stage; a class that is not is built whole on the
    first stage; ``stage_module(model)``: where ``check --pp`` runs the class in stages, the
    module whose input comes from the previous stage (None: not run in stages);
    ``holds``: the prefixes of the family's mcore keys the class holds (empty: all of them), and
    ``root`` the prefix its own keys sit under there (``language_model.`` for ``GPTModel``);
    ``reference_run(model, case, cfg)``: the HF model's run for a class that holds a part, in place
    of the family's whole run; ``why_part``: why the family's whole model has no Megatron class
    here (shown wherever the part is checked or loaded); ``unwritten_extra_state``: modules (by the
    last parts of their names) of the class whose TE ``_extra_state`` slot mmparity's converter
    does not write yet: ``verify --load`` fills exactly those with the empty slot the writer writes
    for every other TE module (``None``) and says how many it filled; ``refuses(cfg)``: why the class
    cannot be built for a model of that config (None: it can), where that depends on the model
    (``LLaVAModel`` on a Pixtral tower): ``verify --load`` then loads the family's other classes."""

    build: Callable
    cases: Callable
    run: Callable
    pairs: Callable
    reference_pairs: Callable = keep_reference_pairs
    reference_outputs: Callable = keep_reference_outputs
    note: str = ""
    module_cases: tuple = ("static",)
    default_config: Optional[Callable[[], object]] = None
    renamed: tuple = ()
    pipelined: bool = False
    stage_module: Optional[Callable] = None
    holds: tuple = ()
    root: str = ""
    reference_run: Optional[Callable] = None
    why_part: str = ""
    unwritten_extra_state: tuple = ()
    refuses: Optional[Callable[[object], Optional[str]]] = None

    def refusal(self, cfg) -> Optional[str]:
        """Why this class cannot be built for a model of ``cfg`` (None: it can, or ``cfg`` is None)."""
        return None if self.refuses is None or cfg is None else self.refuses(cfg)

    def holds_key(self, key: str) -> bool:
        return not self.holds or key.startswith(self.holds)

    def overlaps(self, prefixes: tuple) -> bool:
        """Whether this class holds any key under ``prefixes`` (empty: everything)."""
        if not self.holds or not prefixes:
            return True
        return any(a.startswith(b) or b.startswith(a) for a in self.holds for b in prefixes)

    def state(self, mcore_state: Mapping) -> dict:
        """The keys of the family's mcore state dict this class holds, as it names them."""
        names = dict(self.renamed)
        return {names.get(key[len(self.root):], key[len(self.root):]): value
                for key, value in mcore_state.items() if self.holds_key(key)}

    @property
    def notes(self) -> str:
        return "; ".join(n for n in (self.note, self.why_part) if n)


@dataclass(frozen=True)
class NoMegatron:
    """A family's record where Megatron has no class its weights load into: ``because`` says why
    (``check --impl megatron`` and ``verify --load`` report it)."""

    because: str

    def __post_init__(self):
        if not self.because.strip():
            raise TypeError("NoMegatron needs the reason the family has no Megatron class")


# A family's Megatron classes by name (the first is the default), or why it has none.
MegatronClasses = Union[Mapping[str, MegatronClass], NoMegatron]


class NoMegatronClass(KeyError):
    """The family (or the class asked for) has no Megatron class."""

    def __str__(self) -> str:
        return str(self.args[0])


# ``pick(options)`` returns one of ``options``; a family's ``random_config(pick)`` builds a config
# from such choices, so tests can drive it with hypothesis and the library needs none.
Pick = Callable[[Sequence], Any]


@dataclass(frozen=True)
class ConfigHooks:
    """A family's configs: ``tiny()`` (the built-in one, deliberately awkward sizes),
    ``family_config(cfg)`` (the family's config inside a possibly whole-VLM one), ``random(pick)``
    (one drawn from ``pick``'s choices), and what of a config the native model refuses, each a list
    of problems (empty: none): ``problems(cfg)`` (said before any model is built or rank started),
    ``image_size_problems(cfg, sizes)`` and ``pipeline_problems(cfg, pp)``.
    ``image_size_multiple(cfg)``: image sides must be multiples of it (None: the patch size, times
    the merge size if any)."""

    tiny: Callable[[], Any]
    family_config: Callable[[Any], Any]
    random: Callable[[Pick], Any]
    problems: Callable[[Any], list] = no_problems
    image_size_multiple: Optional[Callable[[Any], int]] = None
    image_size_problems: Callable[[Any, Sequence], list] = no_problems
    pipeline_problems: Callable[[Any, int], list] = no_problems

    def __post_init__(self):
        _callables(self, "tiny", "family_config", "random", "problems", "image_size_problems",
                   "pipeline_problems", optional=("image_size_multiple",))


@dataclass(frozen=True)
class Parity:
    """What the harness checks: ``cases(cfg, seed, image_sizes=None) -> [Case]``, each passed
    through ``prepare_case(case, cfg)``; ``components``: the family's named components compared on
    their own, ``last_stage_components`` those of them the native side computes on the last
    pipeline stage (the rest on the first)."""

    cases: Callable[..., list]
    prepare_case: Callable[[Case, Any], Case] = keep_case
    components: tuple = ()
    last_stage_components: tuple = ()

    def __post_init__(self):
        _callables(self, "cases", "prepare_case")
        _names("components", self.components)
        _names("last_stage_components", self.last_stage_components)


@dataclass(frozen=True)
class Bench:
    """The bench's view of a family: ``flop_shape(cfg, base) -> TowerShape``, its FLOP formula
    (None: FLOPs not counted), and ``published``, its released size (None: tiny only)."""

    flop_shape: Optional[Callable[[Any, TowerShape], TowerShape]] = None
    published: Optional[Published] = None

    def __post_init__(self):
        _callables(self, optional=("flop_shape",))
        if not (self.published is None or isinstance(self.published, Published)):
            _refuse("published", self.published)


@dataclass(frozen=True)
class FamilyHooks:
    """Every hook of one family, grouped by who reads it. Each group checks its own hooks where it
    is built, so a missing or mistyped hook fails naming it (and the registry names the family)."""

    config: ConfigHooks
    reference: Side
    native: Side
    converter: ConverterSpec
    parity: Parity
    # Megatron's own classes the converted weights load into, or NoMegatron saying why none.
    megatron: MegatronClasses
    bench: Bench = field(default_factory=Bench)
    llava_tower: Optional[LlavaTower] = None

    def __post_init__(self):
        for name, kind in (("config", ConfigHooks), ("reference", Side), ("native", Side),
                           ("converter", ConverterSpec), ("parity", Parity), ("bench", Bench)):
            if not isinstance(getattr(self, name), kind):
                _refuse(name, getattr(self, name))
        for name in ("reference", "native"):
            if getattr(self, name).build is None:
                _refuse(f"{name}.build", None)
        if not (self.llava_tower is None or isinstance(self.llava_tower, LlavaTower)):
            _refuse("llava_tower", self.llava_tower)
        options = self.megatron
        if not (isinstance(options, NoMegatron) or (
                isinstance(options, Mapping) and len(options) > 0
                and all(isinstance(k, str) and isinstance(v, MegatronClass) for k, v in options.items()))):
            _refuse("megatron", options)


def megatron_class(hooks: FamilyHooks, family: str, name: Optional[str] = None,
                   cfg=None) -> tuple[str, MegatronClass]:
    """``(class name, record)`` of ``family``'s Megatron class ``name`` (None: its default, the
    first that can be built for a model of ``cfg``, see :meth:`MegatronClass.refusal`);
    :class:`NoMegatronClass` saying why when it has none, not that one, or ``name`` refuses ``cfg``."""
    options = hooks.megatron
    if isinstance(options, NoMegatron):
        raise NoMegatronClass(f"family {family!r} has no Megatron class: {options.because}")
    if name is not None and name not in options:
        raise NoMegatronClass(f"family {family!r}: no Megatron class {name!r}; choose one of "
                              f"{', '.join(options)}")
    if name is not None:
        refusal = options[name].refusal(cfg)
        if refusal is not None:
            raise NoMegatronClass(f"{family}: --megatron-class {name}: {refusal}; leave --megatron-class out "
                                  "to use the family's other classes")
        return name, options[name]
    for candidate, record in options.items():
        if record.refusal(cfg) is None:
            return candidate, record
    raise NoMegatronClass(f"family {family!r}: no Megatron class can be built for this model "
                          f"({default_refusal(hooks, cfg)})")


def default_refusal(hooks: FamilyHooks, cfg) -> Optional[str]:
    """Why the family's default Megatron class cannot be built for a model of ``cfg`` (None: it can):
    the note a check or load that falls back to another class gives."""
    options = hooks.megatron
    return None if isinstance(options, NoMegatron) else next(iter(options.values())).refusal(cfg)


def module_hooks(reference_module, native_module, converter: ConverterSpec, /, *, reference: Side,
                 native: Side, random_config: Callable[[Pick], Any], image_size_multiple=None,
                 image_size_problems=no_problems, **groups) -> FamilyHooks:
    """The usual record: the configs and builders from the family's reference module
    (``tiny_config``, ``vision_config``, ``build``) and native module (``build_native``), the
    sides' drivers, the converter spec; the other groups (``parity``, ``megatron``, ``bench``,
    ``llava_tower``) as given."""
    config = ConfigHooks(tiny=reference_module.tiny_config, family_config=reference_module.vision_config,
                         random=random_config, image_size_multiple=image_size_multiple,
                         image_size_problems=image_size_problems)
    return FamilyHooks(config=config, reference=replace(reference, build=reference_module.build),
                       native=replace(native, build=native_module.build_native), converter=converter, **groups)


# How a composite family (LLaVA) finds the registered family of a vision tower: given the whole
# config, that tower family's hooks; ``ValueError`` naming the registered towers otherwise.
TowerLookup = Callable[[Any], FamilyHooks]
