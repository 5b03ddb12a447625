"""Megatron's own class for Qwen2.5-VL's language model trained alone: stock megatron-core
``GPTModel`` exactly as the dense decoder part builds a Qwen2 decoder (``--add-qkv-bias``, RoPE with
the text config's base, TE layer spec).

On text the three M-RoPE position axes are equal, so M-RoPE is plain rotate-half RoPE and the stock
class computes HF's text model."""

from __future__ import annotations

import dataclasses

import torch

from mmparity.mapping.rules import VOCAB_MULTIPLE
from mmparity.models.llava import megatron as llava
from mmparity.models.parts.dense_decoder import megatron as dense_decoder
from mmparity.models.qwen2_5_vl_whole.config import Qwen2Text


class _AsQwen2:
    """The whole config with its text config read as Qwen2's (q/k/v biases), as the native side
    and the converter read it; every other field its own."""

    def __init__(self, cfg):
        self._cfg = cfg
        self.text_config = Qwen2Text(cfg.text_config)

    def __getattr__(self, name):
        return getattr(self._cfg, name)


def build_language_model(cfg, params_dtype=torch.float32, divisible_by: int = VOCAB_MULTIPLE,
                         parallel_output: bool = True):
    """The Qwen2 decoder of a whole Qwen2.5-VL alone: the dense decoder part's ``GPTModel``; this
    pipeline stage of it."""
    return dense_decoder.build_language_model(_AsQwen2(cfg), params_dtype, divisible_by=divisible_by,
                                              parallel_output=parallel_output)


WHY_NO_WHOLE = ("megatron-core and Megatron-LM main have no Qwen2.5-VL class (no window attention in a "
                "tower, no M-RoPE model; Megatron-Bridge has one, outside this project's scope), so only the "
                "language model has one: stock GPTModel, which trains it alone")

LANGUAGE_MODEL = dataclasses.replace(
    llava.LANGUAGE_MODEL, build=build_language_model, why_part=WHY_NO_WHOLE,
    note=f"the Qwen2 language model part (language_model.*) on text-only ids, stock GPTModel with q/k/v "
         f"biases (M-RoPE on text is plain RoPE); {llava.PADDED_LOSS_NOTE}")
MEGATRON = {"GPTModel": LANGUAGE_MODEL}
