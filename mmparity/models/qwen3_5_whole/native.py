"""Qwen3.5 / Qwen3.5-MoE whole on mcore, ``LLaVAModel``'s tree: the ``qwen3_5`` family's tower with
its merger (Qwen3.5 has no separate projector) as ``vision_model`` and the ``qwen3_5_text`` part's
hybrid decoder (Gated DeltaNet + gated attention, dense or MoE) as ``language_model``.

What the whole adds to its parts, and no more: the merged image and video features take the
place of the image and video tokens' embeddings (a clip's temporal patches apart, after timestamp
text, as Qwen3-VL's), and the decoder's RoPE is the interleaved M-RoPE of Qwen3-VL (three
position ids per token by transformers' ``get_rope_index`` rule; frequencies dealt t h w t h w …),
over the rotated part of each head only (Qwen3.5 rotates a fraction of the head). Both come from
:mod:`mmparity.models.qwen3_vl_whole.native`; the composition is its ``Qwen3VLModel`` with no
DeepStack features. Gated DeltaNet layers read no positions.
"""

from __future__ import annotations

from typing import List

import torch

from mmparity.config import rope_parameters
from mmparity.models.core.stages import build_stage
from mmparity.models.qwen3_5 import native as tower
from mmparity.models.qwen3_vl_whole.native import InterleavedMRoPE, Qwen3VLModel

# transformers' Qwen3.5 text RoPE where the config names no sections.
DEFAULT_MROPE_SECTION = [11, 11, 10]


def mrope_section(text) -> List[int]:
    return list((rope_parameters(text) or {}).get("mrope_section") or DEFAULT_MROPE_SECTION)


def rotary_dim(text) -> int:
    """The rotated width of each attention head, as HF and mcore both round it."""
    fraction = float(rope_parameters(text).get("partial_rotary_factor", 1.0))
    return int(text.head_dim * fraction)


def text_config_problems(text) -> list[str]:
    section = mrope_section(text)
    if len(section) != 3 or min(section) < 0:
        return [f"mrope_section {section} is not three sections (t, h, w)"]
    return []


class Qwen35VLModel(Qwen3VLModel):
    """Qwen3-VL's composition without DeepStack: the merged features alone enter the decoder."""

    def image_features(self, rows: torch.Tensor, imgs_sizes):
        hidden, h, w = self.vision_model.encode(rows, imgs_sizes=imgs_sizes)
        pooled = self.vision_model.merger(hidden, h, w)
        return pooled.reshape(-1, pooled.shape[-1]), []


def use_mrope(model, text) -> None:
    """Switch the part's GPTModel from 1D RoPE to interleaved M-RoPE: its forward reads the kind at
    run time and hands an ``mrope`` embedding the ``[3, b, s]`` positions and the sections."""
    model.position_embedding_type = "mrope"
    model.mrope_section = mrope_section(text)
    model.rotary_pos_emb = InterleavedMRoPE(rotary_dim(text), float(rope_parameters(text)["rope_theta"]))


def build_native(cfg, params_dtype: torch.dtype = torch.float32, *, language) -> Qwen35VLModel:
    """The model at this pipeline stage; ``language``: the part's native module."""
    text, vc = cfg.text_config, cfg.vision_config
    problems = text_config_problems(text)
    if problems:
        raise ValueError("unsupported language model: " + "; ".join(problems))
    vision, language_model = build_stage(
        cfg, text, language.LanguageModelBuilder(text, params_dtype),
        tower=lambda: tower.build_native(vc, params_dtype))
    use_mrope(language_model, text)
    model = Qwen35VLModel(vision, language_model, image_token_id=cfg.image_token_id, vocab_size=text.vocab_size,
                          merge=vc.spatial_merge_size, patch_dim=tower._int(vc.patch_size),
                          video_token_id=cfg.video_token_id)
    return model.to(params_dtype)
