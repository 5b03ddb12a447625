"""Reference side of Kimi-K2.5: transformers' ``Kimi_K25VisionModel`` (+ ``Kimi_K25MultimodalProjection``).

A whole ``Kimi_K25Config`` gives the vision tower and the projector (as ``vision_tower.*`` and
``mm_projector.*``, the names inside ``Kimi_K25Model``); a ``Kimi_K25VisionConfig`` gives the tower
alone. The language model is never built.

HF takes pre-patchified ``(ΣN, 3, P, P)`` pixels with ``grid_thw``; clips are frame-major.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mmparity.config import has_vision_sub_config as has_projector
from mmparity.config import vision_sub_config as vision_cfg

if TYPE_CHECKING:
    from transformers import Kimi_K25Config, Kimi_K25VisionConfig

MODEL_TYPES = ("kimi_k25", "kimi_k25_vision")
CHANNELS = 3  # HF's patch Conv2d has a literal 3 input channels


def tiny_config() -> Kimi_K25Config:
    """Awkward tiny sizes: 4 heads of 12 (TP 1/2/4; hd % 4 == 0 for 2D RoPE), FFN 44 (not a multiple
    of 48), patch 5, a 6x6 position table (so most grids resample), 4 temporal rows, text hidden 40.
    """
    from transformers import Kimi_K25Config, Kimi_K25VisionConfig

    vision = Kimi_K25VisionConfig(patch_size=5, pos_emb_height=6, pos_emb_width=6, pos_emb_time=4,
                                  num_attention_heads=4, num_hidden_layers=2, hidden_size=48,
                                  intermediate_size=44)
    text = {"model_type": "deepseek_v3", "hidden_size": 40, "num_hidden_layers": 1, "vocab_size": 64,
            "intermediate_size": 32, "moe_intermediate_size": 16, "num_attention_heads": 2,
            "num_key_value_heads": 2, "first_k_dense_replace": 1, "q_lora_rank": None,
            "kv_lora_rank": 8, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4, "v_head_dim": 4,
            "n_routed_experts": 2, "num_experts_per_tok": 1}
    return Kimi_K25Config(vision_config=vision, text_config=text, projection_hidden_size=48,
                          tie_word_embeddings=False)


def vision_config(cfg):
    """The family config: a whole Kimi-K2.5 config (tower + projector) or a vision config (tower)."""
    if getattr(cfg, "model_type", None) in MODEL_TYPES:
        return cfg
    raise ValueError(f"config of model_type {getattr(cfg, 'model_type', None)!r} is not a Kimi-K2.5 model")


class KimiK25VisionReference(torch.nn.Module):
    """The vision half of ``Kimi_K25Model``: tower and projector under their HF attribute names."""

    def __init__(self, cfg: Kimi_K25Config):
        from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25MultimodalProjection, Kimi_K25VisionModel

        super().__init__()
        self.config = cfg
        self.vision_tower = Kimi_K25VisionModel(cfg.vision_config)
        self.mm_projector = Kimi_K25MultimodalProjection(cfg)

    def forward(self, pixel_values, grid_thw):
        out = self.vision_tower(pixel_values, grid_thw=grid_thw)
        return out, self.mm_projector(out.pooler_output).squeeze(1)


def build(cfg):
    if has_projector(cfg):
        model = KimiK25VisionReference(cfg)
    else:
        from transformers.models.kimi_k25.modeling_kimi_k25 import Kimi_K25VisionModel

        model = Kimi_K25VisionModel(cfg)
    return model.float().eval()


def state_shapes(cfg) -> dict[str, tuple]:
    """The shapes of :func:`build`'s state dict, read off the config."""
    vc = vision_cfg(cfg)
    h, f = vc.hidden_size, vc.intermediate_size
    ph, pw = (vc.patch_size, vc.patch_size) if isinstance(vc.patch_size, int) else tuple(vc.patch_size)
    layer = {"norm1.weight": (h,), "norm1.bias": (h,), "norm2.weight": (h,), "norm2.bias": (h,),
             "mlp.fc1.weight": (f, h), "mlp.fc1.bias": (f,), "mlp.fc2.weight": (h, f), "mlp.fc2.bias": (h,)}
    for proj in ("q_proj", "k_proj", "v_proj", "proj"):
        layer |= {f"attn.{proj}.weight": (h, h), f"attn.{proj}.bias": (h,)}
    tower = {"patch_embed.proj.weight": (h, CHANNELS, ph, pw), "patch_embed.proj.bias": (h,),
             "patch_embed.pos_emb.position_embeddings": (vc.pos_emb_height, vc.pos_emb_width, h),
             **{f"layers.{i}.{k}": s for i in range(vc.num_hidden_layers) for k, s in layer.items()},
             "final_layernorm.weight": (h,), "final_layernorm.bias": (h,)}
    if not has_projector(cfg):
        return tower
    kh, kw = tuple(vc.merge_kernel_size)
    merged, text = h * kh * kw, cfg.text_config.hidden_size
    return {**{"vision_tower." + k: s for k, s in tower.items()},
            "mm_projector.pre_norm.weight": (cfg.projection_hidden_size,),
            "mm_projector.pre_norm.bias": (cfg.projection_hidden_size,),
            "mm_projector.in_proj.weight": (merged, merged), "mm_projector.in_proj.bias": (merged,),
            "mm_projector.out_proj.weight": (text, merged), "mm_projector.out_proj.bias": (text,)}


def vision_tower(model):
    return model.vision_tower if isinstance(model, KimiK25VisionReference) else model


def patch_size(cfg) -> int:
    p = vision_cfg(cfg).patch_size
    return p if isinstance(p, int) else p[0]
