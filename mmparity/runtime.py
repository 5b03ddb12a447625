"""Process-group and Megatron parallel-state bring-up, on CPU (gloo) and CUDA (nccl).

mcore's tensor-parallel layers read the global parallel state even at world size 1, so every
native model is built inside :func:`parallel_context` (or after :func:`init_parallel`). A single
process gets an in-memory store, so nothing listens on a port; under ``torchrun`` (RANK and
WORLD_SIZE set) the launcher's rendezvous is used as is.

Pipeline parallelism: native models ask :func:`is_first_stage` / :func:`is_last_stage` which
pre- and post-process modules to build, and :func:`pipeline_size` / :func:`stage_layer_counts`
how their layer stack is split. :func:`single_stage` builds a sub-model whole on one stage
(LLaVA's vision tower, which Megatron-LM keeps on the first stage with the embedding).
"""

from __future__ import annotations

import contextlib
import os
import queue as queue_module
import socket
import threading
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelLayout:
    tp: int
    pp: int
    world_size: int
    rank: int
    backend: str
    # Layers of the pipelined stack on each stage; None means mcore's even split.
    layer_counts: tuple[int, ...] | None = None


_layout: ParallelLayout | None = None
_we_created_process_group = False
_single_stage_depth = 0


def default_backend(device: str | torch.device | None = None) -> str:
    device_type = torch.device(device).type if device is not None else (
        "cuda" if torch.cuda.is_available() else "cpu")
    return "nccl" if device_type == "cuda" else "gloo"


def current_layout() -> ParallelLayout | None:
    return _layout


def init_parallel(tp: int = 1, pp: int = 1, *, device: str | torch.device = "cpu",
                  seed: int = 0, layer_counts: Sequence[int] | None = None) -> ParallelLayout:
    """Initialise torch.distributed (if needed) and mcore's model-parallel groups.

    Re-initialising with the same sizes keeps the groups (only ``layer_counts`` is replaced);
    different sizes tear the old groups down first, because mcore keeps exactly one global layout.
    ``layer_counts`` (one count per stage) is how models built afterwards split their pipelined
    layer stack; see :func:`uneven_stage_fields` for which splits mcore can build.
    """
    global _layout, _we_created_process_group
    from megatron.core import parallel_state

    counts = _checked_layer_counts(layer_counts, pp)
    if _layout is not None and (_layout.tp, _layout.pp) == (tp, pp):
        _seed_everything(seed, device)
        if _layout.layer_counts != counts:
            _layout = replace(_layout, layer_counts=counts)
        return _layout
    if _layout is not None:
        parallel_state.destroy_model_parallel()
        _layout = None

    backend = default_backend(device)
    if not dist.is_initialized():
        _init_default_group(backend)
        _we_created_process_group = True
    world_size = dist.get_world_size()
    if world_size % (tp * pp) != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor-parallel {tp} x pipeline-parallel {pp}")
    # The extra gloo groups are for the distributed optimizer's CPU-side traffic, which nothing
    # here runs; each one costs time to make and to free.
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, create_gloo_process_groups=False)
    _seed_everything(seed, device)
    _layout = ParallelLayout(tp=tp, pp=pp, world_size=world_size, rank=dist.get_rank(),
                             backend=backend, layer_counts=counts)
    return _layout


def _checked_layer_counts(layer_counts: Sequence[int] | None, pp: int) -> tuple[int, ...] | None:
    if layer_counts is None:
        return None
    counts = tuple(int(c) for c in layer_counts)
    if len(counts) != pp or any(c < 1 for c in counts):
        raise ValueError(f"layer_counts {list(counts)} must give every one of the {pp} pipeline "
                         "stages at least one layer")
    return counts


def uneven_stage_fields(layer_counts: Sequence[int]) -> dict:
    """``TransformerConfig`` fields under which mcore builds exactly ``layer_counts`` per stage.

    mcore can make only the first and / or the last stage differ from the rest (its
    ``num_layers_in_first_pipeline_stage`` / ``num_layers_in_last_pipeline_stage``); anything else
    raises ``ValueError`` naming the split.
    """
    counts = [int(c) for c in layer_counts]
    if len(set(counts)) <= 1:
        return {}
    if len(set(counts[1:])) == 1:
        return {"num_layers_in_first_pipeline_stage": counts[0]}
    if len(set(counts[:-1])) == 1:
        return {"num_layers_in_last_pipeline_stage": counts[-1]}
    if len(set(counts[1:-1])) == 1:
        return {"num_layers_in_first_pipeline_stage": counts[0],
                "num_layers_in_last_pipeline_stage": counts[-1]}
    raise ValueError(f"per-stage layer counts {counts} cannot be built by mcore, which can only "
                     "make the first and the last pipeline stage differ from the others")


@contextlib.contextmanager
def single_stage():
    """Build the modules inside whole, as if there were no pipeline: every layer of their stacks,
    their pre- and post-process parts. For a sub-model that lives entirely on one stage."""
    global _single_stage_depth
    _single_stage_depth += 1
    try:
        yield
    finally:
        _single_stage_depth -= 1


def pipeline_size() -> int:
    """Pipeline stages that models built now are split over (1 inside :func:`single_stage`)."""
    if _single_stage_depth or _layout is None:
        return 1
    return _layout.pp


def pipeline_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_pipeline_model_parallel_rank() if pipeline_size() > 1 else 0


def is_first_stage() -> bool:
    """Whether models built now own their pre-process modules (embeddings, pre-norm)."""
    return pipeline_rank() == 0


def is_last_stage() -> bool:
    """Whether models built now own their post-process modules (final norms, heads, mergers)."""
    return pipeline_rank() == pipeline_size() - 1


def stage_layer_counts() -> tuple[int, ...] | None:
    """The per-stage split of the pipelined layer stack, or None for mcore's even split."""
    return _layout.layer_counts if pipeline_size() > 1 else None


def _init_default_group(backend: str) -> None:
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)
    else:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1)


def _destroy_all_groups() -> None:
    """`dist.destroy_process_group()`, with the groups' own teardown moved off the caller's thread.

    mcore makes ~18 groups even at world size 1, and freeing a gloo group waits for its transport
    thread to notice (up to 10 ms each, ~0.1 s in all, measured here). Unregistering them is
    instant; the last references go to a thread that frees them while the caller goes on (the
    frees release the GIL). The thread is not a daemon, so the interpreter waits for it at exit.
    """
    registry = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    # Only gloo's frees are known to be safe next to a new group being made: NCCL communicators
    # are torn down where they are released, as torch does it.
    groups = list(registry) if isinstance(registry, dict) and dist.get_backend() == "gloo" else []
    dist.destroy_process_group()
    if groups:
        threading.Thread(target=_free_groups, args=(groups,), name="mmparity-free-groups").start()


def _free_groups(groups: list) -> None:
    while groups:
        groups.pop()


def teardown_parallel() -> None:
    """Destroy mcore's groups and, when this module created it, the default process group."""
    global _layout, _we_created_process_group
    from megatron.core import parallel_state

    if _layout is not None or parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    _layout = None
    if _we_created_process_group and dist.is_initialized():
        _destroy_all_groups()
    _we_created_process_group = False


@contextlib.contextmanager
def process_group(device: str | torch.device = "cpu"):
    """torch.distributed's default group for a block, without mcore's model-parallel groups.

    For collective work that builds no model (writing a checkpoint whose sharded state dict is
    already made). An initialised group is used as is and left alone; one made here is destroyed
    at the end.
    """
    if dist.is_initialized():
        yield
        return
    _init_default_group(default_backend(device))
    try:
        yield
    finally:
        if dist.is_initialized():
            _destroy_all_groups()


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


# How long a rank that has sent its result waits for the parent to take it before exiting anyway.
_RESULT_PICKUP_TIMEOUT_S = 300.0


def _spawn_entry(rank: int, world_size: int, port: int, fn: Callable, args: tuple, queue,
                 warning_filters: list, picked_up) -> None:
    import warnings

    # A fresh interpreter starts with default filters; keep the parent's (the CLI silences the
    # optional-kernel warnings megatron prints on import, once per rank otherwise).
    warnings.filters[:] = warning_filters
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
        # Tensors in the result travel as handles to this process's memory (shared-memory file
        # descriptors, CUDA IPC), served by this process: it must outlive the parent's unpickling.
        picked_up.wait(_RESULT_PICKUP_TIMEOUT_S)
    except BaseException as exc:  # the parent re-raises with the rank attached
        import traceback

        queue.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        teardown_parallel()


def spawn(fn: Callable, world_size: int, *args) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes; return their results.

    Each process sees torchrun-style environment variables, so :func:`init_parallel` rendezvouses
    exactly as it would under ``torchrun``. ``fn`` must be importable (module level). When a rank
    fails (or dies without a word) the others are stopped: under pipeline parallelism they would
    otherwise wait forever for activations the failed rank will never send.
    """
    import warnings

    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results_queue = ctx.Queue()
    picked_up = ctx.Event()
    port = free_port()
    procs = [ctx.Process(target=_spawn_entry,
                         args=(r, world_size, port, fn, args, results_queue, list(warnings.filters), picked_up))
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    results: dict[int, object] = {}
    errors: list[str] = []
    try:
        while len(results) + len(errors) < world_size:
            try:
                rank, status, payload = results_queue.get(timeout=1.0)
            except queue_module.Empty:
                silent = [r for r, proc in enumerate(procs)
                          if r not in results and proc.exitcode not in (None, 0)]
                if silent:
                    errors.extend(f"rank {r}: exited with code {procs[r].exitcode} without a result"
                                  for r in silent)
                    break
                continue
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"rank {rank}: {payload}")
                break
    finally:
        picked_up.set()
        if errors:
            for proc in procs:
                if proc.is_alive():
                    proc.terminate()
        for proc in procs:
            proc.join()
    if errors:
        raise RuntimeError("spawned ranks failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world_size)]
