"""The router's ``Inference.Generate``: locate the best worker for the adapter and proxy the stream.

Before the first token, a worker that is UNAVAILABLE (down, draining, or silent past the first-token
timeout) is skipped for the next candidate; after the first token, errors reach the client as they are
(a worker silent past the stall timeout: UNAVAILABLE). A client that goes away
cancels the upstream call.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc

from loraserve.adapters.mixes import MixPart, parse_mix, validate_mix
from loraserve.common import admission
from loraserve.common.admission import DrainRate, retry_after
from loraserve.common.errors import InvalidArgument, ResourceExhausted, Unavailable, error_from_rpc
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


class RouterServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, locator: Locator, pool: WorkerPool, max_concurrency: int = 1024) -> None:
        self.locator, self.pool, self.max_concurrency = locator, pool, max_concurrency
        self.active = 0
        self.drain = DrainRate()  # streams ending per second: the wait a refusal at the limit announces

    def refusal(self) -> ResourceExhausted | None:
        """What a request is refused with now, before it is read (``common.admission``): the router is at
        its stream limit, or every worker it has sent to refused for want of room and still lacks it."""
        if self.active >= self.max_concurrency:
            wait = retry_after(self.active - self.max_concurrency + 1, self.drain.rate())
            return ResourceExhausted(
                f"router is at its limit of {self.max_concurrency} streams", retry_after=wait
            )
        hint = self.pool.full_hint()
        if hint is not None:
            return ResourceExhausted("every worker's queue is full", retry_after=hint)
        room = self.pool.full.capacity(self.pool.inflight)  # what the workers' refusals said they take
        if room is not None and self.active >= room:
            wait = retry_after(self.active - room + 1, self.drain.rate())
            return ResourceExhausted(f"the workers' queues are full ({room} streams)", retry_after=wait)
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
        hint = self.pool.full_hint(route.addresses)
        if hint is not None:  # every candidate refused for want of room moments ago and still lacks it
            admission.observe("router", "refused", since)
            raise ResourceExhausted(
                "every worker that can serve the request has a full queue", retry_after=hint
            )
        admission.observe("router", "admitted", since)
        tried, full = [], []
        timer = StreamTimer("router")
        deadline = self.pool.deadline(context.time_remaining())  # the client's, else --worker-timeout
        for address in self.pool.order(route):
            if self.pool.full.hint(address, self.pool.inflight.get(address, 0)) is not None:
                continue  # refused for want of room moments ago and still lacks it: the next one
            call = self.pool.generate(address, forward, deadline)
            self.pool.inflight[address] = self.pool.inflight.get(address, 0) + 1
            try:
                first = await self.pool.read(call, address, first=True)  # silent too long: UNAVAILABLE
            except grpc.aio.AioRpcError as exc:
                self.pool.inflight[address] -= 1
                refused = error_from_rpc(exc)
                if refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED and refused.retry_after is not None:
                    # its queue is full (a refusal that waiting cures): remember it, try the next worker
                    self.pool.full.refused(address, self.pool.inflight[address], refused.retry_after)
                    full.append(refused)
                    continue
                if exc.code() in RETRYABLE:
                    tried.append(f"{address}: {exc.code().name}")
                    for ref in [request.adapter] if not request.mix else [p.adapter for p in request.mix]:
                        self.locator.forget(ref)
                    continue
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
        if full:  # every worker that answered was full: the soonest wait any of them announced
            admission.observe("router", "refused_upstream", since)
            raise ResourceExhausted(full[0].message, retry_after=min(r.retry_after for r in full))
        raise Unavailable(f"no worker could serve the request ({'; '.join(tried)})")

    async def _mix_route(self, request: inference_pb2.GenerateRequest) -> Route:
        """A mix's route: each part located (an alias's split resolved per request, as for one adapter),
        then the workers holding most of the mix first. The worker checks what only it knows (max_mix)."""
        if request.adapter:
            raise InvalidArgument("set adapter or mix, not both")
        parts = [MixPart(p.adapter, p.weight) for p in request.mix]
        validate_mix(parts, max_mix=len(parts))
        routes = [(p.weight, await self.locator.route(p.ref, request.routing_key)) for p in parts]
        return mix_route(routes)


def router_services(locator: Locator, pool: WorkerPool, max_concurrency: int = 1024) -> Services:
    servicer = RouterServicer(locator, pool, max_concurrency)  # one: HTTP and gRPC share the stream limit

    def add(server: grpc.aio.Server) -> None:  # bytes that are no request: INVALID_ARGUMENT (common.limits)
        add_servicer(inference_pb2_grpc.add_InferenceServicer_to_server, servicer, server)

    return Services("router", add, (SERVICE_NAME,), inference=servicer)


def build_server(
    locator: Locator,
    pool: WorkerPool,
    address: str,
    security: ServerSecurity | None = None,
    max_concurrency: int = 1024,
) -> tuple[grpc.aio.Server, int, Any]:
    return common_build_server(router_services(locator, pool, max_concurrency), address, security)


async def set_serving(health_servicer: Any, serving: bool) -> None:
    await set_health(health_servicer, (SERVICE_NAME,), serving)
