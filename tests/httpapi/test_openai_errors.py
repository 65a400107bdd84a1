"""Every refusal of the HTTP API over plain HTTP: OpenAI's error shape, the HTTP status the standard gRPC
mapping gives each docs/design.md §8 row, nothing queued, and the server unharmed afterwards. Plus a fuzz of
request bodies: only documented statuses, never a 500."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY

from loraserve.engine.config import EngineConfig
from loraserve.engine.engine import Engine
from loraserve.httpapi.app import build_app
from loraserve.models.checkpoint import load_checkpoint
from loraserve.router.http_backend import RouterHttpBackend
from loraserve.router.routing import Locator, WorkerPool
from loraserve.router.server import RouterServicer
from loraserve.worker.http_backend import WorkerHttpBackend
from loraserve.worker.server import InferenceServicer
from tests.aio_thread import http_server_thread
from tests.e2e.compose_local import free_port
from tests.httpapi.conftest import MODEL

OK = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

# (endpoint, body, status, gRPC code in the error, words in the message, param)
ROWS = [
    ("completions", {**OK, "max_tokens": "ten"}, 400, "INVALID_ARGUMENT", "max_tokens", "max_tokens"),
    (
        "completions",
        {**OK, "foo": 1},
        400,
        "INVALID_ARGUMENT",
        "unrecognized request argument supplied: foo",
        "foo",
    ),
    ("completions", {**OK, "n": 0}, 400, "INVALID_ARGUMENT", "greater than or equal to 1", "n"),
    ("completions", {**OK, "n": 65}, 400, "INVALID_ARGUMENT", "less than or equal to 64", "n"),
    ("completions", {**OK, "n": 3, "best_of": 2}, 400, "INVALID_ARGUMENT", "at least n", None),
    ("completions", {**OK, "n": 1, "best_of": 2, "stream": True}, 400, "INVALID_ARGUMENT", "streamed", None),
    ("completions", {**OK, "prompt": ["a"] * 9, "n": 8}, 400, "INVALID_ARGUMENT", "72 sequences", None),
    ("completions", {**OK, "prompt": ["a"] * 65}, 400, "INVALID_ARGUMENT", "65 prompts", "prompt"),
    ("completions", {**OK, "temperature": -0.5}, 400, "INVALID_ARGUMENT", "temperature", "temperature"),
    ("completions", {**OK, "top_p": 1.5}, 400, "INVALID_ARGUMENT", "top_p", "top_p"),
    ("completions", {**OK, "max_tokens": 0}, 400, "INVALID_ARGUMENT", "max_tokens", "max_tokens"),
    ("completions", {**OK, "logprobs": 21}, 400, "INVALID_ARGUMENT", "logprobs", "logprobs"),
    (
        "completions",
        {**OK, "presence_penalty": 2.5},
        400,
        "INVALID_ARGUMENT",
        "less than or equal to 2",
        None,
    ),
    ("completions", {**OK, "frequency_penalty": -3}, 400, "INVALID_ARGUMENT", "greater than or equal", None),
    ("completions", {**OK, "repetition_penalty": 0}, 400, "INVALID_ARGUMENT", "greater than or equal", None),
    (
        "completions",
        {**OK, "min_tokens": 20},
        400,
        "INVALID_ARGUMENT",
        "min_tokens (20) must be at most",
        None,
    ),
    ("completions", {**OK, "logit_bias": {"x1": 1}}, 400, "INVALID_ARGUMENT", "keys are token ids", None),
    ("completions", {**OK, "logit_bias": {"5": 101}}, 400, "INVALID_ARGUMENT", "in [-100, 100]", None),
    (
        "completions",
        {**OK, "logit_bias": {"99999": 1}},
        400,
        "INVALID_ARGUMENT",
        "outside the vocabulary",
        None,
    ),
    (
        "chat/completions",
        {**CHAT, "logit_bias": {str(t): 1 for t in range(301)}},
        400,
        "INVALID_ARGUMENT",
        "at most 300",
        None,
    ),
    ("completions", {**OK, "prompt": ""}, 400, "INVALID_ARGUMENT", "prompt is empty", None),
    ("completions", {**OK, "prompt": []}, 400, "INVALID_ARGUMENT", "prompt is empty", None),
    ("completions", {**OK, "prompt": ["a", ""]}, 400, "INVALID_ARGUMENT", "prompt 1 is empty", None),
    (
        "completions",
        {**OK, "prompt": ["a", [1, 99999]]},
        400,
        "INVALID_ARGUMENT",
        "outside the vocabulary",
        None,
    ),
    ("completions", {**OK, "prompt": [1, 99999]}, 400, "INVALID_ARGUMENT", "outside the vocabulary", None),
    ("completions", {**OK, "prompt": "word " * 1200}, 400, "INVALID_ARGUMENT", "context", None),
    ("completions", {**OK, "model": "no-such-adapter"}, 404, "NOT_FOUND", "no-such-adapter", None),
    ("completions", {**OK, "model": "org/other-model"}, 404, "NOT_FOUND", "neither a base model", None),
    ("completions", {"prompt": "x"}, 400, "INVALID_ARGUMENT", "model", "model"),
    ("chat/completions", {**CHAT, "messages": []}, 400, "INVALID_ARGUMENT", "messages", "messages"),
    (
        "chat/completions",
        {**CHAT, "messages": [{"role": "wizard", "content": "x"}]},
        400,
        "INVALID_ARGUMENT",
        "unknown role",
        None,
    ),
    (
        "chat/completions",
        {**CHAT, "messages": [{"role": "user", "content": ""}]},
        400,
        "INVALID_ARGUMENT",
        "no text",
        None,
    ),
    (
        "chat/completions",
        {
            **CHAT,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
        },
        400,
        "INVALID_ARGUMENT",
        "",
        None,
    ),
    (
        "chat/completions",
        {**CHAT, "response_format": {"type": "xml"}},
        400,
        "INVALID_ARGUMENT",
        "json_schema",
        None,
    ),
    (
        "chat/completions",
        {**CHAT, "response_format": {"type": "json_schema"}},
        400,
        "INVALID_ARGUMENT",
        "schema",
        None,
    ),
    ("completions", {**OK, "guided_regex": "[a-"}, 400, "INVALID_ARGUMENT", "unclosed character class", None),
    ("completions", {**OK, "guided_json": "{nope"}, 400, "INVALID_ARGUMENT", "json_schema is not JSON", None),
    (
        "completions",
        {**OK, "guided_regex": "a", "guided_choice": ["b"]},
        400,
        "INVALID_ARGUMENT",
        "send one",
        None,
    ),
    ("completions", {**OK, "guided_choice": []}, 400, "INVALID_ARGUMENT", "guided_choice", None),
    ("completions", {**OK, "guided_regex": "a" * 70000}, 400, "INVALID_ARGUMENT", "at most 65536", None),
    (
        "completions",
        {**OK, "structured_outputs": {"regex": "a", "choice": ["b"]}},
        400,
        "INVALID_ARGUMENT",
        "exactly one",
        None,
    ),
    ("chat/completions", {**CHAT, "top_logprobs": 2}, 400, "INVALID_ARGUMENT", "needs logprobs=true", None),
    ("chat/completions", {**CHAT, "tools": [{"type": "function"}]}, 400, "INVALID_ARGUMENT", "tools", None),
]


def _check(resp: httpx.Response, status: int, code: str, words: str = "", param: str | None = None) -> None:
    assert resp.status_code == status, resp.text
    if resp.request.url.path.startswith("/v1/"):  # every refusal names its request, as every answer does
        assert re.fullmatch(r"(chat)?cmpl-[0-9a-f]+", resp.headers.get("x-request-id", "")), resp.headers
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == code and words in err["message"]
    if param is not None:
        assert err["param"] == param
    assert err["type"] == {
        400: "invalid_request_error",
        401: "authentication_error",
        404: "not_found_error",
        413: "invalid_request_error",
        429: "rate_limit_error",
    }.get(status, "server_error")


@pytest.mark.parametrize(
    "endpoint,body,status,code,words,param", ROWS, ids=[f"{r[0]}-{i}" for i, r in enumerate(ROWS)]
)
def test_bad_requests(served, endpoint, body, status, code, words, param) -> None:
    resp = httpx.post(f"{served.url}/v1/{endpoint}", json=body, timeout=30)
    _check(resp, status, code, words, param)
    assert "retry-after" not in resp.headers  # waiting cures no bad request
    snap = served.worker.engine.snapshot()
    assert snap.running == 0 and snap.waiting == 0  # nothing queued


def test_malformed_and_non_finite_json(served) -> None:
    resp = httpx.post(f"{served.url}/v1/completions", content=b'{"model": "x", "prompt": ', timeout=30)
    _check(resp, 400, "INVALID_ARGUMENT", "not valid JSON")
    raw = b'{"model": "tiny-llama", "prompt": "hi", "temperature": NaN}'
    resp = httpx.post(
        f"{served.url}/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    _check(resp, 400, "INVALID_ARGUMENT", "temperature", "temperature")
    raw = raw.replace(b"NaN", b"Infinity")
    resp = httpx.post(
        f"{served.url}/v1/completions", content=raw, headers={"content-type": "application/json"}
    )
    _check(resp, 400, "INVALID_ARGUMENT", "temperature", "temperature")


def test_oversized_body_is_413(served) -> None:
    big = json.dumps({**OK, "prompt": "x" * (17 * 1024 * 1024)}).encode()
    resp = httpx.post(f"{served.url}/v1/completions", content=big, timeout=60)
    _check(resp, 413, "RESOURCE_EXHAUSTED", "over the limit")

    def chunks():  # chunked: no Content-Length to refuse up front
        yield b'{"model": "tiny-llama", "prompt": "'
        for _ in range(17):
            yield b"x" * (1024 * 1024)
        yield b'"}'

    resp = httpx.post(f"{served.url}/v1/completions", content=chunks(), timeout=60)
    _check(resp, 413, "RESOURCE_EXHAUSTED", "over the limit")


def test_wrong_method_and_route(served) -> None:
    assert httpx.get(f"{served.url}/v1/completions").status_code == 405
    resp = httpx.get(f"{served.url}/v1/nothing-here")
    assert resp.status_code == 404 and "message" in resp.json()["error"]
    assert httpx.get(f"{served.url}/v1/models/no-such-model").status_code == 404


def _refusals() -> tuple[float, float]:
    """The router's refusals so far: (how many, seconds in all) of loraserve_admission_seconds."""
    labels = {"role": "router", "outcome": "refused"}
    get = lambda name: REGISTRY.get_sample_value(f"loraserve_admission_seconds_{name}", labels) or 0.0  # noqa: E731
    return get("count"), get("sum")


def test_queue_full_is_429_and_no_worker_is_503() -> None:
    """A router at its stream limit refuses at once (RESOURCE_EXHAUSTED); one whose registry is down and
    has never located anything has nowhere to send (UNAVAILABLE). Both real router servicers."""
    dead = f"127.0.0.1:{free_port()}"

    def app(limit: int):
        def make():
            locator = Locator(dead, ttl=1.0, max_candidates=3)
            servicer = RouterServicer(locator, WorkerPool(), max_concurrency=limit)
            backend = RouterHttpBackend(servicer, locator)
            backend._bases = (float("inf"), {MODEL: 0})  # skip ListWorkers: the registry is down
            return build_app(backend)

        return make

    before = _refusals()
    with http_server_thread(app(0)) as port:
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=OK)
        _check(resp, 429, "RESOURCE_EXHAUSTED", "limit")
        # a wait cures it: clients such as guidellm back off. Nothing has drained yet: the unmeasured 1 s,
        # in whole seconds and in the milliseconds the OpenAI SDKs read first
        assert resp.headers["retry-after"] == "1" and resp.headers["retry-after-ms"] == "1000"
        # refused at the edge, before the body is read: a body that is no JSON gets the same 429, not a 400,
        # and the connection stays usable (the body was drained)
        with httpx.Client() as client:
            for _ in range(2):
                bad = client.post(f"http://127.0.0.1:{port}/v1/completions", content=b"{not json")
                _check(bad, 429, "RESOURCE_EXHAUSTED", "limit")
    # three decisions timed from the edge, each well within the 20 ms the overload target allows
    count, seconds = _refusals()
    assert count - before[0] == 3 and seconds - before[1] < 3 * 0.02
    with http_server_thread(app(8)) as port:
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=OK, timeout=30)
        _check(resp, 503, "UNAVAILABLE", "registry unavailable")
        assert resp.headers["retry-after"] == "1"
        # /v1/models needs the registry too: 503 with the same shape
        _check(httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30), 503, "UNAVAILABLE", "registry")


def test_worker_not_ready_is_503(llama_dir) -> None:
    engine = Engine(
        load_checkpoint(str(llama_dir)), EngineConfig(max_batch_size=1, max_seq_len=32)
    )  # not started

    def make():
        return build_app(WorkerHttpBackend(InferenceServicer(engine, None), MODEL))

    with http_server_thread(make) as port:
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=OK)
        _check(resp, 503, "UNAVAILABLE", "warming up")
        assert resp.headers["retry-after"] == "1"


FUZZ = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=20))
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
fields = st.sampled_from(
    [
        "model",
        "prompt",
        "messages",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "n",
        "logprobs",
        "top_logprobs",
        "stream",
        "stream_options",
        "ignore_eos",
        "stop_token_ids",
        "user",
        "bogus",
    ]
)
bodies = st.dictionaries(fields, values, max_size=8).map(lambda d: {"model": MODEL, "max_tokens": 2, **d})


@FUZZ
@given(body=bodies, chat=st.booleans())
def test_fuzzed_bodies_get_documented_statuses(served, body, chat) -> None:
    try:
        raw = json.dumps(body, allow_nan=True)
    except (TypeError, ValueError):
        return
    endpoint = "chat/completions" if chat else "completions"
    resp = httpx.post(
        f"{served.url}/v1/{endpoint}", content=raw, headers={"content-type": "application/json"}, timeout=60
    )
    assert resp.status_code in (200, 400, 404), resp.text
    if resp.status_code != 200:
        assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


def test_server_unharmed_after_all_that(served) -> None:
    out = served.client.completions.create(
        model="all-r4", prompt="hello", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == 3
