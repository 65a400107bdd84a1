"""Tools on chat (function calling), the parts both ends need.

* The worker renders a conversation's tools and earlier tool calls through the model's chat template in
  Hugging Face's form (:func:`template_tools`, :func:`template_messages`): the template decides how a model
  sees them, as it does in ``transformers``.
* A forced call (OpenAI's ``tool_choice`` ``"required"`` or a named function) is a structured output:
  :func:`call_schema` is the JSON schema the grammar holds the model to, so the arguments always parse and
  match the function's ``parameters``.
* :func:`parse_calls` reads the calls back out of the text; :class:`CallStream` does it while streaming,
  holding back only what may still turn out to be a call. With ``"auto"`` the model writes its calls in
  its own format: Hermes-style ``<tool_call>{"name": …, "arguments": …}</tool_call>`` blocks (Qwen2.5/3,
  Hermes and most function-calling fine-tunes) or a whole reply that is one such JSON object or a list of
  them (Llama 3.1's form); anything else is content.
* Only a complete call is a call: a reply cut short (``max_tokens``) before a call's JSON is whole is content,
  in every mode, and every call's arguments are written one way (:func:`arguments_text`), whatever the mode
  and whatever spacing the model used.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loraserve.common.errors import InvalidArgument
from loraserve.protos.v1 import inference_pb2 as pb

MAX_SCHEMA_DEPTH = 64  # nesting of one tool's parameters schema or one call's arguments
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def json_object(text: str, what: str) -> dict[str, Any]:
    """JSON text that must hold an object (at most MAX_SCHEMA_DEPTH deep) -> the dict; INVALID_ARGUMENT
    naming ``what`` otherwise."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise InvalidArgument(f"{what} is not JSON: {str(exc)[:200]}") from None
    if not isinstance(value, dict):
        raise InvalidArgument(f"{what} must be a JSON object, got {type(value).__name__}")
    if depth(value) > MAX_SCHEMA_DEPTH:
        raise InvalidArgument(f"{what} nests deeper than {MAX_SCHEMA_DEPTH} levels")
    return value


def depth(value: Any) -> int:
    """How deep arrays and objects nest in ``value`` (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, d)
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def check_parameters(schema: Any, what: str) -> dict[str, Any]:
    """A function's ``parameters``: an object schema (OpenAI's rule), or nothing (no arguments)."""
    if schema is None:
        return dict(NO_PARAMETERS)
    if not isinstance(schema, dict):
        raise InvalidArgument(f"{what} must be a JSON schema object")
    if schema.get("type", "object") != "object":
        raise InvalidArgument(f"{what} must describe an object (type 'object'), got type {schema['type']!r}")
    if not isinstance(schema.get("properties", {}), dict):
        raise InvalidArgument(f"{what}.properties must be an object")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise InvalidArgument(f"{what}.required must be a list of property names")
    if depth(schema) > MAX_SCHEMA_DEPTH:
        raise InvalidArgument(f"{what} nests deeper than {MAX_SCHEMA_DEPTH} levels")
    return schema


def parameters_of(tool: pb.Tool, index: int) -> dict[str, Any]:
    what = f"tools[{index}] ({tool.name}) parameters"
    return (
        check_parameters(json_object(tool.parameters, what), what) if tool.parameters else dict(NO_PARAMETERS)
    )


def template_tools(tools: Sequence[pb.Tool]) -> list[dict[str, Any]]:
    """The ``tools`` a chat template gets (``apply_chat_template(tools=...)``'s JSON-schema form)."""
    out = []
    for i, t in enumerate(tools):
        function: dict[str, Any] = {"name": t.name}
        if t.description:
            function["description"] = t.description
        function["parameters"] = parameters_of(t, i)
        out.append({"type": "function", "function": function})
    return out


def template_messages(messages: Sequence[pb.ChatMessage]) -> list[dict[str, Any]]:
    """The conversation as a chat template reads it: tool calls with their arguments as objects (the form
    ``transformers`` documents), a tool turn's ``tool_call_id``."""
    out = []
    for i, m in enumerate(messages):
        turn: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.tool_calls:
            turn["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.name,
                        "arguments": json_object(c.arguments or "{}", f"message {i}'s arguments"),
                    },
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id:
            turn["tool_call_id"] = m.tool_call_id
        if m.name:
            turn["name"] = m.name
        out.append(turn)
    return out


def call_schema(tools: Sequence[pb.Tool], named: str | None, parallel: bool = True) -> str:
    """The JSON schema that forces a call: a named function's arguments object, or (``required``) a list of
    one or more ``{"name", "arguments"}`` calls of the offered tools (one when not ``parallel``). Arguments
    hold the declared properties only, unless a function's schema sets ``additionalProperties`` itself."""
    # keys the function does not declare are not generated unless its schema allows them explicitly
    # (a model held to a loose schema can wander off into extra keys until max_tokens)
    params = {t.name: {"additionalProperties": False, **parameters_of(t, i)} for i, t in enumerate(tools)}
    if named is not None:
        return json.dumps(params[named])
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": schema},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, schema in params.items()
    ]
    array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        array["maxItems"] = 1
    return json.dumps(array)


@dataclass(frozen=True)
class Call:
    """One tool call read from a reply: OpenAI's ``tool_calls`` item."""

    name: str
    arguments: str  # JSON object text
    id: str = ""

    def openai(self, index: int | None = None) -> dict[str, Any]:
        item: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        return item if index is None else {"index": index, **item}


def arguments_text(args: dict[str, Any]) -> str:
    """A call's ``arguments`` as every reply spells them: compact JSON (no spaces after ``,`` and ``:``, the
    form OpenAI's own replies and a forced call's grammar write), keys in the order generated, non-ASCII
    characters as themselves."""
    return json.dumps(args, ensure_ascii=False, separators=(",", ":"))


def _arguments(value: Any) -> dict[str, Any] | None:
    """A call's arguments (an object, or JSON text of one, at most MAX_SCHEMA_DEPTH deep), else None: what a
    reply holds as arguments must come back as history (``template_messages`` parses them)."""
    if isinstance(value, str):
        value = _loads(value)
    return value if isinstance(value, dict) and depth(value) <= MAX_SCHEMA_DEPTH else None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _call(value: Any, names: frozenset[str]) -> Call | None:
    """``{"name": …, "arguments"|"parameters": {…} or JSON text}`` naming an offered tool -> a Call."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    args = _arguments(value.get("arguments", value.get("parameters", {})))
    return None if args is None else Call(value["name"], arguments_text(args), new_call_id())


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return None


def parse_calls(
    text: str, names: frozenset[str], mode: str, named: str | None = None
) -> tuple[str | None, list[Call]]:
    """(content, calls) of a finished reply. ``mode`` is the request's tool choice: ``named`` (the text is
    the arguments), ``required`` (a JSON list of calls), ``auto`` (the model's own format, module doc) or
    ``none`` (all content). A reply that does not hold calls is all content, and so is one cut short before
    its calls' JSON is complete (``max_tokens``), in every mode."""
    if mode == "named":
        args = _arguments(text)
        if args is None:
            return text, []  # cut short (or not an object): content
        return None, [Call(named or "", arguments_text(args), new_call_id())]
    if mode == "none":
        return text, []
    if mode == "required":
        value = _loads(text)
        calls = [_call(v, names) for v in value] if isinstance(value, list) else []
        return (None, calls) if calls and all(calls) else (text, [])  # type: ignore[return-value]
    start = text.find(CALL_OPEN)
    if start >= 0:
        calls = []
        for block in text[start:].split(CALL_OPEN)[1:]:
            body = block.split(CALL_CLOSE, 1)[0]  # the last block may be cut off (max_tokens): then it fails
            call = _call(_loads(body.strip()), names)
            if call is None:
                return text, []
            calls.append(call)
        return text[:start].strip() or None, calls
    stripped = text.strip()
    if stripped[:1] in ("{", "["):
        value = _loads(stripped)
        items = value if isinstance(value, list) else [value]
        calls = [_call(v, names) for v in items]
        if items and all(calls):
            return None, calls  # type: ignore[return-value]
    return text, []


class CallStream:
    """A streamed reply's content as it may be sent: everything while it cannot be part of a call, the rest
    at :meth:`finish` with the calls. ``named``/``required`` replies are calls from their first token.

    Each chunk costs its own length: what is not sent yet is at most a marker's prefix (or, once a call may
    have begun, the held chunks, joined once at the end), never the whole reply scanned again."""

    def __init__(self, names: frozenset[str], mode: str, named: str | None = None) -> None:
        self.names, self.mode, self.named = names, mode, named
        self.sent: list[str] = []  # content already sent, in order
        self.unsent: list[str] = []  # the rest, in order
        self.holding = mode in ("named", "required")
        self.started = False  # a non-whitespace character has come (the reply's opening is decided)

    def feed(self, delta: str) -> str:
        """Content that can go out now, after ``delta``."""
        if self.mode == "none":
            self.sent.append(delta)
            return delta
        self.unsent.append(delta)
        if self.holding:
            return ""
        if not self.started:
            lead = delta.lstrip()  # (everything before this delta was whitespace)
            if not lead:
                return ""  # only whitespace yet: it may open a JSON call
            self.started = True
            if lead[0] in "{[":
                self.holding = True  # a whole-reply JSON call, or content that starts with a brace
                return ""
        pending = "".join(self.unsent)  # a marker's prefix at most, plus this delta
        at = pending.find(CALL_OPEN)
        if at >= 0:
            self.holding = True
            self.unsent = [pending[at:]]
            return self._send(pending[:at])
        keep = next((k for k in range(len(CALL_OPEN) - 1, 0, -1) if pending.endswith(CALL_OPEN[:k])), 0)
        self.unsent = [pending[len(pending) - keep :]] if keep else []
        return self._send(pending[: len(pending) - keep])

    def _send(self, text: str) -> str:
        if text:
            self.sent.append(text)
        return text

    def finish(self) -> tuple[str, list[Call]]:
        """(content not sent yet, the calls) once the reply is complete."""
        rest = "".join(self.unsent)
        _, calls = parse_calls("".join(self.sent) + rest, self.names, self.mode, self.named)
        if calls:
            return "", calls  # content before a Hermes block went out before the block began
        self.unsent = []
        return self._send(rest), []
