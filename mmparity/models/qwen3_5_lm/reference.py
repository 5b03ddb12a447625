"""Reference side of qwen3_5_lm: transformers' ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``
and its state-dict shapes (the ``qwen3_5_text`` part's decoder under ``model.``, the head)."""

from __future__ import annotations

from mmparity.config import tied_embeddings
from mmparity.models.parts.qwen3_5_text import reference as decoder
from mmparity.models.parts.qwen3_5_text.config import is_moe

MODEL_TYPES = decoder.MODEL_TYPES


def tiny_config(moe: bool = True, **overrides):
    """Awkward tiny sizes: 4 layers (attention, DeltaNet, DeltaNet, attention), 2 key heads serving
    4 value heads, head widths 6 / 10 / 12, half-width RoPE, 6 experts of which 2 are chosen."""
    import transformers

    fields = dict(vocab_size=101, hidden_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=12, linear_conv_kernel_dim=3, linear_key_head_dim=6, linear_value_head_dim=10,
                  linear_num_key_heads=2, linear_num_value_heads=4, max_position_embeddings=256,
                  layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                  architectures=["Qwen3_5MoeForCausalLM" if moe else "Qwen3_5ForCausalLM"])
    if moe:
        fields |= dict(moe_intermediate_size=20, shared_expert_intermediate_size=28, num_experts=6,
                       num_experts_per_tok=2)
        return transformers.Qwen3_5MoeTextConfig(**(fields | overrides))
    return transformers.Qwen3_5TextConfig(**(fields | {"intermediate_size": 40} | overrides))


def vision_config(cfg):
    """The family's config inside ``cfg``: the text config itself (no tower)."""
    return cfg


def build(cfg):
    import torch
    import transformers

    cls = transformers.Qwen3_5MoeForCausalLM if is_moe(cfg) else transformers.Qwen3_5ForCausalLM
    model = cls(cfg).to(torch.float32).eval()
    if is_moe(cfg):
        # The reference computes each expert as the modelling code writes it: transformers'
        # grouped-GEMM path needs 16-byte-aligned strides, which bf16 at odd tiny widths lacks.
        model.set_experts_implementation("eager")
    return model


def state_shapes(cfg) -> dict[str, tuple]:
    shapes = {"model." + k: s for k, s in decoder.decoder_shapes(cfg).items()}
    if not tied_embeddings(cfg):
        shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return shapes
