"""The OpenAI-compatible HTTP API as an ASGI app, shared by the router and the workers.

    POST /v1/completions        POST /v1/chat/completions        GET /v1/models[/{model}]
    POST /v1/load_lora_adapter  POST /v1/unload_lora_adapter (a worker's; vLLM's runtime LoRA API)
    GET  /health  (200 while serving)            GET /metrics (Prometheus, no token; only without --metrics-port)

A ``Backend`` (router or worker) turns a ``GenerateRequest`` into the same ``GenerateResponse`` stream its
gRPC ``Generate`` sends, so HTTP and gRPC give the same tokens for the same request. Refusals keep their
docs/design.md §8 status and become the HTTP status of the standard gRPC mapping, in OpenAI's error shape; a client
that disconnects cancels its request (the generator is closed, which frees the row and the slot).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Annotated, Any, Protocol, runtime_checkable

import grpc
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import REGISTRY, Counter, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, Field, ValidationError
from starlette.exceptions import HTTPException

from loraserve.common import admission
from loraserve.common.errors import InvalidArgument, LoraserveError, retry_after_seconds
from loraserve.common.limits import MAX_BODY_BYTES, MAX_ID_CHARS, MAX_REF_CHARS
from loraserve.common.security import GENERATE, ServerSecurity
from loraserve.httpapi.body import load_json, off_loop
from loraserve.httpapi.responses import Choice, Shape, cumulative_logprob, sse, usage_json
from loraserve.httpapi.schemas import ChatCompletionRequest, CompletionRequest, Strict, new_id
from loraserve.protos.v1 import inference_pb2 as pb

log = logging.getLogger("loraserve.http")

TIMEOUT_HEADER = "x-loraserve-timeout"
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")  # what admission (Edge.gate) decides on
ROUTES = (  # counted by route
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
)
# /v1 routes that take the worker admin RPCs' scopes instead of Generate's
ADMIN_ROUTES = {
    "/v1/load_lora_adapter": "/loraserve.v1.WorkerAdmin/LoadAdapter",
    "/v1/unload_lora_adapter": "/loraserve.v1.WorkerAdmin/UnloadAdapter",
}
HTTP_REQUESTS = Counter(
    "loraserve_http_requests",
    "OpenAI-compatible HTTP requests by route and status",
    ["server", "route", "status"],
)

# The standard gRPC -> HTTP mapping (google.rpc.Code), for every status docs/design.md §8 uses and a few more.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


class Backend(Protocol):
    """What the HTTP API needs from the server it runs in."""

    role: str  # "router" or "worker" (metrics label)

    async def adapter_for(self, model: str) -> str:
        """The ``GenerateRequest.adapter`` for an OpenAI ``model``: "" for a base model id, else the ref."""
        ...

    def generate(
        self, request: pb.GenerateRequest, timeout: float | None
    ) -> AsyncIterator[pb.GenerateResponse]:
        """The same stream gRPC ``Generate`` sends (``timeout``: its deadline); refusals raise ``LoraserveError``."""
        ...

    async def models(self) -> list[dict[str, Any]]:
        """OpenAI model objects: the base model(s) first, then the adapters."""
        ...


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    kind = ERROR_TYPE.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(exc: LoraserveError) -> JSONResponse:
    """The OpenAI-shaped error for a refusal; a 429 or 503 that waiting cures says how long in
    ``Retry-After`` (whole seconds)."""
    status = HTTP_STATUS.get(exc.code, 500)
    hint = exc.retry_hint
    headers = dict(retry_headers(hint)) if hint is not None else None
    return JSONResponse(error_body(status, exc.message, exc.code_name), status_code=status, headers=headers)


def retry_headers(hint: float) -> list[tuple[str, str]]:
    """The wait a refusal announces: ``Retry-After`` in whole seconds (HTTP's), and ``retry-after-ms`` in
    milliseconds (what the OpenAI SDKs read first: a wait shorter than a second stays short)."""
    return [
        ("Retry-After", str(retry_after_seconds(hint))),
        ("retry-after-ms", str(max(1, round(hint * 1000)))),
    ]


class Edge:
    """Pure ASGI middleware in front of the app (no task groups, so errors stay plain exceptions):

    - bearer tokens on ``/v1/*``, with ``Inference.Generate``'s scopes (docs/security.md): 401 for a missing
      or unknown token, 403 for a known one of another scope, before anything is read;
    - a body over ``limit`` bytes gets 413: at once when Content-Length says so, else when the app's
      reading passes the limit (``_TooLarge``, answered by the app's handler);
    - ``loraserve_http_requests_total`` by route and status;
    - every ``/v1/*`` response carries ``x-request-id``, refusals included (a 429 as much as a 200): the
      client's own when it sent one, else one made here and handed to the app as if the client had sent it;
    - admission (``common.admission``): a completion request the server cannot take now (``gate`` returns
      its refusal: a full queue, a router at its limit) gets its 429 here, its body drained unparsed, in
      microseconds of work; and the request's arrival is noted for the decision's clock.
    """

    def __init__(
        self,
        app: Any,
        role: str,
        security: ServerSecurity,
        limit: int,
        gate: Callable[[], LoraserveError | None] | None = None,
    ) -> None:
        self.app, self.role, self.security, self.limit, self.gate = app, role, security, limit, gate

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        token = admission.ARRIVED.set(time.perf_counter())
        try:
            await self._serve(scope, receive, send)
        finally:
            admission.ARRIVED.reset(token)

    async def _serve(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope["path"]
        route = path if path in ROUTES else "/v1/models" if path.startswith("/v1/models/") else "other"
        headers = dict(scope["headers"])
        status = 500
        request_id = b""
        if path.startswith("/v1/"):
            request_id = headers.get(b"x-request-id", b"")
            if not request_id:
                request_id = new_id("chatcmpl" if path == "/v1/chat/completions" else "cmpl").encode()
                kept = [(k, v) for k, v in scope["headers"] if k != b"x-request-id"]  # an empty one too
                scope = {**scope, "headers": [*kept, (b"x-request-id", request_id)]}
            if len(request_id) > MAX_ID_CHARS:  # refused by the app (400); not echoed
                request_id = b""

        async def counted_send(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                sent = message.get("headers") or []
                if request_id and not any(k.lower() == b"x-request-id" for k, _ in sent):
                    message = {**message, "headers": [*sent, (b"x-request-id", request_id)]}
            await send(message)

        try:
            if path.startswith("/v1/") and self.security.auth_on:
                header = headers.get(b"authorization", b"").decode("latin-1")
                token = header[7:] if header[:7].lower() == "bearer " else ""
                refused = self.security.refusal(token, ADMIN_ROUTES.get(path, GENERATE))
                if refused is not None:
                    code, why = refused
                    status = HTTP_STATUS[code]
                    return await _send_json(counted_send, status, error_body(status, why, code.name))
            length = headers.get(b"content-length")
            if length is not None and length.isdigit() and int(length) > self.limit:
                return await _send_json(counted_send, 413, too_large_body(self.limit))
            if self.gate is not None and path in GENERATION_ROUTES and scope["method"] == "POST":
                refused = self.gate()
                if refused is not None:
                    return await self._refuse(refused, receive, counted_send)
            seen = 0

            async def counted_receive() -> dict:
                nonlocal seen
                message = await receive()
                seen += len(message.get("body", b""))
                if seen > self.limit:  # chunked bodies announce no length
                    raise _TooLarge(self.limit)
                return message

            await self.app(scope, counted_receive, counted_send)
        finally:
            if route != "other":
                HTTP_REQUESTS.labels(self.role, route, str(status)).inc()

    async def _refuse(self, refused: LoraserveError, receive: Any, send: Any) -> None:
        """``refused`` as its HTTP error, the request's body read to its end (at most ``limit`` bytes, else the
        connection closes) so the connection stays open for the client's next request."""
        seen, more = 0, True
        while more and seen <= self.limit:
            message = await receive()
            seen += len(message.get("body", b""))
            more = message.get("more_body", False) and message["type"] == "http.request"
        status = HTTP_STATUS.get(refused.code, 500)
        hint = refused.retry_hint
        extra = [(k.lower().encode(), v.encode()) for k, v in retry_headers(hint)] if hint is not None else []
        await _send_json(send, status, error_body(status, refused.message, refused.code_name), extra)
        admission.observe(self.role, "refused", admission.arrived())


async def _send_json(
    send: Any, status: int, obj: dict[str, Any], extra: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    body = json.dumps(obj).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *extra]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    def __init__(self, limit: int) -> None:
        self.limit = limit


def too_large_body(limit: int) -> dict[str, Any]:
    return error_body(413, f"request body is over the limit of {limit} bytes", "RESOURCE_EXHAUSTED")


@runtime_checkable
class AdapterAdmin(Protocol):
    """A backend that loads and unloads adapters (a worker's): ``/v1/load_lora_adapter`` and
    ``/v1/unload_lora_adapter`` (vLLM's runtime LoRA API, what llm-d's adapter rollouts call)."""

    async def load_lora(self, name: str, path: str) -> None:
        """Make ``name`` resident (from ``path`` when given): NOT_FOUND, PERMISSION_DENIED, ..."""

    async def unload_lora(self, name: str) -> None:
        """Free ``name``'s slot once the requests using it have finished: NOT_FOUND when not resident."""


class LoadLoraRequest(Strict):
    lora_name: Annotated[str, Field(min_length=1, max_length=MAX_REF_CHARS)]
    lora_path: Annotated[str, Field(max_length=4096)] | None = None
    load_inplace: bool = False  # vLLM's: reload a name already loaded (a new version is a new ref here)


class UnloadLoraRequest(Strict):
    lora_name: Annotated[str, Field(min_length=1, max_length=MAX_REF_CHARS)]
    lora_int_id: int | None = None  # vLLM's; names identify adapters here


def build_app(
    backend: Backend,
    security: ServerSecurity | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    metrics: bool = True,
) -> Any:
    """The ASGI app; the same bearer tokens as gRPC guard /v1 (the tokens whose scope opens Generate).
    ``metrics``: serve ``/metrics`` (no token, as the metrics port does); the servers turn it off when they
    have a metrics port, so their metrics leave through that port only (docs/security.md)."""
    security = security or ServerSecurity()
    app = FastAPI(title="loraserve", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(LoraserveError)
    async def _refusal(request: Request, exc: LoraserveError):
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        return invalid_response(exc.errors())

    @app.exception_handler(_TooLarge)
    async def _too_large(request: Request, exc: _TooLarge):
        return JSONResponse(too_large_body(exc.limit), status_code=413)

    @app.exception_handler(_Invalid)
    async def _invalid_body(request: Request, exc: _Invalid):
        return exc.response

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        return JSONResponse(
            error_body(exc.status_code, str(exc.detail), str(exc.status_code)), exc.status_code
        )

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception):
        log.error("unexpected error in %s", request.url.path, exc_info=exc)
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}", "INTERNAL"), 500)

    @app.get("/health")
    async def health():
        return {"status": "serving"}

    if metrics:

        @app.get("/metrics")
        async def prometheus_metrics():
            return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": await backend.models()}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str):
        for card in await backend.models():
            if card["id"] == model:
                return card
        raise LoraserveError(f"model {model!r} does not exist", grpc.StatusCode.NOT_FOUND)

    if isinstance(backend, AdapterAdmin):  # a worker: vLLM's runtime LoRA API, with the admin RPCs' tokens

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(request: Request):
            body = await _parse(LoadLoraRequest, request)
            await backend.load_lora(body.lora_name, body.lora_path or "")
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(request: Request):
            body = await _parse(UnloadLoraRequest, request)
            await backend.unload_lora(body.lora_name)
            return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _serve(backend, await _parse(CompletionRequest, request), request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _serve(backend, await _parse(ChatCompletionRequest, request), request, chat=True)

    return Edge(app, backend.role, security, max_body_bytes, getattr(backend, "refusal", None))


def invalid_response(errors: Sequence[Any]) -> JSONResponse:
    """A pydantic validation failure -> 400 naming the first offending field (OpenAI's ``param``)."""
    first = errors[0] if errors else {}
    where = [str(p) for p in first.get("loc", ()) if p != "body"]
    message = first.get("msg", "invalid request").removeprefix("Value error, ")
    if first.get("type") == "extra_forbidden":
        message = f"unrecognized request argument supplied: {where[-1]}"
    elif where:
        message = f"{'.'.join(where)}: {message}"
    return JSONResponse(
        error_body(400, message, "INVALID_ARGUMENT", ".".join(where) or None), status_code=400
    )


class _Invalid(Exception):
    def __init__(self, response: JSONResponse) -> None:
        self.response = response


# A body up to this size is parsed, validated and copied into its protos on the event loop (~0.1 ms); a
# larger one on the body threads. Every hop to a thread waits for the GIL, which a busy loop hands over only
# at its switch interval (5 ms): two hops per request capped the router near 100 requests/s and queued the
# rest without bound (4x overload: refusals after seconds, served requests after 6 s).
INLINE_BODY_BYTES = 64 * 1024


async def _parse(kind: type[BaseModel], request: Request) -> Any:
    """The body as ``kind``, whatever the content type says (curl -d sends a form type): JSON or a 400.
    A big body is parsed and validated on the body threads: it never stalls the event loop."""
    raw = await request.body()
    request.state.body_bytes = len(raw)
    if len(raw) <= INLINE_BODY_BYTES:
        return parse_body(kind, raw)
    return await off_loop(parse_body, kind, raw)


def parse_body(kind: type[BaseModel], raw: bytes) -> Any:
    data = load_json(raw)  # depth, object sizes, strings (httpapi.body)
    if not isinstance(data, dict):
        raise InvalidArgument("request body must be a JSON object")
    try:
        return kind.model_validate(data)
    except ValidationError as exc:
        raise _Invalid(invalid_response(exc.errors())) from None


async def _serve(
    backend: Backend, body: CompletionRequest | ChatCompletionRequest, request: Request, chat: bool
) -> Response:
    request_id = request.headers.get("x-request-id") or new_id("chatcmpl" if chat else "cmpl")
    if len(request_id) > MAX_ID_CHARS:
        raise InvalidArgument(f"x-request-id is {len(request_id)} characters; at most {MAX_ID_CHARS}")
    adapter = await backend.adapter_for(body.model)
    # one request per sequence (prompts x candidates): copied on the loop while that is as little as one small
    # body (each candidate copies its prompt: a 64 KiB body with n = 64 would be 4 MiB), else off the loop
    if getattr(request.state, "body_bytes", INLINE_BODY_BYTES + 1) * body.candidates <= INLINE_BODY_BYTES:
        protos = body.to_grpc(adapter, request_id)
    else:
        protos = await off_loop(body.to_grpc, adapter, request_id)
    per_prompt = body.candidates
    echo = not chat and body.echo
    texts = tuple(body.echoed_text(i) for i in range(len(body.prompt))) if echo else ()
    tools = body.tool_use() if chat else None  # (checked by to_grpc above)
    shape = Shape(
        request_id,
        body.model,
        chat,
        body.wants_logprobs,
        echo,
        texts,
        tools if tools and tools.mode != "none" else None,
    )
    log.info(
        "http request",
        extra={"request_id": request_id, "model": body.model, "user": body.user or "", "stream": body.stream},
    )
    streams = [backend.generate(proto, _timeout(request)) for proto in protos]
    try:
        firsts = await _firsts(streams)  # errors before the first token (unknown adapter, queue full...)
    except LoraserveError as exc:
        bad = exc.code == grpc.StatusCode.INVALID_ARGUMENT and "structured output" in exc.message
        if bad and tools is not None and tools.forced:
            # the constraint was made from the tools: say so (the field to fix is theirs)
            raise InvalidArgument(f"tools: a function's parameters do not compile: {exc.message}") from None
        raise
    headers = {"x-request-id": request_id}
    if firsts[0].adapter:
        headers["x-loraserve-adapter"] = firsts[0].adapter  # the resolved name@version
    if body.stream:
        events = _events(streams, firsts, shape, per_prompt, body.include_usage, body.continuous_usage)
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)
    choices = [Choice() for _ in streams]
    for choice, first in zip(choices, firsts, strict=True):
        choice.add(first)
    tasks = [asyncio.ensure_future(_collect(st, c)) for st, c in zip(streams, choices, strict=True)]
    left = asyncio.ensure_future(_disconnected(request))
    try:
        while not all(t.done() for t in tasks):  # a client gone mid-generation cancels it, at once
            await asyncio.wait([*tasks, left], return_when=asyncio.FIRST_COMPLETED)
            if any(t.done() and t.exception() for t in tasks):
                break
            if left.done():
                log.info("client disconnected", extra={"request_id": request_id})
                return Response(status_code=499)
        for task in tasks:
            if task.done():
                task.result()  # the first failure becomes the response's status
    finally:
        left.cancel()
        for task in tasks:
            task.cancel()
    return JSONResponse(
        shape.whole(_best(choices, per_prompt, body.n), _usage(choices, per_prompt)), headers=headers
    )


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away. Its body has been read, so the server's next message is
    ``http.disconnect``: awaited, not polled, the choices are cancelled as the connection drops (a poll every
    0.25 s let a request decode ~80 more tokens on the test model)."""
    with contextlib.suppress(Exception):  # a server that fails the read: the client is gone all the same
        while (await request.receive())["type"] != "http.disconnect":
            pass


async def _firsts(streams: list[AsyncIterator[pb.GenerateResponse]]) -> list[pb.GenerateResponse]:
    """Every stream's first message; a refusal of any ends them all and is raised."""
    results = await asyncio.gather(*(anext(st) for st in streams), return_exceptions=True)
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    if failed is None:
        return list(results)  # type: ignore[arg-type]
    for st in streams:
        await st.aclose()  # type: ignore[attr-defined]
    if isinstance(failed, StopAsyncIteration):
        raise LoraserveError("the stream ended without a response", grpc.StatusCode.INTERNAL)
    raise failed


def _best(choices: list[Choice], per_prompt: int, n: int) -> list[tuple[int, Choice]]:
    """(prompt index, choice) of each prompt's ``n`` best candidates (by summed logprob when there are
    more candidates than ``n``: ``best_of``), prompt by prompt."""
    out = []
    for i in range(0, len(choices), per_prompt):
        group = choices[i : i + per_prompt]
        if per_prompt > n:
            group = sorted(group, key=cumulative_logprob, reverse=True)[:n]
        out.extend((i // per_prompt, c) for c in group)
    return out


def _usage(choices: list[Choice], per_prompt: int) -> tuple[int, int, int, int]:
    """(prompt tokens, counted once per prompt; completion tokens of every sequence, best_of's too; their
    drafted tokens and those kept)."""
    return (
        sum(c.prompt_tokens for c in choices[::per_prompt]),
        sum(c.completion_tokens for c in choices),
        sum(c.draft_tokens for c in choices),
        sum(c.accepted_draft_tokens for c in choices),
    )


def _timeout(request: Request) -> float | None:
    """``X-Loraserve-Timeout: <seconds>``: the request's deadline, as a gRPC client's timeout (504 past it)."""
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < 1e9:
        raise InvalidArgument(f"{TIMEOUT_HEADER} must be a positive number of seconds, got {raw[:32]!r}")
    return value


async def _collect(stream: AsyncIterator[pb.GenerateResponse], choice: Choice) -> None:
    try:
        async for msg in stream:
            choice.add(msg)
    finally:
        await stream.aclose()  # type: ignore[attr-defined]


def _says_nothing(choice: dict[str, Any]) -> bool:
    """A streamed choice without text, tool calls, logprobs or a finish reason."""
    delta = choice.get("delta", choice)
    text = delta.get("content") if "delta" in choice else choice.get("text")
    return (
        not text
        and not delta.get("tool_calls")
        and not choice.get("logprobs")
        and not choice["finish_reason"]
    )


async def _events(
    streams: list[AsyncIterator[pb.GenerateResponse]],
    firsts: list[pb.GenerateResponse],
    shape: Shape,
    per_prompt: int,
    include_usage: bool,
    continuous_usage: bool = False,
) -> AsyncIterator[bytes]:
    """SSE: one chunk per GenerateResponse of every choice as it comes (``index`` says whose; with
    ``continuous_usage`` each carries the request's usage so far, from the messages' ``progress``), the usage
    chunk if asked, then ``[DONE]``. A refusal after the first token (deadline, worker lost) is sent as an
    error event and ends every choice; the client's disconnect cancels us here, and closing the streams
    frees the requests."""
    choices = [Choice() for _ in streams]
    offsets = [0] * len(streams)
    calls = [shape.call_stream() for _ in streams]
    # (prompt, completion) tokens so far per choice: every first message is in, so every prompt is counted
    progress = [(f.progress.prompt_tokens, f.progress.completion_tokens) for f in firsts]
    # bounded: a client that reads slowly holds the streams back (gRPC flow control) instead of their
    # tokens piling up here
    queue: asyncio.Queue = asyncio.Queue(maxsize=2 * len(streams))

    async def pump(index: int) -> None:
        try:
            async for msg in streams[index]:
                await queue.put((index, msg))
        except Exception as exc:  # handed to the writer below, which ends every choice
            await queue.put((index, exc))
            return
        await queue.put((index, None))  # (not when cancelled: nobody reads any more)

    for index, first in enumerate(firsts):
        await queue.put((index, first))
    tasks = [asyncio.ensure_future(pump(i)) for i in range(len(streams))]
    open_streams, first_sent = len(streams), [False] * len(streams)
    try:
        while open_streams:
            index, item = await queue.get()
            if item is None:
                open_streams -= 1
                continue
            if isinstance(item, LoraserveError):
                status = HTTP_STATUS.get(item.code, 500)
                yield sse(error_body(status, item.message, item.code_name))
                break
            if isinstance(item, BaseException):
                raise item
            choices[index].add(item)
            first = not first_sent[index]
            prompt = index // per_prompt
            chunk = shape.chunk(item, offsets[index], first, index, prompt, calls[index])
            offsets[index] += len(item.text) + (shape.text_before(item, prompt) if first else 0)
            first_sent[index] = True
            if continuous_usage:
                progress[index] = (item.progress.prompt_tokens, item.progress.completion_tokens)
            if not first and _says_nothing(chunk["choices"][0]):
                continue  # text held back (a forced tool call's, a partial character, a stop string's start)
            if continuous_usage:
                so_far = sum(p for p, _ in progress[::per_prompt]), sum(c for _, c in progress)
                chunk["usage"] = usage_json(*so_far)
            yield sse(chunk)
    finally:  # also when the client went away (the response's generator is closed at its yield)
        for task in tasks:
            task.cancel()
        # the pumps must have stopped iterating before their streams are closed: closing a generator another
        # task is still inside raises "aclose(): asynchronous generator is already running"
        await asyncio.gather(*tasks, return_exceptions=True)
        for st in streams:
            await st.aclose()  # type: ignore[attr-defined]
    if include_usage:
        yield sse(shape.usage_chunk(_usage(choices, per_prompt)))
    yield sse("[DONE]")
