"""Where to send a request: LocateAdapter answers cached briefly, and one channel per worker.

A stuck peer never holds a stream: every call to a worker carries a deadline (the client's, else
``WorkerLimits.timeout``), a worker that sends nothing for the first-token or stall timeout is given up on
(UNAVAILABLE: the router tries the next worker when nothing was sent to the client yet), and the router's
channels ping idle connections (gRPC keepalive) so a worker or registry that stopped answering is dropped.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from loraserve.adapters.mixes import MixPart, mix_ref
from loraserve.adapters.refs import pick_version
from loraserve.common.admission import FullWorkers
from loraserve.common.errors import Unavailable, error_from_rpc
from loraserve.common.security import aio_channel
from loraserve.common.singleflight import SingleFlight
from loraserve.common.slots import Tier
from loraserve.protos.v1 import inference_pb2, inference_pb2_grpc, placement_pb2, placement_pb2_grpc

log = logging.getLogger("loraserve.router")


def keepalive_options(interval: float) -> list[tuple[str, Any]]:
    """gRPC channel options that ping the peer every ``interval`` seconds, calls or not, and drop the connection
    (failing its calls UNAVAILABLE) when a ping is not answered within ``interval`` (0 = no keepalive). Servers
    built by ``common.server`` accept pings as often as every ``MIN_PING_INTERVAL_S``."""
    if interval <= 0:
        return []
    ms = int(interval * 1000)
    return [
        ("grpc.keepalive_time_ms", ms),
        ("grpc.keepalive_timeout_ms", ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),  # keep pinging while a stream waits for its next token
    ]


@dataclass(frozen=True)
class Route:
    adapter: str  # resolved "name@version" ("" for the base model)
    addresses: tuple[str, ...]  # best first, as the registry ranked them
    holders: frozenset[str]  # addresses that already hold the adapter
    at: float
    split: tuple[tuple[int, float], ...] = ()  # an alias's (version, weight): the router picks per request
    warm: tuple[str, ...] = ()  # addresses holding it in host memory or disk cache, fastest first


class Locator:
    """Caches LocateAdapter for ``ttl`` seconds; serves a stale answer while the registry is down."""

    def __init__(
        self,
        registry: str,
        ttl: float,
        max_candidates: int,
        token: str = "",
        tls_ca: str = "",
        keepalive: float = 0.0,
    ) -> None:
        self.channel = aio_channel(registry, token=token, tls_ca=tls_ca, options=keepalive_options(keepalive))
        self.stub = placement_pb2_grpc.PlacementStub(self.channel)
        self.ttl, self.max_candidates = ttl, max_candidates
        self._routes: dict[str, Route] = {}
        self._locating = SingleFlight()

    async def locate(self, adapter: str) -> Route:
        cached = self._routes.get(adapter)
        if cached is not None and time.monotonic() - cached.at < self.ttl:
            return cached
        # every request that finds the route expired waits for one LocateAdapter, not one each
        return await self._locating.run(adapter, lambda: self._locate(adapter))

    async def _locate(self, adapter: str) -> Route:
        cached = self._routes.get(adapter)
        try:
            resp = await self.stub.LocateAdapter(
                placement_pb2.LocateAdapterRequest(adapter=adapter, max_candidates=self.max_candidates),
                timeout=5,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT):
                raise error_from_rpc(exc) from None
            if cached is not None:  # registry down: keep routing to where the adapter was
                return cached
            raise Unavailable(f"registry unavailable: {exc.code().name}") from None
        route = Route(
            resp.adapter,
            tuple(c.address for c in resp.candidates),
            frozenset(c.address for c in resp.candidates if c.holds_adapter),
            time.monotonic(),
            tuple((t.version, t.weight) for t in resp.split),
            tuple(
                c.address
                for c in sorted(resp.candidates, key=lambda c: c.tier)
                if Tier.of_proto(c.tier) in (Tier.HOST, Tier.DISK)
            ),
        )
        self._routes[adapter] = route
        return route

    async def route(self, adapter: str, routing_key: str = "") -> Route:
        """``locate``, plus rollouts: for an alias with a split, one version is picked per request (by
        ``routing_key``, else at random by weight) from the cached split, then that version is located."""
        route = await self.locate(adapter)
        if len(route.split) <= 1:
            return route
        version = pick_version(route.split, routing_key)
        name = adapter.partition("@")[0]
        return await self.locate(f"{name}@{version}")

    def forget(self, adapter: str) -> None:
        self._routes.pop(adapter, None)

    async def close(self) -> None:
        await self.channel.close()


def mix_route(parts: Sequence[tuple[float, Route]]) -> Route:
    """One route for a weighted mix (``GenerateRequest.mix``) from its parts' routes: the workers holding
    more of the mix first (a part in a device slot counts 2, in host memory or on disk 1), ties in the first
    part's order; ``adapter`` is the mix ref of the resolved versions (``adapters.mixes``)."""
    addresses: list[str] = []
    score: dict[str, int] = {}
    for _, route in parts:
        addresses += [a for a in route.addresses if a not in addresses]
        for a in route.holders:
            score[a] = score.get(a, 0) + 2
        for a in route.warm:
            score[a] = score.get(a, 0) + 1
    ranked = sorted(addresses, key=lambda a: -score.get(a, 0))
    return Route(
        mix_ref([MixPart(route.adapter, weight) for weight, route in parts]),
        tuple(ranked),
        frozenset(a for a in ranked if score.get(a, 0) > 0),
        min(route.at for _, route in parts),
    )


@dataclass(frozen=True)
class WorkerLimits:
    """How long the router waits on a worker (seconds; 0 = no limit), ``RouterConfig``'s ``worker_*`` fields."""

    timeout: float = 600.0  # a call's deadline when the client set none
    first_token_timeout: float = 120.0  # the first message (queueing, adapter load, prefill)
    stall_timeout: float = 30.0  # each later message
    keepalive: float = 10.0  # keepalive ping interval on worker connections


class WorkerPool:
    """One grpc.aio channel per worker address, reused across requests, and this router's open streams
    per worker (fresher than the load in the registry, which heartbeats refresh every few seconds)."""

    def __init__(self, token: str = "", tls_ca: str = "", limits: WorkerLimits | None = None) -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.inflight: dict[str, int] = {}
        self.reserved: dict[str, int] = {}  # places freed by a stream's end, kept for a queued request
        self.full = FullWorkers()  # the workers that refused for want of room, while they still lack it
        self.token, self.tls_ca = token, tls_ca
        self.limits = limits or WorkerLimits()

    def streams(self, address: str) -> int:
        """This router's streams at ``address``, the places reserved there for queued requests included."""
        return self.inflight.get(address, 0) + self.reserved.get(address, 0)

    def load(self) -> dict[str, int]:
        """:meth:`streams` of every worker this router has sent to."""
        return {a: self.streams(a) for a in self.inflight.keys() | self.reserved.keys()}

    def holds_streams(self, addresses: Iterable[str]) -> bool:
        """Whether this router has a stream (or a reserved place) at one of ``addresses``: its end will free a
        place there, so a request may wait for it."""
        return any(self.streams(a) > 0 for a in addresses)

    def order(self, route: Route) -> list[str]:
        """Holders first (registry order), then those holding it in host memory or on disk (faster to load
        than from the object store), then the others with the fewest streams open from here."""
        holders = [a for a in route.addresses if a in route.holders]
        warm = [a for a in route.warm if a in route.addresses and a not in route.holders]
        others = sorted(
            (a for a in route.addresses if a not in route.holders and a not in warm),
            key=lambda a: self.inflight.get(a, 0),
        )
        return holders + warm + others

    def stub(self, address: str) -> inference_pb2_grpc.InferenceStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = aio_channel(
                address,
                token=self.token,
                tls_ca=self.tls_ca,
                options=keepalive_options(self.limits.keepalive),
            )
        return inference_pb2_grpc.InferenceStub(channel)

    def deadline(self, client_remaining: float | None) -> float | None:
        """When (``time.monotonic()``) one request's calls to workers must end, failovers included: the client's
        deadline when it sent one, else ``limits.timeout`` from now (None: no deadline at all)."""
        if client_remaining is not None:
            return time.monotonic() + client_remaining
        return time.monotonic() + self.limits.timeout if self.limits.timeout > 0 else None

    def generate(
        self, address: str, request: inference_pb2.GenerateRequest, deadline: float | None
    ) -> grpc.aio.UnaryStreamCall:
        """``Inference.Generate`` on ``address``, with what is left of ``deadline`` as its timeout."""
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        return self.stub(address).Generate(request, timeout=timeout)

    async def read(self, call: grpc.aio.UnaryStreamCall, address: str, first: bool = False) -> Any:
        """The next message of ``call`` (or ``grpc.aio.EOF``). A worker that sends nothing for the first-token
        (``first``) or stall timeout has its call cancelled and fails UNAVAILABLE, as a worker that went away
        does: before the first token the router tries the next worker."""
        limit = self.limits.first_token_timeout if first else self.limits.stall_timeout
        if limit <= 0:
            return await call.read()
        try:
            async with asyncio.timeout(limit):
                return await call.read()
        except TimeoutError:
            call.cancel()
            what = "no first token" if first else "nothing more"
            details = f"worker {address} sent {what} in {limit:g} s"
            log.warning("%s: giving up on its stream", details)
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details
            ) from None

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
