"""Where to send a request: LocateAdapter answers cached briefly, and one channel per worker."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from loraserve.adapters.mixes import MixPart, mix_ref
from loraserve.adapters.refs import pick_version
from loraserve.common.errors import Unavailable, error_from_rpc
from loraserve.common.security import aio_channel
from loraserve.protos.v1 import inference_pb2_grpc, placement_pb2, placement_pb2_grpc


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
        self, registry: str, ttl: float, max_candidates: int, token: str = "", tls_ca: str = ""
    ) -> None:
        self.channel = aio_channel(registry, token=token, tls_ca=tls_ca)
        self.stub = placement_pb2_grpc.PlacementStub(self.channel)
        self.ttl, self.max_candidates = ttl, max_candidates
        self._routes: dict[str, Route] = {}

    async def locate(self, adapter: str) -> Route:
        cached = self._routes.get(adapter)
        if cached is not None and time.monotonic() - cached.at < self.ttl:
            return cached
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
                if c.tier in (placement_pb2.RESIDENCY_TIER_HOST, placement_pb2.RESIDENCY_TIER_DISK)
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


class WorkerPool:
    """One grpc.aio channel per worker address, reused across requests, and this router's open streams
    per worker (fresher than the load in the registry, which heartbeats refresh every few seconds)."""

    def __init__(self, token: str = "", tls_ca: str = "") -> None:
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.inflight: dict[str, int] = {}
        self.token, self.tls_ca = token, tls_ca

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
            channel = self._channels[address] = aio_channel(address, token=self.token, tls_ca=self.tls_ca)
        return inference_pb2_grpc.InferenceStub(channel)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
