"""The mcore blocks Gemma decoders share (Gemma 3 whole's decoder, the ``gemma4_text`` part): the
sandwich norm on a row-parallel linear, causal attention under a sliding window and a whole VLM's
mask, and attention rotating with its own layer's RoPE table.

Which RMSNorm a block uses is the caller's: Gemma 3 scales by ``1 + w``
(:class:`~mmparity.models.parts.qwen3_5_text.native.ZeroCentredRMSNorm`), Gemma 4 by ``w``.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from megatron.core.transformer.attention import SelfAttention

from mmparity.models.core.layers import BiasInGemmRowParallelLinear
from mmparity.models.parts.dense_decoder.native import CausalCoreAttention, LanguageRotaryEmbedding
from mmparity.models.parts.qwen3_5_text.native import ZeroCentredRMSNorm


def post_normed(row_linear, norm):
    """``row_linear`` (a row-parallel linear class) followed by Gemma's sandwich norm
    (``post_layernorm``, a ``norm_class`` built from the config): the place Megatron-Bridge gives
    Gemma's post-attention and post-feedforward norms. The norm reads the reduced output, so every
    TP rank holds all of its weight. mmparity's native decoders and Megatron's TE spec
    (``TERowParallelLinear`` + ``TENorm``) build it from their own pieces."""

    class PostNormed(row_linear):
        norm_class = norm

        def __init__(self, input_size: int, output_size: int, *, config, **kwargs):
            super().__init__(input_size, output_size, config=config, **kwargs)
            self.post_layernorm = self.norm_class(config, output_size, eps=config.layernorm_epsilon)

        def forward(self, input_):
            out, bias = super().forward(input_)
            if bias is not None:  # Gemma's linears have none; a bias would go before the norm
                out, bias = out + bias, None
            return self.post_layernorm(out), bias

    PostNormed.__name__ = PostNormed.__qualname__ = f"PostNormed{row_linear.__name__}"
    PostNormed.__doc__ = f"``{row_linear.__name__}`` with Gemma's post norm (:func:`post_normed`)."
    return PostNormed


# The native decoders' (Gemma 3's norm: ``1 + w``; a subclass sets another ``norm_class``).
PostNormedRowParallelLinear = post_normed(BiasInGemmRowParallelLinear, ZeroCentredRMSNorm)


def window_mask(seq: int, keys: int, window: int, device) -> torch.Tensor:
    """``[seq, keys]`` True where a key is too far back for a sliding layer: HF's window bounds only
    how far back a key may be (``key > query - window``), on top of whatever else is allowed."""
    q = torch.arange(seq, device=device)[:, None]
    k = torch.arange(keys, device=device)[None, :]
    return k <= q - window


class WindowedCoreAttention(CausalCoreAttention):
    """Causal SDPA (GQA as mcore groups heads) that takes the whole VLM's mask (True = masked: the
    bidirectional image blocks) and, in a sliding layer, the window on top of it. The scale is
    the config's ``softmax_scale``. ``windows``: each layer's window (None: a full layer)."""

    def __init__(self, config, layer_number: int, *args, windows=(), **kwargs):
        super().__init__(config, layer_number, *args, **kwargs)
        self.window = windows[layer_number - 1] if windows else None

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        mask = None if attention_mask is None else attention_mask.bool()
        if self.window is not None:
            seq, keys = query.shape[0], key.shape[0]
            causal = torch.ones(seq, keys, dtype=torch.bool, device=query.device).tril()
            outside = window_mask(seq, keys, self.window, query.device)
            mask = ~causal | outside if mask is None else mask | outside
        if mask is None:
            return super().forward(query, key, value, None, attn_mask_type, attention_bias, packed_seq_params)
        return self._masked(query, key, value, mask)

    def _masked(self, query, key, value, masked):
        seq, batch, heads, _ = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        if k.shape[1] != heads:
            k = k.repeat_interleave(heads // k.shape[1], dim=1)
            v = v.repeat_interleave(heads // v.shape[1], dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=~masked, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(seq, batch, heads * value.shape[-1])


def rope_table(inv_freq: torch.Tensor) -> LanguageRotaryEmbedding:
    """mcore's rotate-half RoPE over ``2 · len(inv_freq)`` channels with these frequencies (fp32,
    a non-persistent buffer: no state-dict key)."""
    rope = LanguageRotaryEmbedding(kv_channels=2 * inv_freq.numel(), rotary_percent=1.0, rotary_interleaved=False,
                                   rotary_base=10000, use_cpu_initialization=True)
    rope.inv_freq = inv_freq.to(torch.float32).clone()
    return rope


class PerLayerRopeSelfAttention(SelfAttention):
    """mcore's ``SelfAttention`` rotating with its own layer's RoPE (Gemma's sliding and full layers
    have different bases and, in Gemma 4, widths; GPTModel hands every layer one table).

    ``ropes``: each layer's inverse frequencies; ``layer_fields``: each layer's
    ``TransformerConfig`` fields that differ from the block's (Gemma 4's full layers are wider),
    none where empty. The state dict is the stock class's."""

    def __init__(self, config, submodules, layer_number: int, *args, ropes=(), layer_fields=(), **kwargs):
        fields = layer_fields[layer_number - 1] if layer_fields else None
        if fields:
            config = dataclasses.replace(config, **fields)
        super().__init__(config, submodules, layer_number, *args, **kwargs)
        self.rope = rope_table(ropes[layer_number - 1])

    def forward(self, hidden_states, attention_mask, *args, rotary_pos_emb=None, **kwargs):
        table = self.rope.get_emb(hidden_states.shape[0]).to(hidden_states.device)
        return super().forward(hidden_states, attention_mask, *args, rotary_pos_emb=table, **kwargs)


def default_inv_freq(dim: int, base: float, factor: float = 1.0) -> torch.Tensor:
    """``θ^(-2k/dim)`` for ``k < dim/2`` in fp32, divided by a linear scaling ``factor``."""
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)) / factor
