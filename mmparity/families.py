"""The family registry: one frozen :class:`Family` record per model family, nothing else.

A family is this entry plus one same-named module in each of ``mmparity.native``,
``mmparity.reference`` and ``mmparity.converters``. Modules are imported only when used, so
listing families costs neither transformers nor megatron.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Family:
    name: str
    summary: str
    reference_classes: tuple
    components: tuple
    module: str = ""  # same-named module under native/, reference/, converters/
    checkpoint_note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def module_name(self) -> str:
        return self.module or self.name

    def native(self):
        return importlib.import_module(f"mmparity.native.{self.module_name}")

    def reference(self):
        return importlib.import_module(f"mmparity.reference.{self.module_name}")

    def converter(self):
        return importlib.import_module(f"mmparity.converters.{self.module_name}")

    def tiny_config(self):
        """The family's built-in HF config: tiny, with deliberately awkward sizes."""
        return self.reference().tiny_config()

    def build_reference(self, cfg):
        """The HF transformers module for ``cfg``, fp32, in eval mode."""
        return self.reference().build(cfg)

    def build_native(self, cfg, params_dtype: torch.dtype = torch.float32):
        """The native mcore module for ``cfg`` in eval mode.

        Uses the parallel state already initialised (any TP size); initialises TP=1 on CPU if there
        is none, since mcore layers cannot be built without one.
        """
        from mmparity import runtime

        if runtime.current_layout() is None:
            runtime.init_parallel(1, 1)
        return self.native().build_native(cfg, params_dtype=params_dtype).eval()


_REGISTRY: dict[str, Family] = {
    "pixtral": Family(
        name="pixtral",
        summary="Pixtral vision encoder (2D RoPE, RMSNorm, SwiGLU), static and packed mixed sizes",
        reference_classes=("PixtralVisionModel",),
        components=("patch_embed", "rope2d", "ln_pre", "layers", "packed attention"),
    ),
    "clip": Family(
        name="clip",
        summary="CLIP vision encoder (class token, learned positions resampled for other sizes, "
                "pre-LayerNorm, quick_gelu), last_hidden_state and pooled class token",
        reference_classes=("CLIPVisionModel",),
        components=("patch_embed", "pos_embed", "ln_pre", "layers", "ln_post", "packed attention"),
        checkpoint_note="CLIPVisionModel, or the vision_model.* of a whole CLIPModel / the "
                        "vision tower of a LLaVA checkpoint (the rest is dropped)",
    ),
    "siglip": Family(
        name="siglip",
        summary="SigLIP vision encoder (learned positions resampled for other sizes, tanh GELU, "
                "post-LayerNorm) and its attention-pooling head",
        reference_classes=("SiglipVisionModel",),
        components=("patch_embed", "pos_embed", "layers", "ln_post", "head", "packed attention"),
        checkpoint_note="SiglipVisionModel, or the vision_model.* of a whole SiglipModel (the text "
                        "model and logit scale / bias are dropped)",
    ),
    "pixtral_large": Family(
        name="pixtral_large",
        summary="Pixtral-Large / Mistral3 vision path: Pixtral tower, RMSNorm + 2x2 patch merger, "
                "MLP projector; static and packed mixed sizes",
        reference_classes=("PixtralVisionModel", "Mistral3MultiModalProjector"),
        components=("patch_embed", "ln_pre", "layers", "merger_norm", "merger", "projector",
                    "packed attention"),
        checkpoint_note="whole Mistral3ForConditionalGeneration checkpoint (vision tower + "
                        "multi_modal_projector, language model dropped), HF or Mistral-native "
                        "consolidated.safetensors layout",
    ),
    "qwen3_5": Family(
        name="qwen3_5",
        summary="Qwen3.5-MoE VL vision tower (Conv3d patches, resampled learned positions, 2D RoPE, "
                "block-first order, 2x2 merger), static and packed mixed sizes",
        reference_classes=("Qwen3_5MoeVisionModel",),
        components=("patch_embed", "pos_embed", "rope2d", "block_first", "layers", "merger",
                    "packed attention"),
        checkpoint_note="standalone vision tower, or a whole Qwen3_5MoeForConditionalGeneration "
                        "checkpoint (model.visual.*) whose language model is dropped",
    ),
    "kimi_k25": Family(
        name="kimi_k25",
        summary="Kimi-K2.5 MoonViT (bicubic learned positions, interleaved 2D RoPE, LayerNorm, 2x2 "
                "merger with temporal mean) and projector; static, packed mixed sizes, video clips",
        reference_classes=("Kimi_K25VisionModel", "Kimi_K25MultimodalProjection"),
        components=("patch_embed", "pos_embed", "rope2d", "layers", "final_layernorm", "merger",
                    "projector", "packed attention"),
        checkpoint_note="HF layout (Kimi_K25VisionModel, or a whole Kimi_K25ForConditionalGeneration "
                        "checkpoint: tower + mm_projector, language model dropped) or the original "
                        "release layout (encoder.blocks.N.wqkv …, mm_projector.proj.* or Kimi-VL's "
                        "multi_modal_projector.*)",
    ),
    "llava": Family(
        name="llava",
        summary="LLaVA: a registered vision tower (Pixtral, CLIP, SigLIP; vision_feature_layer, "
                "select strategy), MLP projector, Llama-style GPT decoder; logits and per-token loss",
        reference_classes=("LlavaForConditionalGeneration",),
        components=("pixel_shuffle", "loss_weights", "expansion", "vision layers", "projector",
                    "layers", "final_norm"),
        checkpoint_note="whole LlavaForConditionalGeneration checkpoint (module names, or files "
                        "saved by transformers 5 or 4); vocabulary padded to a multiple of 128 "
                        "for TP and trimmed on export; tied or untied lm_head",
    ),
}


class UnknownFamilyError(KeyError):
    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


def names() -> list[str]:
    return list(_REGISTRY)


def get(name: str) -> Family:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownFamilyError(f"unknown family {name!r}; valid families: {', '.join(names())}") from None
