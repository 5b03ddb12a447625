"""CUDA-only checks (marker ``gpu``; tests/conftest.py skips them where there is no CUDA device).

Run by scripts/gpu_check.sh on the GPU machine: per-family parity on CUDA (bf16, and fp32 with
TF32 off), torch's varlen kernel against the per-size SDPA path and float64, the auto policy with
the real availability checks, and one published-size bench.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from mmparity.models import registry as families
from mmparity.parity import bench
from mmparity.models.core import attention
from mmparity.models.core import attention_backends as kernels
from mmparity.parity import harness

pytestmark = pytest.mark.gpu

# Mixed image token counts of one 16 x 72 tower: repeated (2304 twice), odd, tiny.
SEQLENS = [2304, 1600, 2304, 777, 1024, 64, 1369]


@pytest.fixture(autouse=True)
def _restore_backend():
    """Each test starts from auto; neither the selection nor set_backend's environment variable
    (which monkeypatch would not undo: it only reverts its own changes) outlives the test."""
    saved = attention._backend, os.environ.get(attention.ENV_VAR)
    attention._restore(None, None)
    yield
    attention._restore(*saved)


@pytest.fixture
def no_tf32():
    """float32 means IEEE float32: cuDNN convolutions default to TF32, which alone costs ~1e-3."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _failures(report) -> list:
    return [(r.check, r.metrics.get("rel_l2"), r.tolerance.get("rel_l2"),
             r.first_divergence.module if r.first_divergence else None) for r in report.failures()]


@pytest.mark.parametrize("family", families.names())
def test_bf16_parity_on_cuda(family):
    # Outputs and paired modules only: the component checks run in the fp32 test below, so that a
    # component that cannot run on CUDA does not hide the model's own bf16 parity.
    report = harness.check(family, dtype="bfloat16", device="cuda", seed=0, components=False)
    assert report.device == "cuda" and report.results
    assert report.passed, _failures(report)


@pytest.mark.parametrize("family", families.names())
def test_fp32_parity_with_components_on_cuda(family, no_tf32):
    report = harness.check(family, dtype="float32", device="cuda", seed=0, components=True)
    assert report.passed, _failures(report)


def test_bf16_parity_through_explicit_varlen():
    # Flash kernels need head dims that are multiples of 8: the tiny config's 12 is refused.
    cfg = families.get("pixtral").tiny_config()
    cfg.hidden_size, cfg.head_dim = 64, 16
    with attention.use_backend("varlen", device="cuda", dtype="bfloat16"):
        with attention.record_kernels() as used:
            report = harness.check("pixtral", cfg, dtype="bfloat16", device="cuda", seed=1,
                                   components=False)
    assert report.attention_backend.startswith("varlen: torch")
    assert report.passed, _failures(report)
    assert used["varlen"] > 0


def _qkv(heads, groups, dim, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(SEQLENS)
    make = lambda h: torch.randn(total, h, dim, device="cuda", generator=gen).to(dtype)  # noqa: E731
    return make(heads), make(groups), make(groups)


def _float64(q, k, v, scale):
    out, start = [], 0
    for length in SEQLENS:
        sl = slice(start, start + length)
        part = kernels.math_batched(*(x[sl].double().transpose(0, 1).unsqueeze(0) for x in (q, k, v)), scale)
        out.append(part[0].transpose(0, 1))
        start += length
    return torch.cat(out)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("groups", [16, 4], ids=["mha", "gqa"])
def test_varlen_equals_grouped_on_cuda(dtype, groups):
    q, k, v = _qkv(16, groups, 72, dtype, seed=groups)
    scale = 0.9 / math.sqrt(72)
    expected = _float64(q, k, v, scale)
    grouped = attention.packed_attention(q, k, v, SEQLENS, scale, backend="sdpa")
    varlen = attention.packed_attention(q, k, v, SEQLENS, scale, backend="varlen")
    for out in (grouped, varlen):
        assert out.shape == q.shape and torch.isfinite(out).all()
        assert _rel(out, expected) <= 1e-2
    assert _rel(varlen, grouped) <= 1e-2


def test_auto_policy_with_real_availability():
    many = [64 * (i + 1) for i in range(attention.VARLEN_MIN_LENGTHS)]
    assert attention.plan(many, "cuda", torch.bfloat16, 72).kernel == "varlen"
    assert attention.plan(many, "cuda", torch.float32, 72).kernel == "grouped"
    assert attention.plan(SEQLENS, "cuda", torch.bfloat16, 72).kernel == "grouped"
    assert attention.plan([2304] * 8, "cuda", torch.bfloat16, 72).kernel == "dense"
    with pytest.raises(ValueError, match="needs bfloat16 or float16"):
        attention.check_backend("varlen", "cuda", "float32")
    assert "or varlen" in attention.describe_backend("cuda", torch.bfloat16)


@pytest.mark.parametrize("backend", ["sdpa", "varlen"])
def test_packed_attention_never_synchronises(backend):
    """Once a batch layout has been seen, no kernel path reads anything back from the device
    (the first call per layout copies its cu_seqlens / gather indices to the device, once)."""
    q, k, v = _qkv(16, 16, 72, torch.bfloat16, seed=3)
    for seqlens in (SEQLENS, [2304] * 3):  # fills the per-layout caches
        attention.packed_attention(q[:sum(seqlens)], k[:sum(seqlens)], v[:sum(seqlens)], seqlens, 0.1,
                                   backend=backend)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        attention.packed_attention(q, k, v, SEQLENS, 0.1, backend=backend)
        attention.packed_attention(q[:6912], k[:6912], v[:6912], [2304] * 3, 0.1, backend=backend)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_bench_published_smoke_on_cuda():
    family = next((f for f in ("clip", "siglip", "pixtral", "qwen3_5", "kimi_k25")
                   if f in families.names()), None)
    if family is None:
        pytest.skip("no family with a published config is registered")
    report = bench.bench([family], size="published", images=8, dtype="bfloat16", device="cuda",
                         warmup=1, repeats=3)
    (r,) = report.results
    assert r.error is None, r.error
    assert report.timer == "cuda-events" and report.device_name
    assert r.native.median_ms > 0 and r.hf.median_ms > 0 and r.native.tflops > 1
    assert r.native.detail["attention_kernels"]
    assert r.rel_l2 is not None and r.rel_l2 < 0.1  # bf16 on both sides, same weights
