"""Reference side of Qwen3-VL-MoE whole: transformers' ``Qwen3VLMoeForConditionalGeneration``, and
its state-dict shapes read off the config, in its module names (which are also what its
``save_pretrained`` writes): the ``qwen3_vl`` tower's, then the decoder's, each MoE layer's experts
as two stacked tensors (``mlp.experts.gate_up_proj`` ``[E, 2F, H]``, rows gate then up per
expert; ``mlp.experts.down_proj`` ``[E, H, F]``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mmparity.config import head_dim, tied_embeddings
from mmparity.models.qwen3_vl import reference as tower
from mmparity.models.qwen3_vl_moe.config import moe_layers
from mmparity.models.qwen3_vl_whole import reference as dense

if TYPE_CHECKING:
    from transformers import Qwen3VLMoeConfig

MODEL_TYPES = ("qwen3_vl_moe",)


def tiny_text(**overrides) -> dict:
    """Qwen3-VL whole's awkward tiny decoder with experts: 8 experts of width 14 (7 per rank at
    TP 2), top 3, and layer 1 dense (``mlp_only_layers``) between two MoE layers, so that a
    layer-kind mix-up and a pipeline split across kinds both show."""
    moe = {"num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 14, "decoder_sparse_step": 1,
           "mlp_only_layers": [1]}
    return dense.tiny_text() | moe | overrides


def tiny_config(**text_overrides) -> Qwen3VLMoeConfig:
    from transformers import Qwen3VLMoeConfig

    text = tiny_text(**text_overrides)
    vision = tower.tiny_config().to_dict() | {"out_hidden_size": text["hidden_size"],
                                              "model_type": "qwen3_vl_moe_vision"}
    return Qwen3VLMoeConfig(vision_config=vision, text_config=text, image_token_id=95, video_token_id=96,
                            vision_start_token_id=93, vision_end_token_id=94, tie_word_embeddings=False)


def vision_config(cfg):
    """The family config: a whole Qwen3-VL-MoE config."""
    if getattr(cfg, "model_type", None) in MODEL_TYPES and getattr(cfg, "text_config", None) is not None:
        return cfg
    raise ValueError(f"config of model_type {getattr(cfg, 'model_type', None)!r} is not a whole "
                     "Qwen3-VL-MoE model")


def build(cfg):
    from transformers import Qwen3VLMoeForConditionalGeneration

    model = Qwen3VLMoeForConditionalGeneration(cfg).float().eval()
    # HF's own per-expert loop: the definition its grouped_mm kernel (which on the CPU refuses
    # strides that are not multiples of 16 bytes) stands for.
    model.set_experts_implementation("eager")
    return model


def state_shapes(cfg) -> dict[str, tuple]:
    text = cfg.text_config
    h, d = text.hidden_size, head_dim(text)
    e, f = text.num_experts, text.moe_intermediate_size
    q, kv = text.num_attention_heads * d, text.num_key_value_heads * d
    attention = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                 "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
                 "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
                 "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}
    mlp = {"mlp.gate_proj.weight": (text.intermediate_size, h), "mlp.up_proj.weight": (text.intermediate_size, h),
           "mlp.down_proj.weight": (h, text.intermediate_size)}
    sparse = {"mlp.gate.weight": (e, h), "mlp.experts.gate_up_proj": (e, 2 * f, h),
              "mlp.experts.down_proj": (e, h, f)}
    moe = set(moe_layers(text))
    out = {f"model.visual.{k}": s for k, s in tower.state_shapes(cfg.vision_config).items()}
    out["model.language_model.embed_tokens.weight"] = (text.vocab_size, h)
    for i in range(text.num_hidden_layers):
        layer = {**attention, **(sparse if i in moe else mlp)}
        out.update({f"model.language_model.layers.{i}.{k}": s for k, s in layer.items()})
    out["model.language_model.norm.weight"] = (h,)
    if not tied_embeddings(cfg):
        out["lm_head.weight"] = (text.vocab_size, h)
    return out
