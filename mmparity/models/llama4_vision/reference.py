"""Reference side of Llama 4's vision tower: transformers' ``Llama4VisionModel``.

Fixed-size tiles (transformers' image processor cuts every image into ``image_size`` tiles, plus a
global one): patch linear, class token appended last, learned positions, ``layernorm_pre``, layers
with 2D RoPE, ``layernorm_post``, the class token dropped, pixel shuffle and the adapter MLP
(``vision_adapter``). Its ``last_hidden_state`` is the adapter's output per tile.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmparity.config import first_int, tower_config

if TYPE_CHECKING:
    from transformers import Llama4VisionConfig, Llama4VisionModel

MODEL_TYPES = ("llama4_vision_model",)
PARENT_MODEL_TYPES = ("llama4",)
OUTPUTS = ("last_hidden_state",)
CLASS_TOKEN_LEN = 1


def tiny_config() -> Llama4VisionConfig:
    """4 heads of 12 (TP 2; head_dim divisible by 4 for 2D RoPE), 3 layers (PP 2 splits them
    unevenly), a 4x4 patch grid (pixel-shuffled to 2x2), adapter 192 -> 40 -> 40."""
    from transformers import Llama4VisionConfig

    return Llama4VisionConfig(hidden_size=48, intermediate_size=192, num_hidden_layers=3, num_attention_heads=4,
                              image_size=32, patch_size=8, num_channels=3, vision_output_dim=40,
                              projector_input_dim=40, projector_output_dim=40, pixel_shuffle_ratio=0.5,
                              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def vision_config(cfg):
    """The Llama 4 vision config inside ``cfg`` (itself, or a whole Llama 4's)."""
    return tower_config(cfg, MODEL_TYPES, PARENT_MODEL_TYPES, "Llama 4 vision")


def build(cfg) -> Llama4VisionModel:
    from transformers import Llama4VisionModel

    return Llama4VisionModel(vision_config(cfg)).eval()


def patch_size(cfg) -> int:
    return first_int(cfg.patch_size)


def state_shapes(cfg) -> dict[str, tuple]:
    """The shapes of :func:`build`'s state dict, read off the config."""
    cfg = vision_config(cfg)
    h, f, p = cfg.hidden_size, cfg.intermediate_size, patch_size(cfg)
    positions = (first_int(cfg.image_size) // p) ** 2 + CLASS_TOKEN_LEN
    layer = {"input_layernorm.weight": (h,), "input_layernorm.bias": (h,),
             "post_attention_layernorm.weight": (h,), "post_attention_layernorm.bias": (h,),
             "mlp.fc1.weight": (f, h), "mlp.fc1.bias": (f,), "mlp.fc2.weight": (h, f), "mlp.fc2.bias": (h,)}
    for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
        layer |= {f"self_attn.{proj}.weight": (h, h), f"self_attn.{proj}.bias": (h,)}
    return {"class_embedding": (h,), "positional_embedding_vlm": (positions, h),
            "patch_embedding.linear.weight": (h, cfg.num_channels * p * p),
            "layernorm_pre.weight": (h,), "layernorm_pre.bias": (h,),
            "layernorm_post.weight": (h,), "layernorm_post.bias": (h,),
            **{f"model.layers.{i}.{k}": s for i in range(cfg.num_hidden_layers) for k, s in layer.items()},
            "vision_adapter.mlp.fc1.weight": (cfg.projector_input_dim, cfg.intermediate_size),
            "vision_adapter.mlp.fc2.weight": (cfg.projector_output_dim, cfg.projector_output_dim)}
