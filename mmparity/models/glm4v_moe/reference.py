"""Reference side of GLM-4.5V whole: transformers' ``Glm4vMoeForConditionalGeneration``, and its
state-dict shapes read off the config, in its module names: the tower's
(:mod:`mmparity.models.glm4v_vision.reference`), then the decoder's, each MoE layer's routed
experts as two stacked tensors (``mlp.experts.gate_up_proj`` ``[E, 2F, H]``, rows gate then up per
expert; ``mlp.experts.down_proj`` ``[E, H, F]``). ``save_pretrained`` writes them one tensor per
expert (transformers' conversion mapping, read through it by the registry)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmparity.config import head_dim, moe_layer_range, routed_experts, shared_expert_size, tied_embeddings
from mmparity.models.glm4v_vision import reference as tower

if TYPE_CHECKING:
    from transformers import Glm4vMoeConfig

MODEL_TYPES = ("glm4v_moe",)


def tiny_text(**overrides) -> dict:
    """Awkward tiny GLM-4.5 MoE sizes: hidden 40 with 4 heads of 16 (q width 64, not the hidden
    size), 2 key/value groups, half of each head rotated (8 dims: 4 frequencies in M-RoPE sections
    t 1, h 2, w 1, unequal so that a swap of t and h shows), 3 layers of which the first is dense
    (FFN 36), then 2 MoE layers of 4 experts of width 14 in 2 groups, top 2 from the best group,
    one shared expert, a routed scale of 1.5, and a vocabulary of 97 (padded in mcore)."""
    text = {"hidden_size": 40, "intermediate_size": 36, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 97, "max_position_embeddings": 256,
            "moe_intermediate_size": 14, "n_routed_experts": 4, "num_experts_per_tok": 2, "n_group": 2,
            "topk_group": 1, "n_shared_experts": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 1.5,
            "norm_topk_prob": True, "attention_bias": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000.0, "mrope_section": [1, 2, 1],
                                "partial_rotary_factor": 0.5}}
    return text | overrides


def tiny_config(**text_overrides) -> Glm4vMoeConfig:
    from transformers import Glm4vMoeConfig

    text = tiny_text(**text_overrides)
    vision = tower.tiny_config().to_dict() | {"out_hidden_size": text["hidden_size"]}
    return Glm4vMoeConfig(vision_config=vision, text_config=text, image_token_id=95, video_token_id=96,
                          image_start_token_id=91, image_end_token_id=92, video_start_token_id=93,
                          video_end_token_id=94, tie_word_embeddings=False)


def vision_config(cfg):
    """The family config: a whole GLM-4.5V config."""
    if getattr(cfg, "model_type", None) in MODEL_TYPES and getattr(cfg, "text_config", None) is not None:
        return cfg
    raise ValueError(f"config of model_type {getattr(cfg, 'model_type', None)!r} is not a whole GLM-4.5V model")


def build(cfg):
    from transformers import Glm4vMoeForConditionalGeneration

    model = Glm4vMoeForConditionalGeneration(cfg).float().eval()
    # HF's own per-expert loop: the definition its grouped_mm kernel stands for.
    model.set_experts_implementation("eager")
    return model


def state_shapes(cfg) -> dict[str, tuple]:
    text = cfg.text_config
    h, d = text.hidden_size, head_dim(text)
    e, f, shared = routed_experts(text), text.moe_intermediate_size, shared_expert_size(text)
    q, kv = text.num_attention_heads * d, text.num_key_value_heads * d
    attention = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                 "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                 "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q)}
    if text.attention_bias:
        attention |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
    mlp = {"mlp.gate_proj.weight": (text.intermediate_size, h), "mlp.up_proj.weight": (text.intermediate_size, h),
           "mlp.down_proj.weight": (h, text.intermediate_size)}
    sparse = {"mlp.gate.weight": (e, h), "mlp.gate.e_score_correction_bias": (e,),
              "mlp.experts.gate_up_proj": (e, 2 * f, h), "mlp.experts.down_proj": (e, h, f),
              "mlp.shared_experts.gate_proj.weight": (shared, h), "mlp.shared_experts.up_proj.weight": (shared, h),
              "mlp.shared_experts.down_proj.weight": (h, shared)}
    moe = set(moe_layer_range(text))
    out = {f"model.visual.{k}": s for k, s in tower.state_shapes(cfg.vision_config).items()}
    out["model.language_model.embed_tokens.weight"] = (text.vocab_size, h)
    for i in range(text.num_hidden_layers):
        layer = {**attention, **(sparse if i in moe else mlp)}
        out.update({f"model.language_model.layers.{i}.{k}": s for k, s in layer.items()})
    out["model.language_model.norm.weight"] = (h,)
    if not tied_embeddings(cfg):
        out["lm_head.weight"] = (text.vocab_size, h)
    return out
