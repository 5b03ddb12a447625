"""Native Pixtral-Large vision path: Pixtral ``ViTModel`` with the 2x2 merger, then mcore's projector.

HF Mistral3 splits this differently: its vision tower ends at the encoder, and the pre-merge
RMSNorm and the patch merger live in ``multi_modal_projector``. Here, as in Megatron-LM's
``megatron/core/models/vision/vit_model.py``, norm and merger belong to the ViT
(``vision_model.merger``) and the projector is mcore's ``MultimodalProjector`` of type ``mlp`` (``vision_projection.encoder.linear_fc1/linear_fc2``, the
names mcore's ``LLaVAModel`` uses). The merger norm's epsilon is the *text* config's
``rms_norm_eps``, as in HF.
"""

from __future__ import annotations

import copy

import torch
from megatron.core.models.vision.multimodal_projector import MultimodalProjector
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules

from mmparity.config import rope_theta
from mmparity.models.llava.config import projection_fields
from mmparity.models.pixtral import native as pixtral
from mmparity.models.core.layers import activation_from_hf, vision_layer_spec, vision_transformer_config
from mmparity.models.core.vit import TowerWithProjection, ViTModel
from mmparity.parallel import runtime

MODEL_TYPES = ("mistral3",)


class PixtralLargeVisionModel(TowerWithProjection):
    """``vision_model`` (ViTModel with merger) -> ``vision_projection`` (mcore MultimodalProjector).

    Static ``(B, C, H, W)`` -> ``(B, M, text_hidden)``; dynamic pre-patchified rows with
    ``imgs_sizes`` -> ``(1, ΣM, text_hidden)``, each image merged on its own grid. Under pipeline
    parallelism the projector, like the merger, lives on the last stage; earlier stages return
    the stage's hidden states.
    """

    def __init__(self, vision_model: ViTModel, projector_config, projector_input_size: int):
        super().__init__(vision_model, lambda: MultimodalProjector(
            projector_config, MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear),
            "mlp", projector_input_size))

    def forward(self, pixel_values: torch.Tensor, imgs_sizes=None, packed_seq_params=None,
                return_merged: bool = False):
        merged = self.vision_model(pixel_values, imgs_sizes=imgs_sizes,
                                   packed_seq_params=packed_seq_params)
        if not self.post_process:
            return (merged, None) if return_merged else merged
        projected = self.vision_projection(merged)
        return (merged, projected) if return_merged else projected


def _mistral3(cfg):
    if getattr(cfg, "model_type", None) not in MODEL_TYPES:
        raise ValueError(f"config of model_type {getattr(cfg, 'model_type', None)!r} is not a "
                         "Mistral3 (Pixtral-Large) model")
    return cfg


def _feature_layer_is_last(cfg) -> bool:
    layer = cfg.vision_feature_layer
    layers = cfg.vision_config.num_hidden_layers
    return isinstance(layer, int) and layer in (-1, layers)


def projector_config(cfg, params_dtype: torch.dtype = torch.float32):
    """TransformerConfig of the projector MLP: the recipe of LLaVA-composed VLMs' projectors
    (:func:`~mmparity.models.llava.config.projection_fields`) with HF's own activation function."""
    fields = projection_fields(cfg)
    fields["activation"] = activation_from_hf(fields["activation"])
    layout = runtime.current_layout()
    # The projector has no attention, but TransformerConfig demands a head count that TP divides.
    heads = layout.tp if layout is not None else 1
    return vision_transformer_config(num_layers=1, num_attention_heads=heads, kv_channels=1,
                                     params_dtype=params_dtype, pipelined_stack=False, **fields)


def build_native(cfg, params_dtype: torch.dtype = torch.float32) -> PixtralLargeVisionModel:
    """From an HF ``Mistral3Config``: vision tower shapes from ``vision_config``, the merger norm's
    epsilon and the projector widths from ``text_config``."""
    cfg = _mistral3(cfg)
    if not _feature_layer_is_last(cfg):
        raise ValueError(f"vision_feature_layer={cfg.vision_feature_layer!r}: only the last layer "
                         "(-1) is supported by the native Pixtral-Large path")
    return PixtralLargeVisionModel(merged_tower(cfg, params_dtype), projector_config(cfg, params_dtype),
                                   cfg.vision_config.hidden_size)


def merged_tower(cfg, params_dtype: torch.dtype = torch.float32, num_layers: int | None = None) -> ViTModel:
    """The Pixtral ``ViTModel`` with Mistral3's 2x2 merger (``vision_model`` of Megatron's layout),
    ``num_layers`` deep (default: the config's); the merger norm takes the text epsilon."""
    vision = copy.copy(cfg.vision_config)
    if num_layers is not None:
        vision.num_hidden_layers = num_layers
    img_h, img_w = pixtral._image_hw(vision)
    return ViTModel(pixtral.transformer_config(vision, params_dtype), vision_layer_spec(),
                    patch_dim=pixtral._patch(vision), img_h=img_h, img_w=img_w,
                    in_channels=vision.num_channels, patch_embed_bias=False, ln_pre=True,
                    ln_pre_eps=pixtral.PIXTRAL_NORM_EPS, pos_emb_type="rope2d",
                    rope_theta=rope_theta(vision), use_merger=True,
                    spatial_merge_size=cfg.spatial_merge_size,
                    merger_norm_eps=cfg.text_config.rms_norm_eps)
