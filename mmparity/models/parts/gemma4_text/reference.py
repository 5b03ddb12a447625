"""Reference side of the Gemma 4 language-model part: what transformers' ``Gemma4TextModel`` holds,
read off its text config (transformers builds it inside ``Gemma4ForConditionalGeneration`` or
``Gemma4ForCausalLM``), and a tiny config of it."""

from __future__ import annotations

from mmparity.models.core.sublayers import LayerNames
from mmparity.models.parts.gemma4_text import per_layer
from mmparity.models.parts.gemma4_text.config import keys_as_values, layer_groups, layer_head_dim
from mmparity.models.parts.gemma4_text.moe import is_moe, moe_shapes

MODEL_TYPES = ("gemma4_text",)
# HF's layer, by the names of the tensors mcore's layer produces (as Gemma 3's): its attention
# pair is the post-attention norm's output, its MLP pair the post-feedforward norm's.
HF_LAYER = LayerNames("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                      "post_feedforward_layernorm")


def tiny_text(**overrides) -> dict:
    """Three layers, sliding / full / full (transformers makes the last one full), a window of 5
    (shorter than the rows), 4 heads in 2 groups (TP 2 divides both) of width 12 on sliding
    layers and 16 on full ones (neither hidden / heads), local and global RoPE bases apart (the
    global one proportional, a quarter of its frequencies turning), a vocabulary of 97 that needs
    padding, soft-capped logits, no per-layer inputs."""
    text = dict(vocab_size=97, hidden_size=40, intermediate_size=52, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=12, global_head_dim=16, sliding_window=5,
                layer_types=["sliding_attention", "full_attention", "full_attention"],
                max_position_embeddings=256, rms_norm_eps=1e-6, final_logit_softcapping=30.0,
                hidden_size_per_layer_input=0, vocab_size_per_layer_input=97,
                rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                 "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                    "rope_theta": 3000.0}})
    return text | overrides


def decoder_shapes(text) -> dict[str, tuple]:
    h, f = text.hidden_size, text.intermediate_size
    shapes = {"embed_tokens.weight": (text.vocab_size, h)}
    for i in range(text.num_hidden_layers):
        d, g, n = layer_head_dim(text, i), layer_groups(text, i), text.num_attention_heads
        layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
                 "pre_feedforward_layernorm.weight": (h,), "post_feedforward_layernorm.weight": (h,),
                 "self_attn.q_proj.weight": (n * d, h), "self_attn.k_proj.weight": (g * d, h),
                 "self_attn.v_proj.weight": (g * d, h), "self_attn.o_proj.weight": (h, n * d),
                 "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
                 "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f),
                 "layer_scalar": (1,)}
        if keys_as_values(text, i):
            del layer["self_attn.v_proj.weight"]
        if is_moe(text):
            layer |= moe_shapes(text)
        shapes |= {f"layers.{i}.{k}": s for k, s in layer.items()}
    shapes |= {"norm.weight": (h,)}
    # E2B / E4B: per-layer inputs, shared layers without keys / values, wider MLPs there.
    for key, shape in per_layer.layer_shapes(text).items():
        if shape is None:
            shapes.pop(key, None)
        else:
            shapes[key] = shape
    return shapes
