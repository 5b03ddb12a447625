"""DeepSeek-V3's HF configuration class as config.json is read without transformers."""

from __future__ import annotations

from mmparity.config import DECODER_FIELDS, ConfigType

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
