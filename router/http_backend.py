"""The router's HTTP backend: requests go through the same servicer as gRPC ``Generate``; ``/v1/models``
lists the base models of live workers and the latest version of every adapter in the registry."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from loraserve.common.errors import Unavailable
from loraserve.common.singleflight import SingleFlight
from loraserve.httpapi.schemas import adapter_for_model, model_card
from loraserve.httpapi.server import CallContext
from loraserve.protos.v1 import inference_pb2 as pb
from loraserve.protos.v1 import placement_pb2, registry_pb2, registry_pb2_grpc
from loraserve.router.routing import Locator
from loraserve.router.server import RouterServicer

MAX_LISTED = 10_000  # /v1/models lists at most this many adapters (registry pages of 1000)


class RouterHttpBackend:
    role = "router"

    def __init__(self, servicer: RouterServicer, locator: Locator, ttl: float = 2.0) -> None:
        self.servicer, self.locator, self.ttl = servicer, locator, ttl
        self.registry = registry_pb2_grpc.AdapterRegistryStub(locator.channel)
        self._bases: tuple[float, dict[str, int]] = (0.0, {})
        self._listing = SingleFlight()

    async def _base_models(self) -> dict[str, int]:
        """Model ids of the live workers -> when this router first saw them (cached ``ttl`` seconds; one
        ``ListWorkers`` however many requests find the cache expired)."""
        at, bases = self._bases
        if time.monotonic() - at < self.ttl:
            return bases
        return await self._listing.run(None, self._list_bases)

    async def _list_bases(self) -> dict[str, int]:
        _, bases = self._bases
        try:
            resp = await self.locator.stub.ListWorkers(placement_pb2.ListWorkersRequest(), timeout=5)
        except grpc.aio.AioRpcError as exc:
            if bases:  # registry down: keep what we knew
                return bases
            raise Unavailable(f"registry unavailable: {exc.code().name}") from None
        now = int(time.time())
        fresh = {w.model_id: bases.get(w.model_id, now) for w in resp.workers}
        self._bases = (time.monotonic(), fresh)
        return fresh

    def refusal(self):
        """Admission at the HTTP edge (``httpapi.app.Edge``): the servicer's, before the body is read."""
        return self.servicer.refusal()

    async def adapter_for(self, model: str) -> str:
        return adapter_for_model(model, set(await self._base_models()))

    def generate(
        self, request: pb.GenerateRequest, timeout: float | None
    ) -> AsyncIterator[pb.GenerateResponse]:
        return self.servicer.Generate(request, CallContext(timeout))

    async def models(self) -> list[dict[str, Any]]:
        cards = [
            model_card(b, created, "loraserve") for b, created in sorted((await self._base_models()).items())
        ]
        latest: dict[str, registry_pb2.Adapter] = {}
        token = ""
        try:
            while len(latest) < MAX_LISTED:
                page = await self.registry.ListAdapters(
                    registry_pb2.ListAdaptersRequest(page_size=1000, page_token=token), timeout=10
                )
                for a in page.adapters:  # ordered by name, then version: the last one is the latest
                    latest[a.name] = a
                token = page.next_page_token
                if not token:
                    break
        except grpc.aio.AioRpcError as exc:
            raise Unavailable(f"registry unavailable: {exc.code().name}") from None
        for name, a in latest.items():
            owner = a.labels.get("owner", "loraserve")
            cards.append(
                model_card(name, a.created_at.seconds, owner, parent=a.base_model, root=f"{name}@{a.version}")
            )
        return cards
