"""Fault injection (tests only).

`MMPARITY_FAULT` makes a writer die or stop at a chosen point, so tests can check the publishing
invariant at every point of a real conversion: comma-separated `kill@N` (SIGKILL at the N-th point
reached), `kill@NAME` (at the first point of that name: staged, tensor, shared (a rank of several
sent its records), node-publish (another node's first rank, told to publish with --node-local),
synced, aside, published, removed), `pause@N` / `pause@NAME` (sleep there until a signal arrives), `noexchange` (publish as
on a filesystem without RENAME_EXCHANGE). `MMPARITY_FAULT_RANK=R` limits them to the process whose
`RANK` is R (one rank of several writing one checkpoint). Unset, a point is one counter increment."""

from __future__ import annotations

import os
import signal
import time


_FAULTS = (frozenset(filter(None, os.environ.get("MMPARITY_FAULT", "").split(",")))
           if os.environ.get("MMPARITY_FAULT_RANK", os.environ.get("RANK")) == os.environ.get("RANK") else frozenset())
_fault_points_reached = 0


def fault_point(name: str) -> None:
    global _fault_points_reached
    if not _FAULTS:
        return
    _fault_points_reached += 1
    for action in ("kill", "pause"):
        if f"{action}@{_fault_points_reached}" in _FAULTS or f"{action}@{name}" in _FAULTS:
            if action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            while True:
                time.sleep(3600)


def injected(fault: str) -> bool:
    """Whether `MMPARITY_FAULT` names `fault` (e.g. `noexchange`)."""
    return fault in _FAULTS
