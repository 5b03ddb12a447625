"""fsio.json_members: a JSON object member by member (a large header or manifest never decoded as
one tree) decodes to what json.loads makes, and refuses what it refuses."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mmparity.io.fsio.json_members import object_members

_scalars = st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=8)
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=20)
_objects = st.dictionaries(st.text(max_size=6), _values, max_size=6)


def _decoded(text: str, streamed=()) -> dict:
    out = {}
    for key, value in object_members(text, streamed):
        out[key] = list(value) if isinstance(value, Iterator) else value
    return out


@settings(max_examples=200, deadline=None)
@given(_objects, st.sampled_from([None, 0, 1, 3]), st.booleans(), st.data())
def test_members_decode_as_json_loads(obj, indent, ascii_only, data):
    text = json.dumps(obj, indent=indent, ensure_ascii=ascii_only)
    assert _decoded(text) == obj
    streamed = data.draw(st.sets(st.sampled_from(sorted(obj) or [""])))
    assert _decoded(text, streamed) == obj


@settings(max_examples=100, deadline=None)
@given(st.lists(_values, max_size=6), st.integers(0, 6))
def test_a_streamed_array_left_untaken_is_skipped(items, taken):
    text = json.dumps({"before": 1, "tensors": items, "after": [2]})
    seen = {}
    for key, value in object_members(text, streamed=("tensors",)):
        if key == "tensors":
            seen[key] = [item for _, item in zip(range(taken), value)]
        else:
            seen[key] = value
    assert seen == {"before": 1, "tensors": items[:taken], "after": [2]}


@pytest.mark.parametrize("text, message", [
    ('{"a": 1, "a": 2}', "'a' appears twice"),
    ('[1, 2]', "expected '{'"),
    ('{"a": 1', "expected ',' or '}'"),
    ('{"a": 1,}', "expected a key"),
    ('{"a" 1}', "expected ':'"),
    ('{"a": [1, 2}', "expected ',' or ']'"),
    ('{"a": 1} x', "extra data"),
    ('{"a": tru}', "Expecting value"),
    ('', "expected '{'"),
])
def test_malformed_objects_are_refused(text, message):
    def decode():
        return _decoded(text, streamed=("a",))

    with pytest.raises(ValueError, match=message):
        decode()
