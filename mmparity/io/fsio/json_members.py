"""A JSON object decoded one member at a time, and a member's array one item at a time.

``json.loads`` builds the whole tree before the first node can be dropped, and keeps every key it
saw until the end. For the large JSON files a checkpoint has (a safetensors header of 70k tensors,
our own manifest's 70k records) that is tens of MB of small objects for records of a few MB; and
the records made while the tree is alive are scattered among its objects, so the interpreter's
small-object arenas stay pinned after the tree is gone (measured: 46 MB still resident after the
first read of a one-file checkpoint of 70k tensors, 111 MB after reading a 30 MB manifest). Member
by member, each node is dropped before the next is made.

The grammar is JSON's; values are decoded by the standard decoder (``raw_decode``), so what one
accepts (numbers, escapes, NaN) the other does too. A key given twice is refused: ``json.loads``
keeps the last one silently. A value nested past the decoder's limit is a ``ValueError`` like any
other malformed JSON; one nested less deep is decoded, and a caller that keeps it (rather than
taking typed fields out of it) bounds it with ``bounded.check_bounded``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Iterator

__all__ = ["object_members"]

# What JSON allows between tokens (a safetensors header is also padded with it to 8 bytes).
_SPACE = re.compile(r"[ \t\n\r]*")
_raw_decode = json.JSONDecoder().raw_decode


def _value_at(text: str, at: int) -> tuple[object, int]:
    try:
        return _raw_decode(text, at)
    except RecursionError:  # the decoder's own limit on nesting, far past any writer's
        raise ValueError(f"a value nested too deep at character {at}") from None


def _skip(text: str, at: int) -> int:
    return _SPACE.match(text, at).end()


def _expect(text: str, at: int, token: str, what: str) -> int:
    if not text.startswith(token, at):
        raise ValueError(f"expected {what} at character {at}")
    return _skip(text, at + 1)


def object_members(text: str, streamed: Collection[str] = ()) -> Iterator[tuple[str, object]]:
    """(key, value) of the JSON object ``text``, in order. The value of a key in ``streamed`` that
    is an array comes as an iterator over its items, each decoded when it is reached; it has to be
    taken (or is skipped, decoded item by item) before the next member is decoded."""
    at = _expect(text, _skip(text, 0), "{", "'{'")
    seen: set[str] = set()
    closed = text.startswith("}", at)
    while not closed:
        if not text.startswith('"', at):
            raise ValueError(f"expected a key at character {at}")
        key, at = json.decoder.scanstring(text, at + 1)
        if key in seen:
            raise ValueError(f"key {key!r} appears twice")
        seen.add(key)
        at = _expect(text, _skip(text, at), ":", "':'")
        if key in streamed and text.startswith("[", at):
            end: list[int] = []
            items = _array_items(text, at, end)
            yield key, items
            for _ in items:  # whatever the caller did not take
                pass
            at = end[0]
        else:
            value, at = _value_at(text, at)
            yield key, value
        at = _skip(text, at)
        closed = text.startswith("}", at)
        if not closed:
            at = _expect(text, at, ",", "',' or '}'")
    if _skip(text, at + 1) != len(text):
        raise ValueError(f"extra data at character {at + 1}")


def _array_items(text: str, at: int, end: list[int]) -> Iterator[object]:
    """The items of the array starting at ``text[at]``; ``end`` gets the position after it."""
    at = _skip(text, at + 1)
    closed = text.startswith("]", at)
    while not closed:
        value, at = _value_at(text, at)
        yield value
        at = _skip(text, at)
        closed = text.startswith("]", at)
        if not closed:
            at = _expect(text, at, ",", "',' or ']'")
    end.append(at + 1)
