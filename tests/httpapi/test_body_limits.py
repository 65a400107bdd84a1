"""The HTTP API's guarded body reading (``httpapi.body``): the value count taken before ``json.loads`` is never
below the truth, and nesting/size/Unicode limits are INVALID_ARGUMENT, never a RecursionError or ValueError."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from loraserve.common.errors import InvalidArgument
from loraserve.common.limits import MAX_JSON_DEPTH, MAX_JSON_KEYS, MAX_JSON_VALUES
from loraserve.httpapi.body import count_values, load_json

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner, max_size=5),
    max_leaves=30,
)


def _values(x) -> int:
    if isinstance(x, list):
        return 1 + sum(_values(v) for v in x)
    if isinstance(x, dict):
        return 1 + sum(_values(v) for v in x.values())
    return 1


@settings(max_examples=100, deadline=None)
@given(doc=json_values, ascii_only=st.booleans())
def test_the_value_count_is_never_below_the_truth(doc, ascii_only) -> None:
    raw = json.dumps(doc, ensure_ascii=ascii_only).encode()
    assert count_values(raw) >= _values(doc)
    assert load_json(raw) == doc


def test_commas_inside_strings_do_not_count_when_it_matters() -> None:
    text = 'a, "b", \\ [c] {d}' * (MAX_JSON_VALUES // 3)
    raw = json.dumps({"model": "m", "prompt": text}).encode()
    assert count_values(raw) < 10  # the slow path skips strings, escaped quotes and backslashes included
    assert load_json(raw)["prompt"] == text
    many = json.dumps({"prompt": [1] * (MAX_JSON_VALUES + 1)}).encode()
    with pytest.raises(InvalidArgument, match=f"more than {MAX_JSON_VALUES} JSON values"):
        load_json(many)


@pytest.mark.parametrize(
    "raw,words",
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested deeper"),
        (
            b'{"a": ' + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1) + b"}",
            "a.0.0.0.0.0.…: request",
        ),
        (b'{"a": ' + b"9" * 5000 + b"}", "not valid JSON"),
        (b'{"a": "\\ud800"}', "a: a string that is not valid Unicode"),
        (b'{"\\udfff": 1}', "not valid Unicode"),
        (b"\xff\xfe", "not valid JSON"),
        (b'{"a": 1', "not valid JSON"),
        (json.dumps({"k": {str(i): i for i in range(MAX_JSON_KEYS + 1)}}).encode(), "k: a JSON object of"),
    ],
)
def test_hostile_bodies_are_invalid_argument(raw, words) -> None:
    with pytest.raises(InvalidArgument) as exc:
        load_json(raw)
    assert words in exc.value.message
