"""The registry's gRPC servicers (AdapterRegistry, Placement) plus health and reflection.

Thin: proto <-> rows/dataclasses; errors are ``LoraserveError``s that ``common.interceptors`` maps to statuses. Catalog and placement calls do blocking SQL and
storage I/O, so they run on worker threads (``asyncio.to_thread``), never on the event loop. Uploads and
imports (parsing and validating adapter files) run on their own bounded pool (``adapter-parse``,
:data:`UPLOAD_THREADS` threads): a burst of uploads waits there, never in front of heartbeats and the
other RPCs in the default pool. At most ``max_concurrent_uploads`` of them are in flight at once
(``Catalog.upload_slots``): one more is refused with RESOURCE_EXHAUSTED at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import logging
from collections.abc import AsyncIterator, Awaitable
from concurrent.futures import Executor, ThreadPoolExecutor
from datetime import UTC, datetime
from typing import Any

import grpc
from google.protobuf.timestamp_pb2 import Timestamp

from loraserve.common.errors import InvalidArgument, Unavailable
from loraserve.common.limits import add_servicer
from loraserve.common.security import ServerSecurity
from loraserve.common.server import Services, set_health
from loraserve.common.server import build_server as common_build_server
from loraserve.common.slots import SlotState, Tier, tier_proto
from loraserve.protos.v1 import (
    placement_pb2,
    placement_pb2_grpc,
    registry_pb2,
    registry_pb2_grpc,
    worker_admin_pb2,
)
from loraserve.registry.aliases import AliasView
from loraserve.registry.catalog import Catalog, UploadHeader, parse_ref
from loraserve.registry.db import AdapterRow, WorkerRow, WorkerState, as_utc
from loraserve.registry.placement import (
    MAX_CACHED,
    Placement,
    ReportedLoad,
    ReportedUsage,
    SlotReport,
    adapter_stats,
)
from loraserve.registry.running_limits import LimitKind, LimitView, RunningLimits
from loraserve.registry.storage import StagedBlob

log = logging.getLogger("loraserve.registry.server")
CHUNK = 1 << 20
MAX_MESSAGE_BYTES = 8 * 1024 * 1024
UPLOAD_THREADS = 2  # uploads and imports validated at once; more wait for a thread of their own pool
SERVICE_NAMES = (
    registry_pb2.DESCRIPTOR.services_by_name["AdapterRegistry"].full_name,
    placement_pb2.DESCRIPTOR.services_by_name["Placement"].full_name,
)


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _placement_state(value: int) -> SlotState:
    """A reported slot's state as a ``placements`` row holds it: LOADED, or LOADING for anything else."""
    return SlotState.LOADED if value == SlotState.LOADED.proto else SlotState.LOADING


def _names(keys) -> set[str]:
    """The adapter names among ``keys`` (a worker may also hold local adapters, e.g. ``/path``)."""
    names = set()
    for key in keys:
        with contextlib.suppress(InvalidArgument):
            names.add(parse_ref(key).name)
    return names


def ts(value: datetime | None) -> Timestamp:
    if value is None:
        return Timestamp()
    since = as_utc(value) - _EPOCH  # whole seconds and microseconds, no float (a page converts 100 of these)
    return Timestamp(seconds=since.days * 86400 + since.seconds, nanos=since.microseconds * 1000)


def targets_to_proto(targets) -> list[registry_pb2.AliasTarget]:
    return [registry_pb2.AliasTarget(version=v, weight=w) for v, w in targets or ()]


def alias_to_proto(view: AliasView) -> registry_pb2.Alias:
    return registry_pb2.Alias(
        name=view.name,
        alias=view.alias,
        targets=targets_to_proto(view.targets),
        updated_at=ts(view.updated_at),
        updated_by=view.updated_by,
    )


def adapter_to_proto(row: AdapterRow, aliases: list[AliasView] = ()) -> registry_pb2.Adapter:
    """``aliases``: the name's aliases; those pointing at this version are included."""
    own = [alias_to_proto(a) for a in aliases if any(v == row.version for v, _ in a.targets)]
    return registry_pb2.Adapter(
        aliases=own,
        # an uploaded ORM row may carry the parser's warnings; a listed plain row has none (and a missing
        # attribute of a Row raises inside getattr, 4 µs a row)
        warnings=getattr(row, "warnings", ()) if isinstance(row, AdapterRow) else (),
        name=row.name,
        version=row.version,
        base_model=row.base_model,
        rank=row.rank,
        alpha=row.alpha,
        use_rslora=row.use_rslora,
        target_modules=row.target_modules,
        size_bytes=row.size_bytes,
        sha256=row.sha256,
        uri=row.uri,
        created_at=ts(row.created_at),
        description=row.description,
        labels=row.labels,
    )


def limit_to_proto(view: LimitView) -> registry_pb2.RunningLimit:
    return registry_pb2.RunningLimit(
        kind=view.kind.value,
        key=view.key,
        max_running=view.max_running,
        updated_at=ts(view.updated_at),
        updated_by=view.updated_by,
    )


def base_model_to_proto(row) -> registry_pb2.BaseModel:
    return registry_pb2.BaseModel(id=row.id, aliases=list(row.aliases or []), num_layers=row.num_layers)


def _actor(request, context) -> str:
    """Who made a change: the request's ``actor``, else the caller's address."""
    return (request.actor or context.peer() or "unknown")[:256]


WORKER_STATES_PB = {
    WorkerState.READY: placement_pb2.WORKER_STATE_READY,
    WorkerState.DRAINING: placement_pb2.WORKER_STATE_DRAINING,
    WorkerState.EXPIRED: placement_pb2.WORKER_STATE_EXPIRED,
}


def usage_from_proto(u: placement_pb2.AdapterUsage) -> ReportedUsage:
    return ReportedUsage(u.requests, u.prompt_tokens, u.completion_tokens, u.loads, u.fetched_bytes)


def usage_to_proto(adapter: str, u: ReportedUsage) -> placement_pb2.AdapterUsage:
    return placement_pb2.AdapterUsage(
        adapter=adapter,
        requests=u.requests,
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        loads=u.loads,
        fetched_bytes=u.fetched_bytes,
    )


def worker_to_proto(row: WorkerRow) -> placement_pb2.Worker:
    return placement_pb2.Worker(
        worker_id=row.id,
        address=row.address,
        model_id=row.model_id,
        state=WORKER_STATES_PB.get(row.state, 0),
        slots=row.slots,
        tensor_parallel_size=row.tensor_parallel_size,
        slot_infos=[
            worker_admin_pb2.SlotInfo(
                slot=p.slot,
                adapter=p.adapter,
                pinned=p.pinned,
                refcount=p.refcount,
                state=SlotState(p.state).proto,
            )
            for p in row.placements
        ],
        load=placement_pb2.WorkerLoad(
            running=row.running, waiting=row.waiting, free_slots=row.free_slots, utilization=row.utilization
        ),
        last_heartbeat=ts(row.last_heartbeat),
        lease_expires_at=ts(row.lease_expires_at),
        residency=[
            placement_pb2.AdapterResidency(adapter=p.adapter, tier=Tier.DEVICE.proto, pinned=p.pinned)
            for p in row.placements
        ]
        + [
            placement_pb2.AdapterResidency(adapter=a, tier=tier_proto(t))
            for a, t in sorted((row.cached or {}).items())
            if tier_proto(t)
        ],
    )


async def _call(context: grpc.aio.ServicerContext, fn, *args: Any, executor: Executor | None = None) -> Any:
    """Run blocking catalog/placement work on a thread (of ``executor``, else the loop's default pool).
    ``LoraserveError``s pass to the interceptor as they are; a database or network outage becomes
    UNAVAILABLE."""
    if executor is None:
        return await _on_the_loop(asyncio.to_thread(fn, *args))
    call = functools.partial(contextvars.copy_context().run, fn, *args)  # what to_thread does
    return await _on_the_loop(asyncio.get_running_loop().run_in_executor(executor, call))


async def _on_the_loop(work: Awaitable) -> Any:
    """Await ``work`` (a coroutine run on the event loop, e.g. ``Placement.locate_async``) with
    :func:`_call`'s error mapping."""
    try:
        return await work
    except (ConnectionError, TimeoutError) as exc:
        raise _backend_unavailable(exc) from exc
    except Exception as exc:
        # SQLAlchemy's or psycopg's (registry.hot_reads): the database is unreachable
        if type(exc).__name__ == "OperationalError":
            raise _backend_unavailable(exc) from exc
        raise


def _backend_unavailable(exc: Exception) -> Unavailable:
    log.warning("backend unavailable: %s", exc)
    return Unavailable(f"registry backend unavailable: {type(exc).__name__}")


class _UploadWork:
    """One upload's (or import's) slot of ``max_concurrent_uploads`` (RESOURCE_EXHAUSTED at once when none is
    free) and its steps on the upload pool. A cancelled RPC cannot stop a step already on its thread, so the
    slot is released, and the staged file deleted, only when the last step is over: an abandoned upload
    counts against the limit while its validation still runs."""

    def __init__(self, catalog: Catalog, executor: Executor) -> None:
        catalog.upload_slots.acquire()
        self.slots, self.executor = catalog.upload_slots, executor
        self.staged: StagedBlob | None = None
        self.last: asyncio.Future | None = None

    async def run(self, fn, *args: Any) -> Any:
        call = functools.partial(contextvars.copy_context().run, fn, *args)
        self.last = asyncio.get_running_loop().run_in_executor(self.executor, call)
        return await _on_the_loop(asyncio.shield(self.last))  # cancelled: the step still runs to its end

    def finish(self) -> None:
        def release(step: asyncio.Future | None = None) -> None:
            if step is not None and not step.cancelled():
                step.exception()  # retrieved: its failure was the cancelled RPC's, nobody else's
            if self.staged is not None:
                self.staged.close()
            self.slots.release()

        if self.last is not None and not self.last.done():
            self.last.add_done_callback(release)
        else:
            release()


class AdapterRegistryServicer(registry_pb2_grpc.AdapterRegistryServicer):
    def __init__(self, catalog: Catalog, upload_threads: int = UPLOAD_THREADS) -> None:
        self.catalog = catalog
        # parsing an upload (adapters.peft: JSON, rank_pattern keys, safetensors, NaN scans) never runs on the
        # event loop nor in the default pool that heartbeats and lease renewals use
        self.uploads = ThreadPoolExecutor(max_workers=upload_threads, thread_name_prefix="adapter-parse")

    async def UploadAdapter(self, request_iterator: AsyncIterator, context: grpc.aio.ServicerContext):
        """The weights go to a local temporary file as they arrive, hashed on the way, and are validated
        tensor by tensor from there (``registry.storage.StagedBlob``, ``adapters.peft_stream``): an upload
        is never held in memory whole. At most ``max_concurrent_uploads`` at once, the next one refused."""
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("payload") != "header":
            raise InvalidArgument("the first upload message must carry the header")
        h = first.header
        header = UploadHeader(
            name=h.name,
            base_model=h.base_model,
            config_bytes=h.adapter_config_json,
            weights_size=h.weights_size,
            weights_sha256=h.weights_sha256.lower(),
            description=h.description,
            labels=dict(h.labels),
            version=h.version,
            allow_base_mismatch=h.allow_base_mismatch,
        )
        work = _UploadWork(self.catalog, self.uploads)  # RESOURCE_EXHAUSTED when max_concurrent_uploads run
        try:
            await work.run(self.catalog.check_header, header)
            staged = work.staged = StagedBlob()  # a local temporary file (tempfile's folder)
            async for msg in request_iterator:
                if msg.WhichOneof("payload") != "chunk":
                    raise InvalidArgument("only the first upload message may carry a header")
                if staged.size + len(msg.chunk) > header.weights_size:
                    raise InvalidArgument(
                        f"upload sent more than the {header.weights_size} bytes its header promised"
                    )
                await work.run(staged.write, msg.chunk)
            row = await work.run(self.catalog.create_staged, header, staged)
        finally:
            work.finish()
        return adapter_to_proto(row)

    async def ImportAdapter(self, request, context):
        work = _UploadWork(self.catalog, self.uploads)
        try:
            row = await work.run(
                self.catalog.import_from,
                request.uri,
                request.name,
                request.base_model,
                request.description,
                dict(request.labels),
                request.version,
                request.allow_base_mismatch,
            )
        finally:
            work.finish()
        return adapter_to_proto(row)

    async def GetAdapter(self, request, context):
        row = await _call(context, self.catalog.get, request.adapter, request.routing_key)

        def extras():  # both reads in one hop to the thread pool
            return self.catalog.aliases.of_names([row.name]), self.catalog.limits.caps_for([row.name])

        aliases, caps = await _call(context, extras)
        out = adapter_to_proto(row, aliases.get(row.name, []))
        out.adapter_config_json = row.config.encode()
        if cap := caps.get(row.name):  # the worker resolving it caps its requests from the first one
            out.max_running, out.tenant_max_running = cap.max_running, cap.tenant_max_running
        return out

    async def ListAdapters(self, request, context):
        def page():  # both reads in one hop to the thread pool
            rows, token = self.catalog.list(
                request.page_size, request.page_token, request.base_model, request.name_prefix
            )
            return rows, token, self.catalog.aliases.of_names([r.name for r in rows])

        rows, token, aliases = await _call(context, page)
        return registry_pb2.ListAdaptersResponse(
            adapters=[adapter_to_proto(r, aliases.get(r.name, [])) for r in rows], next_page_token=token
        )

    async def SetAlias(self, request, context):
        targets = [(t.version, t.weight) for t in request.targets]
        view = await _call(
            context, self.catalog.aliases.set, request.name, request.alias, targets, _actor(request, context)
        )
        return alias_to_proto(view)

    async def DeleteAlias(self, request, context):
        view = await _call(
            context, self.catalog.aliases.delete, request.name, request.alias, _actor(request, context)
        )
        return alias_to_proto(view)

    async def SetBaseModelAliases(self, request, context):
        row = await _call(
            context, self.catalog.base_models.set_aliases, request.id, list(request.add), list(request.remove)
        )
        return base_model_to_proto(row)

    async def GetBaseModel(self, request, context):
        return base_model_to_proto(await _call(context, self.catalog.base_models.get, request.id))

    async def SetRunningLimit(self, request, context):
        if bool(request.adapter) == bool(request.tenant):
            raise InvalidArgument("give exactly one of adapter and tenant")
        kind, key = (
            (LimitKind.ADAPTER, request.adapter) if request.adapter else (LimitKind.TENANT, request.tenant)
        )
        limits, actor = self.catalog.limits, _actor(request, context)
        if request.clear:
            if request.max_running:
                raise InvalidArgument("max_running must be 0 when clear is set")
            view = await _call(context, limits.clear, kind, key, actor)
        else:
            view = await _call(context, limits.set, kind, key, request.max_running, actor)
        return limit_to_proto(view)

    async def ListRunningLimits(self, request, context):
        views = await _call(context, self.catalog.limits.list)
        return registry_pb2.ListRunningLimitsResponse(limits=[limit_to_proto(v) for v in views])

    async def ListAliasHistory(self, request, context):
        rows = await _call(context, self.catalog.aliases.history, request.name, request.alias)
        return registry_pb2.ListAliasHistoryResponse(
            changes=[
                registry_pb2.AliasChange(
                    name=r.name,
                    alias=r.alias,
                    before=targets_to_proto(r.before),
                    after=targets_to_proto(r.after),
                    actor=r.actor,
                    at=ts(r.at),
                )
                for r in rows
            ]
        )

    async def DeleteAdapter(self, request, context):
        rows, orders = await _call(context, self.catalog.delete, request.adapter)
        return registry_pb2.DeleteAdapterResponse(
            deleted=[adapter_to_proto(r) for r in rows], unload_orders=orders
        )

    async def DownloadAdapter(self, request, context):
        # the blob is read from the store into a spool (memory up to the store's spool_bytes, then a local
        # temporary file) and verified before anything is sent, then sent a CHUNK at a time from there
        row, chunks = await _call(context, self.catalog.download, request.adapter, CHUNK)
        try:
            yield registry_pb2.DownloadAdapterResponse(
                header=registry_pb2.DownloadHeader(
                    adapter=adapter_to_proto(row), adapter_config_json=row.config.encode()
                )
            )
            while (chunk := await _call(context, next, chunks, None)) is not None:
                yield registry_pb2.DownloadAdapterResponse(chunk=chunk)
        finally:  # the spool's temporary file goes, also when the client went away
            with contextlib.suppress(ValueError):  # a next() still on its thread: closed when collected
                chunks.close()


class PlacementServicer(placement_pb2_grpc.PlacementServicer):
    def __init__(self, placement: Placement, limits: RunningLimits | None = None) -> None:
        self.placement, self.limits = placement, limits

    async def RegisterWorker(self, request, context):
        shapes = {m.module: (m.in_features, m.out_features, m.num_layers) for m in request.module_shapes}
        row = await _call(
            context,
            self.placement.register,
            request.address,
            request.model_id,
            shapes,
            request.slots,
            request.max_lora_rank,
            request.max_batch_size,
            request.tensor_parallel_size,
            list(request.model_aliases),
            request.instance_id,
        )
        return placement_pb2.RegisterWorkerResponse(
            worker_id=row.id,
            lease_seconds=int(self.placement.lease.total_seconds()),
            lease_expires_at=ts(row.lease_expires_at),
        )

    async def Heartbeat(self, request, context):
        slots = [
            SlotReport(s.slot, s.adapter, _placement_state(s.state), s.pinned, s.refcount)
            for s in request.slots
            if s.adapter
        ]
        load = ReportedLoad(
            request.load.running, request.load.waiting, request.load.free_slots, request.load.utilization
        )
        cached = {c.adapter: Tier.of_proto(c.tier) or "" for c in request.cached if c.adapter}
        usage = {u.adapter: usage_from_proto(u) for u in request.usage if u.adapter}
        held = _names([*(slot.adapter for slot in slots), *list(cached)[:MAX_CACHED]])  # what heartbeat keeps

        def beat():  # the heartbeat and the caps of what the worker holds in one hop to the thread pool
            worker, orders = self.placement.heartbeat(
                request.worker_id, slots, load, cached, usage, request.usage_changed_only
            )
            return worker, orders, self.limits.caps_for(held) if self.limits else {}

        worker, orders, caps = await _call(context, beat)
        return placement_pb2.HeartbeatResponse(
            lease_expires_at=ts(worker.lease_expires_at),
            unload=[
                placement_pb2.UnloadOrder(adapter=o.adapter, reason=o.reason, drain=o.drain) for o in orders
            ],
            caps=[
                placement_pb2.RunningCap(
                    adapter=name,
                    max_running=c.max_running,
                    tenant=c.tenant,
                    tenant_max_running=c.tenant_max_running,
                )
                for name, c in sorted(caps.items())
            ],
        )

    async def GetAdapterStats(self, request, context):
        stats = await _call(context, adapter_stats, self.placement, request.name)
        return placement_pb2.AdapterStats(
            name=request.name,
            versions=[
                placement_pb2.AdapterVersionStats(
                    version=v.version,
                    usage=usage_to_proto(f"{request.name}@{v.version}", v.usage),
                    holders=[
                        placement_pb2.AdapterHolder(worker_id=wid, address=addr, tier=tier_proto(tier))
                        for wid, addr, tier in v.holders
                    ],
                    aliases=v.aliases,
                )
                for v in stats
            ],
        )

    async def ListWorkers(self, request, context):
        rows = await _call(context, self.placement.list_workers, request.model_id, request.include_expired)
        return placement_pb2.ListWorkersResponse(workers=[worker_to_proto(r) for r in rows])

    async def LocateAdapter(self, request, context):
        # on the event loop, no thread hop (registry.hot_reads: the router asks this per request)
        key, candidates = await _on_the_loop(
            self.placement.locate_async(request.adapter, request.max_candidates, request.routing_key)
        )
        split = []
        ref = parse_ref(request.adapter) if request.adapter else None  # valid: locate resolved it
        if ref is not None and ref.alias is not None:
            split = targets_to_proto(
                (await _call(context, self.placement.catalog.aliases.get, ref.name, ref.alias)).targets
            )
        return placement_pb2.LocateAdapterResponse(
            adapter=key,
            split=split,
            candidates=[
                placement_pb2.WorkerCandidate(
                    worker_id=c.worker_id,
                    address=c.address,
                    holds_adapter=c.holds_adapter,
                    tier=tier_proto(c.tier),
                    load=placement_pb2.WorkerLoad(
                        running=c.load.running,
                        waiting=c.load.waiting,
                        free_slots=c.load.free_slots,
                        utilization=c.load.utilization,
                    ),
                )
                for c in candidates
            ],
        )


def registry_services(catalog: Catalog, placement: Placement) -> Services:
    def add(server: grpc.aio.Server) -> None:
        # a request whose bytes do not parse is INVALID_ARGUMENT, not grpc's UNKNOWN (common.limits)
        add_servicer(
            registry_pb2_grpc.add_AdapterRegistryServicer_to_server, AdapterRegistryServicer(catalog), server
        )
        add_servicer(
            placement_pb2_grpc.add_PlacementServicer_to_server,
            PlacementServicer(placement, catalog.limits),
            server,
        )

    return Services("registry", add, SERVICE_NAMES, MAX_MESSAGE_BYTES)


def build_server(
    catalog: Catalog, placement: Placement, address: str, security: ServerSecurity | None = None
) -> tuple[grpc.aio.Server, int, Any]:
    return common_build_server(registry_services(catalog, placement), address, security)


async def set_serving(health_servicer: Any, serving: bool) -> None:
    await set_health(health_servicer, SERVICE_NAMES, serving)


async def expire_leases_forever(placement: Placement, every: float) -> None:
    while True:
        await asyncio.sleep(every)
        with contextlib.suppress(Exception):
            expired = await asyncio.to_thread(placement.expire)
            if expired:
                log.info("leases expired: %s", ", ".join(expired))
