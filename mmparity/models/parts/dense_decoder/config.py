"""The dense decoders' HF configuration classes (Llama, Mistral, Qwen2) as config.json is read
without transformers."""

from __future__ import annotations

from mmparity.config import DECODER_FIELDS, ConfigType

# --- HF config tables ---
# The configuration classes a text_config is read with, without transformers (mmparity.config's
# ConfigView): transformers 5's defaults of each decoder's class.


def _head_dim_and_groups(v: dict, extra: dict) -> None:
    if v.get("head_dim") is None:
        v["head_dim"] = v["hidden_size"] // v["num_attention_heads"]
    if v["num_key_value_heads"] is None:
        v["num_key_value_heads"] = v["num_attention_heads"]


def _qwen2(v: dict, extra: dict) -> None:
    v["sliding_window"] = v["sliding_window"] if v["use_sliding_window"] else None
    if v["num_key_value_heads"] is None:
        v["num_key_value_heads"] = v["num_attention_heads"]
    if v["layer_types"] is None:
        v["layer_types"] = ["sliding_attention" if v["sliding_window"] is not None and i >= v["max_window_layers"]
                            else "full_attention" for i in range(v["num_hidden_layers"])]


HF_CONFIGS = {
    "mistral": ConfigType({**DECODER_FIELDS, "intermediate_size": 14336, "num_key_value_heads": 8,
                           "head_dim": None, "max_position_embeddings": 131072, "bos_token_id": 1,
                           "eos_token_id": 2, "sliding_window": 4096},
                          rope_type="default", before=_head_dim_and_groups),
    "llama": ConfigType({**DECODER_FIELDS, "intermediate_size": 11008, "num_key_value_heads": None,
                         "max_position_embeddings": 2048, "bos_token_id": 1, "eos_token_id": 2, "pretraining_tp": 1,
                         "attention_bias": False, "mlp_bias": False, "head_dim": None},
                        rope_type="default", before=_head_dim_and_groups),
    "qwen2": ConfigType({**DECODER_FIELDS, "vocab_size": 151936, "intermediate_size": 22016,
                         "num_key_value_heads": 32, "max_position_embeddings": 32768, "use_sliding_window": False,
                         "sliding_window": 4096, "max_window_layers": 28, "layer_types": None,
                         "bos_token_id": None, "eos_token_id": None},
                        rope_type="default", before=_qwen2),
}
