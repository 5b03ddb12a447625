"""Reference side of the dense decoder part (Llama / Mistral / Qwen2): what the HF text model built
inside a whole VLM holds, read off its config. transformers builds the module itself (the VLM
class makes its text model from ``text_config``), so only the shapes live here.
"""

from __future__ import annotations

from mmparity.config import decoder_biases, head_dim

MODEL_TYPES = ("llama", "mistral", "qwen2")


def decoder_shapes(text) -> dict[str, tuple]:
    """A dense decoder body (``LlamaModel``, ``MistralModel``, ``Qwen2Model``), biases where HF
    puts them: Llama's ``attention_bias`` on q/k/v and o_proj, ``mlp_bias`` on the MLP, Qwen2's
    q/k/v always."""
    h, f = text.hidden_size, text.intermediate_size
    q, kv = text.num_attention_heads * head_dim(text), text.num_key_value_heads * head_dim(text)
    qkv_bias, _ = decoder_biases(text)
    o_bias = bool(getattr(text, "attention_bias", False)) and qkv_bias
    layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
             "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h),
             "self_attn.v_proj.weight": (kv, h), "self_attn.o_proj.weight": (h, q),
             "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)}
    if qkv_bias:
        layer |= {"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)}
    if o_bias:
        layer["self_attn.o_proj.bias"] = (h,)
    if getattr(text, "mlp_bias", False):
        layer |= {"mlp.gate_proj.bias": (f,), "mlp.up_proj.bias": (f,), "mlp.down_proj.bias": (h,)}
    return {"embed_tokens.weight": (text.vocab_size, h),
            **{f"layers.{i}.{k}": s for i in range(text.num_hidden_layers) for k, s in layer.items()},
            "norm.weight": (h,)}
