"""common.interceptors.StatusInterceptor on a real grpc.aio server: every handler kind maps a raised
LoraserveError to its status, passes aborts through, turns a crash into INTERNAL with a logged traceback, and
records loraserve_rpc_requests_total / loraserve_rpc_seconds once per RPC (streams when they end)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterator

import grpc
import pytest
from prometheus_client import REGISTRY

from loraserve.common.errors import NotFound, ResourceExhausted
from loraserve.common.interceptors import StatusInterceptor
from tests import waiting
from tests.aio_thread import aio_server_thread

SERVICE = "loraserve.test.Probe"
started_streams: list[str] = []  # "Slow" streams that reached their first await (set on the server's loop)


async def unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    match request:
        case b"missing":
            raise NotFound("adapter 'x' does not exist")
        case b"abort":
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "handler said no")
        case b"crash":
            raise RuntimeError("boom")
        case b"set-code":
            context.set_code(grpc.StatusCode.ABORTED)
            context.set_details("told by set_code")
            return b""
    return b"ok:" + request


async def count(request: bytes, context: grpc.aio.ServicerContext):
    """Yields b"0", b"1", ... up to the number given; b"2!" yields two then refuses (RESOURCE_EXHAUSTED)."""
    n = int(request.rstrip(b"!"))
    for i in range(n):
        yield str(i).encode()
    if request.endswith(b"!"):
        raise ResourceExhausted("queue is full")


async def slow(request: bytes, context: grpc.aio.ServicerContext):
    yield b"first"
    started_streams.append(request.decode())
    await asyncio.sleep(60)  # cancelled by the client long before
    yield b"never"


async def written(request: bytes, context: grpc.aio.ServicerContext) -> None:
    """A coroutine-style server stream (context.write), like grpc's own health Watch."""
    await context.write(b"w1")
    if request == b"fail":
        raise NotFound("nothing more")
    await context.write(b"w2")


async def total(requests, context: grpc.aio.ServicerContext) -> bytes:
    parts = [r async for r in requests]
    if b"bad" in parts:
        raise NotFound("a bad part")
    return b"+".join(parts)


async def echo(requests, context: grpc.aio.ServicerContext):
    async for r in requests:
        if r == b"bad":
            raise ResourceExhausted("no more echoes")
        yield r


SERVER_STREAMS = (("Count", "RESOURCE_EXHAUSTED"), ("Written", "NOT_FOUND"))
CLIENT_STREAMS = (("Total", "NOT_FOUND"), ("Echo", "RESOURCE_EXHAUSTED"))


def _handlers() -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(
        SERVICE,
        {
            "Unary": grpc.unary_unary_rpc_method_handler(unary),
            "Count": grpc.unary_stream_rpc_method_handler(count),
            "Slow": grpc.unary_stream_rpc_method_handler(slow),
            "Written": grpc.unary_stream_rpc_method_handler(written),
            "Total": grpc.stream_unary_rpc_method_handler(total),
            "Echo": grpc.stream_stream_rpc_method_handler(echo),
        },
    )


@pytest.fixture
def probe() -> Iterator[tuple[grpc.Channel, str]]:
    server_label = f"probe-{uuid.uuid4().hex[:8]}"  # this test's own metric series

    async def build():
        server = grpc.aio.server(interceptors=[StatusInterceptor(server_label)])
        server.add_generic_rpc_handlers((_handlers(),))
        return server, server.add_insecure_port("127.0.0.1:0")

    with aio_server_thread(build) as port, grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        yield channel, server_label


def _rpcs(server: str, method: str, code: str) -> float:
    return (
        REGISTRY.get_sample_value(
            "loraserve_rpc_requests_total", {"server": server, "method": method, "code": code}
        )
        or 0.0
    )


def settled(read, want, timeout: float = 5.0):
    """``read()`` once it equals ``want`` (the server records an RPC just after its client saw the status),
    or its last value after ``timeout`` seconds."""
    return waiting.settled(read, lambda got: got == want, timeout, interval=0.01)


def _seconds_count(server: str, method: str) -> float:
    return (
        REGISTRY.get_sample_value("loraserve_rpc_seconds_count", {"server": server, "method": method}) or 0.0
    )


def _fail(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as exc:
        call()
    return exc.value


def test_unary_statuses_and_metrics(probe, caplog) -> None:
    channel, server = probe
    call = channel.unary_unary(f"/{SERVICE}/Unary")
    assert call(b"hi") == b"ok:hi"
    err = _fail(lambda: call(b"missing"))
    assert (err.code(), err.details()) == (grpc.StatusCode.NOT_FOUND, "adapter 'x' does not exist")
    err = _fail(lambda: call(b"abort"))
    assert (err.code(), err.details()) == (grpc.StatusCode.PERMISSION_DENIED, "handler said no")
    with caplog.at_level(logging.ERROR, logger="loraserve.rpc"):
        err = _fail(lambda: call(b"crash"))
    assert (err.code(), err.details()) == (grpc.StatusCode.INTERNAL, "internal error: RuntimeError")
    crash = [r for r in caplog.records if r.name == "loraserve.rpc"]
    assert len(crash) == 1 and crash[0].exc_info[0] is RuntimeError and "Unary" in crash[0].getMessage()
    err = _fail(lambda: call(b"set-code"))
    assert (err.code(), err.details()) == (grpc.StatusCode.ABORTED, "told by set_code")
    expected = {"OK": 1, "NOT_FOUND": 1, "PERMISSION_DENIED": 1, "INTERNAL": 1, "ABORTED": 1, "UNKNOWN": 0}
    assert settled(lambda: {code: _rpcs(server, "Unary", code) for code in expected}, expected) == expected
    assert _seconds_count(server, "Unary") == 5


def test_server_streams_record_when_they_end(probe) -> None:
    channel, server = probe
    count = channel.unary_stream(f"/{SERVICE}/Count")
    assert list(count(b"3")) == [b"0", b"1", b"2"]
    got: list[bytes] = []
    err = _fail(lambda: got.extend(count(b"2!")))
    assert got == [b"0", b"1"]  # what was streamed before the refusal still arrived
    assert (err.code(), err.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "queue is full")
    written = channel.unary_stream(f"/{SERVICE}/Written")
    assert list(written(b"ok")) == [b"w1", b"w2"]
    got = []
    err = _fail(lambda: got.extend(written(b"fail")))
    assert got == [b"w1"] and (err.code(), err.details()) == (grpc.StatusCode.NOT_FOUND, "nothing more")
    counts = {
        m: settled(lambda m=m, c=c: (_rpcs(server, m, "OK"), _rpcs(server, m, c)), (1, 1))
        for m, c in SERVER_STREAMS
    }
    assert counts == {"Count": (1, 1), "Written": (1, 1)}


def test_client_cancellation_is_recorded_as_cancelled(probe) -> None:
    channel, server = probe
    tag = uuid.uuid4().hex
    call = channel.unary_stream(f"/{SERVICE}/Slow")(tag.encode())
    assert next(call) == b"first"
    assert settled(lambda: tag in started_streams, True)
    call.cancel()
    assert settled(lambda: _rpcs(server, "Slow", "CANCELLED"), 1) == 1 and _rpcs(server, "Slow", "OK") == 0
    assert _seconds_count(server, "Slow") == 1


def test_client_streams(probe) -> None:
    channel, server = probe
    total = channel.stream_unary(f"/{SERVICE}/Total")
    assert total(iter([b"a", b"b"])) == b"a+b"
    err = _fail(lambda: total(iter([b"a", b"bad"])))
    assert (err.code(), err.details()) == (grpc.StatusCode.NOT_FOUND, "a bad part")
    echo = channel.stream_stream(f"/{SERVICE}/Echo")
    assert list(echo(iter([b"x", b"y"]))) == [b"x", b"y"]
    got: list[bytes] = []
    err = _fail(lambda: got.extend(echo(iter([b"x", b"bad", b"z"]))))
    assert got == [b"x"] and err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    counts = {
        m: settled(lambda m=m, c=c: (_rpcs(server, m, "OK"), _rpcs(server, m, c)), (1, 1))
        for m, c in CLIENT_STREAMS
    }
    assert counts == {"Total": (1, 1), "Echo": (1, 1)}


def test_unknown_methods_are_left_to_grpc(probe) -> None:
    channel, server = probe
    err = _fail(lambda: channel.unary_unary(f"/{SERVICE}/Nope")(b""))
    assert err.code() == grpc.StatusCode.UNIMPLEMENTED
    assert _rpcs(server, "Nope", "UNIMPLEMENTED") == 0  # no handler: nothing of ours ran
