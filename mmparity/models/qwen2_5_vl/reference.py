"""Reference side of the Qwen2.5-VL vision tower: transformers'
``Qwen2_5_VisionTransformerPretrainedModel``.

HF takes pre-patchified rows in the image processor's layout (block-first, width C·T·P·P) plus
``grid_thw``, reorders the merge units into windows (``get_vision_window_index``), and keeps
that order through the blocks: its ``last_hidden_state`` is in window order and precedes the
merger; its ``pooler_output`` (the merger's) is put back in the processor's order.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmparity.config import first_int, tower_config

if TYPE_CHECKING:
    from transformers import Qwen2_5_VLVisionConfig

MODEL_TYPES = ("qwen2_5_vl_vision",)
# Whole-VLM configs that carry this tower as ``vision_config``.
PARENT_MODEL_TYPES = ("qwen2_5_vl",)
OUTPUTS = ("last_hidden_state", "pooler_output")


def tiny_config() -> Qwen2_5_VLVisionConfig:
    """Awkward tiny sizes: 4 heads of 12 (TP 2 and 4; hd % 4 == 0 for 2D RoPE), FFN 44 not a
    multiple of hidden 48, odd patch size 5, out size 36; windows of 20 pixels (2×2 merge units)
    so that the default images have partial windows, and three layers of which the middle one
    attends to the whole image (window, full, window)."""
    from transformers import Qwen2_5_VLVisionConfig

    return Qwen2_5_VLVisionConfig(depth=3, hidden_size=48, intermediate_size=44, num_heads=4,
                                  in_channels=3, patch_size=5, temporal_patch_size=2,
                                  spatial_merge_size=2, out_hidden_size=36, window_size=20,
                                  fullatt_block_indexes=[1], hidden_act="silu")


def vision_config(cfg):
    """The vision config inside ``cfg`` (itself, or a ``Qwen2_5_VLConfig``'s ``vision_config``)."""
    return tower_config(cfg, MODEL_TYPES, PARENT_MODEL_TYPES, "Qwen2.5-VL vision")


def build(cfg):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    return Qwen2_5_VisionTransformerPretrainedModel(cfg).float().eval()


def state_shapes(cfg) -> dict[str, tuple]:
    """The shapes of :func:`build`'s state dict, read off the config."""
    h, f, p = cfg.hidden_size, cfg.intermediate_size, first_int(cfg.patch_size)
    merged = h * cfg.spatial_merge_size ** 2
    layer = {"norm1.weight": (h,), "norm2.weight": (h,),
             "attn.qkv.weight": (3 * h, h), "attn.qkv.bias": (3 * h,), "attn.proj.weight": (h, h),
             "attn.proj.bias": (h,), "mlp.gate_proj.weight": (f, h), "mlp.gate_proj.bias": (f,),
             "mlp.up_proj.weight": (f, h), "mlp.up_proj.bias": (f,), "mlp.down_proj.weight": (h, f),
             "mlp.down_proj.bias": (h,)}
    return {"patch_embed.proj.weight": (h, cfg.in_channels, first_int(cfg.temporal_patch_size), p, p),
            **{f"blocks.{i}.{k}": s for i in range(cfg.depth) for k, s in layer.items()},
            "merger.ln_q.weight": (h,),
            "merger.mlp.0.weight": (merged, merged), "merger.mlp.0.bias": (merged,),
            "merger.mlp.2.weight": (cfg.out_hidden_size, merged), "merger.mlp.2.bias": (cfg.out_hidden_size,)}
