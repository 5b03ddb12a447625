"""Qwen2.5-VL whole on mcore, ``LLaVAModel``'s tree: the ``qwen2_5_vl`` family's tower (with its
merger; Qwen2.5-VL has no separate projector) as ``vision_model`` and a Qwen2 decoder as
``language_model`` (a ``GPTModel``).

The decoder is the dense decoder part's layer (its causal core attention, its TE-spelled linears,
q/k/v biases) with M-RoPE: three position ids per token (t, h, w), the rotary frequencies taken
in contiguous sections, the first ``mrope_section[0]`` from t, the next ``mrope_section[1]``
from h, the last ``mrope_section[2]`` from w (Qwen2-VL's split, not Qwen3-VL's interleaving);
laid out rotate-half. Positions follow transformers' ``get_rope_index``, which is Qwen3-VL whole's
rule (:func:`~mmparity.models.qwen3_vl_whole.native.mrope_position_ids`) for images; a video clip
is one run whose temporal position steps by ``tokens_per_second`` × seconds per temporal patch
(truncated to an integer, fp32, as transformers computes it). The whole model's forward is
Qwen3-VL whole's without DeepStack (no features to add after the decoder layers).
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
from megatron.core.models.gpt.gpt_model import GPTModel

from mmparity.config import rope_theta
from mmparity.models.core.layers import activation_from_hf, vision_transformer_config
from mmparity.models.core.stages import build_stage
from mmparity.models.parts.dense_decoder.config import transformer_fields
from mmparity.models.parts.dense_decoder.native import language_layer_spec
from mmparity.models.qwen2_5_vl import native as tower
from mmparity.models.qwen2_5_vl_whole.config import Qwen2Text
from mmparity.models.qwen3_vl_whole.native import InterleavedMRoPE, Qwen3VLModel


def mrope_section(text) -> list[int]:
    params = getattr(text, "rope_parameters", None) or {}
    return list(params.get("mrope_section", [16, 24, 24]))


def text_config_problems(text) -> list[str]:
    problems = []
    params = getattr(text, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        problems.append(f"rope_type {params.get('rope_type')!r} (only unscaled M-RoPE)")
    section = mrope_section(text)
    half = (getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads) // 2
    if len(section) != 3 or sum(section) != half:
        problems.append(f"mrope_section {section} is not three sections (t, h, w) covering the "
                        f"{half} rotary frequencies of a head")
    if getattr(text, "sliding_window", None) is not None:
        problems.append(f"sliding_window={text.sliding_window} (the decoder is fully causal)")
    return problems


class SectionedMRoPE(InterleavedMRoPE):
    """Qwen3-VL whole's M-RoPE module with Qwen2-VL's assignment of frequencies to positions:
    contiguous sections t, then h, then w."""

    @staticmethod
    def axes(half: int, section: Sequence[int], device=None) -> torch.Tensor:
        if sum(section) != half:
            raise ValueError(f"mrope_section {list(section)} does not cover the {half} rotary frequencies")
        return torch.repeat_interleave(torch.arange(3, device=device),
                                       torch.tensor(list(section), device=device))


def transformer_config(text, params_dtype: torch.dtype = torch.float32):
    problems = text_config_problems(text)
    if problems:
        raise ValueError("unsupported language model: " + "; ".join(problems))
    fields = transformer_fields(Qwen2Text(text))
    fields["activation"] = activation_from_hf(fields["activation"])
    return vision_transformer_config(params_dtype=params_dtype, mrope_section=mrope_section(text), **fields)


def build_language_model(text, params_dtype, vocab_size: int, *, pre_process: bool, post_process: bool,
                         share_embeddings_and_output_weights: bool) -> GPTModel:
    config = transformer_config(text, params_dtype)
    model = GPTModel(config=config, transformer_layer_spec=language_layer_spec(), vocab_size=vocab_size,
                     max_sequence_length=text.max_position_embeddings, pre_process=pre_process,
                     post_process=post_process, parallel_output=True,
                     share_embeddings_and_output_weights=share_embeddings_and_output_weights,
                     position_embedding_type="rope", rotary_base=rope_theta(text),
                     scatter_embedding_sequence_parallel=False)
    # mcore's own MultimodalRotaryEmbedding has this split but is built on CUDA: built as "rope",
    # then switched, as Qwen3-VL whole does (GPTModel reads the kind at run time).
    model.position_embedding_type = "mrope"
    model.mrope_section = mrope_section(text)
    model.rotary_pos_emb = SectionedMRoPE(config.kv_channels, rope_theta(text))
    return model


class Qwen25VLModel(Qwen3VLModel):
    """Qwen3-VL whole's model (ids, images and clips -> logits or per-token loss, positions by the
    processor's rule) over the Qwen2.5-VL tower: its features, and no DeepStack. A clip is one run
    of video tokens whose temporal position steps by ``tokens_per_second`` × its seconds per
    temporal patch (no timestamp text between its temporal patches)."""

    frames_apart = False

    def image_features(self, rows: torch.Tensor, imgs_sizes):
        _, pooled = self.vision_model.features(rows, imgs_sizes=imgs_sizes)
        return pooled.reshape(-1, pooled.shape[-1]), []


def build_native(cfg, params_dtype: torch.dtype = torch.float32) -> Qwen25VLModel:
    text, vc = cfg.text_config, cfg.vision_config
    vision, language_model = build_stage(cfg, text, functools.partial(build_language_model, text, params_dtype),
                                         tower=lambda: tower.build_native(vc, params_dtype))
    model = Qwen25VLModel(vision, language_model, image_token_id=cfg.image_token_id,
                          vocab_size=text.vocab_size, merge=vc.spatial_merge_size,
                          patch_dim=int(vc.patch_size), video_token_id=cfg.video_token_id,
                          tokens_per_second=vc.tokens_per_second)
    return model.to(params_dtype)
