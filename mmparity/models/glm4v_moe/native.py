"""GLM-4.5V whole on mcore, ``LLaVAModel``'s tree: the GLM tower with its merger
(:mod:`mmparity.models.glm4v_vision.native`; GLM has no separate projector) as ``vision_model`` and
the GLM-4.5 MoE decoder as ``language_model`` (a ``GPTModel``).

The decoder layer is the dense decoder part's attention (its causal core attention, TE-spelled
linears, GQA with q/k/v biases and no output bias) with, per layer, the dense decoder's gated MLP
(the ``first_k_dense_replace`` leading layers) or the DeepSeek-V3 part's ``MoELayer`` (a separate
``pre_mlp_layernorm``, the sigmoid router with its score-correction bias, group-limited top-k, the
routed scale, routed ``SequentialMLP`` experts under TEGroupedMLP's names and one shared-expert MLP).

RoPE: only the first ``head_dim · partial_rotary_factor`` dimensions of each head rotate
(rotate-half within them; the rest pass), as both HF and mcore's ``apply_rotary_pos_emb`` take a
table narrower than the head. The rotary frequencies are M-RoPE in contiguous sections: the first
``mrope_section[0]`` read the t position, the next ``mrope_section[1]`` h, the last w (Qwen2-VL's
split, :class:`~mmparity.models.qwen2_5_vl_whole.native.SectionedMRoPE`). Positions follow
transformers' ``get_rope_index`` for GLM, which for images is Qwen-VL's rule
(:func:`~mmparity.models.qwen3_vl_whole.native.mrope_position_ids`: an image's tokens t = start,
h = start + row, w = start + column of its merged grid; the text after continues at start + the
larger side). The whole model's forward is Qwen3-VL whole's without DeepStack; each image is one
run of image tokens between GLM's image start / end tokens. Video is not taken (see the family
docs).
"""

from __future__ import annotations

import functools

import torch
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from mmparity.config import moe_layer_range, rope_parameters, rope_theta
from mmparity.models.core.layers import activation_from_hf, vision_transformer_config
from mmparity.models.core.stages import build_stage
from mmparity.models.glm4v_moe.config import rotary_dim, rotary_fraction
from mmparity.models.glm4v_vision import native as tower
from mmparity.models.parts.deepseek_v3.config import moe_problems, moe_transformer_fields
from mmparity.models.parts.deepseek_v3.native import build_gpt_model
from mmparity.models.parts.dense_decoder.config import transformer_fields
from mmparity.models.parts.dense_decoder.native import language_layer_spec
from mmparity.models.qwen2_5_vl_whole.native import SectionedMRoPE
from mmparity.models.qwen3_vl_moe import native as moe_layers
from mmparity.models.qwen3_vl_whole.native import Qwen3VLModel

# transformers' GLM-4.5V text RoPE where the config names no sections.
DEFAULT_MROPE_SECTION = [8, 12, 12]


def mrope_section(text) -> list[int]:
    return list(rope_parameters(text).get("mrope_section") or DEFAULT_MROPE_SECTION)


def text_config_problems(text) -> list[str]:
    problems = []
    rope = rope_parameters(text)
    if rope["rope_type"] != "default":
        problems.append(f"rope_type {rope['rope_type']!r} (only unscaled M-RoPE)")
    section, half = mrope_section(text), rotary_dim(text) // 2
    if len(section) != 3 or min(section) < 0 or sum(section) != half:
        problems.append(f"mrope_section {section} is not three sections (t, h, w) covering the {half} "
                        f"rotary frequencies of a head")
    if text.hidden_act not in ("silu", "swish"):
        problems.append(f"hidden_act {text.hidden_act!r} (the experts here are SwiGLU)")
    return problems + moe_problems(text)


def transformer_config(text, params_dtype: torch.dtype = torch.float32):
    """The decoder's ``TransformerConfig``: the dense decoder's fields (GQA, q/k/v biases, RMSNorm,
    SwiGLU), the rotated fraction of each head, and the DeepSeek-V3 MoE's fields."""
    problems = text_config_problems(text)
    if problems:
        raise ValueError("unsupported language model: " + "; ".join(problems))
    fields = transformer_fields(text)
    fields["activation"] = activation_from_hf(fields["activation"])
    fields.update(moe_transformer_fields(text))
    return vision_transformer_config(params_dtype=params_dtype,
                                     mrope_section=mrope_section(text), **fields)


def block_spec(text) -> TransformerBlockSubmodules:
    """One spec per layer of this pipeline stage: the dense decoder's layer, its MLP the MoE layer
    with a shared expert after the ``first_k_dense_replace`` dense layers."""
    layer = functools.partial(moe_layers.layer_spec, base=language_layer_spec, shared_experts=True)
    return moe_layers.block_spec(text, moe_layer_range(text), layer)


def build_language_model(text, params_dtype, vocab_size: int, *, pre_process: bool, post_process: bool,
                         share_embeddings_and_output_weights: bool):
    config = transformer_config(text, params_dtype)
    model = build_gpt_model(config, block_spec(text), vocab_size, text.max_position_embeddings,
                            pre_process=pre_process, post_process=post_process, parallel_output=True,
                            share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                            rotary_base=rope_theta(text), rotary_percent=rotary_fraction(text))
    # Sectioned M-RoPE over the rotated width, switched in as the Qwen-VL decoders do (GPTModel
    # reads the kind at run time and hands an "mrope" embedding the [3, b, s] positions).
    model.position_embedding_type = "mrope"
    model.mrope_section = mrope_section(text)
    model.rotary_pos_emb = SectionedMRoPE(rotary_dim(text), rope_theta(text))
    return model


class Glm4vMoeModel(Qwen3VLModel):
    """Qwen3-VL whole's model (ids and images -> logits or per-token loss, positions by the
    processor's rule) over the GLM tower: its merger's features, no DeepStack, images only."""

    def image_features(self, rows: torch.Tensor, imgs_sizes):
        _, pooled = self.vision_model.features(rows, imgs_sizes=imgs_sizes)
        return pooled.reshape(-1, pooled.shape[-1]), []


def build_native(cfg, params_dtype: torch.dtype = torch.float32) -> Glm4vMoeModel:
    text, vc = cfg.text_config, cfg.vision_config
    vision, language_model = build_stage(cfg, text, functools.partial(build_language_model, text, params_dtype),
                                         tower=lambda: tower.build_native(vc, params_dtype))
    model = Glm4vMoeModel(vision, language_model, image_token_id=cfg.image_token_id,
                          vocab_size=text.vocab_size, merge=vc.spatial_merge_size, patch_dim=int(vc.patch_size))
    return model.to(params_dtype)
