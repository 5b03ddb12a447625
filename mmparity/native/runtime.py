"""Process-group and Megatron parallel-state bring-up, on CPU (gloo) and CUDA (nccl).

mcore's tensor-parallel layers read the global parallel state even at world size 1, so every
native model is built inside :func:`parallel_context` (or after :func:`init_parallel`). A single
process gets an in-memory store, so nothing listens on a port; under ``torchrun`` (RANK and
WORLD_SIZE set) the launcher's rendezvous is used as is.
"""

from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelLayout:
    tp: int
    pp: int
    world_size: int
    rank: int
    backend: str


_layout: ParallelLayout | None = None
_we_created_process_group = False


def default_backend(device: str | torch.device | None = None) -> str:
    device_type = torch.device(device).type if device is not None else (
        "cuda" if torch.cuda.is_available() else "cpu")
    return "nccl" if device_type == "cuda" else "gloo"


def current_layout() -> ParallelLayout | None:
    return _layout


def init_parallel(tp: int = 1, pp: int = 1, *, device: str | torch.device = "cpu",
                  seed: int = 0) -> ParallelLayout:
    """Initialise torch.distributed (if needed) and mcore's model-parallel groups.

    Re-initialising with the same sizes is a no-op; different sizes tear the old groups down first,
    because mcore keeps exactly one global layout.
    """
    global _layout, _we_created_process_group
    from megatron.core import parallel_state

    if _layout is not None and (_layout.tp, _layout.pp) == (tp, pp):
        _seed_everything(seed, device)
        return _layout
    if _layout is not None:
        parallel_state.destroy_model_parallel()
        _layout = None

    backend = default_backend(device)
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend=backend)
        else:
            dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)
        _we_created_process_group = True
    world_size = dist.get_world_size()
    if world_size % (tp * pp) != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor-parallel {tp} x pipeline-parallel {pp}")
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    _seed_everything(seed, device)
    _layout = ParallelLayout(tp=tp, pp=pp, world_size=world_size, rank=dist.get_rank(),
                             backend=backend)
    return _layout


def teardown_parallel() -> None:
    """Destroy mcore's groups and, when this module created it, the default process group."""
    global _layout, _we_created_process_group
    from megatron.core import parallel_state

    if _layout is not None or parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    _layout = None
    if _we_created_process_group and dist.is_initialized():
        dist.destroy_process_group()
    _we_created_process_group = False


@contextlib.contextmanager
def parallel_context(tp: int = 1, pp: int = 1, *, device: str | torch.device = "cpu", seed: int = 0):
    """Parallel state for the duration of a block; an enclosing layout of the same size is reused."""
    previous = _layout
    layout = init_parallel(tp, pp, device=device, seed=seed)
    try:
        yield layout
    finally:
        if previous is None:
            teardown_parallel()
        elif (previous.tp, previous.pp) != (tp, pp):
            init_parallel(previous.tp, previous.pp, device=device, seed=seed)


def _seed_everything(seed: int, device: str | torch.device) -> None:
    torch.manual_seed(seed)
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        # mcore's tensor-parallel RNG tracker only exists for CUDA generators.
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def launched_world_size() -> int:
    """World size set by an outside launcher (torchrun), or 1."""
    return int(os.environ.get("WORLD_SIZE", "1")) if "RANK" in os.environ else 1


def tp_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _spawn_entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
    except BaseException as exc:  # the parent re-raises with the rank attached
        import traceback

        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        teardown_parallel()


def spawn(fn: Callable, world_size: int, *args) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes; return their results.

    Each process sees torchrun-style environment variables, so :func:`init_parallel` rendezvouses
    exactly as it would under ``torchrun``. ``fn`` must be importable (module level).
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    procs = [ctx.Process(target=_spawn_entry, args=(r, world_size, port, fn, args, queue))
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    results: dict[int, object] = {}
    errors: list[str] = []
    for _ in procs:
        rank, status, payload = queue.get()
        if status == "ok":
            results[rank] = payload
        else:
            errors.append(f"rank {rank}: {payload}")
    for proc in procs:
        proc.join()
    if errors:
        raise RuntimeError("spawned ranks failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
