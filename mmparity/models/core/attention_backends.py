"""Segment-wise attention kernels over packed ``[t, heads, dim]`` tensors, and whether each can run.

Every kernel takes ``q [t, h, d]``, ``k``/``v [t, g, d]`` (``g`` query groups, ``h % g == 0``, query
head ``i`` reads key/value group ``i // (h // g)`` as in mcore's fused QKV layout), host-side
``seqlens`` summing to ``t`` and a softmax ``scale``; each segment attends only to itself, never
causally. Nothing here pads to the longest segment: on the H200, masked padded SDPA over 8 mixed
images cost 4.0 ms per layer against 1.08 ms for one SDPA call per image.

Which kernel runs for a batch is decided in :mod:`mmparity.models.core.attention`; this module only
computes and answers "can this kernel run here, and if not, why".
"""

from __future__ import annotations

import functools
import inspect
import math as _math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F

HALF_DTYPES = (torch.float16, torch.bfloat16)
# Flash-attention kernels (torch's varlen, flash-attn) take head dims that are multiples of 8 up
# to 256; other sizes fail inside the kernel with a less helpful message.
FLASH_MAX_HEAD_DIM = 256


# --- availability ---------------------------------------------------------------------------------

def _import_varlen() -> Optional[Callable]:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _import_flash() -> Optional[Callable]:
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


def _import_te():
    try:
        import transformer_engine.pytorch as te
    except ImportError:
        return None
    return te


def _cuda_reason(device: torch.device) -> Optional[str]:
    if device.type != "cuda":
        return f"needs a CUDA device, not {device.type!r}"
    if not torch.cuda.is_available():
        return "needs CUDA, which is not available on this machine"
    return None


def _flash_shape_reason(dtype: Optional[torch.dtype], head_dim: Optional[int]) -> Optional[str]:
    if dtype is not None and dtype not in HALF_DTYPES:
        return f"needs bfloat16 or float16 (flash kernels), got {str(dtype).removeprefix('torch.')}"
    if head_dim is not None and (head_dim % 8 or head_dim > FLASH_MAX_HEAD_DIM):
        return f"needs a head dim that is a multiple of 8 and at most {FLASH_MAX_HEAD_DIM}, got {head_dim}"
    return None


def unavailable_reason(kernel: str, device: torch.device | str | None = None,
                       dtype: Optional[torch.dtype] = None,
                       head_dim: Optional[int] = None) -> Optional[str]:
    """``None`` when ``kernel`` can run for this device / dtype / head dim, else why it cannot.

    ``None`` arguments are not checked: ``unavailable_reason("varlen")`` asks whether the machine
    has what the kernel needs at all (CUDA, the import), without a particular tensor in mind.
    """
    if kernel in PORTABLE_KERNELS:
        return None
    if kernel not in OPTIONAL_KERNELS:
        raise ValueError(f"unknown attention kernel {kernel!r}")
    if device is None:
        if not torch.cuda.is_available():
            return "needs CUDA, which is not available on this machine"
    else:
        reason = _cuda_reason(torch.device(device))
        if reason:
            return reason
    if kernel == "varlen" and _import_varlen() is None:
        return f"torch {torch.__version__} has no torch.nn.attention.varlen (torch >= 2.9 has it)"
    if kernel == "flash" and _import_flash() is None:
        return "flash-attn is not installed (pip install 'mmparity[flash]')"
    if kernel == "te" and _import_te() is None:
        return "Transformer Engine is not installed (pip install 'mmparity[te]')"
    return _flash_shape_reason(dtype, head_dim)


def library_version(kernel: str) -> Optional[str]:
    from importlib import metadata

    dist = {"flash": "flash-attn", "te": "transformer-engine"}.get(kernel)
    if dist is None:
        return None
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


# --- helpers ---------------------------------------------------------------------------------------

def expand_kv(kv: torch.Tensor, num_heads: int, head_axis: int) -> torch.Tensor:
    """Repeat each key/value group for the query heads that read it (mcore's group order)."""
    groups = kv.shape[head_axis]
    if groups == num_heads:
        return kv
    if num_heads % groups:
        raise ValueError(f"{num_heads} query heads cannot share {groups} key/value groups evenly")
    return kv.repeat_interleave(num_heads // groups, dim=head_axis)


@dataclass(frozen=True)
class Group:
    """Segments of one length: their starts, and whether they sit back to back (then a view)."""

    length: int
    starts: tuple

    @property
    def contiguous(self) -> bool:
        return all(b - a == self.length for a, b in zip(self.starts, self.starts[1:]))


@functools.lru_cache(maxsize=256)
def length_groups(seqlens: tuple) -> tuple:
    """Segments grouped by length, in order of first appearance."""
    starts, offset = {}, 0
    for length in seqlens:
        starts.setdefault(length, []).append(offset)
        offset += length
    return tuple(Group(length, tuple(s)) for length, s in starts.items())


@functools.lru_cache(maxsize=256)
def _group_index(seqlens: tuple, length: int, device: str) -> torch.Tensor:
    group = next(g for g in length_groups(seqlens) if g.length == length)
    index = torch.cat([torch.arange(s, s + length) for s in group.starts])
    return index.to(device)


@functools.lru_cache(maxsize=256)
def cu_seqlens(seqlens: tuple, device: str) -> torch.Tensor:
    """int32 ``[0, l0, l0+l1, ...]`` on ``device``, built once per (batch layout, device).

    Cached so that the 24-27 layers of one forward (and repeated forwards over the same layout)
    share one host-to-device copy.
    """
    cu = torch.tensor([0, *seqlens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return cu.to(device)


def _device_key(t: torch.Tensor) -> str:
    return str(t.device)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    # Flash kernels take any row / head strides but need unit stride along the head dim.
    return x if x.stride(-1) == 1 else x.contiguous()


# --- batched attention on [n, h, L, d] -------------------------------------------------------------

def sdpa_batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """PyTorch SDPA; ``mask`` in mcore's convention (True = masked out)."""
    heads = q.shape[1]
    k, v = expand_kv(k, heads, 1), expand_kv(v, heads, 1)
    attn_mask = None if mask is None else ~mask.bool()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, scale=scale)


def math_batched(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                 mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Explicit matmul + softmax in at least float32: no fused kernel, no SDPA heuristics."""
    heads = q.shape[1]
    k, v = expand_kv(k, heads, 1), expand_kv(v, heads, 1)
    acc = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(mask.bool(), float("-inf"))
    return torch.matmul(scores.softmax(-1), v.to(acc)).to(q.dtype)


# --- packed kernels on [t, h, d] -------------------------------------------------------------------

def _as_batch(x: torch.Tensor, n: int, length: int) -> torch.Tensor:
    """[n·L, heads, d] -> [n, heads, L, d] as a view (splitting one dim never copies)."""
    return x.view(n, length, x.shape[1], x.shape[2]).transpose(1, 2)


def _from_batch(x: torch.Tensor) -> torch.Tensor:
    n, heads, length, dim = x.shape
    return x.transpose(1, 2).reshape(n * length, heads, dim)


def dense(q, k, v, seqlens: Sequence[int], scale: float, batched=sdpa_batched) -> torch.Tensor:
    """All segments share one length: one batched call, no copies on the way in."""
    n, length = len(seqlens), seqlens[0]
    out = batched(_as_batch(q, n, length), _as_batch(k, n, length), _as_batch(v, n, length), scale)
    return _from_batch(out)


def grouped(q, k, v, seqlens: Sequence[int], scale: float, batched=sdpa_batched) -> torch.Tensor:
    """One batched call per distinct length; back-to-back segments are views, the rest gathered."""
    groups = length_groups(tuple(seqlens))
    if len(groups) == 1 and groups[0].contiguous:
        return dense(q, k, v, seqlens, scale, batched)
    results = []
    for group in groups:
        n = len(group.starts)
        if group.contiguous:
            start, stop = group.starts[0], group.starts[0] + n * group.length
            parts = [x[start:stop] for x in (q, k, v)]
        else:
            index = _group_index(tuple(seqlens), group.length, _device_key(q))
            parts = [x.index_select(0, index) for x in (q, k, v)]
        out = batched(*(_as_batch(x, n, group.length) for x in parts), scale)
        results.append((group, _from_batch(out)))
    if all(group.contiguous for group, _ in results):
        # Each group is then one run, and groups come in order of first appearance: they tile the
        # sequence in order, so concatenating is the output (one copy, no scatter).
        return torch.cat([out for _, out in results], dim=0)
    out = q.new_empty(q.shape)
    for group, res in results:
        if group.contiguous:
            start = group.starts[0]
            out[start:start + res.shape[0]] = res
        else:
            out.index_copy_(0, _group_index(tuple(seqlens), group.length, _device_key(q)), res)
    return out


def math_kernel(q, k, v, seqlens: Sequence[int], scale: float) -> torch.Tensor:
    return grouped(q, k, v, seqlens, scale, batched=math_batched)


@functools.lru_cache(maxsize=None)
def _varlen_parameters() -> frozenset:
    fn = _import_varlen()
    return frozenset(inspect.signature(fn).parameters) if fn is not None else frozenset()


def varlen(q, k, v, seqlens: Sequence[int], scale: float) -> torch.Tensor:
    """``torch.nn.attention.varlen.varlen_attn`` over the whole packed batch in one launch.

    Its signature moved between torch releases (``scale`` and ``enable_gqa`` are keyword-only in
    newer ones, absent in 2.9), so both are passed only where the installed function has them.
    """
    fn = _import_varlen()
    params = _varlen_parameters()
    heads, dim = q.shape[1], q.shape[2]
    kwargs = {}
    if "scale" in params:
        kwargs["scale"] = scale
    else:  # the kernel's own scale is 1/sqrt(dim)
        q = q * (scale * _math.sqrt(dim))
    if k.shape[1] != heads:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k, v = expand_kv(k, heads, 1), expand_kv(v, heads, 1)
    cu = cu_seqlens(tuple(seqlens), _device_key(q))
    longest = max(seqlens)
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    return fn(q, k, v, cu, cu, longest, longest, **kwargs)


def flash(q, k, v, seqlens: Sequence[int], scale: float) -> torch.Tensor:
    """flash-attn's ``flash_attn_varlen_func`` (key/value groups are native there)."""
    fn = _import_flash()
    cu = cu_seqlens(tuple(seqlens), _device_key(q))
    longest = max(seqlens)
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    return fn(q, k, v, cu, cu, longest, longest, dropout_p=0.0, softmax_scale=scale, causal=False)


_te_modules: dict = {}


def te(q, k, v, seqlens: Sequence[int], scale: float) -> torch.Tensor:
    """Transformer Engine's ``DotProductAttention`` in ``thd`` layout (one module per shape)."""
    te_mod = _import_te()
    total, heads, dim = q.shape
    groups = k.shape[1]
    key = (heads, groups, dim, scale)
    module = _te_modules.get(key)
    if module is None:
        # "padding" is TE's mask type for thd: the cu_seqlens are the segment boundaries.
        module = te_mod.DotProductAttention(heads, dim, num_gqa_groups=groups, attention_dropout=0.0,
                                            qkv_format="thd", attn_mask_type="padding",
                                            softmax_scale=scale)
        _te_modules[key] = module
    cu = cu_seqlens(tuple(seqlens), _device_key(q))
    longest = max(seqlens)
    q, k, v = (_last_dim_contiguous(x) for x in (q, k, v))
    out = module(q, k, v, qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                 max_seqlen_q=longest, max_seqlen_kv=longest)
    return out.reshape(total, heads, dim)


PORTABLE_KERNELS = ("dense", "grouped", "math")
OPTIONAL_KERNELS = ("varlen", "flash", "te")
PACKED_KERNELS: dict[str, Callable] = {"dense": dense, "grouped": grouped, "math": math_kernel,
                                       "varlen": varlen, "flash": flash, "te": te}
