"""Reference side of the GLM-4.5V vision tower: transformers' ``Glm4vMoeVisionModel``.

HF takes pre-patchified rows in the image processor's layout (block-first, width C·T·P·P) plus
``grid_thw``; its ``last_hidden_state`` is the downsampled tokens (after ``post_layernorm`` and the
stride-m convolution), its ``pooler_output`` the merger's output.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmparity.config import first_int, tower_config

if TYPE_CHECKING:
    from transformers import Glm4vMoeVisionConfig

# GLM-4.5V's tower, and GLM-4.1V's / GLM-4.6V's (``Glm4vVisionModel``: the same modules and names).
MOE_MODEL_TYPE, DENSE_MODEL_TYPE = "glm4v_moe_vision", "glm4v_vision"
MODEL_TYPES = (MOE_MODEL_TYPE, DENSE_MODEL_TYPE)
OUTPUTS = ("last_hidden_state", "pooler_output")


def tiny_config() -> Glm4vMoeVisionConfig:
    """Awkward tiny sizes: 4 heads of 12 (TP 2; hd % 4 == 0 for 2D RoPE), odd patch size 5, a 5×5
    position table (image_size 25) that the default images exceed on one side and undershoot on
    the other, q/k/v biases on, out size 40 (the blocks' MLP width too) and merger width 28."""
    from transformers import Glm4vMoeVisionConfig

    return Glm4vMoeVisionConfig(depth=2, hidden_size=48, intermediate_size=28, num_heads=4, in_channels=3,
                                patch_size=5, image_size=25, temporal_patch_size=2, spatial_merge_size=2,
                                out_hidden_size=40, attention_bias=True, hidden_act="silu")


def vision_config(cfg):
    """The vision config inside ``cfg``: itself, or the ``vision_config`` of a whole model (whichever
    whole model type carries this tower's)."""
    sub = getattr(cfg, "vision_config", None)
    if getattr(sub, "model_type", None) in MODEL_TYPES:
        return sub
    return tower_config(cfg, MODEL_TYPES, (), "GLM-4.5V vision")


def build(cfg):
    from transformers.models.glm4v.modeling_glm4v import Glm4vVisionModel
    from transformers.models.glm4v_moe.modeling_glm4v_moe import Glm4vMoeVisionModel

    tower = Glm4vVisionModel if cfg.model_type == DENSE_MODEL_TYPE else Glm4vMoeVisionModel
    return tower(cfg).float().eval()


def state_shapes(cfg) -> dict[str, tuple]:
    """The shapes of :func:`build`'s state dict, read off the config."""
    h, out, f, p = cfg.hidden_size, cfg.out_hidden_size, cfg.intermediate_size, first_int(cfg.patch_size)
    m, g = cfg.spatial_merge_size, first_int(cfg.image_size) // p
    layer = {"norm1.weight": (h,), "norm2.weight": (h,), "attn.qkv.weight": (3 * h, h), "attn.proj.weight": (h, h),
             "mlp.gate_proj.weight": (out, h), "mlp.up_proj.weight": (out, h), "mlp.down_proj.weight": (h, out)}
    if cfg.attention_bias:
        layer["attn.qkv.bias"] = (3 * h,)
    return {"embeddings.position_embedding.weight": (g * g, h),
            "patch_embed.proj.weight": (h, cfg.in_channels, first_int(cfg.temporal_patch_size), p, p),
            "patch_embed.proj.bias": (h,), "post_conv_layernorm.weight": (h,),
            **{f"blocks.{i}.{k}": s for i in range(cfg.depth) for k, s in layer.items()},
            "post_layernorm.weight": (h,), "downsample.weight": (out, h, m, m), "downsample.bias": (out,),
            "merger.proj.weight": (out, out), "merger.post_projection_norm.weight": (out,),
            "merger.post_projection_norm.bias": (out,), "merger.gate_proj.weight": (f, out),
            "merger.up_proj.weight": (f, out), "merger.down_proj.weight": (out, f)}
