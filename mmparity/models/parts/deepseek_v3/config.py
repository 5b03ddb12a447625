"""The DeepSeek-V3 part's one HF text config -> Megatron ``MLATransformerConfig`` recipe: what of
the config megatron-core's multi-latent attention and MoE layers reproduce (:func:`config_problems`)
and the config that says it (:func:`transformer_config`), read by the native language model
(:mod:`mmparity.models.parts.deepseek_v3.native`) and by the builder of Megatron's own ``GPTModel``
(:mod:`mmparity.models.parts.deepseek_v3.megatron`) alike. Below it, DeepSeek-V3's HF configuration
class as config.json is read without transformers."""

from __future__ import annotations

from mmparity.config import (
    DECODER_FIELDS, ConfigType, moe_layer_range, rope_parameters, routed_experts, shared_expert_size)


def config_problems(text) -> list[str]:
    """What of a DeepSeek-V3-architecture text config mcore cannot reproduce. Which model types
    are that architecture is the language-model parts' to say (their ``text_model_types``): a part
    built on this block takes those it lists, under whatever name a release gives them."""
    problems = []
    if getattr(text, "attention_bias", False):
        problems.append("attention_bias=True (mcore's MLA projections have no bias)")
    if not getattr(text, "rope_interleave", True):
        problems.append("rope_interleave=False (mcore's MLA reads the rope dimensions as interleaved pairs)")
    rope = rope_parameters(text)
    if rope["rope_type"] not in ("default", "yarn"):
        problems.append(f"rope_type {rope['rope_type']!r} (default and yarn only)")
    return problems + moe_problems(text)


def moe_problems(text) -> list[str]:
    """What of a DeepSeek-V3 MoE (sigmoid router with a score-correction bias, group-limited top-k,
    shared experts) mcore's ``MoELayer`` cannot reproduce; any attention beside it."""
    problems = []
    experts, k = routed_experts(text), text.num_experts_per_tok
    if experts:
        groups, group_k = int(text.n_group or 1), int(text.topk_group or 1)
        if groups > 1 and (k % group_k or k // group_k != 2):
            problems.append(f"num_experts_per_tok={k} over topk_group={group_k}: mcore ranks a group by "
                            f"its top {k // max(group_k, 1)} scores, HF by its top 2 (they agree where "
                            "num_experts_per_tok is twice topk_group)")
        if bool(text.norm_topk_prob) != (k > 1):
            problems.append(f"norm_topk_prob={text.norm_topk_prob} with num_experts_per_tok={k}: mcore "
                            "renormalises sigmoid scores exactly when top-k > 1")
        if not getattr(text, "n_shared_experts", 0):
            problems.append("n_shared_experts=0 (HF still builds a shared MLP, of width 0)")
        if getattr(text, "topk_method", "noaux_tc") not in ("noaux_tc", None):
            problems.append(f"topk_method {text.topk_method!r} (noaux_tc only)")
    return problems


def _moe_layer_freq(text) -> list[int]:
    moe = moe_layer_range(text)
    return [int(i in moe) for i in range(text.num_hidden_layers)]


def transformer_config(text, params_dtype=None):
    """The ``MLATransformerConfig`` of the config's text model (``params_dtype`` None: fp32) at the
    current TP / PP / EP, or ValueError naming what :func:`config_problems` finds."""
    # Imported here: the config tables below are read by commands that load no framework.
    import torch
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    from mmparity.models.core.layers import activation_from_hf, add_stage_fields, run_fields

    params_dtype = torch.float32 if params_dtype is None else params_dtype
    problems = config_problems(text)
    if problems:
        raise ValueError("unsupported DeepSeek-V3 language model: " + "; ".join(problems))
    rope = rope_parameters(text)
    yarn = rope["rope_type"] == "yarn"
    fields = dict(
        num_layers=text.num_hidden_layers, hidden_size=text.hidden_size,
        num_attention_heads=text.num_attention_heads, ffn_hidden_size=text.intermediate_size,
        q_lora_rank=text.q_lora_rank, kv_lora_rank=text.kv_lora_rank, qk_head_dim=text.qk_nope_head_dim,
        qk_pos_emb_head_dim=text.qk_rope_head_dim, v_head_dim=text.v_head_dim, qk_layernorm=True,
        normalization="RMSNorm", layernorm_epsilon=text.rms_norm_eps,
        activation_func=activation_from_hf(text.hidden_act), gated_linear_unit=True, add_bias_linear=False,
        rope_type="yarn" if yarn else "rope", rotary_base=rope["rope_theta"], **run_fields(params_dtype))
    if yarn:
        fields.update(rotary_scaling_factor=float(rope["factor"]),
                      original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
                      beta_fast=float(rope.get("beta_fast", 32)), beta_slow=float(rope.get("beta_slow", 1)),
                      mscale=float(rope.get("mscale", 1)), mscale_all_dim=float(rope.get("mscale_all_dim", 0)))
    fields.update(moe_transformer_fields(text))
    return MLATransformerConfig(**add_stage_fields(fields))


def moe_transformer_fields(text) -> dict:
    """The ``TransformerConfig`` fields of a DeepSeek-V3 MoE (none for a dense decoder): the MoE layers
    after ``first_k_dense_replace``, sigmoid scores with the score-correction bias (frozen: no bias
    updates), group-limited top-k, the routed scale and the shared experts' width."""
    from mmparity.models.core.layers import moe_fields

    experts = routed_experts(text)
    if not experts:
        return {}
    groups = int(text.n_group or 1)
    return moe_fields(
        num_moe_experts=experts, moe_layer_freq=_moe_layer_freq(text),
        moe_ffn_hidden_size=text.moe_intermediate_size,
        moe_shared_expert_intermediate_size=shared_expert_size(text) or None,
        moe_router_topk=text.num_experts_per_tok, moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_topk_scaling_factor=float(text.routed_scaling_factor),
        moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=int(text.topk_group) if groups > 1 else None,
        moe_router_bias_update_rate=0.0)


# --- HF config tables ---
# The configuration class a text_config is read with, without transformers (mmparity.config's
# ConfigView): transformers 5's defaults of DeepseekV3Config.


def _derived(v: dict, extra: dict) -> None:
    if v["num_key_value_heads"] is None:
        v["num_key_value_heads"] = v["num_attention_heads"]
    v["qk_head_dim"] = v["qk_nope_head_dim"] + v["qk_rope_head_dim"]
    v["head_dim"] = v["qk_rope_head_dim"]


HF_CONFIGS = {
    "deepseek_v3": ConfigType({**DECODER_FIELDS, "vocab_size": 129280, "hidden_size": 7168,
                               "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
                               "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
                               "n_routed_experts": 256, "output_router_logits": False,
                               "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
                               "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8,
                               "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
                               "norm_topk_prob": True, "max_position_embeddings": 4096, "bos_token_id": 0,
                               "eos_token_id": 1, "pretraining_tp": 1, "rope_interleave": True,
                               "attention_bias": False, "num_mtp_layers": 1},
                              aliases={"num_local_experts": "n_routed_experts",
                                       "num_mtp_layers": "num_nextn_predict_layers"},
                              rope_type="default", before=_derived),
}
