"""Reference side of Gemma 4's vision tower: transformers' ``Gemma4VisionModel``.

It takes the image processor's output: ``pixel_values`` ``(B, max_patches, P·P·C)`` (each row one
patch, flattened in (P, P, C) order, rows in raster order, zero rows after the image's last) and
``pixel_position_ids`` ``(B, max_patches, 2)`` (each patch's (column, row); padding rows
(-1, -1)). Its ``last_hidden_state`` is what the whole Gemma 4 model reads
(``Gemma4Model.get_image_features`` feeds it to ``embed_vision``): the soft tokens of every image,
k x k patches averaged into one (k = ``pooling_kernel_size``), scaled by sqrt(hidden), padding
dropped, concatenated over the batch ``(Σ tokens, hidden)``, standardized where ``standardize``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmparity.config import first_int, head_dim, num_heads, query_groups, tower_config
from mmparity.models.gemma4_vision.config import BOUNDS

if TYPE_CHECKING:
    from transformers import Gemma4VisionConfig, Gemma4VisionModel

MODEL_TYPES = ("gemma4_vision",)
PARENT_MODEL_TYPES = ("gemma4",)
OUTPUTS = ("last_hidden_state",)
CHANNELS = 3  # transformers' patch embedding takes three channels, whatever the config says
LINEARS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"), "mlp": ("gate_proj", "up_proj", "down_proj")}
LAYER_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
               "post_feedforward_layernorm")


def tiny_config() -> Gemma4VisionConfig:
    """Awkward tiny sizes: hidden 40 with 4 heads of 12 (head_dim not hidden / heads; TP 1, 2, 4),
    MLP width 36, 3 layers (PP 2 splits them unevenly), patch 4 with 3 x 3 pooling, a position
    table of 29 per axis (the bench's default 96-pixel images need 24); clipped linears and
    standardize on, so both are checked."""
    from transformers import Gemma4VisionConfig

    return Gemma4VisionConfig(hidden_size=40, intermediate_size=36, num_hidden_layers=3, num_attention_heads=4,
                              num_key_value_heads=4, head_dim=12, patch_size=4, pooling_kernel_size=3,
                              position_embedding_size=29, use_clipped_linears=True, standardize=True,
                              rope_parameters={"rope_type": "axial", "rope_theta": 100.0})


def vision_config(cfg):
    """The Gemma 4 vision config inside ``cfg`` (itself, or a whole Gemma 4's)."""
    return tower_config(cfg, MODEL_TYPES, PARENT_MODEL_TYPES, "Gemma 4 vision")


def build(cfg) -> Gemma4VisionModel:
    from transformers import Gemma4VisionModel

    return Gemma4VisionModel(vision_config(cfg)).float().eval()


def patch_size(cfg) -> int:
    return first_int(vision_config(cfg).patch_size)


def state_shapes(cfg) -> dict[str, tuple]:
    """The shapes of :func:`build`'s state dict, read off the config."""
    cfg = vision_config(cfg)
    h, f, d, p = cfg.hidden_size, cfg.intermediate_size, head_dim(cfg), patch_size(cfg)
    q, kv = num_heads(cfg) * d, query_groups(cfg) * d
    sizes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
             "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}
    layer = {f"{norm}.weight": (h,) for norm in LAYER_NORMS}
    layer |= {"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}
    for module, linears in LINEARS.items():
        for linear in linears:
            layer[f"{module}.{linear}.linear.weight"] = sizes[linear]
            if cfg.use_clipped_linears:
                layer |= {f"{module}.{linear}.{bound}": () for bound in BOUNDS}
    out = {"patch_embedder.input_proj.weight": (h, CHANNELS * p * p),
           "patch_embedder.position_embedding_table": (2, cfg.position_embedding_size, h),
           **{f"encoder.layers.{i}.{k}": s for i in range(cfg.num_hidden_layers) for k, s in layer.items()}}
    if cfg.standardize:
        out |= {"std_bias": (h,), "std_scale": (h,)}
    return out
