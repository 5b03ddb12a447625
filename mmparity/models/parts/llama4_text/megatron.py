"""Megatron's own class for Llama 4's language model: stock megatron-core ``GPTModel`` whose layers
are stock ``TransformerLayer``s chosen per layer by :data:`LAYER`, as Megatron-LM's
``pretrain_gpt.py`` builds it with ``--spec mmparity.models.parts.llama4_text.megatron LAYER`` and
the Llama 4 flags (``--no-rope-freq --qk-l2-norm --rotary-interleaved --moe-apply-probs-on-input
--moe-router-score-function sigmoid --moe-grouped-gemm ...``, docs/megatron.md).

Each layer is the one megatron-core's own TE decoder spec gives its number (dense or ``MoELayer``
with grouped-GEMM experts and a shared expert, by ``moe_layer_freq``), with one change Megatron's
flags cannot say: ``qk_l2_norm`` puts the weightless ``L2Norm`` on the q/k of every layer, Llama 4
on its RoPE layers only, so a NoPE layer (``no_rope_freq``) gets ``IdentityOp`` there.

What the class does not compute, by design: transformers' chunked attention (a RoPE layer's keys
cut into ``attention_chunk_size`` blocks) and the NoPE layers' attention temperature (queries
scaled past ``floor_scale - 1`` positions) have no megatron-core module; both are the identity on
sequences no longer than the chunk and shorter than ``floor_scale``, and :func:`text_length` gives
the rows its cases take so that HF's function is the one compared.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.models.gpt import gpt_model
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import transformer_block
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_layer import TransformerLayer, get_transformer_layer_offset
from megatron.core.utils import get_pg_rank

from mmparity.config import padded_vocab_size, rope_theta, tied_embeddings
from mmparity.mapping.rules import VOCAB_MULTIPLE
from mmparity.models.core import mla_moe, te_stand_ins
from mmparity.models.core.te_stand_ins import buildable_without_te
from mmparity.models.parts.llama4_text.config import LLAMA3_FIELDS, chunked_layers, megatron_args, rope_layers
from mmparity.models.parts.llama4_text.native import transformer_config as native_config
from mmparity.parallel import runtime


def _stock_layer_spec(config, number: int) -> ModuleSpec:
    """megatron-core's TE GPT layer spec for layer ``number`` (1-based, of the whole stack), with
    the q/k L2 norms only where the layer rotates q/k."""
    from megatron.core.models.gpt import gpt_layer_specs
    with te_stand_ins.qk_norm_without_te():
        specs = te_stand_ins.megatron_te_spec(gpt_layer_specs.get_gpt_decoder_layer_specs, config,
                                              use_transformer_engine=True, qk_l2_norm=config.qk_l2_norm)
    spec = specs[number - 1]
    if config.no_rope_freq and config.no_rope_freq[number - 1]:
        attention = spec.submodules.self_attention
        plain = dataclasses.replace(attention.submodules, q_layernorm=IdentityOp, k_layernorm=IdentityOp)
        spec = dataclasses.replace(spec, submodules=dataclasses.replace(
            spec.submodules, self_attention=dataclasses.replace(attention, submodules=plain)))
    return spec


class Llama4Layer(TransformerLayer):
    """Not a layer class of its own: building it builds the stock ``TransformerLayer`` megatron-core's
    spec gives this layer's number (:func:`_stock_layer_spec`). A ``ModuleSpec`` is built without
    seeing the layer's number; this reads it, and the config, when the block builds the layer."""

    def __new__(cls, config, submodules=None, layer_number: int = 1, pg_collection=None, vp_stage=None,
                **kwargs):
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        number = layer_number + get_transformer_layer_offset(config, vp_stage, get_pg_rank(pg_collection.pp))
        return build_module(_stock_layer_spec(config, number), config=config, layer_number=layer_number,
                            pg_collection=pg_collection, vp_stage=vp_stage, **kwargs)


# What Megatron-LM's ``--spec mmparity.models.parts.llama4_text.megatron LAYER`` imports.
LAYER = ModuleSpec(module=Llama4Layer)


def megatron_config(text, params_dtype=torch.float32):
    """The part's one recipe (:func:`mmparity.models.parts.llama4_text.native.transformer_config`)
    with megatron-core's own switches for what the native layers hold themselves: ``no_rope_freq``
    (1 on a NoPE layer), ``qk_l2_norm`` in place of a q/k norm module, grouped-GEMM experts."""
    config, args = native_config(text, params_dtype), megatron_args(text)  # what convert records
    return dataclasses.replace(
        config, qk_layernorm=False, qk_l2_norm=args["qk_l2_norm"], no_rope_freq=args["no_rope_freq"],
        moe_grouped_gemm=bool(config.num_moe_experts))


def build_language_model(cfg, params_dtype=torch.float32, divisible_by: int = VOCAB_MULTIPLE,
                         parallel_output: bool = True):
    """Stock ``GPTModel`` on :data:`LAYER` for a whole Llama 4's text model; this pipeline stage of
    it. Llama 3 RoPE scaling takes the config's factors through megatron-core's own scaling
    function (its ``GPTModel`` passes only the factor, and Megatron-LM's flags say no more)."""
    text = cfg.text_config
    layout = runtime.current_layout()
    tp = layout.tp if layout is not None else 1
    params = getattr(text, "rope_parameters", None) or {}
    llama3 = params.get("rope_type") == "llama3"
    with buildable_without_te(gpt_model, transformer_block), mla_moe.host_placement(torch.get_default_device()):
        model = gpt_model.GPTModel(
            config=megatron_config(text, params_dtype), transformer_layer_spec=LAYER,
            vocab_size=padded_vocab_size(text.vocab_size, divisible_by, tp),
            max_sequence_length=text.max_position_embeddings,
            pre_process=runtime.is_first_stage(), post_process=runtime.is_last_stage(),
            parallel_output=parallel_output, share_embeddings_and_output_weights=tied_embeddings(cfg),
            position_embedding_type="rope", rotary_base=rope_theta(text, 500000.0),
            scatter_embedding_sequence_parallel=False)
    if llama3:
        rotary = model.rotary_pos_emb
        rotary.inv_freq = rotary._apply_scaling(rotary.inv_freq, **{k: params[k] for k in LLAMA3_FIELDS})
    return model.eval()


def text_length(text, default: int) -> tuple[int, str]:
    """The longest rows on which this class computes HF's function, and why they are that short
    (empty: the default length is within both bounds)."""
    bounds = []
    if any(chunked_layers(text)) and text.attention_chunk_size is not None:
        bounds.append((text.attention_chunk_size, f"attention_chunk_size {text.attention_chunk_size}"))
    if text.attn_temperature_tuning and not all(rope_layers(text)):
        bounds.append((int(text.floor_scale) - 1, f"below floor_scale {text.floor_scale}"))
    shorter = [(n, why) for n, why in bounds if n < default]
    if not shorter:
        return default, ""
    length = min(n for n, _ in shorter)
    return length, ("within " + " and ".join(why for _, why in shorter) +
                    ": GPTModel has no chunked attention or attention temperature")
