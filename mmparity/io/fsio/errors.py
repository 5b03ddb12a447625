"""The one error of the disk layer, and how its one-line messages list names."""

from __future__ import annotations

from collections.abc import Iterable


class CheckpointError(ValueError):
    """A checkpoint cannot be read or written as asked. The message is one line and names the path."""


# How many offending names an error message lists before summarising the rest; keeps one-line
# messages readable for checkpoints with thousands of tensors.
MAX_NAMES_IN_MESSAGE = 8


def name_list(names: Iterable[str]) -> str:
    names = sorted(names)
    shown = ", ".join(names[:MAX_NAMES_IN_MESSAGE])
    hidden = len(names) - MAX_NAMES_IN_MESSAGE
    return f"{shown} (+{hidden} more)" if hidden > 0 else shown


def one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())
