"""The family registry: the one list of model families (:data:`FAMILIES`) and of the language-model
parts whole VLMs are built of (:data:`LANGUAGE_MODELS`), each a package.

A family's package holds its record (``FAMILY`` in its ``__init__``: what ``list`` shows, which
checkpoints detection gives it) and its modules: ``reference`` (the HF config and model), ``native``
(the mcore model), ``mapping`` (the key tables) and ``cases``, whose ``hooks(towers)`` returns the
typed :class:`~mmparity.models.spec.FamilyHooks` record every generic part reads.

What a command needs is loaded when it asks, and no more: the records are data and this module
imports no framework, so ``mmparity list`` and ``--help`` load none; conversion reads the config (a
``mmparity.config.ConfigView``), the key tables and the tensor shapes straight from the reference
and mapping modules, which load neither framework's models nor transformers; the hooks (the models
and the parity glue) load on first use and are checked then (a missing or mistyped hook fails
naming the family).
"""

from __future__ import annotations

import copyreg
import dataclasses
import importlib
import os
from dataclasses import dataclass
from functools import cached_property
from types import ModuleType
from typing import TYPE_CHECKING, Mapping, Sequence

from mmparity.models.record import MISTRAL_NATIVE, FamilyRecord, PartRecord, Takes

if TYPE_CHECKING:
    import torch

    from mmparity.models.spec import FamilyHooks
    from mmparity.mapping.rules import ConverterSpec, McoreShards, RuleSet


class FamilyError(TypeError):
    """A family's module does not provide a valid hook record."""


# The HF layout of every family that transformers' own conversion mapping gives: what its
# ``save_pretrained`` writes and its ``from_pretrained`` reads, decoded at run time through the
# installed transformers (``mmparity.models.core.saved_layout``) over the family's module-name
# table (``hf``). A checkpoint whose keys no table of the family takes is read this way.
TRANSFORMERS_LAYOUT = "transformers"
MODULE_NAMES = "hf"


@dataclass(frozen=True)
class ConfigFacts:
    """What family detection reads off a checkpoint directory (``mmparity.io.hf`` reads it)."""

    source: str  # the file read: config.json, or Mistral's params.json
    architectures: tuple = ()
    model_type: str | None = None
    vision_model_type: str | None = None
    layout: str | None = None
    text_model_type: str | None = None

    def describe(self) -> str:
        if self.source == "params.json":
            return (f"{self.source}: Mistral-native layout"
                    + (f", with a vision_encoder ({self.model_type})" if self.vision_model_type
                       else ", no vision_encoder"))
        seen = [f"architectures {'/'.join(self.architectures)}" if self.architectures else "no architectures"]
        if self.model_type:
            seen.append(f"model_type {self.model_type}")
        if self.vision_model_type:
            seen.append(f"vision_config.model_type {self.vision_model_type}")
        if self.text_model_type:
            seen.append(f"text_config.model_type {self.text_model_type}")
        if self.layout == MISTRAL_NATIVE:
            seen.append("Mistral-native params.json")
        return f"{self.source}: {', '.join(seen)}"

    def checkpoint_name(self) -> str:
        """What the config says the checkpoint is, in a few words."""
        if self.architectures:
            return "/".join(self.architectures)
        if self.model_type:
            return f"model_type {self.model_type}"
        return "Mistral-native" if self.layout == MISTRAL_NATIVE else "unnamed"


@dataclass(frozen=True)
class Family(FamilyRecord):
    """A registered family: its package's record (:class:`~mmparity.models.record.FamilyRecord`),
    named, and what the generic machinery asks of it, loaded from its package's modules on first use."""

    def module(self, layer: str) -> ModuleType:
        """The family's module ``layer`` (``reference``, ``mapping``, ``cases``), imported now."""
        return importlib.import_module(f"{self.package or 'mmparity.models.' + self.name}.{layer}")

    @cached_property
    def hooks(self) -> FamilyHooks:
        """The family's hooks, loaded and checked on first use."""
        from mmparity.models.spec import FamilyHooks

        module = self.module("cases")
        try:
            # A whole VLM is composed of registered parts: its tower and its language model.
            hooks = (module.hooks(tower_of, language_of) if self.composed or self.with_language
                     else module.hooks(tower_of))
        except TypeError as exc:  # a hook left out of the record, or one that does not fit
            raise FamilyError(f"family {self.name!r}: {exc}") from None
        if not isinstance(hooks, FamilyHooks):
            raise FamilyError(f"family {self.name!r}: {module.__name__}.hooks() returned "
                              f"{type(hooks).__name__}, not FamilyHooks")
        return hooks

    # --- what conversion reads, without the models ------------------------------------------------

    @cached_property
    def _reference(self) -> ModuleType:
        # Configuration classes at import; the model class only inside ``build``.
        return self.module("reference")

    @cached_property
    def converter(self) -> ConverterSpec:
        """The family's key tables: its ``mapping.SPEC``, or for a composed family
        LLaVA's table over the vision tower its config names."""
        from mmparity.mapping.rules import ConverterSpec

        if self.composed:
            from mmparity.models.llava import mapping as llava

            spec = llava.converter(_tower_converter, lambda cfg: language_of(cfg).converter,
                                   getattr(self._reference, "HF_LAYOUTS", llava.FORMATS))
        else:
            mapping = self.module("mapping")
            spec = mapping.SPEC
            if not isinstance(spec, ConverterSpec):
                raise FamilyError(f"family {self.name!r}: {mapping.__name__}.SPEC is "
                                  f"{type(spec).__name__}, not ConverterSpec")
        tables = spec.rule_set

        def rule_set(cfg, fmt):
            return self._transformers_rules(cfg) if fmt == TRANSFORMERS_LAYOUT else tables(cfg, fmt)

        return dataclasses.replace(spec, formats=spec.formats + (TRANSFORMERS_LAYOUT,), rule_set=rule_set)

    def tiny_config(self):
        """The family's built-in HF config: tiny, with deliberately awkward sizes."""
        return self._reference.tiny_config()

    def family_config(self, cfg):
        """The family's config inside ``cfg`` (itself, or a whole-VLM config's sub-config)."""
        return self._reference.vision_config(cfg)

    def state_shapes(self, cfg) -> dict[str, tuple]:
        """The shape of every tensor of the HF model :meth:`build_reference` builds for ``cfg``,
        under its module names, read off the config: what ``convert`` checks a checkpoint against
        without importing the model. A composed family's tower is its tower family's."""
        if self.composed:
            return self._reference.state_shapes(cfg, _tower_family(cfg).state_shapes,
                                                language_of(cfg).reference.decoder_shapes)
        return self._reference.state_shapes(cfg)

    # --- the models -----------------------------------------------------------------------------

    def build_reference(self, cfg):
        """The HF transformers module for ``cfg``, fp32, in eval mode."""
        return self.hooks.reference.build(cfg)

    def build_native(self, cfg, params_dtype: torch.dtype | None = None):
        """The native mcore module for ``cfg`` in eval mode (``params_dtype`` default float32).

        Uses the parallel state already initialised (any TP size); initialises TP=1 on CPU if there
        is none, since mcore layers cannot be built without one.
        """
        import torch

        from mmparity.parallel import runtime

        if runtime.current_layout() is None:
            runtime.init_parallel(1, 1)
        dtype = torch.float32 if params_dtype is None else params_dtype
        return self.hooks.native.build(cfg, params_dtype=dtype).eval()

    # --- Megatron's own classes -----------------------------------------------------------------

    def megatron_class(self, name: str | None = None, cfg=None):
        """``(class name, MegatronClass)``: the Megatron class ``name`` the family's hooks list (None:
        the default, the first that can be built for a model of ``cfg``). Raises
        ``cases.core.NoMegatronClass`` with the family's reason when it has none, naming its
        classes when it has no ``name``, or saying why ``name`` cannot be built for ``cfg``."""
        from mmparity.models.spec import megatron_class

        return megatron_class(self.hooks, self.name, name, cfg)

    # --- conversion by name -------------------------------------------------------------------

    def rule_set(self, cfg, hf_format: str | None = None, keys=None) -> RuleSet:
        """The family's table for ``cfg`` in ``hf_format`` (detected from ``keys`` when None).

        ``keys``: the checkpoint's tensor names, or a mapping of them to anything with ``shape``
        and ``dtype`` (what reading through transformers' mapping needs where its names are not
        save_pretrained's own). Detection takes the family's own tables first; keys none of them
        takes (renamed by a transformers release, say) are read as transformers' mapping reads
        them (:data:`TRANSFORMERS_LAYOUT`), when it reads them all."""
        from mmparity.mapping.rules import ConversionError

        stored = _shapes_of(keys)
        if hf_format == TRANSFORMERS_LAYOUT:
            return self._transformers_rules(cfg, stored if stored is not None else keys)
        if hf_format is not None or keys is None:
            return self.converter.rules(cfg, hf_format, keys, family=self.name)
        names = list(keys)
        from mmparity.mapping.ops import AmbiguousLayout

        try:
            table, refusal = self.converter.rules(cfg, None, stored if stored is not None else names,
                                                  family=self.name), None
        except AmbiguousLayout:
            raise  # transformers' reading would be the misreading it names
        except ConversionError as exc:
            table, refusal = None, exc
        unknown = _not_taken(table, names) if table is not None else names
        if not unknown:
            return table
        from mmparity.models.core.saved_layout import NoMapping, Unreadable

        try:
            saved = self._transformers_rules(cfg, stored if stored is not None else names, identity=False)
        except Unreadable as exc:
            # transformers' mapping places more of these files than the family's tables take,
            # and its own reading of them fails: that is the reason to give.
            if exc.taken > len(names) - len(unknown):
                raise
            saved = None
        except (NoMapping, ConversionError):  # its mapping does not apply to this model here
            saved = None
        # Taken when it reads what the family's tables do not: every key, where a table refused
        # these files outright (its reason, an ambiguity say, is the better one otherwise).
        left = _not_taken(saved, names) if saved is not None else names
        if not left or (refusal is None and len(left) < len(unknown)):
            return saved
        if refusal is not None:
            raise refusal
        return table

    def _transformers_rules(self, cfg, stored=None, identity: bool = True) -> RuleSet:
        """The module-name table seen through transformers' conversion mapping (with ``stored``:
        as its from_pretrained reads those keys; without: as its save_pretrained writes). Where
        nothing of it renames this model's tensors, the module-name table itself (``identity``) or
        ``NoMapping``."""
        from mmparity.models.core.saved_layout import NoMapping, rule_set

        table = self.converter.rules(cfg, MODULE_NAMES, family=self.name)
        try:
            return rule_set(table, cfg, stored)
        except NoMapping:
            if not identity:
                raise
            return dataclasses.replace(table, hf_format=TRANSFORMERS_LAYOUT)

    def hf_to_mcore(self, hf_state_dict: Mapping[str, torch.Tensor], cfg, tp_size: int = 1,
                    hf_format: str | None = None, spelling: str = "te",
                    make_vocab_size_divisible_by: int | None = None) -> McoreShards:
        """HF state dict -> one mcore state dict per TP rank (Transformer Engine key spelling by
        default): exactly what Megatron's class for the family loads. Tensors it has no place for
        are in ``.side`` (per rank); the native model loads ``with_side(shards)``. Vocabularies
        are padded as Megatron-LM pads them: to a multiple of ``make_vocab_size_divisible_by ×
        tp_size`` (default Megatron-LM's, ``rules.VOCAB_MULTIPLE``).

        ``hf_format`` picks the HF-side layout; by default it is detected from the keys. Prefixes of
        whole-VLM checkpoints (``model.vision_tower.`` …) are detected; the other parts of such a
        checkpoint are dropped explicitly, anything unexpected is an error.
        """
        from mmparity.mapping.rules import VOCAB_MULTIPLE, McoreShards, convert_hf_to_mcore, to_local_spelling

        if spelling not in ("te", "local"):
            raise ValueError(f"spelling must be 'te' or 'local', got {spelling!r}")
        multiple = VOCAB_MULTIPLE if make_vocab_size_divisible_by is None else make_vocab_size_divisible_by
        shards = convert_hf_to_mcore(self.rule_set(cfg, hf_format, keys=hf_state_dict.keys()),
                                     hf_state_dict, tp_size, vocab_multiple=multiple)
        if spelling == "local":
            return McoreShards([to_local_spelling(s) for s in shards], shards.side, shards.unused)
        return shards

    def mcore_to_hf(self, shards: Sequence[Mapping[str, torch.Tensor]], cfg,
                    hf_format: str | None = None, prefix: str = "",
                    side: Sequence[Mapping[str, torch.Tensor]] | None = None) -> dict:
        """Per-rank mcore state dicts (either key spelling) and their side tensors (``side``, by
        default ``shards.side``) -> HF state dict, keys under ``prefix``."""
        from mmparity.mapping.rules import convert_mcore_to_hf

        return convert_mcore_to_hf(self.rule_set(cfg, hf_format), shards, prefix=prefix, side=side)

    def select_tensors(self, cfg, state: Mapping[str, torch.Tensor],
                       hf_format: str | None = None) -> tuple[dict, str, str]:
        """From a (possibly whole-VLM) HF state dict, the family's tensors with the prefix stripped.

        Returns ``(tensors, prefix, hf_format)``. Missing tensors are not an error here (conversion
        reports them); tensors outside the family are simply not selected.
        """
        from mmparity.mapping.rules import detect_prefix, expected_keys

        rules = self.rule_set(cfg, hf_format, keys=state.keys())
        prefix = detect_prefix(rules, state.keys())
        hf_keys, _ = expected_keys(rules)
        return ({k: state[prefix + k] for k in hf_keys if prefix + k in state}, prefix, rules.hf_format)


def _shapes_of(keys):
    """``keys`` as a mapping name -> (something with ``shape``): a mapping, or the keys view of one."""
    mapping = keys if isinstance(keys, Mapping) else getattr(keys, "mapping", None)
    return mapping if isinstance(mapping, Mapping) else None


def _not_taken(table, names: list) -> list:
    """The names ``table`` neither converts (under the one prefix it finds, as ``detect_prefix``
    finds it) nor drops: none, when the table is the checkpoint's layout."""
    import re

    from mmparity.mapping.rules import expected_keys

    expected = set(expected_keys(table)[0])  # expanded once: a release has tens of thousands
    hits = {p: sum(1 for k in names if k.startswith(p) and k[len(p):] in expected) for p in table.hf_prefixes}
    found = [p for p, n in hits.items() if n]
    if len(found) != 1:
        return names
    prefix = found[0]
    left = [k for k in names if not (k.startswith(prefix) and k[len(prefix):] in expected)]
    drops = [re.compile(p) for p in table.drop_hf]
    return [k for k in left if not any(d.match(k) for d in drops)]




# --- the one list ------------------------------------------------------------------------------
# A family is a package holding its modules, whose ``__init__`` defines its record ``FAMILY``; a
# language-model part of whole VLMs likewise defines ``PART``. Adding one is its package and its
# line here; the order is the order ``list`` shows them in.
FAMILIES = (
    "mmparity.models.pixtral",
    "mmparity.models.clip",
    "mmparity.models.siglip",
    "mmparity.models.internvit",
    "mmparity.models.llama4_vision",
    "mmparity.models.pixtral_large",
    "mmparity.models.qwen3_5",
    "mmparity.models.qwen3_vl",
    "mmparity.models.qwen3_vl_whole",
    "mmparity.models.qwen2_5_vl",
    "mmparity.models.qwen2_5_vl_whole",
    "mmparity.models.qwen3_vl_moe",
    "mmparity.models.glm4v_vision",
    "mmparity.models.glm4v_moe",
    "mmparity.models.glm46v",
    "mmparity.models.kimi_k25",
    "mmparity.models.kimi_k25_vl",
    "mmparity.models.llava",
    "mmparity.models.mistral3",
    "mmparity.models.pixtral_12b",
    "mmparity.models.internvl",
    "mmparity.models.llama4",
    "mmparity.models.qwen3_5_lm",
    "mmparity.models.qwen3_5_whole",
    "mmparity.models.gemma3",
    "mmparity.models.gemma4",
    "mmparity.models.gemma4_vision",
)
LANGUAGE_MODELS = (
    "mmparity.models.parts.dense_decoder",
    "mmparity.models.parts.deepseek_v3",
    "mmparity.models.parts.qwen3_5_text",
    "mmparity.models.parts.llama4_text",
    "mmparity.models.parts.gemma4_text",
)

# Packages outside the tree, by their dotted paths (comma-separated), registered after the built-in
# ones: a family of one's own, in every command and in every rank a command starts.
PLUGINS = "MMPARITY_FAMILIES"

_REGISTRY: dict[str, Family] = {}
_LANGUAGE_MODELS: dict[str, LanguageModel] = {}
_loaded = False


class RegistryError(ValueError):
    """A package named to the registry is not a family's or a part's (one line, naming it)."""


def _record(package: str):
    """The package's record, named after the package."""
    try:
        module = importlib.import_module(package)
    except ImportError as exc:
        raise RegistryError(f"{package}: cannot import it ({exc}); check {PLUGINS} or the registry's "
                            "list") from None
    record = getattr(module, "FAMILY", None) or getattr(module, "PART", None)
    if not isinstance(record, (FamilyRecord, PartRecord)):
        raise RegistryError(f"{package}: its __init__ defines no FAMILY (a FamilyRecord) or PART (a "
                            "PartRecord)")
    kind = Family if isinstance(record, FamilyRecord) else LanguageModel
    values = {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
    return kind(**{**values, "name": package.rpartition(".")[2], "package": package})


def _load() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True  # first: a package's import may ask for the registry
    plugins = [p.strip() for p in os.environ.get(PLUGINS, "").split(",") if p.strip()]
    try:
        for package in (*FAMILIES, *LANGUAGE_MODELS, *plugins):
            _add(_record(package))
    except BaseException:
        _loaded = False
        _REGISTRY.clear()
        _LANGUAGE_MODELS.clear()
        raise


def _add(record) -> None:
    table = _REGISTRY if isinstance(record, Family) else _LANGUAGE_MODELS
    if record.name in _REGISTRY or record.name in _LANGUAGE_MODELS:
        if table.get(record.name, None) == record:
            return
        raise RegistryError(f"{record.package}: a family or part named {record.name!r} is registered "
                            "already; rename the package")
    table[record.name] = record


def _families() -> dict[str, Family]:
    _load()
    return _REGISTRY


def _parts() -> dict[str, LanguageModel]:
    _load()
    return _LANGUAGE_MODELS


def register(package: str):
    """Add the family or language-model part whose package is ``package`` (dotted path) to this
    process's registry, after the others; its record. :func:`unregister` takes it back.
    (Ranks a command starts see only the built-in ones and those in ``MMPARITY_FAMILIES``.)"""
    _load()
    record = _record(package)
    _add(record)
    return record


def unregister(name: str) -> None:
    _load()
    _REGISTRY.pop(name, None)
    _LANGUAGE_MODELS.pop(name, None)


@dataclass(frozen=True)
class LanguageModel(PartRecord):
    """A registered language-model part: its package's record
    (:class:`~mmparity.models.record.PartRecord`), named, and its modules, loaded on first use."""

    def _module(self, layer: str) -> ModuleType:
        return importlib.import_module(f"{self.package or 'mmparity.models.parts.' + self.name}.{layer}")

    @cached_property
    def megatron_build(self):
        """The part's Megatron builder (``megatron``), imported on first use."""
        if not self.megatron:
            from mmparity.models.spec import NoMegatronClass

            raise NoMegatronClass(f"language model {self.name!r} has no Megatron class: "
                                  f"{self.why_no_megatron or 'its registry entry names none'}")
        module, _, function = self.megatron.partition(":")
        return getattr(importlib.import_module(module), function)

    @cached_property
    def converter(self):
        from mmparity.mapping.rules import LanguageKeys

        mapping = self._module("mapping")
        spec = mapping.SPEC
        if not isinstance(spec, LanguageKeys):
            raise FamilyError(f"language model {self.name!r}: {mapping.__name__}.SPEC is "
                              f"{type(spec).__name__}, not LanguageKeys")
        return spec

    @cached_property
    def native(self) -> ModuleType:
        return self._module("native")

    @cached_property
    def reference(self) -> ModuleType:
        return self._module("reference")

    def mlp_pairs(self, *, hf: bool):
        """``mlp_pairs(name, mlp, extract)`` of the part's reference (``hf``) or native module: the
        pairs inside a layer's MLP (an MoE's router and experts). A part that declares none pairs
        its MLP whole."""
        return getattr(self.reference if hf else self.native, "mlp_pairs", _no_mlp_pairs)




def _no_mlp_pairs(name: str, mlp, extract) -> list:
    return []


def language_models() -> list[str]:
    return list(_parts())


def language_of(cfg) -> LanguageModel:
    """The registered language-model part that takes ``cfg.text_config``'s model type."""
    model_type = getattr(getattr(cfg, "text_config", None), "model_type", None)
    for part in _parts().values():
        if model_type in part.text_model_types:
            return part
    taken = [t for part in _parts().values() for t in part.text_model_types]
    raise ValueError(f"language model of model_type {model_type!r} is not supported; registered "
                     f"language models take: {', '.join(taken)}")


class UnknownFamilyError(KeyError):
    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


def names() -> list[str]:
    return list(_families())


def megatron_class(family: str, name: str | None = None, cfg=None):
    """:meth:`Family.megatron_class` of the registered ``family``."""
    return get(family).megatron_class(name, cfg)


def get(name: str) -> Family:
    try:
        return _families()[name]
    except KeyError:
        raise UnknownFamilyError(f"unknown family {name!r}; valid families: {', '.join(names())}") from None


# --- which family a checkpoint is, from its config -------------------------------------------

class DetectError(ValueError):
    """No one registered family takes a checkpoint's config: the user passes ``--family``."""


@dataclass(frozen=True)
class Detection:
    family: str
    whole: bool  # the family takes the whole checkpoint, not only part of it
    facts: ConfigFacts

    def line(self) -> str:
        """The one line that says which family, and why."""
        part = "" if self.whole else f"; takes part of it, {whole_clause(self.facts, named=False)}"
        return f"family: {self.family} (from {self.facts.describe()}{part})"


def _scores(facts: ConfigFacts) -> dict[str, tuple[int, int]]:
    return {name: family.takes(facts) for name, family in _families().items()}


def _best(scores: Mapping[str, tuple[int, int]]) -> list[str]:
    top = max(scores.values(), default=(0, 0))
    return [name for name, score in scores.items() if score == top and top[0]]


def detect(facts: ConfigFacts) -> Detection:
    """The registered family a checkpoint's config names: one taking it whole before one taking
    part, then the one more of the config's facts point to. None, or a tie, is a
    :class:`DetectError` of one line."""
    scores = _scores(facts)
    best = _best(scores)
    if not best:
        raise DetectError(f"no registered family takes this checkpoint ({facts.describe()}); registered "
                          f"families: {', '.join(names())}; pass --family to choose one")
    if len(best) > 1:
        raise DetectError(f"families {' and '.join(best)} take this checkpoint equally ({facts.describe()}); "
                          f"pass --family {' or --family '.join(best)}")
    return Detection(best[0], scores[best[0]][0] == 2, facts)


def whole_takers(facts: ConfigFacts) -> list[str]:
    """The registered families that take the whole checkpoint: the best matched, several on a tie."""
    return _best({name: score for name, score in _scores(facts).items() if score[0] == 2})


def converts_whole(name: str, facts: ConfigFacts) -> bool:
    """Whether family `name` takes the whole of the checkpoint `facts` describe."""
    return get(name).takes(facts)[0] == 2


def whole_clause(facts: ConfigFacts, named: bool = True) -> str:
    """Who takes the whole of a checkpoint, for a report on a family that converts part of it;
    ``named``: saying what the checkpoint is."""
    takers = whole_takers(facts)
    what = f"the whole {facts.checkpoint_name()} checkpoint" if named else "the whole"
    if not takers:
        return f"no registered family takes {what}"
    return f"family {' or '.join(takers)} takes {what}"


def _tower_family(cfg) -> Family:
    """The registered family whose key tables serve as a LLaVA tower of ``cfg.vision_config``'s
    model_type (``ConverterSpec.tower``); found from the converters alone, so converting a whole
    VLM loads no model."""
    model_type = getattr(getattr(cfg, "vision_config", None), "model_type", None)
    towers = {}
    for family in _families().values():
        if not family.composed and family.converter.tower is not None:
            taken = towers.setdefault(family.converter.tower.model_type, family)
            if taken is not family:
                # Which one LLaVA would use would depend on the registry's order: refuse to guess.
                raise RegistryError(f"families {taken.name!r} and {family.name!r} both serve as the LLaVA vision "
                                  f"tower of model_type {family.converter.tower.model_type!r}; one of them "
                                  "must leave its SPEC.tower unset")
    if model_type not in towers:
        raise ValueError(f"LLaVA vision tower of model_type {model_type!r} is not supported; "
                         f"registered vision towers: {', '.join(towers)}")
    return towers[model_type]


def _tower_converter(cfg):
    """What LLaVA's table needs of the tower of ``cfg``: its family's table and transformers 4's
    extra root."""
    from mmparity.models.llava import mapping as llava

    spec = _tower_family(cfg).converter
    return llava.Tower(spec, spec.tower.v4_checkpoint_root)


def tower_of(cfg) -> FamilyHooks:
    """The hooks of the registered family whose LLaVA-tower adapter takes ``cfg.vision_config``:
    that family's alone are loaded."""
    family = _tower_family(cfg)
    if family.hooks.llava_tower is None:
        raise FamilyError(f"family {family.name!r}: its converter serves as a LLaVA tower of "
                          f"{family.converter.tower.model_type!r}, but its hooks have no llava_tower")
    return family.hooks


def config_modules() -> list[ModuleType]:
    """The ``config`` module of every registered family and language-model part that has one, in
    registry order: what a command reads a checkpoint's config with before it knows the family
    (``HF_CONFIGS``: the HF configuration classes as tables; ``MISTRAL_NATIVE``: what a release in
    Mistral's own layout of the model is). Those modules import no model code."""
    packages = [record.package or f"mmparity.models.{record.name}" for record in _families().values()]
    packages += [part.package or f"mmparity.models.parts.{part.name}" for part in _parts().values()]
    found = []
    for package in packages:
        try:
            found.append(importlib.import_module(f"{package}.config"))
        except ModuleNotFoundError as exc:
            if exc.name not in (package, f"{package}.config"):  # a module it imports is missing
                raise
    return found


# --- the records, for commands -----------------------------------------------------------------

def families() -> list[Family]:
    """Every registered family's record, in registry order: what a command iterates."""
    return list(_families().values())


def resolve(family: str | Family) -> Family:
    """The record of ``family`` (a name, or a record passed through): the one lookup a command or
    public entry point makes before handing the record down. :class:`UnknownFamilyError` lists the
    families there are."""
    return family if isinstance(family, Family) else get(family)


def _by_name(family: Family):
    return resolve, (family.name,)


# A record crosses to spawned ranks by name: its loaded hooks hold closures that do not pickle,
# and the rank's registry holds the same record.
copyreg.pickle(Family, _by_name)
