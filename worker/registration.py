"""Keep this worker registered with the registry: RegisterWorker, then heartbeats with slots and load.

Unload orders in heartbeat replies are carried out at once (deleted adapters) or once the adapter is idle
(drain orders: a version an alias moved away from, so requests in flight finish on it). If the registry is down
the worker keeps serving what it holds and retries; if the registry forgot it (lease expired, registry
restarted on an empty database) the next heartbeat is NOT_FOUND and the worker registers again.

Each process registers with a random ``instance_id`` (its identity, docs/security.md): the registry lets it
replace its own registration at its address at any time, but not a live one of another process. A worker
restarted at the same address while its previous lease is live is refused with ALREADY_EXISTS and retries
until that lease ends (at most the registry's lease, 15 s by default).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Sequence

import grpc

from loraserve.adapters.mixes import is_mix, parse_mix
from loraserve.adapters.running_caps import Cap, adapter_names
from loraserve.common.errors import FailedPrecondition
from loraserve.common.security import aio_channel
from loraserve.common.slots import Tier
from loraserve.engine.engine import Engine
from loraserve.protos.v1 import placement_pb2, placement_pb2_grpc
from loraserve.worker.snapshot_messages import occupied_slot_infos, worker_load

log = logging.getLogger("loraserve.worker.registration")
USAGE_PER_HEARTBEAT = 512  # adapters' usage totals one heartbeat carries at most (the rest: the next ones)


class Registration:
    def __init__(
        self,
        engine: Engine,
        target: str,
        address: str,
        model_id: str,
        token: str = "",
        tls_ca: str = "",
        model_aliases: Sequence[str] = (),
    ) -> None:
        """``model_aliases``: other names of the base model (the checkpoint's Hugging Face repo id)."""
        self.engine, self.target, self.address, self.model_id = engine, target, address, model_id
        self.token, self.tls_ca, self.model_aliases = token, tls_ca, tuple(model_aliases)
        self.worker_id = ""
        self.lease_seconds = 15
        self.registered = asyncio.Event()
        self.heartbeats = 0
        self.instance_id = secrets.token_hex(16)  # this process's identity (RegisterWorkerRequest)

    def _register_request(self) -> placement_pb2.RegisterWorkerRequest:
        cfg, e = self.engine.model_config, self.engine.config
        return placement_pb2.RegisterWorkerRequest(
            address=self.address,
            model_id=self.model_id,
            slots=e.max_loras,
            max_lora_rank=e.max_lora_rank,
            max_batch_size=e.max_batch_size,
            tensor_parallel_size=e.tensor_parallel_size,
            model_aliases=list(self.model_aliases),
            instance_id=self.instance_id,
            module_shapes=[
                placement_pb2.ModuleShape(module=m, in_features=i, out_features=o, num_layers=cfg.num_layers)
                for m, (i, o) in cfg.adapter_shapes().items()
            ],
        )

    def _heartbeat_request(self) -> placement_pb2.HeartbeatRequest:
        """Slots, load and cached adapters as they are now, and the usage totals that changed since the last
        answered heartbeat (at most ``USAGE_PER_HEARTBEAT``: a long-lived worker's report stays small)."""
        snap = self.engine.snapshot()
        return placement_pb2.HeartbeatRequest(
            worker_id=self.worker_id,
            # a mix's slot (adapters.mixes) is no registry adapter: its parts are reported in `cached`
            slots=[s for s in occupied_slot_infos(snap) if not is_mix(s.adapter)],
            load=worker_load(snap),
            cached=self._cached(snap),
            usage=[
                placement_pb2.AdapterUsage(
                    adapter=key,
                    requests=u.requests,
                    prompt_tokens=u.prompt_tokens,
                    completion_tokens=u.completion_tokens,
                    loads=u.loads,
                    fetched_bytes=u.fetched_bytes,
                )
                for key, u in self.engine.accounting.take_changed(USAGE_PER_HEARTBEAT).items()
            ],
            usage_changed_only=True,
        )

    def _cached(self, snap) -> list[placement_pb2.AdapterResidency]:
        """Adapters held outside the device slots, each at its fastest tier: host memory, then disk cache."""
        on_device = {s.adapter for s in snap.slots if s.adapter}
        tiers: dict[str, Tier] = {}
        disk_keys = getattr(self.engine.source, "disk_keys", lambda: [])()
        for key in disk_keys:
            tiers[key] = Tier.DISK
        for key in snap.host_tier:
            tiers[key] = Tier.HOST
        for slot in snap.slots:  # a mix's slot holds its parts' matrices: they count as held in memory
            if slot.adapter and is_mix(slot.adapter):
                tiers.update((p.ref, Tier.HOST) for p in parse_mix(slot.adapter))
        return [
            placement_pb2.AdapterResidency(adapter=k, tier=t.proto)
            for k, t in sorted(tiers.items())
            if k not in on_device
        ]

    def _caps(self, request: placement_pb2.HeartbeatRequest, resp: placement_pb2.HeartbeatResponse) -> None:
        """The reply's running caps speak for every adapter name the heartbeat reported holding."""
        reported = [s.adapter for s in request.slots] + [c.adapter for c in request.cached]
        covered = {name for key in reported for name in adapter_names(key)}
        caps = {c.adapter: Cap(c.max_running, c.tenant, c.tenant_max_running) for c in resp.caps}
        self.engine.caps.replace(caps, covered)

    async def _unload(self, order: placement_pb2.UnloadOrder) -> None:
        """A deleted adapter is refused to new requests at once, and every copy of it forgotten (host memory,
        disk cache); requests already admitted finish, then its slot empties. A drained one (an alias moved
        away from it) is unloaded once no request uses it. The registry repeats an order every heartbeat until
        the worker no longer reports the adapter."""
        deleted = not order.drain
        try:
            await asyncio.wrap_future(self.engine.unload_adapter(order.adapter, deleted=deleted))
            log.info("unloaded %s: %s", order.adapter, order.reason)
        except FailedPrecondition as exc:  # drain: still in use; the next heartbeat asks again
            log.debug("drain of %s waits: %s", order.adapter, exc)
        except Exception as exc:
            log.info("unload of %s: %s", order.adapter, exc)

    async def run(self) -> None:
        backoff = 0.2
        async with aio_channel(self.target, token=self.token, tls_ca=self.tls_ca) as channel:
            stub = placement_pb2_grpc.PlacementStub(channel)
            while True:
                try:
                    if not self.worker_id:
                        resp = await stub.RegisterWorker(self._register_request(), timeout=10)
                        self.worker_id, self.lease_seconds = resp.worker_id, resp.lease_seconds or 15
                        self.engine.accounting.mark_changed()  # a new worker row: report every total again
                        self.registered.set()
                        log.info(
                            "registered with %s as %s (lease %ss)",
                            self.target,
                            self.worker_id,
                            self.lease_seconds,
                        )
                    request = self._heartbeat_request()
                    try:
                        resp = await stub.Heartbeat(request, timeout=10)
                    except grpc.aio.AioRpcError:  # not seen by the registry: report these again next time
                        self.engine.accounting.mark_changed(u.adapter for u in request.usage)
                        raise
                    self.heartbeats += 1
                    self._caps(request, resp)
                    for order in resp.unload:
                        await self._unload(order)
                    backoff = 0.2
                    await asyncio.sleep(max(0.2, self.lease_seconds / 3))
                except grpc.aio.AioRpcError as exc:
                    if exc.code() == grpc.StatusCode.NOT_FOUND:
                        log.warning("registry forgot this worker; registering again")
                        self.worker_id = ""
                        continue
                    if exc.code() == grpc.StatusCode.ALREADY_EXISTS:  # a live lease of another process
                        log.warning("registration refused (%s); retrying in %.1fs", exc.details(), backoff)
                        await asyncio.sleep(backoff)
                        backoff = min(backoff * 2, 5.0)
                        continue
                    log.warning(
                        "registry unreachable (%s); serving on, retrying in %.1fs", exc.code().name, backoff
                    )
                    await asyncio.sleep(backoff)
                    backoff = min(backoff * 2, 5.0)
