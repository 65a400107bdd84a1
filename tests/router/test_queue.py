"""The router's queue (common.admission.WaitQueue, #57): when its workers are full, requests wait their turn,
first come first served, instead of being refused, so clients that resend at once (a load generator's
closed loop) are served at the workers' pace; the queue is bounded in length and in time, and a client that
leaves it gives its turn on. In process, with a worker of a fixed number of places."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import pytest

from loraserve.client.sdk import Client
from loraserve.common.errors import LoraserveError, ResourceExhausted
from loraserve.common.server import build_server as common_build_server
from loraserve.protos.v1 import inference_pb2 as pb
from loraserve.protos.v1 import inference_pb2_grpc
from loraserve.router.routing import WorkerLimits, WorkerPool
from loraserve.router.server import router_services
from tests.aio_thread import aio_server_thread
from tests.router.test_worker_limits import FixedLocator, _serve_worker

LIMITS = WorkerLimits(timeout=60.0, first_token_timeout=30.0, stall_timeout=30.0, keepalive=10.0)


class PlacesWorker(inference_pb2_grpc.InferenceServicer):
    """A worker of ``places`` concurrent streams that refuses the next one as a full queue does (with a wait).
    Each stream sends its prompt's first id back as 3 tokens, one every ``step`` seconds, or waits for
    ``release`` (a threading.Event) before its first when ``hold`` is set."""

    def __init__(self, places: int, step: float = 0.01, hold: bool = False) -> None:
        self.places, self.step, self.hold = places, step, hold
        self.release = threading.Event()
        self.streams = self.most = self.refused = 0
        self.served: list[int] = []

    async def Generate(self, request, context):
        if self.streams >= self.places:
            self.refused += 1
            raise ResourceExhausted(f"queue is full ({self.places} places)", retry_after=0.5)
        self.streams += 1
        self.most = max(self.most, self.streams)
        try:
            while self.hold and not self.release.is_set():
                await asyncio.sleep(0.01)
            rid = request.tokens.ids[0]
            for i in range(3):
                await asyncio.sleep(self.step)
                yield pb.GenerateResponse(
                    token_ids=[rid], finish_reason=pb.FINISH_REASON_LENGTH if i == 2 else 0
                )
            self.served.append(rid)
        finally:
            self.streams -= 1


@pytest.fixture
def es() -> Iterator[ExitStack]:
    with ExitStack() as stack:
        yield stack


def _stack(es: ExitStack, worker: PlacesWorker, **limits):
    """A worker and a router in front of it: the router's address and its servicer (to look at its queue)."""
    address = _serve_worker(es, worker)  # type: ignore[arg-type]  # any Inference servicer
    holder = {}

    async def build_router():
        services = router_services(FixedLocator([address]), WorkerPool(limits=LIMITS), **limits)  # type: ignore[arg-type]
        holder["servicer"] = services.inference
        server, port, _ = common_build_server(services, "127.0.0.1:0")
        return server, port

    router = f"127.0.0.1:{es.enter_context(aio_server_thread(build_router))}"
    return router, holder["servicer"]


def _ask(router: str, rid: int, timeout: float = 30) -> str:
    """One request (prompt [rid]); -> "OK" with the right tokens, else the status's name."""
    try:
        with Client(router, timeout=timeout) as client:
            out = client.complete([rid], max_tokens=3)
    except LoraserveError as exc:
        return exc.code_name
    assert out.token_ids == [rid] * 3
    return "OK"


def _wait_for(predicate, seconds: float = 10) -> None:
    end = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_clients_beyond_the_places_wait_their_turn_and_all_are_served(es) -> None:
    """40 clients at once on 4 places: every one served, the worker never over its places. Once the router
    has learned the worker's room (the first burst), a second burst is queued by the router, not refused
    upstream: the worker sees at most a probe's refusal, where without a queue most requests fail."""
    worker = PlacesWorker(4)
    router, servicer = _stack(es, worker, max_queued=64)
    with ThreadPoolExecutor(40) as pool:
        assert list(pool.map(lambda i: _ask(router, i), range(40))) == ["OK"] * 40
        first = worker.refused
        assert list(pool.map(lambda i: _ask(router, 100 + i), range(40))) == ["OK"] * 40
    assert worker.most <= 4 and sorted(worker.served) == [*range(40), *range(100, 140)]
    print("refused", first, worker.refused)
    assert worker.refused - first <= 4, (first, worker.refused)
    _wait_for(lambda: servicer.active == 0)
    assert (len(servicer.queue), sum(servicer.pool.reserved.values()), servicer.pool.inflight) == (
        0,
        0,
        {next(iter(servicer.pool.inflight)): 0},
    )
    bare, _ = _stack(es, PlacesWorker(4), max_queued=0)  # no queue: refused beyond what the worker holds
    with ThreadPoolExecutor(40) as pool:
        codes = list(pool.map(lambda i: _ask(bare, i), range(40)))
    assert codes.count("RESOURCE_EXHAUSTED") >= 20, codes


def test_a_full_queue_refuses_at_once_and_the_queued_are_served_in_order(es) -> None:
    worker = PlacesWorker(1, hold=True)
    router, servicer = _stack(es, worker, max_queued=2)
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(_ask, router, 1)
        _wait_for(lambda: worker.streams == 1)
        second = pool.submit(_ask, router, 2)  # refused by the worker once, then waits at the front
        _wait_for(lambda: len(servicer.queue) == 1)
        third = pool.submit(_ask, router, 3)
        _wait_for(lambda: len(servicer.queue) == 2)
        t0 = time.perf_counter()
        with Client(router, timeout=30) as client, pytest.raises(LoraserveError) as err:
            client.complete([4], max_tokens=3)
        assert time.perf_counter() - t0 < 0.5
        assert (err.value.code_name, err.value.message) == (
            "RESOURCE_EXHAUSTED",
            "the router's queue is full (2 waiting)",
        )
        assert err.value.retry_after is not None and err.value.retry_after >= 0.05
        worker.release.set()
        assert [first.result(), second.result(), third.result()] == ["OK"] * 3
    assert (worker.served, worker.refused) == ([1, 2, 3], 1)


def test_a_request_waits_at_most_max_queue_wait(es) -> None:
    worker = PlacesWorker(1, hold=True)
    router, servicer = _stack(es, worker, max_queued=8, max_queue_wait=0.5)
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(_ask, router, 1)
        _wait_for(lambda: worker.streams == 1)
        t0 = time.perf_counter()
        assert _ask(router, 2) == "RESOURCE_EXHAUSTED"
        assert 0.4 < time.perf_counter() - t0 < 3
        assert len(servicer.queue) == 0
        worker.release.set()
        assert first.result() == "OK"


def test_a_client_that_leaves_the_queue_gives_its_turn_on(es) -> None:
    """A queued client whose deadline passes gets DEADLINE_EXCEEDED and leaves the queue; one whose turn
    came as it left passes the place on: the next one is served, nothing stays reserved."""
    worker = PlacesWorker(1, hold=True)
    router, servicer = _stack(es, worker, max_queued=8)
    with ThreadPoolExecutor(4) as pool:
        first = pool.submit(_ask, router, 1)
        _wait_for(lambda: worker.streams == 1)
        assert _ask(router, 2, timeout=0.5) == "DEADLINE_EXCEEDED"
        _wait_for(lambda: len(servicer.queue) == 0)
        later = pool.submit(_ask, router, 3)
        _wait_for(lambda: len(servicer.queue) == 1)
        worker.release.set()
        assert (first.result(), later.result()) == ("OK", "OK")
    _wait_for(lambda: servicer.active == 0)
    assert sum(servicer.pool.reserved.values()) == 0 and worker.served == [1, 3]
