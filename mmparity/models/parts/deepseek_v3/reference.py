"""Reference side of the DeepSeek-V3 language-model part: what transformers' ``DeepseekV3Model``
holds, read off its text config. transformers builds the module (a VLM class makes its text model
from ``text_config``), so only the shapes live here, in its module names (each MoE layer's experts
as two stacked tensors)."""

from __future__ import annotations

from functools import partial

from mmparity.config import dense_layer_range, moe_layer_range, routed_experts, shared_expert_size
from mmparity.models.spec import Case, Extractor, Pair, routing_tensor

MODEL_TYPES = ("deepseek_v3",)


def _attention(text) -> dict[str, tuple]:
    h, heads = text.hidden_size, text.num_attention_heads
    q_width = heads * (text.qk_nope_head_dim + text.qk_rope_head_dim)
    out = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
           "self_attn.kv_a_proj_with_mqa.weight": (text.kv_lora_rank + text.qk_rope_head_dim, h),
           "self_attn.kv_a_layernorm.weight": (text.kv_lora_rank,),
           "self_attn.kv_b_proj.weight": (heads * (text.qk_nope_head_dim + text.v_head_dim), text.kv_lora_rank),
           "self_attn.o_proj.weight": (h, heads * text.v_head_dim)}
    if text.q_lora_rank is None:
        out["self_attn.q_proj.weight"] = (q_width, h)
    else:
        out |= {"self_attn.q_a_proj.weight": (text.q_lora_rank, h),
                "self_attn.q_a_layernorm.weight": (text.q_lora_rank,),
                "self_attn.q_b_proj.weight": (q_width, text.q_lora_rank)}
    return out


def _mlp(prefix: str, h: int, f: int) -> dict[str, tuple]:
    return {prefix + "gate_proj.weight": (f, h), prefix + "up_proj.weight": (f, h), prefix + "down_proj.weight": (h, f)}


def decoder_shapes(text) -> dict[str, tuple]:
    h, e, f = text.hidden_size, routed_experts(text), text.moe_intermediate_size
    dense = _attention(text) | _mlp("mlp.", h, text.intermediate_size)
    moe = _attention(text) | {"mlp.gate.weight": (e, h), "mlp.gate.e_score_correction_bias": (e,),
                              "mlp.experts.gate_up_proj": (e, 2 * f, h), "mlp.experts.down_proj": (e, h, f)}
    if shared_expert_size(text):
        moe |= _mlp("mlp.shared_experts.", h, shared_expert_size(text))
    layers = {}
    for kinds, layer in ((dense_layer_range(text), dense), (moe_layer_range(text), moe)):
        layers |= {f"layers.{i}.{k}": s for i in kinds for k, s in layer.items()}
    return {"embed_tokens.weight": (text.vocab_size, h), **dict(sorted(layers.items(), key=_layer_order)),
            "norm.weight": (h,)}


def _layer_order(item) -> tuple:
    number = int(item[0].split(".")[1])
    return (number, item[0])


# --- parity: the pairs inside an MoE layer's MLP ---------------------------------------------------

def mlp_pairs(name: str, mlp, extract: Extractor) -> list[Pair]:
    """HF's ``DeepseekV3MoE``: its router (the dense routing weights), shared experts and routed
    experts, named as Megatron's ``MoELayer`` names them under ``name`` (the layer's ``mlp``);
    none in a dense layer. ``extract``: the layer's own token layout."""
    if not (hasattr(mlp, "gate") and hasattr(mlp, "experts")):
        return []
    return [Pair(name + ".router", mlp.gate, partial(_routing, router=mlp.gate)),
            Pair(name + ".shared_experts", getattr(mlp, "shared_experts", None), extract),
            # HF runs the routed experts on the batch-major flattened tokens.
            Pair(name + ".experts", mlp.experts, extract)]


def _routing(output, case: Case, *, router):
    """HF's router output ``(logits, top-k weights, top-k indices)`` -> the dense routing weights
    and the scores the choice was made on (sigmoid plus the correction bias), tokens batch-major:
    :func:`mmparity.models.spec.routing_tensor`."""
    logits, weights, indices = output
    dense = logits.new_zeros(logits.shape, dtype=weights.dtype).scatter(1, indices, weights)
    return routing_tensor(dense, logits.float().sigmoid() + router.e_score_correction_bias.float())
