"""What megatron-core's multi-latent attention and MoE layers need to run here, whoever builds
them: the two corrections megatron-core 0.16 needs to run those layers without Transformer Engine
(made on import), and the host placement of the buffers they put on
``torch.cuda.current_device()``. The DeepSeek-V3 part's recipe of their config is its own
(:mod:`mmparity.models.parts.deepseek_v3.config`).
"""

from __future__ import annotations

import contextlib
import importlib.util

import torch


def _without_transformer_engine() -> None:
    """mcore's import guards misfire when Transformer Engine is absent. 0.16: its extensions
    module subclasses a ``MagicMock`` stand-in, so ``multi_latent_attention`` believes TE is
    there and checks ``isinstance`` against a mock, and ``moe_utils`` never defines the
    ``te_general_gemm`` name its router GEMM tests. Tell both modules the truth."""
    if importlib.util.find_spec("transformer_engine") is not None:
        return
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.moe import moe_utils

    multi_latent_attention.HAVE_TE = False
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    if getattr(multi_latent_attention, "Linear", None) is None:
        # 0.19 imports the replicated linear it accepts for the down projections only beside TE,
        # though the class needs no TE: without it MLA refuses every replicated down projection.
        from megatron.core.post_training.modelopt.layers import Linear

        multi_latent_attention.Linear = Linear


_without_transformer_engine()

@contextlib.contextmanager
def host_placement(device: torch.device | str):
    """mcore's router and YaRN table put buffers on ``torch.cuda.current_device()`` (at build and
    on first forward), whatever device the model is on; for a model on the CPU (or on the meta
    device, where the converter plans torch_dist files) that call must name the CPU. Elsewhere
    nothing changes."""
    if torch.device(device).type not in ("cpu", "meta"):
        yield
        return
    saved = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = saved
