"""Where long work is, said by the code doing it and shown by whoever listens.

The harness says which case it runs, a spawned rank which case it is at (``parallel.runtime``
forwards a rank's steps to its parent), ``verify --load`` what each rank builds and loads. Nothing
listens unless a caller does (the CLI, when its stderr is a terminal): then a step costs a call, and
otherwise nothing; the code saying it never prints.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Optional

# (text, where): where is "" for this process, "rank N" for a spawned rank's step.
Listener = Callable[[str, str], None]

_listener: Optional[Listener] = None


def step(text: str, where: str = "") -> None:
    """The work now under way, in a few words (``case 2/4 images-3``)."""
    if _listener is not None:
        _listener(text, where)


def listening() -> bool:
    return _listener is not None


@contextlib.contextmanager
def listen(listener: Listener) -> Iterator[None]:
    """Steps go to ``listener`` for the block; the one before is restored after it."""
    global _listener
    previous, _listener = _listener, listener
    try:
        yield
    finally:
        _listener = previous
