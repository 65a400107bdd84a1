"""Reading a request body without trusting it: JSON parsed off the event loop, with its nesting, object sizes
and strings checked before pydantic sees it, so that nothing a client sends can stall the loop (health checks,
other streams) or end as a 500 (``RecursionError``, a 5000-digit integer, a lone surrogate).

The limits are ``loraserve.common.limits``; a body past one is INVALID_ARGUMENT (400) naming it.
"""

from __future__ import annotations

import json
from typing import Any

from loraserve.common.errors import InvalidArgument
from loraserve.common.limits import MAX_JSON_DEPTH, MAX_JSON_KEYS, MAX_JSON_VALUES
from loraserve.common.offload import OffLoop

# parsing and converting bodies run here, never on the event loop nor in its default executor
off_loop = OffLoop("loraserve-http-body")


def load_json(raw: bytes) -> Any:
    """``raw`` as JSON within the limits: INVALID_ARGUMENT for bad JSON, more than ``MAX_JSON_VALUES`` values
    (counted before parsing), nesting deeper than ``MAX_JSON_DEPTH``, an object of more than ``MAX_JSON_KEYS``
    members, or a string that is not Unicode."""
    if count_values(raw) > MAX_JSON_VALUES:
        raise InvalidArgument(f"request body holds more than {MAX_JSON_VALUES} JSON values")
    try:
        data = json.loads(raw)
    except RecursionError:
        raise InvalidArgument(f"request body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidArgument(f"request body is not valid JSON: {exc}") from None
    except ValueError as exc:  # an integer of more than 4300 digits
        raise InvalidArgument(f"request body is not valid JSON: {str(exc)[:120]}") from None
    check_shape(data)
    return data


def _separators(raw: bytes, start: int, stop: int) -> int:
    return raw.count(b",", start, stop) + raw.count(b"[", start, stop) + raw.count(b"{", start, stop)


def count_values(raw: bytes) -> int:
    """At most how many values (array elements, object members) ``json.loads(raw)`` would make: one more than
    the commas and opening brackets outside strings. Bytes scans only (``count``/``find``, each releasing
    the GIL's holder within milliseconds); the strings are skipped only when counting inside them as well
    could exceed the limit (a long prompt with many commas)."""
    quick = _separators(raw, 0, len(raw)) + 1
    if quick <= MAX_JSON_VALUES:
        return quick
    if raw.count(b'"') > 2 * MAX_JSON_VALUES:  # every string is a value or a key
        return raw.count(b'"') // 2
    total, pos, n = 1, 0, len(raw)
    while pos < n:
        quote = raw.find(b'"', pos)
        total += _separators(raw, pos, n if quote < 0 else quote)
        if quote < 0:
            break
        end = quote
        while True:  # the closing quote: the next one after an even number of backslashes
            end = raw.find(b'"', end + 1)
            if end < 0:
                return total  # unterminated: json.loads says so
            back = end - 1
            while raw[back] == 0x5C:
                back -= 1
            if (end - 1 - back) % 2 == 0:
                break
        pos = end + 1
    return total


def check_shape(data: Any) -> None:
    """Depth, object sizes and strings of parsed JSON, walked without recursion (containers only are stacked,
    with their path for the message)."""
    if isinstance(data, str):
        _check_text(data, ())
    stack: list[tuple[Any, tuple[Any, ...]]] = [(data, ())] if isinstance(data, list | dict) else []
    while stack:
        node, path = stack.pop()
        if len(path) >= MAX_JSON_DEPTH:
            raise InvalidArgument(
                f"{_where(path)}: request body is nested deeper than {MAX_JSON_DEPTH} levels"
            )
        if isinstance(node, dict):
            if len(node) > MAX_JSON_KEYS:
                raise InvalidArgument(
                    f"{_where(path)}: a JSON object of {len(node)} members; at most {MAX_JSON_KEYS}"
                )
            items = node.items()
            for key in node:
                _check_text(key, path)
        else:
            items = enumerate(node)
        for key, value in items:
            if isinstance(value, str):
                _check_text(value, (*path, key))
            elif isinstance(value, list | dict):
                stack.append((value, (*path, key)))


def _where(path: tuple[Any, ...]) -> str:
    shown = ".".join(str(p) for p in path[:6])
    return (shown + (".…" if len(path) > 6 else "")) or "body"


def _check_text(s: str, path: tuple[Any, ...]) -> None:
    if not s.isascii():
        try:
            s.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidArgument(
                f"{_where(path)}: a string that is not valid Unicode (a lone surrogate escape such as \\ud800)"
            ) from None
