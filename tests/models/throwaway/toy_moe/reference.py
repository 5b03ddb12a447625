"""Reference side: transformers' ``DeepseekV3Model`` under the part's own model type, and its
shapes (DeepSeek-V3's, read off the text config)."""

from __future__ import annotations

from transformers import AutoConfig, AutoModel, DeepseekV3Config, DeepseekV3Model

from mmparity.models.parts.deepseek_v3.reference import decoder_shapes, mlp_pairs  # noqa: F401


class ToyMoeConfig(DeepseekV3Config):
    model_type = "toy_moe"


class ToyMoeModel(DeepseekV3Model):
    config_class = ToyMoeConfig


def register_with_transformers() -> None:
    """What ``AutoConfig`` and ``AutoModel`` build for ``toy_moe``: LLaVA's HF class makes its text
    model from ``text_config`` through them."""
    try:
        AutoConfig.register("toy_moe", ToyMoeConfig)
    except ValueError:  # this process has them already
        return
    AutoModel.register(ToyMoeConfig, ToyMoeModel)


def tiny_text(**overrides) -> ToyMoeConfig:
    """3 layers (1 dense, then MoE), 6 experts in 3 groups of which 2 are kept, top-4 (HF's
    top-2-per-group ranking is then mcore's), one shared expert, a q LoRA rank, rope/nope/v head
    widths 4/6/5, YaRN past its original 64 positions (a LLaVA row is longer); TP 2 divides the
    heads, EP 2 the experts."""
    values = dict(hidden_size=40, num_hidden_layers=3, vocab_size=97, intermediate_size=36, moe_intermediate_size=12,
                  num_attention_heads=4, num_key_value_heads=4, first_k_dense_replace=1, q_lora_rank=12,
                  kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=5, n_routed_experts=6,
                  n_shared_experts=1, num_experts_per_tok=4, n_group=3, topk_group=2, norm_topk_prob=True,
                  routed_scaling_factor=2.5, max_position_embeddings=256,
                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                   "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                                   "mscale": 1.0, "mscale_all_dim": 1.0})
    return ToyMoeConfig(**(values | overrides))
