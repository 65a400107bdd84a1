"""What one generation request may hold, checked at every door (the HTTP API, the router's and the worker's
``Generate``) before any work is done on it: a request past a limit is INVALID_ARGUMENT (HTTP 400) with a
message naming the limit, never an INTERNAL error from protobuf, numpy or the event loop's stack.

The worker adds what only it knows: the prompt's tokens against its context (``max_seq_len``), token ids
against its vocabulary, and a prompt text's UTF-8 length against the most its context can hold
(``worker.tokenizer.PromptBound``), all before tokenising. docs/http.md has the table.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from loraserve.common.errors import InvalidArgument
from loraserve.protos.v1 import inference_pb2 as pb

INT32_MAX = 2**31 - 1
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1

MAX_BODY_BYTES = 16 * 1024 * 1024  # an HTTP body, and a gRPC message to a worker
MAX_JSON_DEPTH = 32  # nesting of an HTTP body's arrays and objects (the API's own is 5 deep)
MAX_JSON_KEYS = 1024  # members of one JSON object
MAX_PROMPT_TOKENS = 1 << 18  # token ids one prompt may carry (a worker refuses past its context)
# values (array elements, object members) of one HTTP body: json.loads holds the GIL for its whole parse, so
# its work is bounded before it starts (1M small values would stall the event loop ~0.1 s)
MAX_JSON_VALUES = MAX_PROMPT_TOKENS + (1 << 16)
MAX_MESSAGES = 4096  # chat messages of one request
MAX_CONTENT_PARTS = 256  # text parts of one chat message's content
MAX_STOP = 16  # stop strings
MAX_STOP_CHARS = 256  # characters of one stop string
MAX_STOP_TOKEN_IDS = 256
MAX_LOGPROBS = 20  # alternatives per token (the device computes this many)
MAX_LOGIT_BIAS = 300  # logit_bias entries (OpenAI's limit)
MAX_LOGIT_BIAS_VALUE = 100.0  # |bias| (OpenAI's range: -100 to 100)
SPECULATIVE_METHODS = ("off", "ngram")  # speculative decoding's methods (engine.speculative's drafters)
MAX_SPECULATIVE_TOKENS = 8  # the most tokens one row may propose for a verify step (num_speculative_tokens)
MAX_PREDICTION_TOKENS = 4096  # a request's prediction (speculative decoding's predicted output), as tokens
MAX_PREDICTION_CHARS = 1 << 16  # ... and as text, before it is tokenised
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty| (OpenAI's range)
REPETITION_PENALTY_RANGE = (0.01, 100.0)  # repetition_penalty: positive, bounded so logits stay finite
MAX_CONSTRAINT_CHARS = 65536  # a structured output's schema, regex or grammar, and all its choices together
MAX_CHOICES = 256  # strings of a structured output's choice
MAX_TOOLS = 128  # tools one chat request offers (OpenAI's limit), and tool calls of one assistant turn
MAX_TOOLS_CHARS = 32768  # the tools' names, descriptions and parameter schemas together (a forced call's
# schema wraps them in at most ~17K more: it stays under MAX_CONSTRAINT_CHARS)
MAX_SEQUENCES = 64  # sequences one HTTP request may start: prompts x (best_of or n)
MAX_ID_CHARS = 256  # request_id, and an HTTP x-request-id (it is echoed in every streamed chunk)
MAX_ROUTING_KEY_CHARS = 1024
MAX_MIX_PARTS = 64  # parts of a weighted mix (a worker allows --max-mix of them)
MAX_REF_CHARS = 200  # an adapter ref: a name of <= 128 characters, "@", a version or an alias of <= 64


def check_ref(ref: str, what: str = "adapter") -> None:
    """INVALID_ARGUMENT for what cannot be an adapter ref (``adapters.refs`` checks the rest): too long, or
    not ASCII (refs are, and non-ASCII digits would pass ``str.isdigit`` but not ``int``)."""
    if len(ref) > MAX_REF_CHARS or not ref.isascii():
        raise InvalidArgument(
            f"{what} {ref[:64]!r} is not an adapter ref (name, name@3 or name@alias: ASCII, at most "
            f"{MAX_REF_CHARS} characters)"
        )


def check_generate_request(request: pb.GenerateRequest) -> None:
    """The limits of a ``GenerateRequest`` that need no model: counts and lengths, O(1) each but the stop
    strings' and mix parts' (a bounded number of them). INVALID_ARGUMENT naming the first one exceeded, and
    for bytes that did not parse (``Unparsable``)."""
    if isinstance(request, Unparsable):
        raise InvalidArgument(request.message)
    if len(request.request_id) > MAX_ID_CHARS:
        raise InvalidArgument(f"request_id is {len(request.request_id)} characters; at most {MAX_ID_CHARS}")
    if len(request.routing_key) > MAX_ROUTING_KEY_CHARS:
        raise InvalidArgument(
            f"routing_key is {len(request.routing_key)} characters; at most {MAX_ROUTING_KEY_CHARS}"
        )
    check_ref(request.adapter)
    if len(request.mix) > MAX_MIX_PARTS:
        raise InvalidArgument(f"a mix has {len(request.mix)} parts; at most {MAX_MIX_PARTS}")
    for part in request.mix:
        check_ref(part.adapter, "mix adapter")
    kind = request.WhichOneof("prompt")
    if kind == "tokens" and len(request.tokens.ids) > MAX_PROMPT_TOKENS:
        raise InvalidArgument(
            f"prompt has {len(request.tokens.ids)} token ids; at most {MAX_PROMPT_TOKENS} (and under the "
            "worker's context)"
        )
    if kind == "chat":
        check_chat(request.chat)
    s = request.sampling
    if len(s.stop) > MAX_STOP:
        raise InvalidArgument(f"stop has {len(s.stop)} strings; at most {MAX_STOP}")
    long = [len(x) for x in s.stop if len(x) > MAX_STOP_CHARS]
    if long:
        raise InvalidArgument(f"a stop string is {long[0]} characters; at most {MAX_STOP_CHARS}")
    if len(s.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidArgument(f"stop_token_ids has {len(s.stop_token_ids)} ids; at most {MAX_STOP_TOKEN_IDS}")
    if s.HasField("logprobs") and s.logprobs > MAX_LOGPROBS:
        raise InvalidArgument(f"logprobs must be in [0, {MAX_LOGPROBS}], got {s.logprobs}")
    if s.HasField("prompt_logprobs") and s.prompt_logprobs > MAX_LOGPROBS:
        raise InvalidArgument(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {s.prompt_logprobs}")
    if len(s.logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidArgument(f"logit_bias has {len(s.logit_bias)} entries; at most {MAX_LOGIT_BIAS}")
    if s.HasField("structured"):
        check_structured(s.structured)
    if s.HasField("speculative"):
        check_speculative(s.speculative)


def check_chat(chat: pb.ChatMessages) -> None:
    """A conversation's counts and its tools' sizes and names (their JSON is parsed where it is used,
    ``common.tools``)."""
    if len(chat.messages) > MAX_MESSAGES:
        raise InvalidArgument(f"chat has {len(chat.messages)} messages; at most {MAX_MESSAGES}")
    if len(chat.tools) > MAX_TOOLS:
        raise InvalidArgument(f"chat offers {len(chat.tools)} tools; at most {MAX_TOOLS}")
    size = sum(len(t.name) + len(t.description) + len(t.parameters) for t in chat.tools)
    if size > MAX_TOOLS_CHARS:
        raise InvalidArgument(f"the tools are {size} characters; at most {MAX_TOOLS_CHARS}")
    names = [t.name for t in chat.tools]
    for name in names:
        check_tool_name(name, "tool")
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise InvalidArgument(f"tool {dup!r} is offered twice")
    for i, m in enumerate(chat.messages):
        if len(m.tool_calls) > MAX_TOOLS:
            raise InvalidArgument(f"message {i} has {len(m.tool_calls)} tool calls; at most {MAX_TOOLS}")
        for call in m.tool_calls:
            check_tool_name(call.name, f"message {i}'s tool call")
            if len(call.id) > MAX_ID_CHARS:
                raise InvalidArgument(f"a tool call id is {len(call.id)} characters; at most {MAX_ID_CHARS}")
        if len(m.tool_call_id) > MAX_ID_CHARS or len(m.name) > MAX_ID_CHARS:
            raise InvalidArgument(f"message {i}'s tool_call_id or name is over {MAX_ID_CHARS} characters")


def check_tool_name(name: str, what: str) -> None:
    """OpenAI's rule for a function name: 1-64 characters of ASCII letters, digits, ``_`` and ``-``."""
    if not (0 < len(name) <= 64 and name.isascii() and all(c.isalnum() or c in "_-" for c in name)):
        raise InvalidArgument(f"{what} name {name[:70]!r} must be 1-64 characters of A-Z, a-z, 0-9, _ and -")


def check_structured(spec: pb.StructuredOutput) -> None:
    """A structured output's size: INVALID_ARGUMENT past MAX_CONSTRAINT_CHARS or MAX_CHOICES."""
    kind = spec.WhichOneof("kind")
    if kind == "choice":
        if len(spec.choice.choices) > MAX_CHOICES:
            raise InvalidArgument(f"choice has {len(spec.choice.choices)} strings; at most {MAX_CHOICES}")
        size = sum(len(c) for c in spec.choice.choices)
    else:
        size = len(getattr(spec, kind)) if kind in ("json_schema", "regex", "grammar") else 0
    if size > MAX_CONSTRAINT_CHARS:
        raise InvalidArgument(f"the structured output is {size} characters; at most {MAX_CONSTRAINT_CHARS}")


# ------------------------------------------------------------------------------ bytes that are no request
class Unparsable:
    """What a servicer gets instead of a request whose bytes do not parse (e.g. a string field of bad UTF-8):
    grpc would end such a call UNKNOWN; ``add_servicer``'s handlers end it INVALID_ARGUMENT."""

    def __init__(self, kind: str, error: Exception) -> None:
        self.message = f"the request is not a valid {kind}: {str(error)[:200]}"


def _lenient(parse: Callable[[bytes], Any], kind: str) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return parse(data)
        except DecodeError as exc:
            return Unparsable(kind, exc)

    return deserialize


def _refusing(behavior: Callable, streams: bool) -> Callable:
    """``behavior`` with an ``Unparsable`` request refused first (an async generator stays one)."""
    if streams and inspect.isasyncgenfunction(behavior):

        async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
            if isinstance(request, Unparsable):
                raise InvalidArgument(request.message)
            async for item in behavior(request, context):
                yield item

        return stream

    async def unary(request: Any, context: Any) -> Any:
        if isinstance(request, Unparsable):
            raise InvalidArgument(request.message)
        result = behavior(request, context)
        return (await result) if inspect.isawaitable(result) else result

    return unary


class _Collect:
    """Stands in for a server while a generated ``add_*Servicer_to_server`` registers its handlers."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self.service, self.handlers = service, handlers


def add_servicer(add: Callable[[Any, Any], None], servicer: Any, server: grpc.aio.Server) -> None:
    """``add(servicer, server)`` (a generated ``add_*Servicer_to_server``), except that a unary request whose
    bytes do not parse is INVALID_ARGUMENT instead of grpc's UNKNOWN."""
    collected = _Collect()
    add(servicer, collected)
    if not collected.handlers:  # generated code of another shape: as it is
        add(servicer, server)
        return
    handlers = {}
    for name, h in collected.handlers.items():
        if h.request_streaming or h.request_deserializer is None:
            handlers[name] = h
            continue
        parse = _lenient(h.request_deserializer, name + " request")
        make = (
            grpc.unary_stream_rpc_method_handler
            if h.response_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        behavior = h.unary_stream if h.response_streaming else h.unary_unary
        handlers[name] = make(
            _refusing(behavior, h.response_streaming),
            request_deserializer=parse,
            response_serializer=h.response_serializer,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(collected.service, handlers),))
    server.add_registered_method_handlers(collected.service, handlers)


def check_speculative(spec: pb.Speculative) -> None:
    """The size of a request's prediction (speculative decoding), before anything is copied or tokenised; its
    method and k, and its token ids against the vocabulary, are the engine's checks (``Sampling.validate``,
    ``validate_prediction``)."""
    if spec.prediction_text and spec.prediction_ids:
        raise InvalidArgument("a prediction is text or token ids, not both")
    if len(spec.prediction_text) > MAX_PREDICTION_CHARS:
        raise InvalidArgument(
            f"prediction is {len(spec.prediction_text)} characters; at most {MAX_PREDICTION_CHARS}"
        )
    if len(spec.prediction_ids) > MAX_PREDICTION_TOKENS:
        raise InvalidArgument(
            f"prediction has {len(spec.prediction_ids)} token ids; at most {MAX_PREDICTION_TOKENS}"
        )
