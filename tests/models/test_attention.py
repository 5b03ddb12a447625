"""Attention backends: the selection policy, every CPU kernel against float64, the optional
kernels' glue (with stand-ins for the CUDA-only libraries), and the CLI switch."""

from __future__ import annotations

import json
import math
import os
import sys
import types

import pytest
import torch

from mmparity.models.core import attention
from mmparity.models.core import attention_backends as kernels

# Mixed sizes with groups that are back to back, interleaved and singletons; GQA 6 heads / 2 groups.
SEQLENS = [[7], [4, 4, 4], [5, 9, 5, 1, 9, 9], [3, 3, 8, 3], [2, 11]]
CPU_BACKENDS = ("auto", "sdpa", "math")


@pytest.fixture(autouse=True)
def _restore_backend():
    """Each test starts from auto; neither the selection nor set_backend's environment variable
    (which monkeypatch would not undo: it only reverts its own changes) outlives the test."""
    saved = attention._backend, os.environ.get(attention.ENV_VAR)
    attention._restore(None, None)
    yield
    attention._restore(*saved)


def packed_qkv(seqlens, heads=6, groups=2, dim=8, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(seqlens)
    q = torch.randn(total, heads, dim, generator=gen)
    k = torch.randn(total, groups, dim, generator=gen)
    v = torch.randn(total, groups, dim, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype)


def reference(q, k, v, seqlens, scale):
    """float64, one segment at a time, query head i reads key/value group i // (heads // groups)."""
    heads, groups = q.shape[1], k.shape[1]
    share = heads // groups
    out = torch.empty(q.shape, dtype=torch.float64)
    start = 0
    for length in seqlens:
        sl = slice(start, start + length)
        for h in range(heads):
            qh = q[sl, h].double()
            kh, vh = k[sl, h // share].double(), v[sl, h // share].double()
            out[sl, h] = torch.softmax(qh @ kh.T * scale, dim=-1) @ vh
        start += length
    return out


def rel_l2(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# --- policy -----------------------------------------------------------------------------------------

def test_equal_sizes_run_dense_everywhere():
    assert attention.plan([64] * 8, "cpu").kernel == "dense"
    assert attention.plan([64] * 8, "cuda", torch.bfloat16, 72, available={"varlen"}).kernel == "dense"
    assert attention.plan([9], "cpu").kernel == "dense"


def test_mixed_sizes_run_grouped_on_cpu():
    chosen = attention.plan([5, 9, 5], "cpu", torch.float32, 8)
    assert chosen.kernel == "grouped" and "per length" in chosen.reason


def test_auto_takes_varlen_for_many_segments_of_few_lengths():
    # Measured crossover: 64 images of 2 sizes ran faster as one varlen launch, 8 of 8 sizes did not.
    two_sizes = [64, 128] * (attention.VARLEN_MIN_SEGMENTS // 2)
    assert attention.plan(two_sizes, "cuda", torch.bfloat16, 72, available={"varlen"}).kernel == "varlen"
    eight = [64 * (i + 1) for i in range(8)]
    assert attention.plan(eight, "cuda", torch.bfloat16, 72, available={"varlen"}).kernel == "grouped"


def test_auto_takes_varlen_only_for_many_lengths_where_it_can_run():
    many = list(range(1, attention.VARLEN_MIN_LENGTHS + 1))
    fewer = many[:-1]
    assert attention.plan(many, "cuda", torch.bfloat16, 72, available={"varlen"}).kernel == "varlen"
    assert attention.plan(fewer, "cuda", torch.bfloat16, 72, available={"varlen"}).kernel == "grouped"
    assert attention.plan(many, "cuda", torch.bfloat16, 72, available=set()).kernel == "grouped"
    # The real availability check: fp32 never goes to a flash kernel, and nothing does on the CPU.
    assert attention.plan(many, "cpu", torch.bfloat16, 72).kernel == "grouped"
    assert "varlen not available" in attention.plan(many, "cpu", torch.bfloat16, 72).reason


def test_sdpa_and_math_backends_never_pick_a_packed_kernel():
    many = list(range(1, 40))
    assert attention.plan(many, "cuda", torch.bfloat16, 72, "sdpa", available={"varlen"}).kernel == "grouped"
    assert attention.plan([4, 4], "cpu", backend="math").kernel == "math"
    assert attention.plan([4, 5], "cpu", backend="math").kernel == "math"


def test_explicit_backend_runs_its_kernel_or_refuses():
    assert attention.plan([4, 4], "cuda", torch.bfloat16, 64, "varlen", available={"varlen"}).kernel == "varlen"
    with pytest.raises(ValueError, match="attention backend 'varlen' cannot run on cpu: needs a CUDA device"):
        attention.plan([4, 5], "cpu", torch.bfloat16, 64, "varlen")
    with pytest.raises(ValueError, match="'flash' cannot run"):
        attention.plan([4, 5], "cuda", torch.bfloat16, 64, "flash", available={"varlen"})


def test_plan_refuses_bad_lengths_and_names():
    with pytest.raises(ValueError, match="positive"):
        attention.plan([3, 0], "cpu")
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        attention.plan([3], "cpu", backend="fast")
    assert attention.kernel_for([3, 4], "cpu") == "grouped"


def test_set_backend_refuses_unknown_and_unavailable(monkeypatch):
    with pytest.raises(ValueError, match="unknown attention backend 'cudnn'; choose one of auto, sdpa"):
        attention.set_backend("cudnn")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="'varlen' cannot run: needs CUDA"):
            attention.set_backend("varlen")
        with pytest.raises(ValueError, match="'te' cannot run on cuda"):
            attention.set_backend("te", device="cuda", dtype="bfloat16")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "_import_flash", lambda: None)
    with pytest.raises(ValueError, match=r"flash-attn is not installed \(pip install 'mmparity\[flash\]'\)"):
        attention.set_backend("flash")
    monkeypatch.setattr(kernels, "_import_varlen", lambda: (lambda *a, **k: None))
    with pytest.raises(ValueError, match="needs bfloat16 or float16"):
        attention.set_backend("varlen", device="cuda", dtype="float32")
    with pytest.raises(ValueError, match="head dim that is a multiple of 8"):
        attention.check_backend("varlen", "cuda", torch.bfloat16, head_dim=12)
    with pytest.raises(ValueError, match="needs a CUDA device, not 'cpu'"):
        attention.set_backend("varlen", device="cpu", dtype="bfloat16")
    attention.set_backend("varlen", device="cuda", dtype="bfloat16")
    assert attention.get_backend() == "varlen"
    assert attention.describe_backend("cuda").startswith("varlen: torch ")


@pytest.mark.slow
def test_backend_choice_reaches_spawned_processes_through_the_environment(monkeypatch):
    attention.set_backend("math")
    assert attention.get_backend() == "math"
    assert os.environ[attention.ENV_VAR] == "math"
    monkeypatch.setattr(attention, "_backend", None)  # a fresh process: only the environment
    assert attention.get_backend() == "math"
    monkeypatch.setenv(attention.ENV_VAR, "warp")
    with pytest.raises(ValueError, match="unknown attention backend 'warp'"):
        attention.get_backend()


def test_use_backend_restores_the_previous_choice():
    attention.set_backend("sdpa")
    with attention.use_backend("math"):
        assert attention.get_backend() == "math"
    assert attention.get_backend() == "sdpa"
    with pytest.raises(ValueError):
        with attention.use_backend("varlen", device="cpu"):
            pass
    assert attention.get_backend() == "sdpa"


def test_describe_backend_says_what_the_policy_can_run(monkeypatch):
    text = attention.describe_backend("cpu")
    assert text == "auto: equal sizes->sdpa dense, mixed->sdpa per size"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(kernels, "_import_varlen", lambda: (lambda *a, **k: None))
    assert "or varlen (bf16/fp16, head dim multiple of 8)" in attention.describe_backend("cuda")
    assert "varlen" not in attention.describe_backend("cuda", "float32")
    assert "or varlen" in attention.describe_backend("cuda", torch.bfloat16)
    with attention.use_backend("sdpa"):
        assert "varlen" not in attention.describe_backend("cuda", torch.bfloat16)
    with attention.use_backend("math"):
        assert attention.describe_backend("cpu").startswith("math:")


# --- correctness of every CPU kernel ------------------------------------------------------------------

@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("seqlens", SEQLENS, ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)],
                         ids=["fp32", "bf16"])
@pytest.mark.parametrize("groups", [2, 6], ids=["gqa", "mha"])
def test_packed_kernels_match_float64(backend, seqlens, dtype, bound, groups):
    q, k, v = packed_qkv(seqlens, groups=groups, dtype=dtype, seed=len(seqlens))
    scale = 0.7 / math.sqrt(q.shape[-1])  # not the default: the scale must reach the kernel
    expected = reference(q, k, v, seqlens, scale)
    with attention.record_kernels() as used:
        out = attention.packed_attention(q, k, v, seqlens, scale, backend=backend)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out).all()
    assert rel_l2(out, expected) <= bound
    assert list(used) == [attention.plan(seqlens, "cpu", dtype, 8, backend).kernel]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_segments_attend_only_to_themselves(backend):
    seqlens = [5, 9, 5, 3]
    q, k, v = packed_qkv(seqlens)
    out = attention.packed_attention(q, k, v, seqlens, 0.3, backend=backend)
    changed = [x.clone() for x in (q, k, v)]
    for x in changed:
        x[5:14] = x[5:14] * -3.0 + 1.0  # the second segment only
    out2 = attention.packed_attention(*changed, seqlens, 0.3, backend=backend)
    assert torch.equal(out[:5], out2[:5]) and torch.equal(out[14:], out2[14:])
    assert not torch.allclose(out[5:14], out2[5:14])


def test_grouped_handles_non_contiguous_inputs():
    """mcore hands over q/k/v as strided views of the fused QKV projection."""
    seqlens = [4, 6, 4]
    fused = torch.randn(sum(seqlens), 3, 6, 8)
    q, k, v = fused[:, 0], fused[:, 1], fused[:, 2]
    assert not q.is_contiguous()
    out = attention.packed_attention(q, k, v, seqlens, 0.5)
    assert rel_l2(out, reference(q, k, v, seqlens, 0.5)) <= 1e-5


def test_packed_attention_refuses_a_length_mismatch():
    q, k, v = packed_qkv([4, 4])
    with pytest.raises(ValueError, match="sum to 9 but there are 8 tokens"):
        attention.packed_attention(q, k, v, [4, 5], 0.5)


class _Config:
    kv_channels = 8
    hidden_size = 48
    num_attention_heads = 6


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_core_attention_thd_sbhd_and_cross(backend):
    attention.set_backend(backend)
    core = attention.BidirectionalCoreAttention(_Config(), layer_number=1)
    scale = 1 / math.sqrt(8)
    # thd: packed, mixed sizes
    seqlens = [3, 5, 3]
    q, k, v = packed_qkv(seqlens)
    params = attention.make_packed_seq_params(seqlens, "cpu")
    out = core(q, k, v, packed_seq_params=params)
    assert out.shape == (11, 48)
    assert rel_l2(out.view(11, 6, 8), reference(q, k, v, seqlens, scale)) <= 1e-5
    # sbhd: a static batch of 2 sequences of 4
    qs, ks, vs = (x.view(2, 4, x.shape[1], 8).transpose(0, 1) for x in packed_qkv([4, 4]))
    out = core(qs, ks, vs)
    flat = [x.transpose(0, 1).reshape(8, x.shape[2], 8) for x in (qs, ks, vs)]
    expected = reference(*flat, [4, 4], scale).view(2, 4, 48).transpose(0, 1)
    assert out.shape == (4, 2, 48) and rel_l2(out, expected) <= 1e-5
    # cross-attention: 1 probe per item over 5 keys, item 1 masks its last 2 keys (True = masked)
    probe = torch.randn(1, 2, 6, 8)
    keys, values = torch.randn(5, 2, 2, 8), torch.randn(5, 2, 2, 8)
    mask = torch.zeros(2, 1, 1, 5, dtype=torch.bool)
    mask[1, ..., 3:] = True
    out = core(probe, keys, values, attention_mask=mask)
    for b, n in ((0, 5), (1, 3)):
        exp = reference(probe[:, b].expand(n, -1, -1).contiguous(), keys[:n, b], values[:n, b], [n], scale)[0]
        assert rel_l2(out[0, b].view(6, 8), exp) <= 1e-5


def test_record_kernels_counts_per_call():
    q, k, v = packed_qkv([4, 4, 6])
    with attention.record_kernels() as outer:
        attention.packed_attention(q, k, v, [4, 4, 6], 0.5)
        with attention.record_kernels() as inner:
            attention.packed_attention(q, k, v, [7, 7], 0.5)
    assert outer == {"grouped": 1, "dense": 1} and inner == {"dense": 1}


def test_packed_seq_params_keep_lengths_on_the_host():
    params = attention.make_packed_seq_params([3, 5, 2], "cpu")
    assert params.cu_seqlens_q.device.type == "cpu" and params.cu_seqlens_q.tolist() == [0, 3, 8, 10]
    assert params.cu_seqlens_q.dtype == torch.int32 and params.max_seqlen_q == 5
    assert attention.packed_seq_params_seqlens(params) == [3, 5, 2]
    from megatron.core.packed_seq_params import PackedSeqParams

    foreign = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor([0, 2, 7], dtype=torch.int32))
    assert attention.packed_seq_params_seqlens(foreign) == [2, 5]
    with pytest.raises(ValueError, match="positive"):
        attention.make_packed_seq_params([3, 0])


# --- optional kernels' glue, with stand-ins for CUDA-only libraries ----------------------------------

def _fake_varlen(with_scale: bool, with_gqa: bool, calls: list):
    """A varlen_attn stand-in with the given signature that checks what the adapter sends."""

    def check(q, k, v, cu_q, cu_k, max_q, max_k, scale, enable_gqa):
        calls.append({"scale": scale, "enable_gqa": enable_gqa, "kv_heads": k.shape[1]})
        assert cu_q.dtype == torch.int32 and cu_q is cu_k and q.stride(-1) == 1
        lengths = (cu_q[1:] - cu_q[:-1]).tolist()
        assert max_q == max_k == max(lengths)
        if k.shape[1] != q.shape[1]:
            assert enable_gqa, "fewer key/value heads without enable_gqa"
        s = scale if scale is not None else 1 / math.sqrt(q.shape[-1])
        return reference(q, k, v, lengths, s).to(q.dtype)

    if with_scale and with_gqa:
        def fn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
               window_size=(-1, -1), enable_gqa=False):
            return check(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, enable_gqa)
    elif with_scale:
        def fn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None):
            return check(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, False)
    else:
        def fn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
            return check(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, None, False)
    return fn


@pytest.mark.parametrize("with_scale,with_gqa", [(True, True), (True, False), (False, False)],
                         ids=["torch2.13", "scale-only", "torch2.9"])
def test_varlen_adapter_across_signatures(monkeypatch, with_scale, with_gqa):
    calls = []
    monkeypatch.setattr(kernels, "_import_varlen", lambda: _fake_varlen(with_scale, with_gqa, calls))
    kernels._varlen_parameters.cache_clear()
    try:
        seqlens = [5, 9, 5]
        q, k, v = packed_qkv(seqlens, groups=2)
        out = kernels.varlen(q, k, v, seqlens, 0.25)
        assert rel_l2(out, reference(q, k, v, seqlens, 0.25)) <= 1e-5
        assert calls[0]["enable_gqa"] == with_gqa
        assert calls[0]["kv_heads"] == (2 if with_gqa else 6)
        assert calls[0]["scale"] == (0.25 if with_scale else None)
    finally:
        kernels._varlen_parameters.cache_clear()


def test_flash_adapter(monkeypatch):
    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None,
                               causal=False):
        assert dropout_p == 0.0 and not causal and cu_q.dtype == torch.int32
        return reference(q, k, v, (cu_q[1:] - cu_q[:-1]).tolist(), softmax_scale).to(q.dtype)

    monkeypatch.setitem(sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func))
    seqlens = [3, 8]
    q, k, v = packed_qkv(seqlens, groups=3)
    out = kernels.flash(q, k, v, seqlens, 0.4)
    assert rel_l2(out, reference(q, k, v, seqlens, 0.4)) <= 1e-5


def test_transformer_engine_adapter(monkeypatch):
    built = []

    class DotProductAttention(torch.nn.Module):
        def __init__(self, num_attention_heads, kv_channels, num_gqa_groups=None, attention_dropout=0.0,
                     qkv_format="sbhd", attn_mask_type="causal", softmax_scale=None):
            super().__init__()
            built.append((num_attention_heads, kv_channels, num_gqa_groups, qkv_format, attn_mask_type))
            self.scale = softmax_scale

        def forward(self, q, k, v, qkv_format=None, cu_seqlens_q=None, cu_seqlens_kv=None,
                    max_seqlen_q=None, max_seqlen_kv=None):
            assert qkv_format == "thd"
            out = reference(q, k, v, (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).tolist(), self.scale)
            return out.to(q.dtype).reshape(q.shape[0], -1)

    pytorch = types.SimpleNamespace(DotProductAttention=DotProductAttention)
    monkeypatch.setitem(sys.modules, "transformer_engine", types.SimpleNamespace(pytorch=pytorch))
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", pytorch)
    monkeypatch.setattr(kernels, "_te_modules", {})
    seqlens = [6, 2, 6]
    q, k, v = packed_qkv(seqlens, groups=2)
    for _ in range(2):
        out = kernels.te(q, k, v, seqlens, 0.3)
    assert rel_l2(out, reference(q, k, v, seqlens, 0.3)) <= 1e-5
    assert built == [(6, 8, 2, "thd", "padding")]  # one module per shape, reused


# --- end to end ------------------------------------------------------------------------------------------

def test_native_pixtral_agrees_across_cpu_backends():
    from mmparity.models import registry as families
    from mmparity.models.core import inputs
    from mmparity.models.core.inputs import random_like_state

    fam = families.get("pixtral")
    cfg = fam.tiny_config()
    native = fam.build_native(cfg)
    native.load_state_dict(families.get("pixtral").hf_to_mcore(random_like_state(
        fam.build_reference(cfg).state_dict(), 3), cfg)[0])
    sizes = [(16, 24), (40, 8), (16, 24)]
    rows = inputs.packed_rows(inputs.images(sizes, 3, seed=5), 8)
    outs = {}
    with torch.no_grad():
        for backend in CPU_BACKENDS:
            with attention.use_backend(backend), attention.record_kernels() as used:
                outs[backend] = native(rows, imgs_sizes=sizes)
            assert set(used) == {"math" if backend == "math" else "grouped"}
    assert rel_l2(outs["sdpa"], outs["math"]) <= 1e-6 and torch.equal(outs["auto"], outs["sdpa"])


def test_cli_check_attention_backend(tmp_path, capsys):
    from mmparity.cli.main import main

    out = tmp_path / "r.json"
    assert main(["check", "pixtral", "--attention-backend", "math", "--no-components", "--quiet",
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["attention_backend"].startswith("math:")
    capsys.readouterr()
    assert main(["check", "pixtral", "--attention-backend", "warp", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mmparity: error: unknown attention backend 'warp'") and err.count("\n") == 1
    if not torch.cuda.is_available():
        assert main(["check", "pixtral", "--attention-backend", "varlen", "--quiet"]) == 2
        assert "'varlen' cannot run on cpu: needs a CUDA device" in capsys.readouterr().err
