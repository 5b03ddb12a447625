"""What a decode of checkpoint bytes may hand on: a value every walk of it finishes soon.

A pickle makes an object once and refers to it again in two bytes (a memo reference), so a 1 kB
file can hold a list of itself twice nested 60 deep: 120 objects, 2^60 paths. Every walk over a
decoded value (a scan for records of Megatron's classes, a copy, ``repr`` in a message, ``==``,
``json.dumps``) follows paths, not objects, and Python's own recursive walks fail past about a
thousand levels. JSON has no shared references, but its decoder gives up on deep nesting with a
``RecursionError``, and a value just shallow enough to decode can still be too deep for whatever
walks it next. So every decoder of checkpoint bytes (the restricted unpickler, the JSON readers)
hands on only values that pass :func:`check_bounded`: at most a few paths per byte decoded, and at
most :data:`MAX_DEPTH` levels of containers.

What writers make stays far inside both: a DCP index of 70k tensors is 2.3 million paths in 18 MB
of pickle, a manifest or a config is a tree (one path per node), and none nests a dozen levels.
"""

from __future__ import annotations

import enum
import gc
import io
import json
import sys

import torch

from mmparity.io.fsio.errors import CheckpointError, one_line
from mmparity.io.fsio.paths import require_regular_file

__all__ = ["MAX_DEPTH", "check_bounded", "json_value", "read_json_file"]

MAX_DEPTH = 100
PATHS_PER_BYTE = 2
MIN_PATHS = 1 << 20


class _Walked(dict):
    """type -> whether a walk goes into values of that type: not into numbers, strings, tensors,
    nor classes and enum members (which every instance of them refers to, and whose attributes are
    code, not data). Filled per type as decodes meet them."""

    _LEAVES = (str, bytes, bytearray, int, float, complex, type(None), torch.dtype, torch.layout,
               torch.memory_format, torch.Size, torch.Tensor, torch.storage.TypedStorage, torch.UntypedStorage,
               io.IOBase, type, enum.Enum)

    def __missing__(self, kind):
        walked = self[kind] = not issubclass(kind, self._LEAVES)
        return walked


_WALKED = _Walked()


def _references(objects: list) -> list:
    """What ``objects`` refer to, as the garbage collector's traversal lists it (in C, for a whole
    level of a walk at once), with the items of numpy object arrays, which it cannot see."""
    found = gc.get_referents(*objects)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        for array in [item for item in objects if type(item) is numpy.ndarray]:
            if array.dtype.hasobject:
                found += array.ravel().tolist()
    return found


def _refused(where: str, what: str) -> CheckpointError:
    return CheckpointError(f"{where}: {what}; the file is damaged or was made to stall its readers: re-save it "
                           "from its source")


def check_bounded(value, where: str, nbytes: int | None = None, limit: int | None = None) -> None:
    """Refuses ``value`` (``where`` names the file and item) if a walk of it would follow more than
    ``limit`` paths (by default ``PATHS_PER_BYTE`` per byte of the ``nbytes`` it was decoded from,
    at least ``MIN_PATHS``) or go deeper than :data:`MAX_DEPTH`. The walk is breadth first and
    stops at the limit, so this check costs no more than the limit however the value is shaped."""
    if limit is None:
        limit = max(MIN_PATHS, PATHS_PER_BYTE * (nbytes or 0))
    level, paths, depth = [value], 1, 0
    while level:
        depth += 1
        if depth > MAX_DEPTH:
            raise _refused(where, f"containers nested more than {MAX_DEPTH} deep, or one that holds itself "
                                  "(no checkpoint writer makes either)")
        references = _references(level)
        paths += len(references)
        if paths > limit:
            raise _refused(where, f"shared references that a walk of the decoded value would follow more than "
                                  f"{limit} times (a writer's file makes fewer paths than bytes)")
        walked = _WALKED
        level = [item for item in references if walked[type(item)]]


def json_value(text: str | bytes, where: str):
    """``json.loads(text)``, refused in one ``CheckpointError`` naming ``where`` if it is no JSON,
    or nests deeper than :data:`MAX_DEPTH` (which the decoder itself would meet as a
    ``RecursionError`` only far deeper, or not at all)."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise _refused(where, f"JSON nested more than {MAX_DEPTH} deep (no writer nests a dozen)") from None
    check_bounded(value, where, len(text))
    return value


def read_json_file(path, what: str, max_bytes: int):
    """The JSON value of the file ``path`` (``what``: the kind of file, for messages), read only if
    it holds at most ``max_bytes`` (a bound far above any real one: past it the file is not what it
    claims, and is not read into memory), and bounded as :func:`json_value` bounds it."""
    size = require_regular_file(path, what).st_size
    if size > max_bytes:
        raise CheckpointError(f"{path}: {size} bytes, more than the {max_bytes} a {what} may hold; not a real "
                              f"{what}: replace it with the one its checkpoint was saved with")
    try:
        with open(path, "rb") as f:
            data = f.read(max_bytes + 1)
        return json_value(data, f"{path}: unreadable {what}")
    except CheckpointError:
        raise
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: unreadable {what} ({one_line(exc)[:200]})") from None
