"""Reference side of the Qwen3.5 language-model part: what transformers' ``Qwen3_5TextModel`` /
``Qwen3_5MoeTextModel`` hold, read off the text config. transformers builds the module (a VLM
class makes its text model from ``text_config``; ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM``
alone), so only the shapes live here, in its module names (each MoE layer's experts as two stacked
tensors)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable

from mmparity.models.parts.qwen3_5_text.config import LINEAR, is_moe

MODEL_TYPES = ("qwen3_5_text", "qwen3_5_moe_text")

# transformers' modules whose gated delta rule it swaps for fla's wherever fla imports.
_DELTA_RULE_MODULES = ("transformers.models.qwen3_5.modeling_qwen3_5",
                       "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe")
_DELTA_RULE_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")


@contextlib.contextmanager
def own_delta_rule_off_gpu(device):
    """transformers runs fla's gated delta rule wherever fla is installed, on any device; fla's
    triton kernels have no CPU driver ("0 active drivers"), so on a machine with fla and no GPU
    its reference cannot run at all. Off CUDA, transformers' own torch functions (the ones fla's
    replace, kept as ``__wrapped__``) run instead, for the length of the block."""
    swapped = []
    if getattr(device, "type", str(device)) != "cuda":
        for module_name in _DELTA_RULE_MODULES:
            module = sys.modules.get(module_name)
            for name in _DELTA_RULE_FUNCTIONS:
                current = getattr(module, name, None)
                own = getattr(current, "__wrapped__", None)
                if own is not None:
                    swapped.append((module, name, current))
                    setattr(module, name, own)
    try:
        yield
    finally:
        for module, name, current in swapped:
            setattr(module, name, current)


def on_own_delta_rule(run: Callable) -> Callable:
    """``run(model, case)`` of a reference model, under :func:`own_delta_rule_off_gpu` on its device."""

    def reference_run(model, case):
        with own_delta_rule_off_gpu(next(model.parameters()).device):
            return run(model, case)

    reference_run.__doc__ = run.__doc__
    return reference_run


def _mlp(prefix: str, h: int, f: int) -> dict[str, tuple]:
    return {prefix + "gate_proj.weight": (f, h), prefix + "up_proj.weight": (f, h), prefix + "down_proj.weight": (h, f)}


def _delta_net(text) -> dict[str, tuple]:
    h, qk = text.hidden_size, text.linear_num_key_heads * text.linear_key_head_dim
    v, heads = text.linear_num_value_heads * text.linear_value_head_dim, text.linear_num_value_heads
    return {"linear_attn.conv1d.weight": (2 * qk + v, 1, text.linear_conv_kernel_dim),
            "linear_attn.dt_bias": (heads,), "linear_attn.A_log": (heads,),
            "linear_attn.norm.weight": (text.linear_value_head_dim,),
            "linear_attn.out_proj.weight": (h, v), "linear_attn.in_proj_qkv.weight": (2 * qk + v, h),
            "linear_attn.in_proj_z.weight": (v, h), "linear_attn.in_proj_b.weight": (heads, h),
            "linear_attn.in_proj_a.weight": (heads, h)}


def _attention(text) -> dict[str, tuple]:
    h, d = text.hidden_size, text.head_dim
    heads, groups = text.num_attention_heads, text.num_key_value_heads
    return {"self_attn.q_proj.weight": (2 * heads * d, h), "self_attn.k_proj.weight": (groups * d, h),
            "self_attn.v_proj.weight": (groups * d, h), "self_attn.o_proj.weight": (h, heads * d),
            "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}


def _ffn(text) -> dict[str, tuple]:
    h = text.hidden_size
    if not is_moe(text):
        return _mlp("mlp.", h, text.intermediate_size)
    e, f = text.num_experts, text.moe_intermediate_size
    return {"mlp.gate.weight": (e, h), "mlp.experts.gate_up_proj": (e, 2 * f, h),
            "mlp.experts.down_proj": (e, h, f), **_mlp("mlp.shared_expert.", h, text.shared_expert_intermediate_size),
            "mlp.shared_expert_gate.weight": (1, h)}


def decoder_shapes(text) -> dict[str, tuple]:
    h = text.hidden_size
    layers = {}
    for i, kind in enumerate(text.layer_types):
        mixer = _delta_net(text) if kind == LINEAR else _attention(text)
        layer = {**mixer, **_ffn(text), "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,)}
        layers |= {f"layers.{i}.{k}": s for k, s in sorted(layer.items())}
    return {"embed_tokens.weight": (text.vocab_size, h), **layers, "norm.weight": (h,)}
