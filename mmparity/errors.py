"""Exceptions from torch, DCP and Megatron reduced to one line, cause first.

DCP wraps each rank's failure in a ``CheckpointException`` whose text is every rank's traceback
flattened; Megatron and torch chain exceptions several deep. A user is told the innermost cause
(an allocation that cannot succeed, a refused pickle), never a traceback.
"""

from __future__ import annotations

import re

__all__ = ["root_cause", "one_line", "MAX_CHARS"]

MAX_CHARS = 600

# A traceback pasted into a message ("Traceback (most recent call last): File ..., line N, in f ...").
_TRACEBACK = re.compile(r"Traceback \(most recent call last\):.*?(?=\b[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit)\b: |\Z)",
                        re.S)
_ALLOCATION = re.compile(r"(?:can't allocate memory|not enough memory|out of memory).*?allocate (\d+) bytes", re.I | re.S)


def _wrapped(exc: BaseException) -> BaseException | None:
    """The exception DCP's ``CheckpointException`` carries for its first failed rank, if any."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = failures[min(failures)]  # (exception, its traceback frames)
        inner = first[0] if isinstance(first, tuple) and first else getattr(first, "exc", first)
        if isinstance(inner, BaseException):
            return inner
    return None


def root_cause(exc: BaseException) -> BaseException:
    """The innermost exception behind ``exc``: through DCP's per-rank wrappers, ``raise … from``
    chains and the exception another one was raised while handling (unless suppressed)."""
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        inner = _wrapped(exc) or exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
        if inner is None:
            break
        exc = inner
    return exc


def _text(exc: BaseException) -> str:
    text = str(exc).split("Exception raised from")[0]  # torch's C++ errors append their frames
    text = _TRACEBACK.sub("", text)
    text = " ".join(line.strip() for line in text.splitlines()
                    if line.strip() and not line.strip().startswith(("Traceback (most recent", 'File "')))
    allocation = _ALLOCATION.search(text)
    if allocation:
        text = f"cannot allocate {int(allocation.group(1)) / 1e9:.1f} GB ({text})"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def one_line(exc: BaseException, limit: int = MAX_CHARS) -> str:
    """``exc``'s root cause as one line: ``Type: message``, traceback and C++ frame text removed,
    whitespace collapsed, an impossible allocation said in GB; what it was raised as in brackets
    (unless that is only DCP's per-rank wrapper); cut to ``limit`` characters."""
    cause = root_cause(exc)
    line = _text(cause)
    if cause is not exc and _wrapped(exc) is None:
        line = f"{line} (raised as {_text(exc)})"
    return line if len(line) <= limit else line[: limit - 3] + "..."
