"""Bidirectional core attention for mcore layer specs, on CPU and CUDA, with packed (THD) input.

mcore's own ``DotProductAttention`` allocates its softmax buffers on CUDA and refuses packed
sequences, and Transformer Engine / flash-attn are optional here. This module implements the
``core_attention`` contract of ``SelfAttention`` (and ``CrossAttention``):

* ``sbhd`` input ``[s, b, heads, dim]`` -> ``[s, b, heads * dim]``;
* ``thd`` input (``packed_seq_params.qkv_format == 'thd'``) ``[t, heads, dim]`` -> ``[t, heads * dim]``,
  where every segment of ``cu_seqlens_q`` attends only to itself (one image, one segment).

Which kernel runs is decided per batch by :func:`plan`, from the segment lengths, the device,
the dtype and the selected backend (:func:`set_backend`):

=========  ==========================================================================================
backend    kernel
=========  ==========================================================================================
``auto``   equal lengths -> ``dense`` (one batched SDPA call); mixed lengths -> ``grouped`` (one
           SDPA call per distinct length), or ``varlen`` (torch's cu_seqlens flash kernel, one
           launch) once there are ``VARLEN_MIN_LENGTHS`` or more distinct lengths and varlen can run
           (CUDA, bf16/fp16, head dim a multiple of 8)
``sdpa``   ``dense`` / ``grouped`` as above, never varlen
``math``   explicit float32 matmul + softmax per length group (no fused kernel; a reference)
``varlen`` ``torch.nn.attention.varlen.varlen_attn`` for every packed batch
``flash``  flash-attn's ``flash_attn_varlen_func`` (optional extra ``mmparity[flash]``)
``te``     Transformer Engine ``DotProductAttention`` in thd layout (optional extra ``mmparity[te]``)
=========  ==========================================================================================

Never a padded mask: on the H200 (bf16, 16 heads x 72) 8 equal images of 2304 tokens took 0.57 ms
per layer dense against 1.00 ms varlen and 0.99 ms masked-padded; 8 mixed sizes (17.9k tokens) took
1.08 ms as one SDPA call per image, 1.41 ms varlen and 4.0 ms masked-padded. Asking for a backend
that cannot run (not installed, no CUDA, fp32 on a flash kernel) is a ``ValueError``, never a
silent fallback. Cross-attention (query and key lengths differ) and explicit masks, used only by
pooling heads, always go through SDPA (``math`` under the math backend); :func:`record_kernels`
shows what actually ran.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import torch

from mmparity.models.core import attention_backends as kernels

BACKENDS = ("auto", "sdpa", "math", "varlen", "flash", "te")
# Backends that name exactly one optional kernel.
_SINGLE_KERNEL = {"varlen": "varlen", "flash": "flash", "te": "te"}
# Mixed lengths: auto prefers one varlen launch to one SDPA call per length from this many distinct
# lengths, or from this many segments, on. Measured on the H200 (torch 2.11, bf16, 16 heads x 72,
# benchmarks/attention_kernels.py, 2026-11-29): 8 images of 8 sizes: grouped 0.84 ms, varlen 1.09;
# 64 images of 2 sizes: grouped 0.49, varlen 0.41; of 4 sizes 0.75 vs 0.59; of 16 sizes 1.51 vs
# 0.74 — the per-length gathers, not the number of lengths, dominate once there are many images.
VARLEN_MIN_LENGTHS = 16
VARLEN_MIN_SEGMENTS = 16
# set_backend also writes this, so that spawned tensor-parallel ranks inherit the choice.
ENV_VAR = "MMPARITY_ATTENTION_BACKEND"

_backend: Optional[str] = None  # None: the environment variable, else "auto"
_recorders: list = []


@dataclass(frozen=True)
class Plan:
    """What runs for one batch: ``kernel`` (``dense``, ``grouped``, ``math``, ``varlen``, ``flash``,
    ``te``), chosen under ``backend``, and why."""

    backend: str
    kernel: str
    reason: str


def _check_name(name: str) -> None:
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of {', '.join(BACKENDS)}")


def _torch_dtype(dtype) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
            "float64": torch.float64}[str(dtype)]


def check_backend(name: str, device: torch.device | str | None = None, dtype=None,
                  head_dim: Optional[int] = None) -> None:
    """Raise ``ValueError`` unless backend ``name`` can run for ``device`` / ``dtype`` / ``head_dim``
    (``None`` skips that check: without a device, only what the machine has is checked)."""
    _check_name(name)
    kernel = _SINGLE_KERNEL.get(name)
    if kernel is None:
        return
    where = f" on {torch.device(device)}" if device is not None else ""
    reason = kernels.unavailable_reason(kernel, device, _torch_dtype(dtype), head_dim)
    if reason:
        raise ValueError(f"attention backend {name!r} cannot run{where}: {reason}")


def set_backend(name: str, device: torch.device | str | None = None, dtype=None) -> None:
    """Select the attention backend. Unknown or unavailable names are an error, not a fallback.

    With ``device`` (and ``dtype``), availability is checked for them, e.g. ``varlen`` with
    ``float32`` is refused up front instead of failing in the first layer.
    """
    global _backend
    check_backend(name, device, dtype)
    _backend = name
    os.environ[ENV_VAR] = name


def get_backend() -> str:
    if _backend is not None:
        return _backend
    name = os.environ.get(ENV_VAR) or "auto"
    _check_name(name)
    return name


@contextlib.contextmanager
def use_backend(name: str, device: torch.device | str | None = None, dtype=None):
    """:func:`set_backend` for the duration of a block."""
    previous_global, previous_env = _backend, os.environ.get(ENV_VAR)
    set_backend(name, device, dtype)
    try:
        yield
    finally:
        _restore(previous_global, previous_env)


def _restore(previous_global, previous_env) -> None:
    global _backend
    _backend = previous_global
    if previous_env is None:
        os.environ.pop(ENV_VAR, None)
    else:
        os.environ[ENV_VAR] = previous_env


def plan(seqlens: Sequence[int], device: torch.device | str = "cpu", dtype=None,
         head_dim: Optional[int] = None, backend: Optional[str] = None, *,
         available: Optional[Iterable[str]] = None) -> Plan:
    """The kernel that runs for segments of ``seqlens`` tokens under ``backend`` (default: the
    selected one). ``available`` overrides which optional kernels count as runnable (tests)."""
    backend = backend or get_backend()
    _check_name(backend)
    seqlens = list(seqlens)
    if not seqlens or min(seqlens) <= 0:
        raise ValueError(f"segment lengths must be positive, got {seqlens}")
    dtype = _torch_dtype(dtype)

    def unavailable(kernel: str) -> Optional[str]:
        if available is not None:
            return None if kernel in available else "not available (as told by the caller)"
        return kernels.unavailable_reason(kernel, device, dtype, head_dim)

    if backend in _SINGLE_KERNEL:
        reason = unavailable(_SINGLE_KERNEL[backend])
        if reason:
            raise ValueError(f"attention backend {backend!r} cannot run on {torch.device(device)}: {reason}")
        return Plan(backend, _SINGLE_KERNEL[backend], "selected explicitly")
    if backend == "math":
        return Plan(backend, "math", "selected explicitly")
    distinct = len(set(seqlens))
    if distinct == 1:
        return Plan(backend, "dense", f"{len(seqlens)} segment(s) of one length: one batched SDPA call")
    many = distinct >= VARLEN_MIN_LENGTHS or len(seqlens) >= VARLEN_MIN_SEGMENTS
    if backend == "auto" and many and unavailable("varlen") is None:
        return Plan(backend, "varlen",
                    f"{len(seqlens)} segments of {distinct} distinct lengths (>= {VARLEN_MIN_SEGMENTS} "
                    f"segments or >= {VARLEN_MIN_LENGTHS} lengths): one varlen launch")
    if backend == "sdpa":
        why = "sdpa never uses varlen"
    elif not many:
        why = (f"{len(seqlens)} segments < {VARLEN_MIN_SEGMENTS} and {distinct} distinct lengths "
               f"< {VARLEN_MIN_LENGTHS}")
    else:
        why = f"varlen not available: {unavailable('varlen')}"
    return Plan(backend, "grouped", f"{why}: one SDPA call per length")


def kernel_for(seqlens: Sequence[int], device: torch.device | str = "cpu", dtype=None,
               head_dim: Optional[int] = None, backend: Optional[str] = None) -> str:
    """Just the kernel name of :func:`plan`."""
    return plan(seqlens, device, dtype, head_dim, backend).kernel


def describe_backend(device: torch.device | str, dtype=None) -> str:
    """The selection policy in force on ``device`` (and ``dtype``), for reports.

    Per-batch choices depend on the image sizes; :func:`record_kernels` gives what actually ran.
    """
    backend = get_backend()
    device = torch.device(device)
    dtype = _torch_dtype(dtype)
    if backend in _SINGLE_KERNEL:
        kernel = _SINGLE_KERNEL[backend]
        names = {"varlen": f"torch {torch.__version__.split('+')[0]} varlen_attn",
                 "flash": f"flash-attn {kernels.library_version('flash')} flash_attn_varlen_func",
                 "te": f"transformer-engine {kernels.library_version('te')} DotProductAttention(thd)"}
        return f"{backend}: {names[kernel]}"
    if backend == "math":
        return "math: float32 matmul+softmax per size group"
    rules = ["equal sizes->sdpa dense", "mixed->sdpa per size"]
    if backend == "auto" and kernels.unavailable_reason("varlen", device, dtype) is None:
        rules[1] = (f"mixed->sdpa per size (<{VARLEN_MIN_SEGMENTS} images and <{VARLEN_MIN_LENGTHS} "
                    f"sizes) or varlen")
        rules[1] += " (bf16/fp16, head dim multiple of 8)" if dtype is None else " (head dim multiple of 8)"
    return f"{backend}: " + ", ".join(rules)


@contextlib.contextmanager
def record_kernels():
    """Count the kernels that run inside the block: ``{kernel: calls}`` (one call per layer)."""
    counts: Counter = Counter()
    _recorders.append(counts)
    try:
        yield counts
    finally:
        _recorders.remove(counts)


def _record(kernel: str) -> None:
    for counts in _recorders:
        counts[kernel] += 1


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: list[int],
                     scale: float, backend: Optional[str] = None) -> torch.Tensor:
    """Segment-wise attention over packed ``[t, heads, dim]`` tensors; returns ``[t, heads, dim]``.

    ``k`` / ``v`` may have fewer heads (query groups) than ``q``.
    """
    if sum(seqlens) != q.shape[0]:
        raise ValueError(f"segment lengths sum to {sum(seqlens)} but there are {q.shape[0]} tokens")
    chosen = plan(seqlens, q.device, q.dtype, q.shape[-1], backend)
    _record(chosen.kernel)
    return kernels.PACKED_KERNELS[chosen.kernel](q, k, v, seqlens, scale)


def head_width(config) -> int:
    """The per-head width of a megatron-core ``TransformerConfig``: ``kv_channels``, or hidden /
    heads where it is unset (mcore's own default, for a config that did not run its checks)."""
    return config.kv_channels or config.hidden_size // config.num_attention_heads


class BidirectionalCoreAttention(torch.nn.Module):
    """Drop-in ``core_attention`` for mcore ``SelfAttention`` / ``CrossAttention``, never causal."""

    def __init__(self, config, layer_number: int, attn_mask_type=None, attention_type: str = "self",
                 attention_dropout: Optional[float] = None, softmax_scale: Optional[float] = None,
                 cp_comm_type: Optional[str] = None, pg_collection=None, **unused):
        super().__init__()
        self.config = config
        head_dim = head_width(config)
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
        if attention_mask is None and key.shape[0] == seq:
            out = self._self_attention_sbhd(query, key, value)
        else:  # cross-attention (pooling probes) or an explicit mask
            use_math = get_backend() == "math"
            _record("math" if use_math else "sdpa-masked")
            batched = kernels.math_batched if use_math else kernels.sdpa_batched
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
            out = batched(q, k, v, self.softmax_scale, attention_mask)
        return out.permute(2, 0, 1, 3).reshape(seq, batch, heads * dim)

    def _self_attention_sbhd(self, query, key, value) -> torch.Tensor:
        """[s, b, h, d] -> [b, h, s, d]: a static batch is ``b`` segments of one length."""
        seq, batch, heads, dim = query.shape
        chosen = plan([seq] * batch, query.device, query.dtype, dim)
        _record(chosen.kernel)
        if chosen.kernel in ("dense", "grouped", "math"):
            batched = kernels.math_batched if chosen.kernel == "math" else kernels.sdpa_batched
            q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))
            return batched(q, k, v, self.softmax_scale)
        # An explicitly chosen packed kernel: run the batch as `batch` packed segments.
        flat = [x.transpose(0, 1).reshape(batch * seq, x.shape[2], dim) for x in (query, key, value)]
        out = kernels.PACKED_KERNELS[chosen.kernel](*flat, [seq] * batch, self.softmax_scale)
        return out.view(batch, seq, heads, dim).transpose(1, 2)


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


def make_packed_seq_params(seqlens: list[int], device: torch.device | str | None = None):
    """PackedSeqParams for per-image attention over a packed sequence of ``seqlens`` tokens.

    ``cu_seqlens`` stay on the host whatever ``device`` is: mcore's unfused THD RoPE reads them with
    ``.tolist()`` and ``.item()`` in every layer (a device synchronisation per image per layer when
    they live on the GPU), and the kernels here that need them on the device keep their own cached
    copy. ``device`` is accepted for callers that pass it.
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    if not seqlens or min(seqlens) <= 0:
        raise ValueError(f"segment lengths must be positive, got {list(seqlens)}")
    cu = torch.tensor([0, *seqlens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                             max_seqlen_q=max(seqlens), max_seqlen_kv=max(seqlens))
    try:
        params._mmparity_seqlens = list(seqlens)
    except AttributeError:
        pass
    return params
