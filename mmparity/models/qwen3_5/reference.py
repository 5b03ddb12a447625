"""Reference side of Qwen3.5-MoE VL: transformers' ``Qwen3_5MoeVisionModel``.

HF takes pre-patchified rows in the image processor's layout (block-first, width C·T·P·P) plus
``grid_thw``. Its ``last_hidden_state`` is the stack output *before* the merger; the native tower's
output is after the merger's norm and 2×2 grouping, so ``cases.qwen3_5.reference_run`` applies
HF's own merger norm and grouping to compare like with like. ``pooler_output`` is HF's whole merger.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmparity.config import tower_config

if TYPE_CHECKING:
    from transformers import Qwen3_5MoeVisionConfig

    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

MODEL_TYPES = ("qwen3_5_moe_vision",)
# Whole-VLM configs that carry this tower as ``vision_config``.
PARENT_MODEL_TYPES = ("qwen3_5_moe",)
OUTPUTS = ("last_hidden_state", "pooler_output")


def tiny_config() -> Qwen3_5MoeVisionConfig:
    """Awkward tiny sizes: 4 heads of 12 (TP 2 and 4; hd % 4 == 0 for 2D RoPE), FFN 44 not a
    multiple of hidden 48, odd patch size 5, out size 36, and a 5×5 learned position table so that
    grids beyond the table are cheap."""
    from transformers import Qwen3_5MoeVisionConfig

    return Qwen3_5MoeVisionConfig(depth=2, hidden_size=48, intermediate_size=44, num_heads=4,
                                  in_channels=3, patch_size=5, temporal_patch_size=2,
                                  spatial_merge_size=2, out_hidden_size=36,
                                  num_position_embeddings=25, hidden_act="gelu_pytorch_tanh")


def vision_config(cfg):
    """The vision config inside ``cfg`` (itself, or a ``Qwen3_5MoeConfig``'s ``vision_config``)."""
    return tower_config(cfg, MODEL_TYPES, PARENT_MODEL_TYPES, "Qwen3.5-MoE vision")


def build(cfg) -> Qwen3_5MoeVisionModel:
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

    return Qwen3_5MoeVisionModel(cfg).eval()


def state_shapes(cfg) -> dict[str, tuple]:
    """The shapes of :func:`build`'s state dict, read off the config."""
    h, f, p = cfg.hidden_size, cfg.intermediate_size, _int(cfg.patch_size)
    merged = h * cfg.spatial_merge_size ** 2
    layer = {"norm1.weight": (h,), "norm1.bias": (h,), "norm2.weight": (h,), "norm2.bias": (h,),
             "attn.qkv.weight": (3 * h, h), "attn.qkv.bias": (3 * h,), "attn.proj.weight": (h, h),
             "attn.proj.bias": (h,), "mlp.linear_fc1.weight": (f, h), "mlp.linear_fc1.bias": (f,),
             "mlp.linear_fc2.weight": (h, f), "mlp.linear_fc2.bias": (h,)}
    return {"patch_embed.proj.weight": (h, cfg.in_channels, cfg.temporal_patch_size, p, p),
            "patch_embed.proj.bias": (h,), "pos_embed.weight": (cfg.num_position_embeddings, h),
            **{f"blocks.{i}.{k}": s for i in range(cfg.depth) for k, s in layer.items()},
            "merger.norm.weight": (h,), "merger.norm.bias": (h,),
            "merger.linear_fc1.weight": (merged, merged), "merger.linear_fc1.bias": (merged,),
            "merger.linear_fc2.weight": (cfg.out_hidden_size, merged),
            "merger.linear_fc2.bias": (cfg.out_hidden_size,)}


def _int(value) -> int:
    return value if isinstance(value, int) else int(value[0])


def table_side(cfg) -> int:
    return int(cfg.num_position_embeddings ** 0.5)
