"""Reference side of SigLIP: transformers' ``SiglipVisionModel``, as CLIP plus overrides.

No class token, no ``pre_layrnorm``, ``post_layernorm`` on every token, and (``vision_use_head``)
an attention-pooling head whose output is ``pooler_output``.
"""

from __future__ import annotations

import torch
from transformers import SiglipVisionConfig, SiglipVisionModel

from mmparity.parity import inputs
from mmparity.parity.cases import Case, Pair, tokens_2d
from mmparity.reference import clip
from mmparity.reference.clip import conv_tokens, patch_size, prepare_case, run  # noqa: F401

MODEL_TYPES = ("siglip_vision_model",)
PARENT_MODEL_TYPES = ("siglip", "paligemma", "llava", "llava_next", "llava_onevision")


def tiny_config() -> SiglipVisionConfig:
    """4 heads of 12 (TP 2 and 4), FFN 52, an odd 5x5 position grid, the pooling head on."""
    return SiglipVisionConfig(hidden_size=48, intermediate_size=52, num_hidden_layers=2,
                              num_attention_heads=4, image_size=40, patch_size=8, num_channels=3,
                              hidden_act="gelu_pytorch_tanh", layer_norm_eps=1e-6,
                              vision_use_head=True)


def vision_config(cfg):
    """The SigLIP vision config inside ``cfg`` (itself, a ``SiglipConfig``'s or a VLM's)."""
    return clip._vision_config(cfg, MODEL_TYPES, PARENT_MODEL_TYPES, "SigLIP")


def build(cfg) -> SiglipVisionModel:
    return SiglipVisionModel(vision_config(cfg)).eval()


def outputs(cfg) -> tuple:
    cfg = vision_config(cfg)
    return ("last_hidden_state", "pooler_output") if cfg.vision_use_head else ("last_hidden_state",)


def cases(cfg, seed: int, image_sizes=None) -> list[Case]:
    return clip.make_cases(vision_config(cfg), seed, image_sizes, outputs(cfg))


def pairs(model, cfg) -> list[Pair]:
    out = [Pair("patch_embed", model.embeddings.patch_embedding, conv_tokens)]
    out += [Pair(f"layer.{i}", layer, tokens_2d) for i, layer in enumerate(model.encoder.layers)]
    out.append(Pair("ln_post", model.post_layernorm, tokens_2d))
    if getattr(model, "head", None) is not None:
        out.append(Pair("head", model.head, tokens_2d))
    return out


COMPONENTS = ("patch_embed", "pos_embed")


def component(name: str, model, cfg, seed: int) -> torch.Tensor:
    cfg = vision_config(cfg)
    if name == "pos_embed":
        return clip.interpolated_positions(model.embeddings, cfg, inputs.COMPONENT_GRID, 0)
    return clip.component(name, model, cfg, seed)
