"""Qwen3-VL-MoE's HF configuration classes as tables, so that config.json is read without
transformers (mmparity.config's ConfigView): transformers 5's defaults of the whole model's, the
tower's and the text model's classes; and which decoder layers are MoE layers, as transformers'
decoder layer decides it. Imports no framework."""

from __future__ import annotations

from mmparity.config import DECODER_FIELDS, ConfigType
from mmparity.models.qwen3_vl.config import HF_CONFIGS as DENSE_CONFIGS, _text_rope


def experts(text) -> int:
    """Routed experts per MoE layer (0: none)."""
    return int(getattr(text, "num_experts", 0) or 0)


def moe_layers(text) -> tuple[int, ...]:
    """The layers whose MLP is the sparse block: not in ``mlp_only_layers``, and every
    ``decoder_sparse_step``-th (counted from one), where the model has experts."""
    if not experts(text):
        return ()
    only = set(getattr(text, "mlp_only_layers", None) or ())
    step = int(getattr(text, "decoder_sparse_step", 1) or 1)
    return tuple(i for i in range(text.num_hidden_layers) if i not in only and (i + 1) % step == 0)


def dense_layers(text) -> tuple[int, ...]:
    moe = set(moe_layers(text))
    return tuple(i for i in range(text.num_hidden_layers) if i not in moe)


def _text(v: dict, extra: dict) -> None:
    _text_rope(v, extra)
    if v["head_dim"] is None:
        v["head_dim"] = v["hidden_size"] // v["num_attention_heads"]
    if v["mlp_only_layers"] is None:
        v["mlp_only_layers"] = []
    v["sliding_window"] = None


HF_CONFIGS = {
    "qwen3_vl_moe": ConfigType({**DENSE_CONFIGS["qwen3_vl"].fields},
                               subs={"vision_config": ("qwen3_vl_moe_vision", False, {}),
                                     "text_config": ("qwen3_vl_moe_text", False, {})}),
    "qwen3_vl_moe_vision": ConfigType({**DENSE_CONFIGS["qwen3_vl_vision"].fields},
                                      aliases=dict(DENSE_CONFIGS["qwen3_vl_vision"].aliases), rope_type="axial"),
    "qwen3_vl_moe_text": ConfigType({**DECODER_FIELDS, "vocab_size": 151936, "hidden_size": 2048,
                                     "intermediate_size": 5632, "num_hidden_layers": 24, "num_attention_heads": 16,
                                     "num_key_value_heads": 16, "max_position_embeddings": 128000,
                                     "tie_word_embeddings": True, "attention_bias": False,
                                     "decoder_sparse_step": 1, "moe_intermediate_size": 1408,
                                     "num_experts_per_tok": 4, "num_local_experts": 60,
                                     "output_router_logits": False, "router_aux_loss_coef": 0.001,
                                     "mlp_only_layers": None, "bos_token_id": None, "eos_token_id": None,
                                     "head_dim": None, "sliding_window": None},
                                    aliases={"num_experts": "num_local_experts"}, rope_type="default",
                                    before=_text),
}


def dense_tower(vision):
    """The tower config seen as the ``qwen3_vl`` family's: Qwen3-VL-MoE's vision class is Qwen3-VL's
    under another model type (same fields, same module), and that family's checks ask for its own.
    A copy: only the checks read it, never a conversion."""
    import copy

    if getattr(vision, "model_type", None) != "qwen3_vl_moe_vision":
        return vision
    view = copy.copy(vision)
    object.__setattr__(view, "model_type", "qwen3_vl_vision")
    return view
