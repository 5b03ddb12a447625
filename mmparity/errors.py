"""The errors every layer raises, and exceptions from torch, DCP and Megatron reduced to one line.

:class:`ConversionError` lists every reason a conversion cannot be total (the rule engine, the
parallel splits and the formats raise it); :class:`ConvertError` is why a conversion on disk cannot
be done, in one line (the CLI prints it). Both live here, below every layer that raises them.

DCP wraps each rank's failure in a ``CheckpointException`` whose text is every rank's traceback
flattened; Megatron and torch chain exceptions several deep. A user is told the innermost cause
(an allocation that cannot succeed, a refused pickle), never a traceback.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

__all__ = ["ConversionError", "ConvertError", "problems_line", "from_conversion_error", "root_cause", "one_line",
           "MAX_CHARS"]

MAX_CHARS = 600
# How many problems a one-line message shows before counting the rest.
MAX_PROBLEMS_SHOWN = 4


class ConversionError(ValueError):
    """Every reason a conversion cannot be total, listed at once."""

    def __init__(self, title: str, problems: Sequence[str]):
        self.title = title
        self.problems = list(problems)
        shown = self.problems[:60]
        more = len(self.problems) - len(shown)
        body = "\n".join(f"  - {p}" for p in shown) + (f"\n  … and {more} more" if more > 0 else "")
        super().__init__(f"{title} ({len(self.problems)} problem(s)):\n{body}")

    def line(self, shown: int = 4) -> str:
        """The same as one line, as a user error is printed: the title, the first ``shown``
        problems, how many more (the multi-line ``str`` lists them all, for the Python API)."""
        first = "; ".join(" ".join(p.split()) for p in self.problems[:shown])
        more = len(self.problems) - shown
        return f"{self.title}: {first}" + (f" (+{more} more)" if more > 0 else "")


class ConvertError(Exception):
    """Why a conversion cannot be done, in one line (the CLI prints it and exits 2)."""


def problems_line(title: str, problems: Sequence[str]) -> str:
    """``title: first; second; ... (+N more)``, each problem's whitespace collapsed."""
    shown = "; ".join(" ".join(p.split()) for p in problems[:MAX_PROBLEMS_SHOWN])
    more = len(problems) - MAX_PROBLEMS_SHOWN
    return f"{title}: {shown}" + (f" (+{more} more)" if more > 0 else "")


def from_conversion_error(exc: ConversionError, where: str = "") -> ConvertError:
    return ConvertError(problems_line(f"{where}{exc.title}", exc.problems))

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
