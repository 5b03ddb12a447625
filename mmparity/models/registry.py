"""The family registry: one :class:`Family` per model family, in one dict literal.

A family is its entry here plus its modules: ``mmparity.reference.<name>`` (the HF config and
model), ``mmparity.native.<name>`` (the mcore model), ``mmparity.converters.<name>`` (the key
tables) and ``mmparity.cases.<name>``, whose ``hooks(towers)`` returns the typed
:class:`~mmparity.models.spec.FamilyHooks` record every generic part reads.

What a command needs is loaded when it asks, and no more: the entry itself is data (what
``list`` shows, which checkpoints detection gives the family), and this module imports no
framework, so ``mmparity list`` and ``--help`` load none; conversion reads the config (a
``hfconfig.ConfigView``), the key tables and the tensor shapes straight from the reference and
converters modules, which load neither framework's models nor transformers; the hooks (the
models and the parity glue) load on first use and are checked then (a missing or mistyped hook
fails naming the family).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from functools import cached_property
from types import ModuleType
from typing import TYPE_CHECKING, Mapping, Sequence

if TYPE_CHECKING:
    import torch

    from mmparity.models.spec import FamilyHooks
    from mmparity.mapping.rules import ConverterSpec, McoreShards, RuleSet


class FamilyError(TypeError):
    """A family's module does not provide a valid hook record."""


# A layout told by the files rather than by config.json: Mistral's own release, ``params.json``
# beside ``consolidated.safetensors``.
MISTRAL_NATIVE = "mistral_native"

# The HF layout of every family that transformers' own conversion mapping gives: what its
# ``save_pretrained`` writes and its ``from_pretrained`` reads, decoded at run time through the
# installed transformers (``mmparity.models.core.saved_layout``) over the family's module-name
# table (``hf``). A checkpoint whose keys no table of the family takes is read this way.
TRANSFORMERS_LAYOUT = "transformers"
MODULE_NAMES = "hf"


@dataclass(frozen=True)
class Takes:
    """One kind of checkpoint, as its config names it; every field given must match.

    ``architecture``: one of config.json's ``architectures``; ``model_type``: its ``model_type``;
    ``vision_model_type``: its ``vision_config.model_type``, for whole-VLM configs whose tower
    decides which family converts the vision part; ``text_model_type``: its
    ``text_config.model_type``, where the language model tells two whole families apart (Pixtral-12B
    from another LLaVA); ``layout``: a layout the files tell (:data:`MISTRAL_NATIVE`).
    """

    architecture: str | None = None
    model_type: str | None = None
    vision_model_type: str | None = None
    layout: str | None = None
    text_model_type: str | None = None

    def matches(self, facts: "ConfigFacts") -> frozenset | None:
        """The facts this confirms, or None when one of its fields does not match."""
        wanted = {name: value for name in ("architecture", "model_type", "vision_model_type", "layout",
                                           "text_model_type")
                  if (value := getattr(self, name)) is not None}
        for name, value in wanted.items():
            if (value not in facts.architectures if name == "architecture" else getattr(facts, name) != value):
                return None
        return frozenset(wanted.items())


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
class Family:
    name: str
    summary: str
    reference_classes: tuple
    # What ``check`` compares, for ``mmparity list``: paired modules and components.
    compared: tuple = ()
    checkpoint_note: str = ""
    # Which checkpoints ``check --hf`` and ``convert`` without ``--family`` give this family, read
    # off the config alone: those it converts whole, and whole-VLM ones it converts only part of
    # (a tower family on a LLaVA, the vision path of a Mistral3). A family that takes a
    # checkpoint whole is preferred over one taking part; the report of a partial conversion
    # names it. ``--family`` picks any family, listed here or not.
    takes_whole: tuple = ()
    takes_part: tuple = ()
    # A whole VLM composed as Megatron's LLaVAModel (``cases.llava``): its key tables are LLaVA's
    # (``mmparity.models.llava.mapping``) over the registered vision tower its config names, not a
    # ``mmparity.converters.<name>`` of its own.
    composed: bool = False
    # Built of registered parts with its own key table (not LLaVA's): its hooks are given the
    # tower and the language-model lookups, as a composed family's are.
    with_language: bool = False
    # ``check --low-memory`` reproduces its in-memory report (one module's weights resident at a
    # time); a family whose models that path cannot drive yet says False.
    low_memory: bool = True

    def takes(self, facts: ConfigFacts) -> tuple[int, int]:
        """How well this family takes a checkpoint: (2 whole, 1 part, 0 not at all; how many facts
        of the config say so)."""
        for level, kinds in ((2, self.takes_whole), (1, self.takes_part)):
            confirmed = [m for t in kinds if (m := t.matches(facts)) is not None]
            if confirmed:
                return level, len(frozenset().union(*confirmed))
        return 0, 0

    @cached_property
    def hooks(self) -> FamilyHooks:
        """The family's hooks, loaded and checked on first use."""
        from mmparity.models.spec import FamilyHooks

        module = importlib.import_module(f"mmparity.models.{self.name}.cases")
        try:
            # A whole VLM is composed of registered parts: its tower and its language model.
            hooks = (module.hooks(tower_of, language_of) if self.composed or self.with_language
                     else module.hooks(tower_of))
        except TypeError as exc:  # a required hook left out of the record
            raise FamilyError(f"family {self.name!r}: {exc}") from None
        if not isinstance(hooks, FamilyHooks):
            raise FamilyError(f"family {self.name!r}: mmparity.cases.{self.name}.hooks() returned "
                              f"{type(hooks).__name__}, not FamilyHooks")
        try:
            hooks.check(self.name)
        except TypeError as exc:
            raise FamilyError(str(exc)) from None
        return hooks

    # --- what conversion reads, without the models ------------------------------------------------

    @cached_property
    def _reference(self) -> ModuleType:
        # Configuration classes at import; the model class only inside ``build``.
        return importlib.import_module(f"mmparity.models.{self.name}.reference")

    @cached_property
    def converter(self) -> ConverterSpec:
        """The family's key tables: ``mmparity.converters.<name>.SPEC``, or for a composed family
        LLaVA's table over the vision tower its config names."""
        from mmparity.mapping.rules import ConverterSpec

        if self.composed:
            from mmparity.models.llava import mapping as llava

            spec = llava.converter(_tower_converter, lambda cfg: language_of(cfg).converter)
        else:
            spec = importlib.import_module(f"mmparity.models.{self.name}.mapping").SPEC
            if not isinstance(spec, ConverterSpec):
                raise FamilyError(f"family {self.name!r}: mmparity.converters.{self.name}.SPEC is "
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
        return self.hooks.build_reference(cfg)

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
        return self.hooks.build_native(cfg, params_dtype=dtype).eval()

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
        try:
            table, refusal = self.converter.rules(cfg, None, names, family=self.name), None
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


def _llava_tower(vision_model_type: str) -> tuple:
    """A LLaVA checkpoint whose vision tower is of ``vision_model_type``: its tower is the part."""
    return (Takes(architecture="LlavaForConditionalGeneration", vision_model_type=vision_model_type),
            Takes(model_type="llava", vision_model_type=vision_model_type))


_REGISTRY: dict[str, Family] = {
    "pixtral": Family(
        name="pixtral",
        summary="Pixtral vision encoder (2D RoPE, RMSNorm, SwiGLU), static and packed mixed sizes",
        reference_classes=("PixtralVisionModel",),
        compared=("patch_embed", "rope2d", "ln_pre", "layers", "packed attention"),
        takes_whole=(Takes(architecture="PixtralVisionModel"), Takes(model_type="pixtral")),
        takes_part=_llava_tower("pixtral"),
    ),
    "clip": Family(
        name="clip",
        summary="CLIP vision encoder (class token, learned positions resampled for other sizes, "
                "pre-LayerNorm, quick_gelu), last_hidden_state and pooled class token",
        reference_classes=("CLIPVisionModel",),
        compared=("patch_embed", "pos_embed", "ln_pre", "layers", "ln_post", "packed attention"),
        checkpoint_note="CLIPVisionModel, or the vision_model.* of a whole CLIPModel / the "
                        "vision tower of a LLaVA checkpoint (the rest is dropped)",
        takes_whole=(Takes(architecture="CLIPVisionModel"), Takes(model_type="clip_vision_model")),
        takes_part=(Takes(architecture="CLIPModel"), Takes(model_type="clip"),
                    *_llava_tower("clip_vision_model")),
    ),
    "siglip": Family(
        name="siglip",
        summary="SigLIP vision encoder (learned positions resampled for other sizes, tanh GELU, "
                "post-LayerNorm) and its attention-pooling head",
        reference_classes=("SiglipVisionModel",),
        compared=("patch_embed", "pos_embed", "layers", "ln_post", "head", "packed attention"),
        checkpoint_note="SiglipVisionModel, or the vision_model.* of a whole SiglipModel (the text "
                        "model and logit scale / bias are dropped)",
        takes_whole=(Takes(architecture="SiglipVisionModel"), Takes(model_type="siglip_vision_model")),
        takes_part=(Takes(architecture="SiglipModel"), Takes(model_type="siglip"),
                    *_llava_tower("siglip_vision_model")),
    ),
    "pixtral_large": Family(
        name="pixtral_large",
        summary="Pixtral-Large / Mistral3 vision path: Pixtral tower, RMSNorm + 2x2 patch merger, "
                "MLP projector; static and packed mixed sizes",
        reference_classes=("PixtralVisionModel", "Mistral3MultiModalProjector"),
        compared=("patch_embed", "ln_pre", "layers", "merger_norm", "merger", "projector",
                  "packed attention"),
        checkpoint_note="whole Mistral3ForConditionalGeneration checkpoint (vision tower + "
                        "multi_modal_projector, language model dropped), HF or Mistral-native "
                        "consolidated.safetensors layout",
        # Whole Mistral3 (and Mistral-native) releases are a whole-model family's, once there is one.
        takes_part=(Takes(architecture="Mistral3ForConditionalGeneration"), Takes(model_type="mistral3"),
                    Takes(layout=MISTRAL_NATIVE, vision_model_type="pixtral")),
    ),
    "qwen3_5": Family(
        name="qwen3_5",
        summary="Qwen3.5-MoE VL vision tower (Conv3d patches, resampled learned positions, 2D RoPE, "
                "block-first order, 2x2 merger), static and packed mixed sizes",
        reference_classes=("Qwen3_5MoeVisionModel",),
        compared=("patch_embed", "pos_embed", "rope2d", "block_first", "layers", "merger",
                  "packed attention"),
        checkpoint_note="standalone vision tower, or a whole Qwen3_5MoeForConditionalGeneration "
                        "checkpoint (model.visual.*) whose language model is dropped",
        takes_whole=(Takes(architecture="Qwen3_5MoeVisionModel"), Takes(model_type="qwen3_5_moe_vision")),
        takes_part=(Takes(architecture="Qwen3_5MoeForConditionalGeneration"), Takes(model_type="qwen3_5_moe")),
    ),
    "kimi_k25": Family(
        name="kimi_k25",
        summary="Kimi-K2.5 MoonViT (bicubic learned positions, interleaved 2D RoPE, LayerNorm, 2x2 "
                "merger with temporal mean) and projector; static, packed mixed sizes, video clips",
        reference_classes=("Kimi_K25VisionModel", "Kimi_K25MultimodalProjection"),
        compared=("patch_embed", "pos_embed", "rope2d", "layers", "final_layernorm", "merger",
                  "projector", "packed attention"),
        checkpoint_note="HF layout (Kimi_K25VisionModel, or a whole Kimi_K25ForConditionalGeneration "
                        "checkpoint: tower + mm_projector, language model dropped) or the original "
                        "release layout (encoder.blocks.N.wqkv …, mm_projector.proj.* or Kimi-VL's "
                        "multi_modal_projector.*)",
        takes_whole=(Takes(architecture="Kimi_K25VisionModel"), Takes(model_type="kimi_k25_vision")),
        takes_part=(Takes(architecture="Kimi_K25ForConditionalGeneration"), Takes(model_type="kimi_k25")),
    ),
    "kimi_k25_vl": Family(
        name="kimi_k25_vl",
        summary="Kimi-K2.5 whole: MoonViT + projector + DeepSeek-V3 decoder (MLA, leading dense "
                "layers, routed and shared experts); logits, per-token loss, router agreement",
        reference_classes=("Kimi_K25ForConditionalGeneration",),
        compared=("vision layers", "vision_projection", "attention", "router", "shared_experts",
                  "routed experts", "language layers", "final_norm"),
        checkpoint_note="whole Kimi_K25ForConditionalGeneration checkpoint as Megatron's LLaVAModel "
                        "(vision_model, vision_projection, language_model with MoE layers); module "
                        "names, the release layout (language_model.model.layers.N, one tensor per "
                        "expert) or what transformers' save_pretrained writes (blocks.N, read through "
                        "its conversion mapping); experts as TEGroupedMLP names them; MTP layers "
                        "dropped and reported",
        takes_whole=(Takes(architecture="Kimi_K25ForConditionalGeneration", text_model_type="deepseek_v3"),
                     Takes(model_type="kimi_k25", text_model_type="deepseek_v3")),
        with_language=True,
    ),
    "llava": Family(
        name="llava",
        summary="LLaVA: a registered vision tower (Pixtral, CLIP, SigLIP; vision_feature_layer, "
                "select strategy), MLP projector, Llama-style GPT decoder; logits and per-token loss",
        reference_classes=("LlavaForConditionalGeneration",),
        compared=("pixel_shuffle", "loss_weights", "expansion", "vision layers", "projector",
                  "layers", "final_norm"),
        checkpoint_note="whole LlavaForConditionalGeneration checkpoint (module names, or files "
                        "saved by transformers 5 or 4); vocabulary padded to a multiple of 128 "
                        "for TP and trimmed on export; tied or untied lm_head",
        takes_whole=(Takes(architecture="LlavaForConditionalGeneration"), Takes(model_type="llava")),
        composed=True,
    ),
    "mistral3": Family(
        name="mistral3",
        summary="Mistral3 whole (Mistral-Small-3.1 / Pixtral-Large style): Pixtral tower with the "
                "2x2 merger, MLP projector, Mistral decoder; Pixtral processor's image rows; logits "
                "and per-token loss",
        reference_classes=("Mistral3ForConditionalGeneration",),
        compared=("vision layers", "merger", "projector", "language layers", "final_norm",
                  "pixel_shuffle", "loss_weights", "expansion"),
        checkpoint_note="whole Mistral3ForConditionalGeneration checkpoint as Megatron's LLaVAModel "
                        "(vision_model with merger, vision_projection, language_model), HF or "
                        "Mistral-native (consolidated.safetensors + params.json); vocabulary padded as "
                        "Megatron-LM pads it",
        takes_whole=(Takes(architecture="Mistral3ForConditionalGeneration"), Takes(model_type="mistral3"),
                     Takes(layout=MISTRAL_NATIVE, model_type="mistral3")),
        composed=True,
    ),
    "pixtral_12b": Family(
        name="pixtral_12b",
        summary="Pixtral-12B: LLaVA with a Pixtral tower and a Mistral decoder, fed the Pixtral "
                "processor's [IMG] / [IMG_BREAK] / [IMG_END] rows; logits and per-token loss",
        reference_classes=("LlavaForConditionalGeneration",),
        compared=("vision layers", "projector", "language layers", "final_norm",
                  "pixel_shuffle", "loss_weights", "expansion"),
        checkpoint_note="whole LlavaForConditionalGeneration checkpoint with a Pixtral tower and a "
                        "Mistral text model, as Megatron's LLaVAModel; HF or Mistral-native "
                        "(consolidated.safetensors + params.json)",
        takes_whole=(Takes(architecture="LlavaForConditionalGeneration", vision_model_type="pixtral",
                           text_model_type="mistral"),
                     Takes(model_type="llava", vision_model_type="pixtral", text_model_type="mistral"),
                     Takes(layout=MISTRAL_NATIVE, model_type="llava")),
        composed=True,
    ),
}


@dataclass(frozen=True)
class LanguageModel:
    """A language-model part of whole VLMs: the HF text model types it takes and its modules,
    ``mmparity.converters.<module>`` (``SPEC``, a ``LanguageKeys``: rules per layout),
    ``mmparity.native.<module>`` (``transformer_config``, ``LanguageModelBuilder``) and
    ``mmparity.reference.<module>`` (``decoder_shapes``). A composed family finds its language
    model here by ``text_config.model_type``, as it finds its tower among the families.

    ``megatron``: where Megatron's class for the part is built, ``"module:function"`` (a builder
    ``(whole cfg, params_dtype, divisible_by=, parallel_output=)`` of the part alone, as
    ``mmparity.models.core.megatron_classes.build_language_model``); every whole VLM composed with the part
    checks and loads its ``language_model.*`` in it. Empty: Megatron has no class for it, and
    ``why_no_megatron`` says why."""

    name: str
    summary: str
    text_model_types: tuple
    module: str
    megatron: str = ""
    why_no_megatron: str = ""

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

        spec = importlib.import_module(f"mmparity.models.parts.{self.module}.mapping").SPEC
        if not isinstance(spec, LanguageKeys):
            raise FamilyError(f"language model {self.name!r}: mmparity.converters.{self.module}.SPEC is "
                              f"{type(spec).__name__}, not LanguageKeys")
        return spec

    @cached_property
    def native(self) -> ModuleType:
        return importlib.import_module(f"mmparity.models.parts.{self.module}.native")

    @cached_property
    def reference(self) -> ModuleType:
        return importlib.import_module(f"mmparity.models.parts.{self.module}.reference")


_LANGUAGE_MODELS: dict[str, LanguageModel] = {
    "dense_decoder": LanguageModel(
        name="dense_decoder",
        summary="Llama / Mistral / Qwen2-style decoder (GQA, explicit head_dim, q/k/v biases as the "
                "model type has them, tied or untied head) as Megatron's GPTModel",
        text_model_types=("llama", "mistral", "qwen2"),
        module="dense_decoder",
        megatron="mmparity.models.core.megatron_classes:build_language_model",
    ),
    "deepseek_v3": LanguageModel(
        name="deepseek_v3",
        summary="DeepSeek-V3 / Kimi-K2 decoder: multi-latent attention, leading dense layers, then "
                "routed experts with a shared expert (sigmoid, score-correction bias, group-limited "
                "top-k, scaling factor), YaRN RoPE; GPTModel with mcore's MLA and MoE layers",
        text_model_types=("deepseek_v3",),
        module="deepseek_v3",
        megatron="mmparity.models.core.megatron_classes:build_moe_language_model",
    ),
}


def language_models() -> list[str]:
    return list(_LANGUAGE_MODELS)


def language_of(cfg) -> LanguageModel:
    """The registered language-model part that takes ``cfg.text_config``'s model type."""
    model_type = getattr(getattr(cfg, "text_config", None), "model_type", None)
    for part in _LANGUAGE_MODELS.values():
        if model_type in part.text_model_types:
            return part
    taken = [t for part in _LANGUAGE_MODELS.values() for t in part.text_model_types]
    raise ValueError(f"language model of model_type {model_type!r} is not supported; registered "
                     f"language models take: {', '.join(taken)}")


class UnknownFamilyError(KeyError):
    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


def names() -> list[str]:
    return list(_REGISTRY)


def megatron_class(family: str, name: str | None = None, cfg=None):
    """:meth:`Family.megatron_class` of the registered ``family``."""
    return get(family).megatron_class(name, cfg)


def get(name: str) -> Family:
    try:
        return _REGISTRY[name]
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
    return {name: family.takes(facts) for name, family in _REGISTRY.items()}


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
    for family in _REGISTRY.values():
        if not family.composed and family.converter.tower is not None:
            towers[family.converter.tower.model_type] = family
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
    packages = ([f"mmparity.models.{name}" for name in names()]
                + [f"mmparity.models.parts.{name}" for name in language_models()])
    found = []
    for package in packages:
        try:
            found.append(importlib.import_module(f"{package}.config"))
        except ModuleNotFoundError as exc:
            if exc.name not in (package, f"{package}.config"):  # a module it imports is missing
                raise
    return found
