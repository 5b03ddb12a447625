"""Reference side of the Llama 4 language-model part: what transformers' ``Llama4TextModel`` holds,
read off its text config (transformers builds the module inside its VLM class), and the pairs
inside its MoE blocks."""

from __future__ import annotations

from mmparity.config import head_dim, query_groups
from mmparity.models.core.sublayers import LayerNames
from mmparity.models.parts.llama4_text.config import moe_layers
from mmparity.models.spec import Case, Extractor, Pair, first_tensor, routing_tensor

MODEL_TYPES = ("llama4_text",)
# transformers' Llama4TextDecoderLayer keeps its MLP (dense or MoE) as ``feed_forward``.
HF_LAYER = LayerNames("input_layernorm", "self_attn", "post_attention_layernorm", "feed_forward")


def _mlp(prefix: str, h: int, f: int) -> dict[str, tuple]:
    return {prefix + "gate_proj.weight": (f, h), prefix + "up_proj.weight": (f, h), prefix + "down_proj.weight": (h, f)}


def decoder_shapes(text) -> dict[str, tuple]:
    h, d = text.hidden_size, head_dim(text)
    e, f = text.num_local_experts, text.intermediate_size
    attention = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                 "self_attn.q_proj.weight": (text.num_attention_heads * d, h),
                 "self_attn.k_proj.weight": (query_groups(text) * d, h),
                 "self_attn.v_proj.weight": (query_groups(text) * d, h),
                 "self_attn.o_proj.weight": (h, text.num_attention_heads * d)}
    dense = attention | _mlp("feed_forward.", h, text.intermediate_size_mlp)
    moe = attention | {"feed_forward.experts.gate_up_proj": (e, h, 2 * f), "feed_forward.experts.down_proj": (e, f, h),
                       "feed_forward.router.weight": (e, h), **_mlp("feed_forward.shared_expert.", h, f)}
    layers = {}
    for i, sparse in enumerate(moe_layers(text)):
        layers |= {f"layers.{i}.{k}": s for k, s in sorted((moe if sparse else dense).items())}
    return {"embed_tokens.weight": (text.vocab_size, h), **layers, "norm.weight": (h,)}


# --- parity: the pairs inside an MoE block ---------------------------------------------------------

def mlp_pairs(name: str, mlp, extract: Extractor) -> list[Pair]:
    """transformers' ``Llama4TextMoe``: its router (the dense routing weights: the sigmoid of the
    chosen logit, zero elsewhere), its shared expert and its routed experts' summed output, named
    as Megatron's ``MoELayer`` names them under ``name``; none in a dense block."""
    if not (hasattr(mlp, "router") and hasattr(mlp, "experts")):
        return []
    experts = mlp.experts.gate_up_proj.shape[0]
    return [Pair(name + ".router", mlp.router, _routing),
            # transformers adds the routed output into the shared expert's, in place.
            Pair(name + ".shared_experts", mlp.shared_expert, extract, snapshot=True),
            Pair(name + ".experts", mlp.experts, lambda output, case: _summed(output, experts))]


def _routing(output, case: Case):
    """``(scores, logits)``: scores are dense over the experts already (``-inf`` -> 0 where not
    chosen), tokens batch-major; the choice was made on the logits (sigmoid is monotonic)."""
    scores, logits = output
    return routing_tensor(scores, logits.float().sigmoid())


def _summed(output, experts: int):
    """transformers runs every expert on every token (inputs scaled by the routing weights, zero
    where not chosen) and returns ``[experts · tokens, H]``: the routed output is their sum."""
    t = first_tensor(output)
    return t.reshape(experts, -1, t.shape[-1]).sum(0)
