"""Megatron's own class for a whole Llama 4's language model: stock ``GPTModel`` as the part builds
it (:mod:`mmparity.models.parts.llama4_text.megatron`), holding ``language_model.*``, checked on
text rows no longer than its function is HF's there (no chunked attention, no attention
temperature in megatron-core)."""

from __future__ import annotations

import dataclasses

from mmparity.models.core import megatron_side
from mmparity.models.llava import megatron as llava
from mmparity.models.parts.llama4_text.megatron import build_language_model, text_length
from mmparity.models.spec import Case


def _cases(hooks, cfg, seed: int, image_sizes) -> list[Case]:
    length, why = text_length(cfg.text_config, llava.TEXT_LENGTH)
    if length < 2:
        raise megatron_side.UnsupportedInput(
            f"text_config: Megatron's GPTModel computes Llama 4's function only on rows of at most {length} "
            "token(s) here (no chunked attention, no attention temperature): too short to compare")
    return llava.text_cases(hooks, cfg, seed, image_sizes, length=length, why_length=why)


def _reference_language_model(model, case: Case, cfg) -> dict:
    """HF's text model with its head (``model.language_model``, a ``Llama4ForCausalLM``) on the ids."""
    device = next(model.parameters()).device
    logits = model.language_model(input_ids=case.data["input_ids"].to(device)).logits.float()
    return {"logits": logits.reshape(-1, logits.shape[-1]), "loss_mask": case.data["loss_mask"].reshape(-1)}


WHY_NO_WHOLE = ("Megatron-LM has no Llama 4 VLM class (no Llama 4 tower), so only the language model has one: "
                "stock GPTModel, which trains it alone")

LANGUAGE_MODEL = dataclasses.replace(
    llava.LANGUAGE_MODEL, build=build_language_model, cases=_cases,
    reference_run=_reference_language_model, why_part=WHY_NO_WHOLE, unwritten_extra_state=(),
    note=f"the Llama 4 language model part (language_model.*) on text-only ids, stock GPTModel whose layers are "
         f"megatron-core's TE spec per layer (RoPE / NoPE by no_rope_freq, L2 q/k norms on RoPE layers only, dense "
         f"or MoE with a shared expert and grouped-GEMM experts); rows no longer than attention_chunk_size and shorter "
         f"than floor_scale, where HF's chunked attention and attention temperature (which megatron-core has no "
         f"module for) are the identity; {llava.PADDED_LOSS_NOTE}")
MEGATRON = {"GPTModel": LANGUAGE_MODEL}
