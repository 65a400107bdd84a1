"""The router's ``Inference.Generate``: locate the best worker for the adapter and proxy the stream.

Before the first token, a worker that is UNAVAILABLE (down, draining, or silent past the first-token
timeout) is skipped for the next candidate; after the first token, errors reach the client as they are
(a worker silent past the stall timeout: UNAVAILABLE). A client that goes away
cancels the upstream call.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import grpc

from loraserve.adapters.mixes import MixPart, parse_mix, validate_mix
from loraserve.common import admission
from loraserve.common.admission import PROBE_S, QUEUE_SECONDS, DrainRate, WaitQueue, retry_after
from loraserve.common.errors import (
    DeadlineExceeded,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
    error_from_rpc,
)
from loraserve.common.limits import add_servicer, check_generate_request
from loraserve.common.observability import StreamTimer
from loraserve.common.security import ServerSecurity
from loraserve.common.server import Services, set_health
from loraserve.common.server import build_server as common_build_server
from loraserve.protos.v1 import inference_pb2, inference_pb2_grpc
from loraserve.router.routing import Locator, Route, WorkerPool, mix_route

log = logging.getLogger("loraserve.router")
SERVICE_NAME = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
RETRYABLE = (grpc.StatusCode.UNAVAILABLE,)


@dataclass
class _Turn:
    """One request's place in the router's admission: when it arrived (``admission.arrived``), until when it
    may wait in the queue (``--max-queue-wait``, or the client's deadline when that comes first:
    ``by_deadline``), the place a stream's end reserved for it, and the last refusal of the workers it tried."""

    since: float
    end: float
    by_deadline: bool = False
    place: str | None = None
    refusal: ResourceExhausted | None = None


class RouterServicer(inference_pb2_grpc.InferenceServicer):
    """``max_concurrency`` bounds the requests inside the router (streams and waiters); ``max_queued`` the ones
    waiting for a place at a full worker, each for at most ``max_queue_wait`` seconds (``common.admission``)."""

    def __init__(
        self,
        locator: Locator,
        pool: WorkerPool,
        max_concurrency: int = 1024,
        max_queued: int = 1024,
        max_queue_wait: float = 30.0,
    ) -> None:
        self.locator, self.pool, self.max_concurrency = locator, pool, max_concurrency
        self.active = 0
        self.drain = DrainRate()  # streams ending per second: the wait a refusal announces
        self.queue = WaitQueue(max_queued)
        self.max_queue_wait = max_queue_wait

    def refusal(self) -> ResourceExhausted | None:
        """What a request is refused with now, before it is read (``common.admission``): the router is at
        its limit, or every worker it has sent to is full and the request could not wait its turn (the queue
        is full, or none of those workers holds a stream of this router whose end would free a place)."""
        if self.active >= self.max_concurrency:
            wait = retry_after(self.active - self.max_concurrency + 1, self.drain.rate())
            return ResourceExhausted(
                f"router is at its limit of {self.max_concurrency} requests", retry_after=wait
            )
        full = self._fullness(None)
        if full is None:
            return None
        if not self.pool.holds_streams(self.pool.inflight):
            return ResourceExhausted(full[0], retry_after=full[1])
        if not self.queue.has_room():
            return self._queue_full()
        return None

    def _queue_full(self) -> ResourceExhausted:
        wait = retry_after(len(self.queue) + 1, self.drain.rate())
        if not self.queue.limit:  # no queue (--max-queued 0): the workers are full
            return ResourceExhausted("every worker's queue is full", retry_after=wait)
        return ResourceExhausted(f"the router's queue is full ({self.queue.limit} waiting)", retry_after=wait)

    def _fullness(self, addresses: Iterable[str] | None) -> tuple[str, float] | None:
        """(why, the wait to announce) when every one of ``addresses`` (default: every worker this router has
        sent to) is full: it refused for want of room and still lacks it, or this router holds as many streams
        there as their refusals said they take; None while one may have room."""
        load = self.pool.load()
        where = list(load if addresses is None else addresses)
        hint = self.pool.full.all_full(load, where)
        if hint is not None:
            return "every worker that can serve the request has a full queue", hint
        room = self.pool.full.capacity(where)  # what the workers' refusals said they take
        streams = sum(load.get(a, 0) for a in where)
        if room is not None and streams >= room:
            wait = retry_after(streams - room + 1, self.drain.rate())
            return f"the workers' queues are full ({room} streams)", wait
        return None

    async def Generate(self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        since = admission.arrived()
        check_generate_request(request)  # counts and lengths (common.limits), before any routing
        refused = self.refusal()  # admission: refuse at once, never queue without bound
        if refused is not None:
            admission.observe("router", "refused", since)
            raise refused
        self.active += 1
        try:
            async for msg in self._generate(request, context, since):
                yield msg
        finally:
            self.active -= 1
            self.drain.note()

    async def _generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext, since: float
    ):
        # LoraserveError: NOT_FOUND, UNAVAILABLE, ...; an alias's split is resolved here, once per request, so
        # the request stays on that version even if the alias moves while it decodes.
        forward = inference_pb2.GenerateRequest()
        forward.CopyFrom(request)
        if request.mix:
            route = await self._mix_route(request)
            for part, resolved in zip(forward.mix, parse_mix(route.adapter), strict=True):
                part.adapter = resolved.ref
        else:
            route = await self.locator.route(request.adapter, request.routing_key)
            forward.adapter = route.adapter
        if not route.addresses:
            raise Unavailable(f"no worker can serve {route.adapter or 'the base model'}")
        client_remaining = context.time_remaining()
        deadline = self.pool.deadline(client_remaining)  # the client's, else --worker-timeout
        by_deadline = client_remaining is not None and client_remaining < self.max_queue_wait
        wait = client_remaining if by_deadline else self.max_queue_wait
        turn = _Turn(since, time.monotonic() + wait, by_deadline)
        try:
            await self._wait_turn(route, turn)
            timer = StreamTimer("router")
            while True:
                tried, full = [], []
                for address in self._order(route, turn.place):
                    if address == turn.place:  # the place a stream's end reserved for this request
                        self.pool.reserved[address] -= 1
                        turn.place = None
                    elif self.pool.full.hint(address, self.pool.streams(address)) is not None:
                        continue  # refused for want of room moments ago and still lacks it: the next one
                    call = self.pool.generate(address, forward, deadline)
                    self.pool.inflight[address] = self.pool.inflight.get(address, 0) + 1
                    try:
                        first = await self.pool.read(
                            call, address, first=True
                        )  # silent too long: UNAVAILABLE
                    except grpc.aio.AioRpcError as exc:
                        self.pool.inflight[address] -= 1
                        refused = error_from_rpc(exc)
                        if (
                            refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED
                            and refused.retry_after is not None
                        ):
                            # its queue is full (a refusal that waiting cures): remember it, try the next worker
                            self.pool.full.refused(address, self.pool.inflight[address], refused.retry_after)
                            full.append(refused)
                            continue
                        if exc.code() in RETRYABLE:
                            tried.append(f"{address}: {exc.code().name}")
                            for ref in (
                                [request.adapter] if not request.mix else [p.adapter for p in request.mix]
                            ):
                                self.locator.forget(ref)
                            continue
                        self._freed(address)  # refused for this request's own sake: its place is free
                        raise refused from None
                    try:
                        msg = first
                        while msg is not grpc.aio.EOF:  # read() only: grpc forbids mixing it with iteration
                            timer.chunk(len(msg.token_ids))
                            yield msg
                            if msg.finish_reason:
                                timer.done(msg.usage.prompt_tokens)
                            msg = await self.pool.read(call, address)
                        return
                    except grpc.aio.AioRpcError as exc:
                        raise error_from_rpc(exc) from None
                    finally:
                        self.pool.inflight[address] -= 1
                        call.cancel()  # no-op when finished; frees the worker's row when the client left
                        self._freed(address)  # its place goes to the oldest request waiting for it
                if not full:
                    raise Unavailable(f"no worker could serve the request ({'; '.join(tried)})")
                # every worker that answered was full: wait for a place, first in line, while it may
                turn.refusal = ResourceExhausted(
                    full[0].message, retry_after=min(r.retry_after for r in full)
                )
                await self._wait_turn(route, turn)
        finally:
            if turn.place is not None:  # given a place it did not take (the client left): the next waiter's
                self._release(turn.place)

    def _order(self, route: Route, place: str | None) -> list[str]:
        order = self.pool.order(route)
        return order if place is None else [place, *(a for a in order if a != place)]

    async def _wait_turn(self, route: Route, turn: _Turn) -> None:
        """Return when the request may go to a worker of ``route``: at once while one may have room and no
        earlier request waits for them, else once a stream's end gives it a place (``turn.place``), first come
        first served, for at most ``--max-queue-wait`` (and the client's deadline). A request refused
        upstream (``turn.refusal``) waits again at the front of the queue. Refused at once (the time to that
        decision observed) when it may not wait: the queue is full, or no stream of this router at those
        workers will end to free a place."""
        again = turn.refusal is not None
        full = self._fullness(route.addresses)
        if not again and full is None and not self.queue.ahead(route.addresses):
            admission.observe("router", "admitted", since=turn.since)
            return
        why: ResourceExhausted | None = None
        if full is not None and not self.pool.holds_streams(route.addresses):
            why = turn.refusal or ResourceExhausted(full[0], retry_after=full[1])
        elif not again and not self.queue.has_room():  # one refused upstream was admitted: it goes first
            why = self._queue_full()
        if why is not None:
            admission.observe("router", "refused_upstream" if again else "refused", since=turn.since)
            raise why
        if not again:
            admission.observe("router", "queued", since=turn.since)
        waiter = self.queue.join(route.addresses, front=again)
        t0, outcome = time.monotonic(), "left"
        try:
            while True:
                left = turn.end - time.monotonic()
                if left <= 0:
                    outcome = "refused"
                    if turn.by_deadline:
                        raise DeadlineExceeded("the deadline passed while waiting in the router's queue")
                    raise turn.refusal or ResourceExhausted(
                        f"waited {self.max_queue_wait:g} s in the router's queue for a place at a worker",
                        retry_after=retry_after(len(self.queue), self.drain.rate()),
                    )
                await waiter.wait(min(left, PROBE_S))
                if waiter.place is not None:
                    outcome, turn.place = "served", waiter.place
                    return
                if self.queue.first() is waiter or not self.pool.holds_streams(route.addresses):
                    full = self._fullness(route.addresses)
                    if full is None:  # room appeared without a stream of ours ending there (it expired)
                        outcome = "served"
                        return
                    if not self.pool.holds_streams(route.addresses):  # nothing of ours there to free a place
                        outcome = "refused"
                        raise turn.refusal or ResourceExhausted(full[0], retry_after=full[1])
        finally:
            self.queue.leave(waiter)
            QUEUE_SECONDS.labels(outcome).observe(time.monotonic() - t0)
            if outcome != "served" and waiter.place is not None:  # woken as it gave up: pass the place on
                self._release(waiter.place)

    def _freed(self, address: str) -> None:
        """A place at ``address`` freed: reserve it for the oldest request waiting for that worker."""
        if self.queue.wake(address) is not None:
            self.pool.reserved[address] = self.pool.reserved.get(address, 0) + 1

    def _release(self, address: str) -> None:
        """A reserved place given back unused: to the next waiter."""
        self.pool.reserved[address] -= 1
        self._freed(address)

    async def _mix_route(self, request: inference_pb2.GenerateRequest) -> Route:
        """A mix's route: each part located (an alias's split resolved per request, as for one adapter),
        then the workers holding most of the mix first. The worker checks what only it knows (max_mix)."""
        if request.adapter:
            raise InvalidArgument("set adapter or mix, not both")
        parts = [MixPart(p.adapter, p.weight) for p in request.mix]
        validate_mix(parts, max_mix=len(parts))
        routes = [(p.weight, await self.locator.route(p.ref, request.routing_key)) for p in parts]
        return mix_route(routes)


def router_services(
    locator: Locator,
    pool: WorkerPool,
    max_concurrency: int = 1024,
    max_queued: int = 1024,
    max_queue_wait: float = 30.0,
) -> Services:
    # one servicer: HTTP and gRPC share the request limit and the queue
    servicer = RouterServicer(locator, pool, max_concurrency, max_queued, max_queue_wait)

    def add(server: grpc.aio.Server) -> None:  # bytes that are no request: INVALID_ARGUMENT (common.limits)
        add_servicer(inference_pb2_grpc.add_InferenceServicer_to_server, servicer, server)

    return Services("router", add, (SERVICE_NAME,), inference=servicer)


def build_server(
    locator: Locator,
    pool: WorkerPool,
    address: str,
    security: ServerSecurity | None = None,
    max_concurrency: int = 1024,
    max_queued: int = 1024,
    max_queue_wait: float = 30.0,
) -> tuple[grpc.aio.Server, int, Any]:
    services = router_services(locator, pool, max_concurrency, max_queued, max_queue_wait)
    return common_build_server(services, address, security)


async def set_serving(health_servicer: Any, serving: bool) -> None:
    await set_health(health_servicer, (SERVICE_NAME,), serving)
