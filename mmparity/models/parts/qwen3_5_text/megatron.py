"""Megatron's own layout for the Qwen3.5 part: megatron-core's hybrid block spec
(``get_transformer_block_with_experimental_attention_variant_spec``: ``GatedDeltaNet`` where
``linear_attention_freq`` says, ``SelfAttention`` with the output gate elsewhere, dense or MoE
MLPs after ``moe_layer_freq``), built with the Transformer Engine stand-ins where TE is absent.

What it is for: the state dict of a ``GPTModel`` built from it is the layout the native model and
the converter must hold (key names, per-rank shapes). No Megatron class runs the part here
(``PART.why_no_megatron``): megatron-core's ``GatedDeltaNet.forward`` calls fla's kernels. The
layout does not depend on ``layernorm_zero_centered_gamma`` (every norm of the model uses it; it
changes what the norms compute, not their parameters), which :func:`build_layout_model` leaves off.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch

from mmparity.models.core.te_stand_ins import buildable_without_te, megatron_te_spec
from mmparity.models.parts.qwen3_5_text.config import rotary_fraction, transformer_config


@contextlib.contextmanager
def hybrid_spec_without_te():
    """The hybrid spec module asks for ``TESpecProvider``, which it imports only beside TE, and
    the provider asks TE's version for the q/k norms' class (the stand-in's, whatever it says)."""
    from megatron.core.extensions import transformer_engine_spec_provider as provider
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as hybrid

    missing = object()
    saved = [(hybrid, "TESpecProvider", getattr(hybrid, "TESpecProvider", missing)),
             (provider, "is_te_min_version", provider.is_te_min_version)]
    hybrid.TESpecProvider = provider.TESpecProvider
    provider.is_te_min_version = lambda *unused, **unused_kw: True
    try:
        yield
    finally:
        for module, name, value in saved:
            if value is missing:
                delattr(module, name)
            else:
                setattr(module, name, value)


def megatron_block_spec(config):
    """megatron-core's own hybrid block spec for ``config`` (this pipeline stage's layers)."""
    from megatron.core.models.gpt import experimental_attention_variant_module_specs as hybrid

    with hybrid_spec_without_te():
        return megatron_te_spec(hybrid.get_transformer_block_with_experimental_attention_variant_spec, config)


def build_layout_model(text, vocab_size: int, params_dtype=torch.float32):
    """megatron-core's ``GPTModel`` from its own hybrid spec, at the current TP / PP, with
    ``layernorm_zero_centered_gamma`` off (the parameters are the same): the
    layout reference the native model is tested against."""
    from megatron.core.models.gpt import gpt_model
    from megatron.core.ssm import gated_delta_net

    from mmparity.models.parts.qwen3_5_text.native import _buildable_without_fla
    from mmparity.parallel import runtime

    config = transformer_config(text, params_dtype)
    # Experts as grouped GEMMs (TEGroupedMLP's names), as Megatron-LM's MoE recipes run them.
    config = dataclasses.replace(config, layernorm_zero_centered_gamma=False, perform_initialization=False,
                                 moe_grouped_gemm=config.num_moe_experts is not None)
    spec = megatron_block_spec(config)
    with buildable_without_te(gpt_model, gated_delta_net), _buildable_without_fla():
        return gpt_model.GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab_size,
                                  max_sequence_length=text.max_position_embeddings,
                                  pre_process=runtime.is_first_stage(), post_process=runtime.is_last_stage(),
                                  position_embedding_type="rope", rotary_percent=rotary_fraction(text),
                                  scatter_embedding_sequence_parallel=False)
