"""GLM-4.5V's HF configuration classes as tables, so that config.json is read without transformers
(``mmparity.config``'s ConfigView): transformers 5's defaults of ``Glm4vMoeConfig`` and
``Glm4vMoeTextConfig`` (``Glm4vMoeVisionConfig``'s sits with the ``glm4v_vision`` tower family); and
the text model's rotary width. Imports no framework."""

from __future__ import annotations

from mmparity.config import DECODER_FIELDS, ConfigType, head_dim, rope_parameters


def rotary_fraction(text) -> float:
    return float(rope_parameters(text).get("partial_rotary_factor", 1.0))


def rotary_dim(text) -> int:
    """The rotated width of each attention head (its leading dimensions), as HF and mcore round it."""
    return int(head_dim(text) * rotary_fraction(text))


def _text(v: dict, extra: dict) -> None:
    # The class's init gives a config that names none half of each head rotated.
    extra.setdefault("partial_rotary_factor", 0.5)


HF_CONFIGS = {
    "glm4v_moe": ConfigType({"text_config": None, "vision_config": None, "image_token_id": 151363,
                             "video_token_id": 151364, "image_start_token_id": 151339, "image_end_token_id": 151340,
                             "video_start_token_id": 151341, "video_end_token_id": 151342,
                             "tie_word_embeddings": False},
                            subs={"vision_config": ("glm4v_moe_vision", False, {}),
                                  "text_config": ("glm4v_moe_text", False, {})}),
    "glm4v_moe_text": ConfigType({**DECODER_FIELDS, "vocab_size": 151424, "hidden_size": 4096,
                                  "intermediate_size": 10944, "num_hidden_layers": 46, "num_attention_heads": 96,
                                  "num_key_value_heads": 8, "max_position_embeddings": 65536, "rms_norm_eps": 1e-05,
                                  "attention_bias": True, "moe_intermediate_size": 1408, "num_experts_per_tok": 8,
                                  "output_router_logits": False, "n_shared_experts": 1, "n_routed_experts": 128,
                                  "routed_scaling_factor": 1.0, "n_group": 1, "topk_group": 1,
                                  "first_k_dense_replace": 1, "norm_topk_prob": True, "bos_token_id": None,
                                  "eos_token_id": None, "router_aux_loss_coef": 0.0001},
                                 aliases={"num_local_experts": "n_routed_experts"}, rope_type="default", before=_text),
}
