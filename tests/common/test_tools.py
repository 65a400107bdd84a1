"""Reading tool calls out of a reply (``common.tools``): every format ``auto`` understands, what stays
content, and a streamed reply whose content goes out as soon as it cannot be part of a call."""

from __future__ import annotations

import json

import pytest

from loraserve.common.errors import InvalidArgument
from loraserve.common.tools import CALL_OPEN, CallStream, call_schema, json_object, parse_calls
from loraserve.protos.v1 import inference_pb2 as pb

NAMES = frozenset({"get_weather", "get_time"})
HERMES = 'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'


def _calls(text: str, mode: str = "auto") -> tuple[str | None, list[tuple[str, dict]]]:
    content, calls = parse_calls(text, NAMES, mode, "get_time" if mode == "named" else None)
    return content, [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_blocks_and_the_content_before_them() -> None:
    assert _calls(HERMES) == ("Let me check.", [("get_weather", {"city": "Oslo"})])
    two = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>\n<tool_call>{"name": "get_weather", "parameters": {"city": "Rome"}}</tool_call>'
    assert _calls(two) == (None, [("get_time", {}), ("get_weather", {"city": "Rome"})])


def test_a_whole_json_reply_is_a_call_of_an_offered_tool() -> None:
    assert _calls('{"name": "get_time", "parameters": {"zone": "utc"}}') == (
        None,
        [("get_time", {"zone": "utc"})],
    )
    assert _calls('[{"name": "get_time", "arguments": "{\\"zone\\": \\"cet\\"}"}]') == (
        None,
        [("get_time", {"zone": "cet"})],
    )


@pytest.mark.parametrize(
    "text",
    [
        "Just text.",
        '{"name": "rm_rf", "arguments": {}}',  # not an offered tool
        '{"city": "Oslo"}',  # JSON, but no call
        'Sure <tool_call>{"name": "get_time", "arguments": {"zone": ',  # cut off by max_tokens
        '<tool_call>{"name": "get_time", "arguments": [1]}</tool_call>',  # arguments not an object
    ],
)
def test_what_is_not_a_call_stays_content(text: str) -> None:
    assert _calls(text) == (text, [])


def test_forced_modes() -> None:
    assert _calls('{"zone": "utc"}', "named") == (None, [("get_time", {"zone": "utc"})])
    assert _calls('[{"name": "get_weather", "arguments": {"city": "Nice"}}]', "required") == (
        None,
        [("get_weather", {"city": "Nice"})],
    )
    assert _calls(HERMES, "none") == (HERMES, [])


def _stream(mode: str, pieces: list[str]) -> tuple[list[str], str, list[str]]:
    s = CallStream(NAMES, mode, "get_time" if mode == "named" else None)
    sent = [s.feed(p) for p in pieces]
    rest, calls = s.finish()
    return sent, rest, [c.name for c in calls]


def test_streamed_content_goes_out_until_a_call_may_begin() -> None:
    pieces = [
        "Let me",
        " check. <tool",
        '_call>{"name": "get_weather", ',
        '"arguments": {"city": "Oslo"}}</tool_call>',
    ]
    sent, rest, calls = _stream("auto", pieces)
    assert sent == ["Let me", " check. ", "", ""] and rest == "" and calls == ["get_weather"]
    # a "<" that turns out not to open a call is sent once it cannot any more
    sent, rest, calls = _stream("auto", ["a <", "b", " c"])
    assert "".join(sent) + rest == "a <b c" and sent[0] == "a " and calls == []
    # a reply that opens with a brace is held to the end: a call, or content after all
    assert _stream("auto", [' {"name": "get_time", ', '"arguments": {}}']) == (["", ""], "", ["get_time"])
    assert _stream("auto", ["{not", " json"]) == (["", ""], "{not json", [])
    assert _stream("none", ["<tool_call>", "x"]) == (["<tool_call>", "x"], "", [])
    assert _stream("named", ['{"zone"', ': "utc"}']) == (["", ""], "", ["get_time"])


def test_the_forced_call_schema() -> None:
    tools = [
        pb.Tool(
            name="get_time",
            parameters=json.dumps({"type": "object", "properties": {"zone": {"type": "string"}}}),
        ),
        pb.Tool(name="ping"),
    ]
    assert json.loads(call_schema(tools, "get_time"))["properties"] == {"zone": {"type": "string"}}
    required = json.loads(call_schema(tools, None, parallel=False))
    assert required["minItems"] == 1 and required["maxItems"] == 1
    names = [c["properties"]["name"]["const"] for c in required["items"]["anyOf"]]
    assert names == ["get_time", "ping"]
    no_args = {"type": "object", "properties": {}, "additionalProperties": False}
    assert required["items"]["anyOf"][1]["properties"]["arguments"] == no_args
    loose = pb.Tool(name="loose", parameters=json.dumps({"type": "object", "additionalProperties": True}))
    assert json.loads(call_schema([loose], "loose"))["additionalProperties"] is True


def test_json_object_bounds_what_it_parses() -> None:
    assert json_object('{"a": [1]}', "x") == {"a": [1]}
    for text, says in [
        ("[1]", "must be a JSON object"),
        ("{", "not JSON"),
        ('{"a":' + "[" * 70 + "]" * 70 + "}", "deeper"),
    ]:
        with pytest.raises(InvalidArgument, match=says):
            json_object(text, "x")
    with pytest.raises(InvalidArgument, match="not JSON"):
        json_object("[" * 100_000, "x")  # the parser's own recursion limit


def test_a_long_stream_costs_each_chunk_its_own_length() -> None:
    """What a stream keeps unsent stays a marker's prefix long, however long the reply (no rescans)."""
    s = CallStream(NAMES, "auto")
    assert s.feed("   ") == "" and s.feed("\n") == ""  # whitespace only: undecided
    sent = [s.feed("word <tool") for _ in range(2000)]
    assert sum(len(u) for u in s.unsent) <= len(CALL_OPEN)
    assert "".join(sent) + s.finish()[0] == "   \n" + "word <tool" * 2000


# one call, as each mode's reply spells it (spacing, key order and the arguments' form as a model may write)
OSLO = {"city": "Oslo", "days": 2}
ONE_CALL = {
    "named": '{ "city" : "Oslo",\n  "days": 2 }',
    "required": '[{"name":"get_weather","arguments":{"city":"Oslo","days":2}}]',
    "auto": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>',
    "auto_json": '{"name": "get_weather", "parameters": "{\\"city\\":  \\"Oslo\\", \\"days\\": 2}"}',
}


def _one(mode: str, text: str) -> tuple[str | None, list]:
    named = "get_weather" if mode == "named" else None
    return parse_calls(text, NAMES, mode.removesuffix("_json"), named)


def test_every_mode_writes_the_same_call_s_arguments_one_way() -> None:
    """Compact JSON, keys in their order, whatever spacing (or JSON-text arguments) the reply had."""
    for mode, text in ONE_CALL.items():
        content, (call,) = _one(mode, text)
        assert content is None and call.name == "get_weather", mode
        assert call.arguments == '{"city":"Oslo","days":2}', mode
        assert json.loads(call.arguments) == OSLO
    # non-ASCII characters stay themselves; the order the model wrote the keys in is kept
    (call,) = _one("named", '{"days": 1, "city": "Zürich"}')[1]
    assert call.arguments == '{"days":1,"city":"Zürich"}'
    streamed = CallStream(NAMES, "named", "get_weather")
    assert streamed.feed(ONE_CALL["named"]) == ""
    assert streamed.finish()[1][0].arguments == '{"city":"Oslo","days":2}'


@pytest.mark.parametrize("mode", list(ONE_CALL))
def test_a_call_cut_short_is_content_in_every_mode(mode: str) -> None:
    """max_tokens reached before a call's JSON is whole: every prefix of the reply is content, never a call
    (whose arguments would not parse), streamed or not."""
    text = ONE_CALL[mode]
    whole_at = len(text.rstrip()) if mode != "auto" else text.index("}}") + 2  # Hermes: the JSON ends there
    for cut in range(1, whole_at):
        prefix = text[:cut]
        assert _one(mode, prefix) == (prefix, []), (mode, prefix)
        s = CallStream(NAMES, mode.removesuffix("_json"), "get_weather" if mode == "named" else None)
        sent = [s.feed(prefix[i : i + 3]) for i in range(0, cut, 3)]
        rest, calls = s.finish()
        assert calls == [] and "".join(sent) + rest == prefix, (mode, prefix)


def test_arguments_that_could_not_come_back_are_not_a_call() -> None:
    """A call's arguments come back as history (parsed, at most MAX_SCHEMA_DEPTH deep): deeper ones, or
    arguments that are not an object, leave the reply content."""
    deep = '{"a": ' + "[" * 70 + "]" * 70 + "}"
    assert parse_calls(deep, NAMES, "named", "get_time") == (deep, [])
    assert parse_calls("[1, 2]", NAMES, "named", "get_time") == ("[1, 2]", [])
    hermes = f'<tool_call>{{"name": "get_time", "arguments": {deep}}}</tool_call>'
    assert parse_calls(hermes, NAMES, "auto") == (hermes, [])
    nested = '{"name": "get_time", "arguments": "' + "[" * 100_000 + '"}'  # JSON text past the parser's limit
    assert parse_calls(nested, NAMES, "auto") == (nested, [])
