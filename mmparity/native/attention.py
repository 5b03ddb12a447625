"""Bidirectional core attention for mcore layer specs, on CPU and CUDA, with packed (THD) input.

mcore's own ``DotProductAttention`` allocates its softmax buffers on CUDA and refuses packed
sequences, and Transformer Engine / flash-attn are optional here. This module implements the
``core_attention`` contract of ``SelfAttention`` with PyTorch kernels:

* ``sbhd`` input ``[s, b, heads, dim]`` -> ``[s, b, heads * dim]``;
* ``thd`` input (``packed_seq_params.qkv_format == 'thd'``) ``[t, heads, dim]`` -> ``[t, heads * dim]``,
  where every segment of ``cu_seqlens_q`` attends only to itself (one image, one segment).

Packed batches never pad to the longest image: segments of equal length are batched together in
one dense call, the rest run per length group (or through ``varlen_attn`` on CUDA when chosen).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "sdpa", "math", "varlen")
_backend = "auto"


def set_backend(name: str) -> None:
    """Select the attention kernel family. Unknown or unavailable names are an error, not a fallback."""
    global _backend
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "varlen" and not varlen_available():
        raise ValueError("attention backend 'varlen' needs CUDA and torch.nn.attention.varlen")
    _backend = name


def get_backend() -> str:
    return _backend


def describe_backend(device: torch.device | str) -> str:
    """The kernel path actually used on ``device``, for reports."""
    device_type = torch.device(device).type
    if _backend == "auto":
        return "sdpa(dense|grouped)" + ("+varlen" if device_type == "cuda" and varlen_available() else "")
    return _backend


def varlen_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _expand_kv(kv: torch.Tensor, num_heads: int, head_axis: int) -> torch.Tensor:
    groups = kv.shape[head_axis]
    if groups == num_heads:
        return kv
    return kv.repeat_interleave(num_heads // groups, dim=head_axis)


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q, k, v: [batch, heads, seq, dim]."""
    if _backend == "math":
        scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
        return torch.matmul(scores.softmax(-1), v.float()).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, scale=scale)


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: list[int],
                     scale: float) -> torch.Tensor:
    """Segment-wise attention over packed ``[t, heads, dim]`` tensors; returns ``[t, heads, dim]``."""
    total, heads, dim = q.shape
    k = _expand_kv(k, heads, 1)
    v = _expand_kv(v, heads, 1)
    if len(set(seqlens)) == 1:
        n, length = len(seqlens), seqlens[0]
        def to_batch(x):  # [n*L, h, d] -> [n, h, L, d]
            return x.view(n, length, heads, dim).transpose(1, 2)
        out = _dense(to_batch(q), to_batch(k), to_batch(v), scale)
        return out.transpose(1, 2).reshape(total, heads, dim)
    if _backend == "varlen" and q.is_cuda:
        from torch.nn.attention.varlen import varlen_attn

        cu = torch.tensor([0, *seqlens], device=q.device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return varlen_attn(q, k, v, cu, cu, max(seqlens), max(seqlens), scale=scale)
    # Group segments by length so that each group is one dense batched call.
    out = torch.empty_like(q)
    starts = [0]
    for n in seqlens[:-1]:
        starts.append(starts[-1] + n)
    by_length: dict[int, list[int]] = {}
    for start, length in zip(starts, seqlens):
        by_length.setdefault(length, []).append(start)
    for length, group_starts in by_length.items():
        index = torch.cat([torch.arange(s, s + length, device=q.device) for s in group_starts])
        def gather(x):
            return x.index_select(0, index).view(len(group_starts), length, heads, dim).transpose(1, 2)
        res = _dense(gather(q), gather(k), gather(v), scale)
        out.index_copy_(0, index, res.transpose(1, 2).reshape(-1, heads, dim))
    return out


class BidirectionalCoreAttention(torch.nn.Module):
    """Drop-in ``core_attention`` for mcore ``SelfAttention`` (local spec), never causal."""

    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type: str = "self",
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None, **unused):
        super().__init__()
        self.config = config
        head_dim = config.kv_channels or config.hidden_size // config.num_attention_heads
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)

    def forward(self, query, key, value, attention_mask=None, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if attention_bias is not None:
            raise NotImplementedError("attention_bias is not supported by BidirectionalCoreAttention")
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            seqlens = packed_seq_params_seqlens(packed_seq_params)
            out = packed_attention(query, key, value, seqlens, self.softmax_scale)
            return out.reshape(out.shape[0], -1)
        seq, batch, heads, dim = query.shape
        q = query.permute(1, 2, 0, 3)
        k = _expand_kv(key.permute(1, 2, 0, 3), heads, 1)
        v = _expand_kv(value.permute(1, 2, 0, 3), heads, 1)
        if attention_mask is not None:
            # mcore masks are boolean "True = masked out"; SDPA wants True = attend.
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=~attention_mask.bool(),
                                                 scale=self.softmax_scale)
        else:
            out = _dense(q, k, v, self.softmax_scale)
        return out.permute(2, 0, 1, 3).reshape(seq, batch, heads * dim)


def packed_seq_params_seqlens(packed_seq_params) -> list[int]:
    """Host-side segment lengths; cached on the params object so each layer does not re-sync."""
    cached = getattr(packed_seq_params, "_mmparity_seqlens", None)
    if cached is None:
        cu = packed_seq_params.cu_seqlens_q
        cached = (cu[1:] - cu[:-1]).tolist()
        try:
            packed_seq_params._mmparity_seqlens = cached
        except AttributeError:
            pass
    return cached


def make_packed_seq_params(seqlens: list[int], device: torch.device | str):
    """PackedSeqParams for per-image attention over a packed sequence of ``seqlens`` tokens."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, *seqlens], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(seqlens), max_seqlen_kv=max(seqlens))
    params._mmparity_seqlens = list(seqlens)
    return params
