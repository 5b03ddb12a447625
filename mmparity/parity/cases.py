"""Framework-free description of one parity input case, shared by both sides of a family."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Case:
    """``name`` identifies the check; ``data`` holds plain tensors and lists both sides read."""

    name: str
    data: dict
    outputs: tuple = ("last_hidden_state",)
    description: str = ""


# Extracts a canonical (tokens, features) tensor from a hooked module's output for one case.
Extractor = Callable[[Any, Case], Any]


@dataclass
class Pair:
    """One module on one side whose output is compared with its counterpart of the same ``name``."""

    name: str
    module: Any
    extract: Extractor = field(default=None)


def first_tensor(output):
    while isinstance(output, (tuple, list)):
        output = output[0]
    if hasattr(output, "last_hidden_state"):
        output = output.last_hidden_state
    return output


def tokens_2d(output, case: Case):
    """Any (…, features) tensor -> (tokens, features) in its stored order."""
    t = first_tensor(output)
    return t.reshape(-1, t.shape[-1])


def sbh_tokens_2d(output, case: Case):
    """mcore layer outputs are [seq, batch, hidden]: batch-major before flattening."""
    t = first_tensor(output)
    return t.transpose(0, 1).reshape(-1, t.shape[-1])
