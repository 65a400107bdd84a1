"""Hypothesis against the serving doors of a worker and a router (real processes on loopback, the FakeRunner's
engine, a real tokenizer): OpenAI HTTP bodies with hostile values (huge, negative and fractional integers,
NaN, wrong types, nesting, unicode, lone surrogates), every field of a gRPC ``GenerateRequest`` at its type's
extremes, and raw bytes for every unary RPC of the worker and the router. No 5xx but 503/504, no INTERNAL or
UNKNOWN, no server dies, and the health checks of both (gRPC Health and HTTP /health, from a prober process)
stay under 100 ms at p99 throughout."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from loraserve.common.limits import MAX_JSON_DEPTH
from loraserve.protos.v1 import inference_pb2 as pb
from loraserve.protos.v1 import inference_pb2_grpc
from tests.security.conftest import HOSTILE_CONTEXT
from tests.security.fake_servers import ADAPTERS, MODEL, while_probing

pytestmark = pytest.mark.exclusive  # health p99 under load: `make test` runs these alone

FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
HTTP_OK = {200, 400, 404, 413, 429, 503, 504}  # 5xx only for "unavailable" and "deadline"
GRPC_OK = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}
EXTREMES = [0, 1, -1, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**32 - 1, 2**32, 2**40, 2**63, 2**64, 2**70]
HOSTILE_STRINGS = [
    "NaN",
    "Infinity",
    "-1",
    "1e309",
    "\ud800",
    "",
    "a@²",
    "x" * 300,
    "é" * 50,
    "\x00",
    "a1",
    "a1@1",
]


def _nest(depth: int) -> list:
    out: list = []
    for _ in range(depth):
        out = [out]
    return out


ints = st.integers(-(2**70), 2**70) | st.sampled_from(EXTREMES)
scalars = (
    st.none()
    | st.booleans()
    | ints
    | st.floats()
    | st.text(max_size=20)
    | st.sampled_from(HOSTILE_STRINGS)
    | st.sampled_from([_nest(MAX_JSON_DEPTH + 2), [[]] * 3])
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
token_ids = st.lists(st.integers(0, 383), min_size=1, max_size=8) | st.lists(ints, max_size=6)
small = st.integers(1, 6)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "tool", "wizard", ""])},
    optional={
        "content": st.text(max_size=30)
        | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=10)}), max_size=3)
        | values,
        "name": values,
    },
)
FIELDS = {  # each OpenAI field: plausible values and hostile ones
    "prompt": st.text(max_size=40) | token_ids | st.lists(token_ids, max_size=2) | values,
    "messages": st.lists(message, max_size=3) | values,
    "max_tokens": small | ints | values,
    "max_completion_tokens": small | ints,
    "temperature": st.floats(0, 2) | st.floats() | values,
    "top_p": st.floats(0, 1) | values,
    "top_k": ints | values,
    "seed": ints | values,
    "stop": st.text(max_size=5) | st.lists(st.text(max_size=5), max_size=20) | values,
    "stop_token_ids": st.lists(ints, max_size=5) | values,
    "n": ints | values,
    "logprobs": st.integers(0, 20) | ints | st.booleans() | values,
    "top_logprobs": st.integers(0, 20) | ints,
    "stream": st.booleans() | values,
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}) | values,
    "ignore_eos": st.booleans() | values,
    "logit_bias": st.dictionaries(st.text(max_size=4), st.floats(), max_size=3) | values,
    "user": st.text(max_size=10) | values,
    "presence_penalty": st.floats() | values,
    "echo": st.booleans() | values,
    "response_format": values,
    "bogus": values,
}
bodies = st.builds(
    lambda model, fields: {"model": model, **fields},
    st.sampled_from([MODEL, *ADAPTERS, "a1@1", "nope", "a@²", "", "x" * 600]) | values,
    st.fixed_dictionaries({}, optional=FIELDS),
)
PLAUSIBLE = {  # valid values only: these bodies reach the engine
    "max_tokens": small,
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 50),
    "seed": st.integers(-(2**63), 2**64 - 1),
    "stop": st.lists(st.text(min_size=1, max_size=3), max_size=3),
    "stop_token_ids": st.lists(st.integers(0, 383), max_size=3),
    "stream": st.booleans(),
    "ignore_eos": st.booleans(),
    "user": st.text(max_size=10),
}
plausible = st.builds(
    lambda model, prompt, fields: {"model": model, "prompt": prompt, **fields},
    st.sampled_from([MODEL, *ADAPTERS]),
    st.text(min_size=1, max_size=30) | st.lists(st.integers(0, 383), min_size=1, max_size=8),
    st.fixed_dictionaries({}, optional=PLAUSIBLE),
)
RAW_BODIES = [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"model": "tiny-fake", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}",
    b'{"model": "tiny-fake", "prompt": "\\ud800"}',
    b'{"model": "tiny-fake", "prompt": [' + b",".join([b"7"] * 400_000) + b"]}",
    json.dumps({"model": MODEL, "prompt": "word, " * 300_000}).encode(),
    json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "x"}] * 5000}).encode(),
    b"\xff\xfe\x00{",
    b"",
    b"null",
]


def test_fuzzed_http_bodies(hostile_stack) -> None:
    worker, router = hostile_stack
    clients = {s.url: httpx.Client(timeout=60) for s in (worker, router)}
    seen: dict[int, int] = {}

    @FUZZ
    @given(
        body=plausible | bodies | st.sampled_from(RAW_BODIES), chat=st.booleans(), via_router=st.booleans()
    )
    def run(body, chat, via_router) -> None:
        raw = body if isinstance(body, bytes) else json.dumps(body, allow_nan=True).encode()
        server = router if via_router else worker
        if chat and isinstance(body, dict) and isinstance(body.get("prompt"), str):  # a plausible chat
            chat_body = {k: v for k, v in body.items() if k != "prompt"}
            raw = json.dumps(
                {**chat_body, "messages": [{"role": "user", "content": body["prompt"]}]}
            ).encode()
        path = "chat/completions" if chat else "completions"
        resp = clients[server.url].post(
            f"{server.url}/v1/{path}", content=raw, headers={"content-type": "application/json"}
        )
        seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
        assert resp.status_code in HTTP_OK, (server.role, resp.status_code, resp.text[:300])
        if resp.status_code != 200:
            assert set(resp.json()["error"]) == {"message", "type", "param", "code"}

    try:
        while_probing((worker, router), run)
    finally:
        for c in clients.values():
            c.close()
    print("statuses:", seen)
    assert seen.get(200) and seen.get(400), seen  # the fuzz reached the engine, and the refusals


u32 = st.integers(0, 2**32 - 1) | st.sampled_from([0, 1, 2**31 - 1, 2**31, 2**32 - 1])
i32 = st.integers(-(2**31), 2**31 - 1) | st.sampled_from([-(2**31), -1, 0, 383, 384, 2**31 - 1])
u64 = st.integers(0, 2**64 - 1) | st.sampled_from([0, 2**63, 2**64 - 1])
f32 = st.floats(width=32) | st.sampled_from([0.0, 0.5, 1.0, 2.0])
texts = st.text(max_size=40) | st.sampled_from([s for s in HOSTILE_STRINGS if s != "\ud800"])
names = st.sampled_from(["", *ADAPTERS, "a1@1", "a2@prod", "nope", "a@²", "x" * 300]) | texts


@st.composite
def sampling(draw) -> pb.SamplingParams:
    p = pb.SamplingParams(
        max_tokens=draw(st.integers(0, 6) | u32),
        temperature=draw(f32),
        top_p=draw(f32),
        top_k=draw(u32),
        stop=draw(st.lists(texts, max_size=20)),
        stop_token_ids=draw(st.lists(i32, max_size=5) | st.lists(i32, min_size=257, max_size=300)),
        ignore_eos=draw(st.booleans()),
    )
    if draw(st.booleans()):
        p.seed = draw(u64)
    if draw(st.booleans()):
        p.logprobs = draw(st.integers(0, 21) | u32)
    return p


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    req = pb.GenerateRequest(
        request_id=draw(texts | st.just("r" * 300)),
        adapter=draw(names),
        sampling=draw(sampling()),
        routing_key=draw(texts),
        mix=draw(st.lists(st.builds(pb.MixPart, adapter=names, weight=st.floats()), max_size=5)),
    )
    kind = draw(st.sampled_from(["text", "tokens", "chat", "none"]))
    if kind == "text":
        req.text = draw(texts | st.just("word " * (HOSTILE_CONTEXT * 2)))
    elif kind == "tokens":
        req.tokens.ids.extend(draw(st.lists(st.integers(0, 383), min_size=1, max_size=8) | st.lists(i32)))
    elif kind == "chat":
        roles = st.sampled_from(["system", "user", "assistant", "wizard", ""]) | texts
        req.chat.messages.extend(
            draw(st.lists(st.builds(pb.ChatMessage, role=roles, content=texts), max_size=4))
        )
    return req


@st.composite
def plausible_requests(draw) -> pb.GenerateRequest:
    """Valid requests: these reach the engine."""
    req = pb.GenerateRequest(
        adapter=draw(st.sampled_from(["", *ADAPTERS])),
        sampling=pb.SamplingParams(
            max_tokens=draw(st.integers(0, 6)),
            temperature=draw(st.floats(0, 2, width=32)),
            top_p=draw(st.floats(0, 1, width=32)),
            top_k=draw(u32),
            stop=draw(st.lists(st.text(min_size=1, max_size=3), max_size=3)),
            ignore_eos=draw(st.booleans()),
        ),
    )
    if draw(st.booleans()):
        req.sampling.logprobs = draw(st.integers(0, 20))
    kind = draw(st.sampled_from(["text", "tokens", "chat"]))
    if kind == "text":
        req.text = draw(st.text(min_size=1, max_size=30))
    elif kind == "tokens":
        req.tokens.ids.extend(draw(st.lists(st.integers(0, 383), min_size=1, max_size=8)))
    else:
        req.chat.messages.append(pb.ChatMessage(role="user", content=draw(st.text(min_size=1, max_size=30))))
    return req


def _grpc(channel: grpc.Channel, method: str, raw: bytes, streaming: bool) -> grpc.StatusCode:
    kind = channel.unary_stream if streaming else channel.unary_unary
    call = kind(method, request_serializer=lambda b: b, response_deserializer=lambda b: b)
    try:
        out = call(raw, timeout=30)
        if streaming:
            list(out)
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_fuzzed_grpc_generate(hostile_stack) -> None:
    worker, router = hostile_stack
    channels = {s.address: grpc.insecure_channel(s.address) for s in (worker, router)}
    seen: dict[str, int] = {}

    @FUZZ
    @given(req=plausible_requests() | generate_requests(), via_router=st.booleans())
    def run(req, via_router) -> None:
        server = router if via_router else worker
        code = _grpc(
            channels[server.address], "/loraserve.v1.Inference/Generate", req.SerializeToString(), True
        )
        seen[code.name] = seen.get(code.name, 0) + 1
        assert code in GRPC_OK, (server.role, code, req)

    try:
        while_probing((worker, router), run)
    finally:
        for c in channels.values():
            c.close()
    print("codes:", seen)
    assert seen.get("OK") and seen.get("INVALID_ARGUMENT"), seen


UNARY = [  # every RPC of the worker and the router, raw bytes for its request
    ("worker", "/loraserve.v1.Inference/Generate", True),
    ("router", "/loraserve.v1.Inference/Generate", True),
    ("worker", "/loraserve.v1.WorkerAdmin/LoadAdapter", False),
    ("worker", "/loraserve.v1.WorkerAdmin/UnloadAdapter", False),
    ("worker", "/loraserve.v1.WorkerAdmin/ListSlots", False),
    ("worker", "/loraserve.v1.WorkerAdmin/GetWorkerInfo", False),
]


@pytest.mark.parametrize("role,method,streaming", UNARY, ids=[f"{r}{m}" for r, m, _ in UNARY])
def test_raw_bytes_to_every_rpc(hostile_stack, role, method, streaming) -> None:
    server = dict(zip(("worker", "router"), hostile_stack, strict=True))[role]
    with grpc.insecure_channel(server.address) as channel:

        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
        @given(
            raw=st.binary(max_size=64)
            | st.sampled_from([b"\x1a\x02\xff\xfe", b"\x0a\x03\xc3\x28a", b"\xff" * 8])
        )
        def run(raw) -> None:
            code = _grpc(channel, method, raw, streaming)
            assert code in GRPC_OK, (method, code, raw)

        run()


def test_both_servers_alive_and_serving_after_the_fuzz(hostile_stack) -> None:
    for server in hostile_stack:
        assert server.alive(), "".join(server.log[-40:])
        resp = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": MODEL, "prompt": "hello", "max_tokens": 3, "ignore_eos": True},
            timeout=30,
        )
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3, resp.text
        with grpc.insecure_channel(server.address) as channel:
            out = list(
                inference_pb2_grpc.InferenceStub(channel).Generate(
                    pb.GenerateRequest(
                        tokens=pb.TokenIds(ids=[5, 6]), sampling=pb.SamplingParams(max_tokens=2)
                    ),
                    timeout=30,
                )
            )
        assert out[-1].usage.completion_tokens == 2
