"""A hostile client against a worker and a router (real processes on loopback, the FakeRunner's engine with a
real byte-level BPE tokenizer): oversized prompts are refused before any tokenising, quickly, while health
checks of both servers stay fast; out-of-range integers, deep JSON and oversized lists are 400 /
INVALID_ARGUMENT, never 500 / INTERNAL."""

from __future__ import annotations

import json
import time

import grpc
import httpx
import pytest

from loraserve.protos.v1 import inference_pb2 as pb
from loraserve.protos.v1 import inference_pb2_grpc
from tests.security.fake_servers import MODEL, Server, while_probing

pytestmark = pytest.mark.exclusive  # health p99 under load: `make test` runs these alone

BIG = 15_000_000  # bytes of prompt text: under the 16 MiB body and message limits


@pytest.fixture(scope="module")
def stack(hostile_stack):
    return hostile_stack


def _nest(depth: int) -> list:
    out: list = []
    for _ in range(depth - 1):
        out = [out]
    return out


@pytest.fixture(scope="module")
def big_text() -> str:
    return ("hello world, " * (BIG // 13 + 1))[:BIG]


def _post(server: Server, path: str, body: dict | bytes, timeout: float = 120) -> httpx.Response:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(
        f"{server.url}/v1/{path}", content=raw, headers={"content-type": "application/json"}, timeout=timeout
    )


def _error(resp: httpx.Response, status: int = 400, code: str = "INVALID_ARGUMENT") -> str:
    assert resp.status_code == status, resp.text[:500]
    err = resp.json()["error"]
    assert err["code"] == code, err
    return err["message"]


def _grpc_code(server: Server, req: pb.GenerateRequest) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(
        server.address, options=[("grpc.max_send_message_length", 32 << 20)]
    ) as channel:
        try:
            list(inference_pb2_grpc.InferenceStub(channel).Generate(req, timeout=120))
        except grpc.RpcError as exc:
            return exc.code(), exc.details()
    return grpc.StatusCode.OK, ""


def test_a_15_mb_prompt_is_refused_at_once_over_http(stack, big_text) -> None:
    worker, router = stack
    bodies = [
        ("completions", json.dumps({"model": MODEL, "prompt": big_text, "max_tokens": 2}).encode()),
        (
            "chat/completions",
            json.dumps(
                {"model": MODEL, "messages": [{"role": "user", "content": big_text}], "max_tokens": 2}
            ).encode(),
        ),
    ]

    def action() -> None:
        for server in (worker, router):
            for path, body in bodies:
                t = time.perf_counter()
                message = _error(_post(server, path, body))
                took = time.perf_counter() - t
                print(f"{path} via {server.url}: 400 after {took * 1000:.0f} ms")
                assert "bytes" in message and "context" in message, message
                assert took < 3.0, f"{path} on the {server.url}: refused after {took:.1f} s"

    while_probing((worker, router), action)


def test_a_15_mb_prompt_is_refused_at_once_over_grpc(stack, big_text) -> None:
    worker, router = stack

    def action() -> None:
        for server in (worker, router):
            # the router takes gRPC messages of up to 4 MiB (grpc's default), the worker 16 MiB
            text = big_text if server is worker else big_text[: 3 << 20]
            requests = [
                pb.GenerateRequest(text=text, sampling=pb.SamplingParams(max_tokens=2)),
                pb.GenerateRequest(
                    chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=text)]),
                    sampling=pb.SamplingParams(max_tokens=2),
                ),
                pb.GenerateRequest(tokens=pb.TokenIds(ids=[5] * 3_000_000)),
            ]
            for req in requests:
                t = time.perf_counter()
                code, details = _grpc_code(server, req)
                took = time.perf_counter() - t
                print(
                    f"{req.WhichOneof('prompt')} via {server.address}: {code.name} after {took * 1000:.0f} ms"
                )
                assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
                assert "context" in details, details
                assert took < 3.0, f"{req.WhichOneof('prompt')} refused after {took:.1f} s"

    while_probing((worker, router), action)


@pytest.mark.parametrize(
    "body,words",
    [
        ({"max_tokens": 4294967296}, "max_tokens"),
        ({"max_tokens": 2**70}, "max_tokens"),
        ({"prompt": [1, 2**40]}, "token"),
        ({"prompt": [[1, -3]]}, "token"),
        ({"stop_token_ids": [2**40]}, "stop_token_ids"),
        ({"top_k": 2**40}, "top_k"),
        ({"seed": 2**64}, "seed"),
        ({"prompt": "\ud800 lone surrogate"}, "Unicode"),
        ({"prompt": [5] * 300_000}, "token ids; at most 262144"),
        ({"prompt": [5] * 2_000_000}, "more than 327680 JSON values"),
        ({"prompt": "a,b" * 400_000}, "context"),  # commas in a string are no JSON values
        ({"stop": ["x"] * 100_000}, "stop"),
        ({"stop": "y" * 100_000}, "stop"),
        ({"stop_token_ids": [3] * 100_000}, "stop_token_ids"),
        ({"logit_bias": {str(i): 1.0 for i in range(100_000)}}, "logit_bias"),
        ({"metadata": {"k": _nest(80)}}, "nested"),
    ],
)
def test_out_of_range_fields_are_400(stack, body, words) -> None:
    worker, router = stack
    raw = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 2, **body}).encode()
    for server in (worker, router):
        message = _error(_post(server, "completions", raw))
        assert words in message, message


def test_chat_limits_are_400(stack) -> None:
    worker, router = stack
    many = [{"role": "user", "content": "x"}] * 5000
    for server in (worker, router):
        message = _error(_post(server, "chat/completions", {"model": MODEL, "messages": many}))
        assert "messages" in message, message
        message = _error(
            _post(
                server,
                "chat/completions",
                {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 1000}],
                },
            )
        )
        assert "content" in message, message


def test_json_nested_100000_deep_is_400(stack) -> None:
    worker, router = stack
    for server in (worker, router):
        for deep in (b"[" * 100_000 + b"]" * 100_000, b'{"model": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"):
            message = _error(_post(server, "completions", deep))
            assert "nested" in message, message
        huge_int = b'{"model": "' + MODEL.encode() + b'", "prompt": "x", "max_tokens": ' + b"9" * 5000 + b"}"
        _error(_post(server, "completions", huge_int))


def test_grpc_fields_out_of_range_are_invalid_argument(stack) -> None:
    worker, router = stack
    cases = [
        pb.GenerateRequest(request_id="r" * 1_000_000, text="hi"),
        pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(stop=["s"] * 1000)),
        pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(stop=["s" * 100_000])),
        pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(stop_token_ids=[3] * 100_000)),
        pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(logprobs=2**32 - 1)),
        pb.GenerateRequest(
            chat=pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="x")] * 100_000)
        ),
        pb.GenerateRequest(tokens=pb.TokenIds(ids=[-1, 2**31 - 1])),
    ]
    for server in (worker, router):
        for req in cases:
            code, details = _grpc_code(server, req)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (server.address, code, details[:200])


def test_adapter_refs_that_crash_int_are_invalid_argument(stack) -> None:
    """ "a@²" passes str.isdigit but not int(); so does a 5000-digit version: both were INTERNAL."""
    from loraserve.protos.v1 import worker_admin_pb2 as wa
    from loraserve.protos.v1 import worker_admin_pb2_grpc

    worker, router = stack
    refs = ["a1@²", "a1@" + "9" * 5000]
    for server in (worker, router):
        for ref in refs:
            code, details = _grpc_code(server, pb.GenerateRequest(adapter=ref, text="hi"))
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (ref[:8], code, details)
        message = _error(_post(server, "completions", {"model": refs[0], "prompt": "hi"}), 404, "NOT_FOUND")
        assert "does not exist" in message
    with grpc.insecure_channel(worker.address) as channel:
        admin = worker_admin_pb2_grpc.WorkerAdminStub(channel)
        for ref in refs:
            for method, request in (
                (admin.LoadAdapter, wa.LoadAdapterRequest(adapter=ref)),
                (admin.UnloadAdapter, wa.UnloadAdapterRequest(adapter=ref)),
            ):
                with pytest.raises(grpc.RpcError) as exc:
                    method(request, timeout=30)
                assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.value


def test_grpc_bytes_that_are_no_request_are_invalid_argument(stack) -> None:
    """A string field holding bad UTF-8 fails to parse: INVALID_ARGUMENT, not INTERNAL."""
    worker, router = stack
    for server in (worker, router):
        with grpc.insecure_channel(server.address) as channel:
            call = channel.unary_stream(
                "/loraserve.v1.Inference/Generate",
                request_serializer=lambda b: b,
                response_deserializer=pb.GenerateResponse.FromString,
            )
            with pytest.raises(grpc.RpcError) as exc:
                list(call(b"\x1a\x02\xff\xfe", timeout=30))
            assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.value


def test_huge_top_k_never_reaches_numpy_as_an_overflow() -> None:
    """top_k is a uint32 on the wire and an int32 on the device: values past the vocabulary mean 'off'."""
    from loraserve.engine.jax_runner import _sampling_arrays
    from loraserve.engine.request import EngineRequest, Sampling, SamplingRow

    req = EngineRequest("r", "", [1], Sampling(top_k=2**32 - 1, temperature=1.0), lambda ev: None)
    arrays = _sampling_arrays([SamplingRow.of(req)])
    assert arrays.top_k[0] == 2**31 - 1


def test_servers_alive_and_serving_after_all_that(stack) -> None:
    worker, router = stack
    for server in (worker, router):
        assert server.alive()
        resp = _post(
            server, "completions", {"model": MODEL, "prompt": "hello", "max_tokens": 3, "ignore_eos": True}
        )
        assert resp.status_code == 200, resp.text
        assert resp.json()["usage"]["completion_tokens"] == 3
