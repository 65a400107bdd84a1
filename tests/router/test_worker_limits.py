"""How long the router waits on a worker (#30 item 7), in process and in milliseconds: every call to a worker
carries a deadline (the client's, else ``--worker-timeout``); a worker silent past the first-token timeout is
given up for the next one; one silent past the stall timeout mid-stream fails the stream UNAVAILABLE; the
router's channels ping (keepalive) and loraserve servers accept those pings. The same with real processes
and SIGSTOP: tests/e2e/test_stuck_workers.py."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import ExitStack

import grpc
import pytest

from loraserve.client.sdk import Client
from loraserve.common.config import ConfigError
from loraserve.common.errors import LoraserveError, ResourceExhausted
from loraserve.common.server import Services
from loraserve.common.server import build_server as common_build_server
from loraserve.protos.v1 import inference_pb2 as pb
from loraserve.protos.v1 import inference_pb2_grpc
from loraserve.router.config import RouterConfig
from loraserve.router.routing import Route, WorkerLimits, WorkerPool, keepalive_options
from loraserve.router.server import build_server as build_router
from tests.aio_thread import aio_server_thread

LIMITS = WorkerLimits(timeout=42.0, first_token_timeout=0.5, stall_timeout=0.5, keepalive=10.0)


class FakeWorker(inference_pb2_grpc.InferenceServicer):
    """Answers 3 chunks of one token; ``mode`` "hang-first" sends nothing, "hang-after-one" one chunk and then
    nothing, "full" refuses as a worker whose queue is full. Records the deadline each call arrived with (``context.time_remaining()``)."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.deadlines: list[float | None] = []
        self.cancelled = 0

    async def Generate(self, request, context):
        self.deadlines.append(context.time_remaining())
        if self.mode == "full":
            raise ResourceExhausted("queue is full (1 waiting)", retry_after=2.5)
        try:
            for i in range(3):
                if self.mode == "hang-first" or (self.mode == "hang-after-one" and i == 1):
                    await asyncio.sleep(3600)
                yield pb.GenerateResponse(
                    token_ids=[i], finish_reason=pb.FINISH_REASON_LENGTH if i == 2 else 0
                )
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


class FixedLocator:
    """Every request routed to ``addresses``, in that order."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = tuple(addresses)

    async def route(self, adapter: str, routing_key: str = "") -> Route:
        return Route(adapter, self.addresses, frozenset(), time.monotonic())

    def forget(self, adapter: str) -> None:
        pass


def _serve_worker(es: ExitStack, worker: FakeWorker) -> str:
    async def build():
        services = Services(
            "worker", lambda s: inference_pb2_grpc.add_InferenceServicer_to_server(worker, s), ()
        )
        server, port, _ = common_build_server(services, "127.0.0.1:0")
        return server, port

    return f"127.0.0.1:{es.enter_context(aio_server_thread(build))}"


def _serve_router(es: ExitStack, addresses: list[str], limits: WorkerLimits = LIMITS) -> str:
    async def build():
        server, port, _ = build_router(FixedLocator(addresses), WorkerPool(limits=limits), "127.0.0.1:0")  # type: ignore[arg-type]
        return server, port

    return f"127.0.0.1:{es.enter_context(aio_server_thread(build))}"


@pytest.fixture
def es() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def test_config_fields_flags_and_refusals() -> None:
    config = RouterConfig.from_env({})
    assert (config.worker_timeout, config.worker_first_token_timeout, config.worker_stall_timeout) == (
        600.0,
        120.0,
        30.0,
    )
    assert config.upstream_keepalive == 10.0
    env = {
        "LORASERVE_ROUTER_WORKER_TIMEOUT": "60",
        "LORASERVE_ROUTER_WORKER_FIRST_TOKEN_TIMEOUT": "0",
        "LORASERVE_ROUTER_WORKER_STALL_TIMEOUT": "2.5",
        "LORASERVE_ROUTER_UPSTREAM_KEEPALIVE": "0",
    }
    assert RouterConfig.from_env(env).worker_limits() == WorkerLimits(60.0, 0.0, 2.5, 0.0)
    for field, value, words in (
        ("worker_stall_timeout", -1.0, ">= 0"),
        ("worker_timeout", float("inf"), "finite"),
        ("upstream_keepalive", 1.0, ">= 5"),  # servers would answer such pings with GOAWAY
    ):
        with pytest.raises(ConfigError, match=words):
            RouterConfig.from_env({}, **{field: value})
    from loraserve.common.config import field_help

    for name in (
        "worker_timeout",
        "worker_first_token_timeout",
        "worker_stall_timeout",
        "upstream_keepalive",
    ):
        assert "seconds" in field_help(RouterConfig, name)


def test_keepalive_options() -> None:
    assert dict(keepalive_options(10)) == {
        "grpc.keepalive_time_ms": 10000,
        "grpc.keepalive_timeout_ms": 10000,
        "grpc.keepalive_permit_without_calls": 1,
        "grpc.http2.max_pings_without_data": 0,
    }
    assert keepalive_options(0) == []


def test_worker_calls_carry_the_clients_deadline_else_the_worker_timeout(es) -> None:
    worker = FakeWorker()
    router = _serve_router(es, [_serve_worker(es, worker)])
    with Client(router, timeout=None) as client:
        assert client.complete([1], max_tokens=3).token_ids == [0, 1, 2]
    with Client(router, timeout=7.0) as client:
        client.complete([1], max_tokens=3)
    no_deadline, seven = worker.deadlines
    assert no_deadline is not None and 40 < no_deadline < 42.1
    assert seven is not None and 5 < seven < 7.1  # gRPC rounds deadlines up a little


def test_a_worker_silent_mid_stream_fails_the_stream_unavailable(es) -> None:
    worker = FakeWorker("hang-after-one")
    address = _serve_worker(es, worker)
    router = _serve_router(es, [address])
    with Client(router, timeout=30) as client:
        stream = client.generate([1], max_tokens=3)
        assert next(stream).token_ids == [0]
        start = time.monotonic()
        with pytest.raises(LoraserveError) as err:
            next(stream)
    assert err.value.code_name == "UNAVAILABLE"
    assert err.value.message == f"worker {address} sent nothing more in 0.5 s"
    assert 0.4 < time.monotonic() - start < 5
    deadline = time.monotonic() + 5
    while not worker.cancelled and time.monotonic() < deadline:  # the router cancelled its call
        time.sleep(0.02)
    assert worker.cancelled == 1


def test_a_worker_silent_before_the_first_token_is_given_up_for_the_next(es) -> None:
    silent, ok = FakeWorker("hang-first"), FakeWorker()
    silent_address = _serve_worker(es, silent)
    router = _serve_router(es, [silent_address, _serve_worker(es, ok)])
    with Client(router, timeout=30) as client:
        start = time.monotonic()
        assert client.complete([1], max_tokens=3).token_ids == [0, 1, 2]
        assert 0.4 < time.monotonic() - start < 5
    assert len(silent.deadlines) == 1 and len(ok.deadlines) == 1
    lone = _serve_router(es, [silent_address])  # nobody else: UNAVAILABLE naming what happened
    with Client(lone, timeout=30) as client, pytest.raises(LoraserveError) as err:
        client.complete([1], max_tokens=3)
    assert err.value.code_name == "UNAVAILABLE"
    assert f"{silent_address}: UNAVAILABLE" in err.value.message


def test_a_full_worker_s_retry_hint_reaches_the_client_through_the_router(es) -> None:
    """A refusal that waiting cures carries its wait in the trailing metadata (whole seconds as HTTP's
    Retry-After, and gRPC's own pushback in ms); the router passes the worker's on, and the SDK reads it."""
    router = _serve_router(es, [_serve_worker(es, FakeWorker("full"))])
    with grpc.insecure_channel(router) as channel, pytest.raises(grpc.RpcError) as raw:
        list(
            inference_pb2_grpc.InferenceStub(channel).Generate(
                pb.GenerateRequest(tokens=pb.TokenIds(ids=[1]))
            )
        )
    assert (raw.value.code(), raw.value.details()) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "queue is full (1 waiting)",
    )
    trailing = dict(raw.value.trailing_metadata())
    assert (trailing["retry-after"], trailing["grpc-retry-pushback-ms"]) == ("3", "2500")
    with Client(router, timeout=30) as client, pytest.raises(LoraserveError) as err:
        client.complete([1], max_tokens=3)
    assert (err.value.code_name, err.value.retry_after) == ("RESOURCE_EXHAUSTED", 2.5)
    lone = _serve_router(es, [])  # nowhere to send: UNAVAILABLE, with the default wait
    with Client(lone, timeout=30) as client, pytest.raises(LoraserveError) as err:
        client.complete([1], max_tokens=3)
    assert (err.value.code_name, err.value.retry_after) == ("UNAVAILABLE", 1.0)


def test_a_full_worker_is_asked_again_only_once_a_place_may_have_freed(es) -> None:
    """Admission (common.admission.FullWorkers): the next candidate serves what a full worker refused, and
    the router sends the full one nothing more while it lacks room: when it alone can serve, the router
    refuses by itself, at once, with the wait that worker announced."""
    full, ok = FakeWorker("full"), FakeWorker()
    router = _serve_router(es, [_serve_worker(es, full), _serve_worker(es, ok)])
    with Client(router, timeout=30) as client:
        for _ in range(3):
            assert client.complete([1], max_tokens=3).token_ids == [0, 1, 2]
    assert (len(full.deadlines), len(ok.deadlines)) == (1, 3)  # asked once, then skipped
    alone = _serve_router(es, [_serve_worker(es, full2 := FakeWorker("full"))])
    with Client(alone, timeout=30) as client:
        for _ in range(3):
            t0 = time.perf_counter()
            with pytest.raises(LoraserveError) as err:
                client.complete([1], max_tokens=3)
            assert (err.value.code_name, err.value.retry_after) == ("RESOURCE_EXHAUSTED", 2.5)
            assert time.perf_counter() - t0 < 1.0
    assert len(full2.deadlines) == 1


def test_zero_turns_a_timeout_off(es) -> None:
    worker = FakeWorker("hang-after-one")
    router = _serve_router(es, [_serve_worker(es, worker)], WorkerLimits(0, 0, 0, 0))
    with Client(router, timeout=1.5) as client:  # only the client's own deadline ends it
        stream = client.generate([1], max_tokens=3)
        next(stream)
        with pytest.raises(LoraserveError) as err:
            next(stream)
    assert err.value.code_name == "DEADLINE_EXCEEDED"
    assert worker.deadlines[0] is not None and worker.deadlines[0] < 1.6


def test_servers_accept_keepalive_pings_without_calls(es, monkeypatch) -> None:
    """A gRPC server's defaults answer the third ping on an idle connection with GOAWAY ENHANCE_YOUR_CALM
    ("too_many_pings"); loraserve's servers accept one every PING_FLOOR_S (lowered here to see 3 pings in 3 s:
    gRPC clients ping at most once a second). The channel stays READY on its first connection throughout."""
    import loraserve.common.server as common_server

    monkeypatch.setattr(common_server, "PING_FLOOR_S", 0.8)
    address = _serve_worker(es, FakeWorker())

    async def watch() -> list[grpc.ChannelConnectivity]:
        options = [*keepalive_options(1.0)]
        async with grpc.aio.insecure_channel(address, options=options) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            async for _ in stub.Generate(pb.GenerateRequest(tokens=pb.TokenIds(ids=[1])), timeout=5):
                pass
            states = [channel.get_state()]
            end = time.monotonic() + 3.6
            while time.monotonic() < end:
                if channel.get_state() != states[-1]:
                    states.append(channel.get_state())
                await asyncio.sleep(0.05)
            return states

    assert asyncio.run(watch()) == [grpc.ChannelConnectivity.READY]
