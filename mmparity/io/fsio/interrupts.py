"""Steps that an interrupt must not split: a staging directory made and recorded for cleanup,
a staging directory removed.

Ctrl-C (and SIGTERM / SIGHUP, which the CLI turns into the same ``KeyboardInterrupt``) raises
wherever the interpreter next checks for signals: between ``mkdir`` and the statement that records
the new directory for its ``except`` clause to remove, or halfway through that removal. Either
leaves a staging directory behind. Inside :func:`deferred`, those signals are noted instead, and
raised when the block ends, where whoever made the directory can already remove it.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

__all__ = ["deferred"]

_HELD = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Holds SIGINT, SIGTERM and SIGHUP for the block, each where a Python handler would raise (one
    left to the system's default action still acts at once: nothing could clean up after it
    anyway), and raises what arrived when the block ends, in order, through the handlers that were
    in place. Only the main thread runs signal handlers: elsewhere this does nothing. Keep the
    block short: nothing in it can be interrupted."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    arrived: list[int] = []

    def note(signum, frame):
        arrived.append(signum)

    previous = {}
    for signum in _HELD:
        handler = signal.getsignal(signum)
        if callable(handler):
            previous[signum] = signal.signal(signum, note)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        for signum in dict.fromkeys(arrived):
            signal.raise_signal(signum)  # the handler runs as this returns: the first one raises
