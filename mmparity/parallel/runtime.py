"""Process-group and Megatron parallel-state bring-up, on CPU (gloo) and CUDA (nccl).

mcore's tensor-parallel layers read the global parallel state even at world size 1, so every
native model is built inside :func:`parallel_context` (or after :func:`init_parallel`). A single
process gets an in-memory store, so nothing listens on a port; under ``torchrun`` (RANK and
WORLD_SIZE set) the ranks meet on a TCP store at MASTER_ADDR:MASTER_PORT (rank 0's, or the one
torchrun's agent hosts). The launcher's variables are checked first (:func:`launch_env`), and every
rendezvous and collective gives up after :func:`timeout_s` (``MMPARITY_TIMEOUT``, 60 s): a partial
or inconsistent environment, or a rank that never comes, is a one-line :class:`LaunchError`.

Pipeline parallelism: native models ask :func:`is_first_stage` / :func:`is_last_stage` which
pre- and post-process modules to build, and :func:`pipeline_size` / :func:`stage_layer_counts`
how their layer stack is split. :func:`single_stage` builds a sub-model whole on one stage
(LLaVA's vision tower, which Megatron-LM keeps on the first stage with the embedding).
"""

from __future__ import annotations

import contextlib
import os
import queue as queue_module
import random
import socket
import threading
import time
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from mmparity import errors, progress
from mmparity.parallel.axes import Grid


@dataclass(frozen=True)
class ParallelLayout:
    """The parallel state models are built under: the :class:`~mmparity.parallel.axes.Grid` the
    groups were made for (the one record of the sizes), and this process's place in the world."""

    grid: Grid
    world_size: int
    rank: int
    backend: str
    # Layers of the pipelined stack on each stage; None means mcore's even split.
    layer_counts: tuple[int, ...] | None = None

    # The sizes as the models being built read them (``grid.ep``: Megatron's
    # expert_model_parallel_size, so MoE layers built now hold 1/ep of their experts).
    @property
    def tp(self) -> int:
        return self.grid.tp.size

    @property
    def pp(self) -> int:
        return self.grid.pp.size

    @property
    def ep(self) -> int:
        return self.grid.ep.size


_layout: ParallelLayout | None = None
_we_created_process_group = False
_single_stage_depth = 0


def default_backend(device: str | torch.device | None = None) -> str:
    device_type = torch.device(device).type if device is not None else (
        "cuda" if torch.cuda.is_available() else "cpu")
    return "nccl" if device_type == "cuda" else "gloo"


def current_layout() -> ParallelLayout | None:
    return _layout


def _sizes(tp: int | Grid, pp: int, ep: int) -> tuple[int, int, int]:
    """(TP, PP, EP) of a :class:`~mmparity.parallel.axes.Grid`, or of the three sizes given as integers
    (checked here, with this module's own messages)."""
    if isinstance(tp, Grid):
        if (pp, ep) != (1, 1):
            raise ValueError(f"a Grid holds every size: pp={pp!r} and ep={ep!r} must not be given beside it")
        return tp.sizes
    for name, size in (("tensor-parallel", tp), ("pipeline-parallel", pp), ("expert-parallel", ep)):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"{name} size must be a positive integer, got {size!r}")
    return tp, pp, ep


def init_parallel(tp: int | Grid = 1, pp: int = 1, *, ep: int = 1, device: str | torch.device = "cpu",
                  seed: int = 0, layer_counts: Sequence[int] | None = None) -> ParallelLayout:
    """Initialise torch.distributed (if needed) and mcore's model-parallel groups for a
    :class:`~mmparity.parallel.axes.Grid` (or its TP, PP and EP sizes as integers).

    Re-initialising with the same sizes keeps the groups (only ``layer_counts`` is replaced);
    different sizes tear the old groups down first, because mcore keeps exactly one global layout.
    ``layer_counts`` (one count per stage) is how models built afterwards split their pipelined
    layer stack; see :func:`uneven_stage_fields` for which splits mcore can build.

    ``ep`` is Megatron's ``expert_model_parallel_size``, with its default expert TP (= ``tp``):
    the world is ``tp x pp x dp`` ranks and ``ep`` must divide ``dp`` (mcore lays the expert
    groups over ``tp x ep x pp``), so EP 2 needs at least two ranks. MoE layers built afterwards
    hold their EP rank's experts, and their sharded state dicts place them at global offsets.
    """
    global _layout, _we_created_process_group
    from megatron.core import parallel_state

    counts = _checked_layer_counts(layer_counts, tp.pp.size if isinstance(tp, Grid) else pp)
    tp, pp, ep = _sizes(tp, pp, ep)
    grid = Grid.of(tp, pp, ep)
    if _layout is not None and _layout.grid == grid:
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
    if world_size % (tp * pp * ep) != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor-parallel {tp} x pipeline-parallel {pp} x "
            f"expert-parallel {ep}: EP must divide the data-parallel size {world_size // (tp * pp)}")
    # The extra gloo groups are for the distributed optimizer's CPU-side traffic, which nothing
    # here runs; each one costs time to make and to free.
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        create_gloo_process_groups=False)
    _seed_everything(seed, device)
    _layout = ParallelLayout(grid, world_size=world_size, rank=dist.get_rank(), backend=backend,
                             layer_counts=counts)
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
    return _layout.grid.pp.size


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


TIMEOUT_ENV = "MMPARITY_TIMEOUT"
DEFAULT_TIMEOUT_S = 60.0
_timeout_override: float | None = None
# Set in a process :func:`spawn` started: its launcher variables are ours, not the user's.
_spawned_rank = False
# Rendezvous made by this process so far: every rank makes the same sequence, so the count keeps
# the arrival keys of one apart from those of an earlier one on a store that lives on.
_rendezvous_round = 0
# Variables a launcher sets that no process started by :func:`spawn` may inherit.
_LAUNCHER_ONLY = ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT")
# What a launcher (torchrun) sets for each rank: a command that starts its own ranks replaces all.
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK",
                      "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", *_LAUNCHER_ONLY)


class LaunchError(Exception):
    """The launcher's variables are partial or inconsistent, or the ranks they name did not all
    meet within the timeout. One line for the user, naming the variable or the missing ranks."""


class SpawnError(RuntimeError):
    """Ranks started by :func:`spawn` failed; ``failures`` holds one line per rank, cause first."""

    def __init__(self, failures: Sequence[str]):
        self.failures = list(failures)
        super().__init__("spawned ranks failed: " + "; ".join(self.failures))


@dataclass(frozen=True)
class LaunchEnv:
    """A launcher's (torchrun's) environment, checked."""
    rank: int
    world_size: int
    local_rank: int
    master_addr: str | None
    master_port: int | None
    agent_store: bool  # torchrun's agent hosts the store; every rank is a client
    # Which machine this rank runs on, as the launcher numbers them (torchrun's GROUP_RANK, Slurm's
    # SLURM_NODEID), else the host name: ranks with the same node see the same local disks.
    node: str = ""

    @property
    def where(self) -> str:
        return f"{self.master_addr}:{self.master_port}"


def set_timeout(seconds: float | None) -> None:
    """Seconds every rendezvous and collective waits (None: ``MMPARITY_TIMEOUT`` or 60 s)."""
    global _timeout_override
    if seconds is not None and not seconds > 0:
        raise ValueError(f"timeout must be positive, got {seconds}")
    _timeout_override = None if seconds is None else float(seconds)


def timeout_s() -> float:
    """Seconds a rendezvous or a collective waits for the other ranks before giving up."""
    if _timeout_override is not None:
        return _timeout_override
    text = os.environ.get(TIMEOUT_ENV, "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise LaunchError(f"{TIMEOUT_ENV}={text!r} is not a number of seconds above 0: set one "
                          f"(e.g. {TIMEOUT_ENV}=120), or unset it for the default {DEFAULT_TIMEOUT_S:g} s")
    return seconds


def launch_failure(exc: BaseException) -> str | None:
    """The one line to show for a failure of the ranks to meet or to keep together (a
    :class:`LaunchError`, a :class:`SpawnError`, a collective that timed out or lost its peer);
    None for anything else."""
    if isinstance(exc, (LaunchError, SpawnError)):
        return str(exc)
    # gloo's errors are plain RuntimeErrors naming its source file; NCCL's and the stores' are DistErrors.
    if isinstance(exc, dist.DistError) or (isinstance(exc, RuntimeError) and "/gloo/" in str(exc)):
        return (f"a collective between the ranks failed: {one_line_cause(exc)} (another rank stopped or "
                f"died; each collective waits {TIMEOUT_ENV} / --timeout seconds, {DEFAULT_TIMEOUT_S:g} by default)")
    return None


def _unset_hint(names: str = "RANK and WORLD_SIZE") -> str:
    return f"unset {names} to run as one process"


def _int_var(name: str, *, hint: str) -> int:
    text = os.environ[name]
    try:
        return int(text.strip())
    except ValueError:
        raise LaunchError(f"{name}={text!r} is not an integer: {hint}") from None


def launch_env() -> LaunchEnv | None:
    """The launcher's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), checked;
    None when neither RANK nor WORLD_SIZE is set. Raises :class:`LaunchError` naming the variable
    for a partial or inconsistent set."""
    has_rank, has_world = "RANK" in os.environ, "WORLD_SIZE" in os.environ
    if not has_rank and not has_world:
        return None
    if not has_world:
        raise LaunchError("RANK is set but WORLD_SIZE is not: a launcher sets both (torchrun does); "
                          f"{_unset_hint('RANK')}")
    if not has_rank:
        raise LaunchError("WORLD_SIZE is set but RANK is not: a launcher sets both (torchrun does); "
                          f"{_unset_hint('WORLD_SIZE')}")
    hint = f"{_unset_hint()}, or set it as a launcher does"
    world_size = _int_var("WORLD_SIZE", hint=hint)
    rank = _int_var("RANK", hint=hint)
    if world_size < 1:
        raise LaunchError(f"WORLD_SIZE={world_size} must be at least 1: {hint}")
    if not 0 <= rank < world_size:
        raise LaunchError(f"RANK={rank} is out of range for WORLD_SIZE={world_size} (0 to {world_size - 1}): "
                          f"{_unset_hint()}, or give every rank its own RANK below WORLD_SIZE")
    local_rank = 0
    if "LOCAL_RANK" in os.environ:
        local_rank = _int_var("LOCAL_RANK", hint=f"unset LOCAL_RANK (and {_unset_hint()})")
        if local_rank < 0:
            raise LaunchError(f"LOCAL_RANK={local_rank} must not be negative: unset LOCAL_RANK "
                              f"(and {_unset_hint()})")
    addr = os.environ.get("MASTER_ADDR", "").strip() or None
    port_text = os.environ.get("MASTER_PORT", "").strip() or None
    port = None
    if world_size > 1:
        for name, value in (("MASTER_ADDR", addr), ("MASTER_PORT", port_text)):
            if value is None:
                raise LaunchError(f"WORLD_SIZE={world_size} needs MASTER_ADDR and MASTER_PORT (where rank 0's "
                                  f"store listens) and {name} is not set: set it, or {_unset_hint()}")
        try:
            port = int(port_text)
        except ValueError:
            port = -1
        if not 1 <= port <= 65535:
            raise LaunchError(f"MASTER_PORT={port_text!r} is not a port (1 to 65535): set a free port, "
                              f"or {_unset_hint()}")
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    return LaunchEnv(rank, world_size, local_rank, addr, port, agent_store, node_name())


def node_name() -> str:
    """This process's machine among a launch's: torchrun's node rank (two torchrun "nodes" on one
    host are two nodes), Slurm's node number, else the host name."""
    for variable in ("GROUP_RANK", "SLURM_NODEID"):
        value = os.environ.get(variable, "").strip()
        if value:
            return f"{variable}={value}"
    return f"host {socket.gethostname()}"


def _ranks_text(ranks: Sequence[int], world_size: int, verb: str) -> str:
    listed = ", ".join(map(str, ranks))
    return f"rank{'s' if len(ranks) > 1 else ''} {listed} of {world_size} {verb}"


def _rendezvous_failure(env: LaunchEnv, timeout: float, what: str) -> LaunchError:
    tail = ("" if _spawned_rank else
            " (RANK/WORLD_SIZE are set in the environment: unset them to run as one process, "
            "or start every rank)")
    return LaunchError(f"rendezvous at {env.where} timed out after {timeout:g} s: {what}{tail}")


class PollPace:
    """Pauses between polls of something another process will do: short while the wait is young,
    a tenth of the time waited so far after that, never more than ``longest``. A fixed pause puts
    its whole length on every hand-off (a rank waiting 20 ms to see a key set 1 ms after it
    looked), which a conversion of a few hundred milliseconds pays several times over; a long
    wait still polls rarely, so many ranks do not flood the store."""

    def __init__(self, longest: float, shortest: float = 0.0005):
        self.longest, self.shortest = longest, shortest
        self.started = time.monotonic()

    def pause(self, deadline: float | None = None) -> None:
        now = time.monotonic()
        seconds = min(self.longest, max(self.shortest, (now - self.started) / 10))
        if deadline is not None:
            seconds = min(seconds, max(0.0, deadline - now))
        time.sleep(seconds)


def _wait_for_listener(env: LaunchEnv, deadline: float, timeout: float) -> None:
    """Until the store's port accepts a connection (torch's own client would log each retry)."""
    last = ""
    pace = PollPace(0.1)
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            host = "torchrun's agent, which hosts the store," if env.agent_store else "rank 0, which hosts the store,"
            raise _rendezvous_failure(env, timeout, f"{host} never answered"
                                      f"{f' ({last})' if last else ''}")
        try:
            with socket.create_connection((env.master_addr, env.master_port), timeout=min(1.0, left)):
                return
        except OSError as exc:
            last = exc.strerror or type(exc).__name__
            pace.pause(deadline)


def _rendezvous(env: LaunchEnv, timeout: float):
    """The ranks of ``env`` meet on a TCP store: each sets an arrival key and waits for all of
    them, so that a timeout can say which ranks never came. Returns a store for the process group."""
    store, prefix = _meet(env, timeout)
    return dist.PrefixStore(prefix + "pg/", store)


def rendezvous_store(env: LaunchEnv, purpose: str) -> tuple:
    """The ranks of ``env`` meet (as for a process group, with the same one-line failures) and
    share a store, without a process group: for processes that only exchange a few small
    messages. Returns (the store, a function opening another client of it, for a thread of its
    own); the keys are private to ``purpose`` and to this meeting."""
    timeout = timeout_s()
    store, prefix = _meet(env, timeout)
    prefix = f"{prefix}{purpose}/"

    def another_client():
        client = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False,
                               timeout=timedelta(seconds=timeout))
        return dist.PrefixStore(prefix, client)

    return dist.PrefixStore(prefix, store), another_client


def _meet(env: LaunchEnv, timeout: float):
    global _rendezvous_round
    _rendezvous_round += 1
    deadline = time.monotonic() + timeout
    if env.rank == 0 and not env.agent_store:
        try:
            store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=True,
                                  timeout=timedelta(seconds=timeout), wait_for_workers=False,
                                  multi_tenant=True)
        except RuntimeError as exc:
            reason = "address already in use" if "EADDRINUSE" in str(exc) else "the port cannot be listened on"
            raise LaunchError(f"MASTER_PORT={env.master_port}: rank 0 cannot host the store there ({reason}): "
                              f"choose a free MASTER_PORT, or {_unset_hint()}") from None
    else:
        _wait_for_listener(env, deadline, timeout)
        try:
            store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False,
                                  timeout=timedelta(seconds=max(1.0, deadline - time.monotonic())))
        except RuntimeError:
            raise _rendezvous_failure(env, timeout, "the store at MASTER_ADDR:MASTER_PORT did not answer") from None
    prefix = (f"mmparity/rendezvous/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
              f"{_rendezvous_round}/")
    try:
        store.set(f"{prefix}arrived/{env.rank}", "1")
        missing = [r for r in range(env.world_size) if r != env.rank]
        pace = PollPace(0.01)
        while missing:
            # One call for every arrival (true when all are there); which ranks are missing is
            # asked rank by rank only for the message that names them.
            if store.check([f"{prefix}arrived/{r}" for r in missing]):
                break
            if time.monotonic() >= deadline:
                missing = [r for r in missing if not store.check([f"{prefix}arrived/{r}"])]
                if missing:
                    raise _rendezvous_failure(env, timeout, _ranks_text(missing, env.world_size, "never joined"))
            pace.pause()
    except RuntimeError:  # the store went away under us: its host (rank 0 or the agent) died
        raise _rendezvous_failure(env, timeout, "the store's host went away before every rank joined") from None
    return store, prefix


def _init_default_group(backend: str) -> None:
    env = launch_env()
    timeout = timeout_s()
    if env is not None and backend == "nccl":
        torch.cuda.set_device(env.local_rank)
    if env is None or env.world_size == 1:
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1,
                                timeout=timedelta(seconds=timeout))
        return
    store = _rendezvous(env, timeout)
    dist.init_process_group(backend=backend, store=store, rank=env.rank, world_size=env.world_size,
                            timeout=timedelta(seconds=timeout))


def _destroy_all_groups() -> None:
    """`dist.destroy_process_group()`, with the groups' own teardown moved off the caller's thread.

    mcore makes ~18 groups even at world size 1, and freeing a gloo group waits for its transport
    thread to notice (up to 10 ms each, so ~0.1 s in all). Unregistering them is
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
def parallel_context(tp: int | Grid = 1, pp: int = 1, *, ep: int = 1, device: str | torch.device = "cpu",
                     seed: int = 0):
    """Parallel state for the duration of a block (a :class:`~mmparity.parallel.axes.Grid`, or its sizes);
    an enclosing layout of the same size is reused."""
    previous = _layout
    layout = init_parallel(tp, pp, ep=ep, device=device, seed=seed)
    try:
        yield layout
    finally:
        if previous is None:
            teardown_parallel()
        elif previous.grid != layout.grid:
            init_parallel(previous.grid, device=device, seed=seed)


def _seed_everything(seed: int, device: str | torch.device) -> None:
    torch.manual_seed(seed)
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        # mcore's tensor-parallel RNG tracker only exists for CUDA generators.
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def launched_world_size() -> int:
    """World size set by an outside launcher (torchrun), or 1. Raises :class:`LaunchError` for a
    partial or inconsistent launcher environment."""
    env = launch_env()
    return env.world_size if env is not None else 1


def tp_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank()


# A port the kernel picks for bind(0) comes from its ephemeral range, which is also where every
# outgoing connection's local port comes from: on a machine whose other processes open many (a
# gloo mesh opens one per rank pair), one of them can take the port between the choice and the
# store's bind. Below that range only an explicit bind takes a port.
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_PORT_WINDOW = 16384  # how far below the ephemeral range to choose, at most
_LOWEST_PORT = 1025  # never a privileged port
_PORT_TRIES = 64


def _ephemeral_ports() -> tuple[int, int] | None:
    """The kernel's (first, last) ephemeral port, or None where it cannot be read (not Linux)."""
    try:
        with open(EPHEMERAL_RANGE_FILE) as f:
            first, last = (int(field) for field in f.read().split())
    except (OSError, ValueError):
        return None
    return first, last


def _bindable(host: str, port: int) -> bool:
    # Without SO_REUSEADDR, so a port that still has connections in TIME_WAIT is passed over too.
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing is bound to on ``host``, for a rendezvous store to bind shortly after:
    chosen at random below the kernel's ephemeral range where there is room, so that no outgoing
    connection can take it meanwhile, else the kernel's pick. The choice is random from the OS's
    entropy, not ``random``'s state, which forked processes share."""
    span = _ephemeral_ports()
    if span is not None and span[0] - _LOWEST_PORT >= 2:
        low = max(_LOWEST_PORT, span[0] - _PORT_WINDOW)
        draw = random.SystemRandom()
        for _ in range(_PORT_TRIES):
            port = draw.randrange(low, span[0])
            if _bindable(host, port):
                return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


# How long a rank that has sent its result waits for the parent to take it before exiting anyway.
_RESULT_PICKUP_TIMEOUT_S = 300.0


# One line, cause first, for a rank's failure.
one_line_cause = errors.one_line


def _logger_levels() -> dict:
    """The levels set on this process's loggers (e.g. the CLI's, quieting megatron's import chatter)."""
    import logging

    return {name: logger.level for name, logger in logging.root.manager.loggerDict.items()
            if isinstance(logger, logging.Logger) and logger.level != logging.NOTSET}


def _spawn_entry(rank: int, world_size: int, port: int, work: bytes, queue, warning_filters: list,
                 logger_levels: dict, picked_up, timeout: float, environ: dict, cwd: str,
                 forward_progress: bool = False) -> None:
    import logging
    import warnings

    from multiprocessing.reduction import ForkingPickler

    global _spawned_rank
    # A rank forked from the shared server (share_rank_imports) starts in the server's environment
    # and directory, as they were when it started: take the parent's, as a spawned rank has them.
    if os.environ != environ:
        os.environ.clear()
        os.environ.update(environ)
    if os.getcwd() != cwd:
        os.chdir(cwd)
    # A fresh interpreter starts with default filters and logger levels; take the parent's before
    # the work is unpickled, which imports megatron (the CLI silences the optional-kernel warnings
    # it prints on import, once per rank otherwise).
    warnings.filters[:] = warning_filters
    for name, level in logger_levels.items():
        logging.getLogger(name).setLevel(level)
    # Our own launcher variables, whatever the parent's environment held (a torchrun agent's
    # store is not where these ranks meet).
    for name in _LAUNCHER_ONLY:
        os.environ.pop(name, None)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    _spawned_rank = True
    set_timeout(timeout)
    torch.set_num_threads(1)
    try:
        fn, args = ForkingPickler.loads(work)
        # The parent shows where its ranks are (mmparity.progress): a rank's steps go to it.
        with (progress.listen(lambda text, where: queue.put((rank, "progress", text))) if forward_progress
              else contextlib.nullcontext()):
            result = fn(rank, world_size, *args)
        queue.put((rank, "ok", result))
        # Tensors in the result travel as handles to this process's memory (shared-memory file
        # descriptors, CUDA IPC), served by this process: it must outlive the parent's unpickling.
        picked_up.wait(_RESULT_PICKUP_TIMEOUT_S)
    except BaseException as exc:  # the parent re-raises with the rank attached
        kind = "launch" if isinstance(exc, LaunchError) else "error"
        queue.put((rank, kind, str(exc) if kind == "launch" else one_line_cause(exc)))
    finally:
        teardown_parallel()


_shared_imports: tuple[str, ...] | None = None


def share_rank_imports(modules: Sequence[str]) -> None:
    """Start the ranks of every later :func:`spawn` by forking one server process that imported
    ``modules`` once, instead of each rank importing them afresh (megatron-core alone costs a rank
    about 8 CPU-seconds). For a process that launches ranks many times, as a test suite does; a
    rank still gets the parent's environment, directory and warning filters as they are at the
    call. The server starts at the next spawn and lives as long as this process."""
    global _shared_imports
    _shared_imports = tuple(modules)


def spawn(fn: Callable, world_size: int, *args) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` fresh processes; return their results.

    Each process sees torchrun-style environment variables, so :func:`init_parallel` rendezvouses
    exactly as it would under ``torchrun``. ``fn`` must be importable (module level). When a rank
    fails (or dies without a word) the others are stopped: under pipeline parallelism they would
    otherwise wait forever for activations the failed rank will never send.
    """
    import warnings
    from multiprocessing.reduction import ForkingPickler

    import torch.multiprocessing as mp

    if _shared_imports is None:
        ctx = mp.get_context("spawn")
    else:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(_shared_imports))
    results_queue = ctx.Queue()
    picked_up = ctx.Event()
    port = free_port()
    timeout = timeout_s()
    # The work travels pickled apart (once per rank: a shared tensor's handle is taken once), so
    # that a rank unpickles it, and imports what it needs, only once quieted like this process.
    procs = [ctx.Process(target=_spawn_entry,
                         args=(r, world_size, port, bytes(ForkingPickler.dumps((fn, args))), results_queue,
                               list(warnings.filters), _logger_levels(), picked_up, timeout, dict(os.environ),
                               os.getcwd(), progress.listening()))
             for r in range(world_size)]
    for proc in procs:
        proc.start()
    results: dict[int, object] = {}
    errors: list[str] = []
    launch_failed = False
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
            if status == "progress":
                progress.step(payload, f"rank {rank}")
            elif status == "ok":
                results[rank] = payload
            else:
                errors.append(f"rank {rank}: {payload}")
                launch_failed = status == "launch"
                break
    finally:
        picked_up.set()
        if errors:
            for proc in procs:
                if proc.is_alive():
                    proc.terminate()
        for proc in procs:
            proc.join()
    if launch_failed:
        raise LaunchError(f"spawned {errors[0]}")
    if errors:
        raise SpawnError(errors)
    return [results[r] for r in range(world_size)]
