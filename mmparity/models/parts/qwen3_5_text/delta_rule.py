"""The gated delta rule in plain torch, and the choice between it and the fla kernel.

One Gated DeltaNet head keeps a ``[d_k, d_v]`` state ``S``; at token ``t`` it decays the state by
``exp(g_t)``, writes the part of ``v_t`` the state does not already predict from ``k_t`` at rate
``beta_t`` (the delta rule: ``u_t = beta_t (v_t - Sᵀ k_t)``, ``S += k_t u_tᵀ``) and reads
``o_t = Sᵀ q_t``, with ``q`` scaled by ``d_k^-1/2``. :func:`recurrent_gated_delta_rule` runs that
token by token; :func:`chunked_gated_delta_rule` computes the same in chunks: within a chunk the
writes ``U`` solve the unit lower-triangular system ``(I + A) U = beta V - beta e^γ K S0`` (``A`` the
decayed ``beta_i k_i·k_j``, ``γ`` the running log decay), so a chunk costs a triangular solve and a
few matmuls, and only the state crosses chunks. Both work in fp32 and take ``[batch, seq, heads,
dim]`` tensors whose query/key heads are already repeated to the value heads, as megatron-core's
``GatedDeltaNet`` hands its kernel (queries and keys already l2-normalised).

The fla kernel (``fla.ops.gated_delta_rule.chunk_gated_delta_rule``), where it is installed and the
tensors are on a GPU, is what megatron-core runs; :func:`kernel_for` says which one a layer uses.
"""

from __future__ import annotations

import importlib.util

import torch

TORCH_CHUNKED = "torch-chunked"
FLA = "fla"
CHUNK = 64


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """fla's ``l2norm`` (``x / sqrt(|x|² + eps)`` over the last dim), computed in fp32."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.square().sum(-1, keepdim=True) + eps)).to(x.dtype)


def _heads_first(*tensors):
    return [t.transpose(1, 2).float() for t in tensors]


def recurrent_gated_delta_rule(q, k, v, g, beta) -> torch.Tensor:
    """The rule token by token (the reference the chunked form is tested against)."""
    dtype = q.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    q = q * q.shape[-1] ** -0.5
    b, h, s, dk = k.shape
    state = q.new_zeros(b, h, dk, v.shape[-1])
    out = torch.empty_like(v)
    for t in range(s):
        state = state * g[:, :, t].exp()[..., None, None]
        kt = k[:, :, t]
        write = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhkv,bhk->bhv", state, kt))
        state = state + kt[..., :, None] * write[..., None, :]
        out[:, :, t] = torch.einsum("bhkv,bhk->bhv", state, q[:, :, t])
    return out.transpose(1, 2).to(dtype)


def chunked_gated_delta_rule(q, k, v, g, beta, chunk: int = CHUNK) -> torch.Tensor:
    """The rule chunk by chunk (see the module note)."""
    dtype = q.dtype
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    q = q * q.shape[-1] ** -0.5
    b, h, s, dk = k.shape
    dv = v.shape[-1]
    pad = -s % chunk
    if pad:
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (torch.nn.functional.pad(t, (0, pad)) for t in (g, beta))
    n = (s + pad) // chunk
    q, k, v = (t.reshape(b, h, n, chunk, -1) for t in (q, k, v))
    g, beta = g.reshape(b, h, n, chunk), beta.reshape(b, h, n, chunk)
    gamma = g.cumsum(-1)  # log decay from the chunk's start, through each position
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # exp(γ_i - γ_j) where j <= i; zero above the diagonal (masked before exp: no overflow).
    decay = (gamma[..., :, None] - gamma[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    kk = (k @ k.transpose(-1, -2)) * decay * beta[..., :, None]
    # Only the strict lower triangle is read: the diagonal is taken as ones.
    writes = torch.linalg.solve_triangular(kk, v * beta[..., None], upper=False, unitriangular=True)
    reads = torch.linalg.solve_triangular(kk, k * (beta * gamma.exp())[..., None], upper=False,
                                          unitriangular=True)
    within = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * gamma.exp()[..., None]
    k_to_end = k * (gamma[..., -1:] - gamma).exp()[..., None]
    state = q.new_zeros(b, h, dk, dv)
    out = torch.empty_like(v)
    for c in range(n):
        u = writes[:, :, c] - reads[:, :, c] @ state
        out[:, :, c] = q_decayed[:, :, c] @ state + within[:, :, c] @ u
        state = state * gamma[:, :, c, -1].exp()[..., None, None] + k_to_end[:, :, c].transpose(-1, -2) @ u
    out = out.reshape(b, h, n * chunk, dv)[:, :, :s]
    return out.transpose(1, 2).contiguous().to(dtype)


def fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


def kernel_for(device: torch.device) -> str:
    """The kernel a layer on ``device`` runs: fla's on a GPU where it is installed, else torch's."""
    return FLA if torch.device(device).type == "cuda" and fla_available() else TORCH_CHUNKED


def gated_delta_rule(kernel: str, q, k, v, g, beta) -> torch.Tensor:
    if kernel == FLA:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        out, _ = chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=None,
                                        output_final_state=False, use_qk_l2norm_in_kernel=False)
        return out
    return chunked_gated_delta_rule(q, k, v, g, beta)
