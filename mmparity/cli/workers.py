"""``convert --workers P``: the same command as P ranks on this machine, started as torchrun would
start them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), and watched: the first rank to
fail or die stops the others, and the user hears one line naming it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mmparity.cli.common import EXIT_OK, UsageError

_PREFIX = "mmparity: error: "
_GRACE_S = 10.0  # how long a stopped rank gets to clean up before SIGKILL
_SAME_FAILURE_S = 1.0


def max_workers() -> int:
    """The most ``--workers`` this machine takes: each is an interpreter with torch imported
    (hundreds of MB) and its own buffers, and past the CPUs this process may use they only queue.
    Two per CPU leaves room for ranks waiting on the disk; never fewer than 8."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(8, 2 * cpus)


def signal_name(number: int) -> str:
    """``SIGTERM``, ``SIGRTMIN+3`` (real-time signals have no name of their own), or ``signal 99``."""
    try:
        return signal.Signals(number).name
    except ValueError:
        low, high = getattr(signal, "SIGRTMIN", None), getattr(signal, "SIGRTMAX", None)
        if low is not None and high is not None and low <= number <= high:
            return f"SIGRTMIN+{number - low}"
        return f"signal {number}"


def without_workers(argv: list[str]) -> list[str]:
    """``argv`` with its ``--workers N`` (or ``--workers=N``) removed: each rank's own command."""
    out, skip = [], False
    for token in argv:
        if skip:
            skip = False
        elif token == "--workers":
            skip = True
        elif not token.startswith("--workers="):
            out.append(token)
    return out


def _last_error(stream) -> str:
    stream.seek(0)
    lines = [line.strip() for line in stream.read().decode(errors="replace").splitlines() if line.strip()]
    for line in reversed(lines):
        if line.startswith(_PREFIX):
            return line[len(_PREFIX):]
    return lines[-1] if lines else ""


def _stop(procs, survivors) -> None:
    for rank in survivors:
        if procs[rank].poll() is None:
            procs[rank].send_signal(signal.SIGTERM)
    deadline = time.monotonic() + _GRACE_S
    for rank in survivors:
        try:
            procs[rank].wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            procs[rank].kill()
            procs[rank].wait()


def run(argv: list[str], workers: int, destination: Path) -> int:
    """Runs ``argv`` (a ``convert`` command line without ``--workers``) as ``workers`` ranks."""
    from mmparity.parallel import runtime
    from mmparity.io.fsio.publish import recover_destination

    env = {k: v for k, v in os.environ.items() if k not in runtime.LAUNCHER_VARIABLES}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(runtime.free_port()), WORLD_SIZE=str(workers))
    command = [sys.executable, "-m", "mmparity", *argv]
    errs = [tempfile.TemporaryFile() for _ in range(workers)]
    procs: list[subprocess.Popen] = []
    failure = None
    try:
        for rank in range(workers):
            # Rank 0 speaks for the conversion (its summary); every rank's stderr is kept for the
            # one line a failure gets.
            procs.append(subprocess.Popen(command, env={**env, "RANK": str(rank), "LOCAL_RANK": str(rank)},
                                          stdin=subprocess.DEVNULL,
                                          stdout=None if rank == 0 else subprocess.DEVNULL, stderr=errs[rank]))
        running = set(range(workers))
        while running and failure is None:
            for rank in sorted(running):
                code = procs[rank].poll()
                if code is None:
                    continue
                running.discard(rank)
                if code != 0:
                    failure = (rank, code)
                    break
            time.sleep(0.02)
        if failure is not None:
            # Ranks refusing the same input fail within moments of each other: let them, so that a
            # user error reads as one, not as a rank's.
            deadline = time.monotonic() + _SAME_FAILURE_S
            while time.monotonic() < deadline and any(procs[rank].poll() is None for rank in running):
                time.sleep(0.02)
            _stop(procs, running)
    except BaseException:  # interrupted: no rank outlives the command
        from mmparity.io.fsio import interrupts

        with interrupts.deferred():  # a second Ctrl-C waits for the ranks to stop and their litter to go
            _stop(procs, range(len(procs)))
            recover_destination(destination, quiet=True)
        raise
    if failure is None:
        errs[0].seek(0)
        sys.stderr.write(errs[0].read().decode(errors="replace"))
        return EXIT_OK
    # A rank killed before it could clean up (rank 0 holds the staging directory) leaves litter
    # that the next run would remove: remove it now.
    recover_destination(destination, quiet=True)
    rank, code = failure
    if code < 0:
        raise UsageError(f"convert --workers {workers}: rank {rank} was killed by {signal_name(-code)}; "
                         f"nothing was published ({destination} is as it was)")
    said = [_last_error(stream) for stream in errs]
    if len(set(said)) == 1 and said[0]:  # every rank refused the same thing: it is not about ranks
        raise UsageError(said[0])
    raise UsageError(f"convert --workers {workers}: rank {rank} failed: {said[rank] or f'exit code {code}'}")
