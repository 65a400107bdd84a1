"""Placement: workers register with a lease, heartbeat their slots and load, and get ranked for adapters.

A worker whose lease expires loses its placements (``expire``); its row stays as EXPIRED until it
registers again. ``locate`` ranks live workers of the adapter's base model: those holding the adapter
(least loaded first), then those with free slots (most free first), then the least loaded.

``locate`` is the router's hot path, so it ranks an in-memory view of the live fleet (:class:`Fleet`)
instead of reading every worker row per call: this process's registrations, heartbeats and expiries
update the view as they commit, and it is re-read from the database every ``FLEET_TTL_S`` seconds (what
other registry replicas wrote shows up within that). The view indexes, per adapter, the workers holding
or caching it and, per model, the order of cold candidates, so a locate costs O(holders + candidates),
not a sort of the fleet. The adapter's resolution comes from :meth:`Catalog.resolve`: this process's
uploads and deletes are seen at once, another replica's within ``RESOLVE_TTL_S``; an alias is always
read, so a moved alias is seen at once.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import delete, select
from sqlalchemy.orm import selectinload, sessionmaker

from loraserve.common.errors import FailedPrecondition, InvalidArgument, NotFound
from loraserve.registry.catalog import Catalog
from loraserve.registry.db import (
    AdapterRow,
    BaseModelRow,
    PlacementRow,
    UnloadOrderRow,
    WorkerRow,
    as_utc,
    utcnow,
)

MAX_CANDIDATES = 16


@dataclass(frozen=True)
class Order:
    """An unload order for a heartbeat's reply: at once (deleted), or once idle (``drain``: retired)."""

    adapter: str
    reason: str
    drain: bool = False


@dataclass(frozen=True)
class SlotReport:
    slot: int
    adapter: str  # resolved "name@version"; "" = empty
    state: str  # "LOADING" | "LOADED"
    pinned: bool = False
    refcount: int = 0


@dataclass(frozen=True)
class Load:
    running: int = 0
    waiting: int = 0
    free_slots: int = 0
    utilization: float = 0.0


TIERS = ("DEVICE", "HOST", "DISK")  # fastest first; a worker holding nothing is a cold load
MAX_USAGE = 4096  # adapters of a heartbeat's usage report kept (bounds a worker row)
FLEET_TTL_S = 1.0  # the live-fleet view is re-read from the database at least this often


@dataclass(frozen=True)
class LiveWorker:
    """What ``locate`` needs of one READY worker: its lease, load, what it holds and in which tier."""

    id: str
    address: str
    model_id: str
    lease_expires_at: datetime
    load: Load
    cached: dict[str, str] = field(default_factory=dict)  # adapter -> "HOST" | "DISK"
    holds: frozenset[str] = frozenset()  # adapters LOADED in a device slot


def _live(row: WorkerRow, holds: frozenset[str]) -> LiveWorker:
    return LiveWorker(
        row.id,
        row.address,
        row.model_id,
        as_utc(row.lease_expires_at),
        Load(row.running, row.waiting, row.free_slots, row.utilization),
        dict(row.cached or {}),
        holds,
    )


class Fleet:
    """The READY workers as last read from the database or written by this process (thread-safe)."""

    def __init__(self, sessions: sessionmaker, ttl_s: float = FLEET_TTL_S) -> None:
        self.sessions, self.ttl_s = sessions, ttl_s
        self._lock = threading.Lock()
        self._workers: dict[str, LiveWorker] = {}
        self._written: dict[str, float] = {}  # worker id -> when this process last wrote it (monotonic)
        self._read_at = float("-inf")
        self._index: _RankIndex | None = None  # built from _workers on the first rank after a change

    def put(self, worker: LiveWorker) -> None:
        with self._lock:
            self._workers[worker.id] = worker
            self._written[worker.id] = time.monotonic()
            self._index = None

    def drop(self, *worker_ids: str) -> None:
        with self._lock:
            for wid in worker_ids:
                self._workers.pop(wid, None)
                self._written[wid] = time.monotonic()
            self._index = None

    def rank(self, key: str, model: str | None, limit: int, now: datetime) -> list[tuple[LiveWorker, str]]:
        """The ``limit`` best live workers of ``model`` (any model if None) for adapter ``key`` ("" = the base
        model), each with its tier for ``key``: device slot > host memory > disk cache (the least busy first
        within a tier), then workers with free slots (most free first, then the least busy), then the least
        busy; ties by worker id.

        Costs O(holders of ``key`` + ``limit``), not O(fleet): the workers holding or caching an adapter and
        each model's order of cold candidates are indexed once per change of the view (a heartbeat), not
        sorted per call."""
        self._refresh()
        with self._lock:
            if self._index is None:
                self._index = _RankIndex(self._workers.values())
            index = self._index

        def fits(w: LiveWorker) -> bool:
            return w.lease_expires_at > now and (model is None or w.model_id == model)

        warm = (
            sorted(
                ((t, w.load.running + w.load.waiting, w.id), w)
                for t, w in index.tiers.get(key, ())
                if fits(w)
            )
            if key
            else []
        )
        out = [(w, TIERS[t]) for (t, _, _), w in warm[:limit]]
        taken = {w.id for w, _ in out}
        for w in index.cold.get(model, ()):
            if len(out) >= limit:
                break
            if w.id not in taken and fits(w):
                out.append((w, ""))
        return out

    def _refresh(self) -> None:
        if time.monotonic() - self._read_at > self.ttl_s:
            self._reload()

    def _reload(self) -> None:
        started = time.monotonic()
        with self.sessions() as s:
            rows = list(s.scalars(select(WorkerRow).where(WorkerRow.state == "READY")))
            holds: dict[str, set[str]] = {}
            for wid, adapter in s.execute(
                select(PlacementRow.worker_id, PlacementRow.adapter).where(PlacementRow.state == "LOADED")
            ):
                holds.setdefault(wid, set()).add(adapter)
        fresh = {r.id: _live(r, frozenset(holds.get(r.id, ()))) for r in rows}
        with self._lock:  # what this process wrote while the database was read is newer: keep it
            for wid, at in self._written.items():
                if at >= started:
                    if wid in self._workers:
                        fresh[wid] = self._workers[wid]
                    else:
                        fresh.pop(wid, None)
            self._written = {wid: at for wid, at in self._written.items() if at >= started}
            self._workers, self._read_at, self._index = fresh, started, None


class _RankIndex:
    """What :meth:`Fleet.rank` reads, built from one view of the fleet: per adapter, the workers holding
    (DEVICE) or caching (HOST, DISK) it with that tier's index in ``TIERS``; per model (and for ``None``, all
    models), every worker in cold order: free slots first (most free, then least busy), then the least
    busy, ties by id."""

    def __init__(self, workers) -> None:
        self.tiers: dict[str, list[tuple[int, LiveWorker]]] = {}
        by_model: dict[str | None, list[LiveWorker]] = {None: []}
        for w in workers:
            for key, tier in w.cached.items():
                if key not in w.holds and tier in TIERS:
                    self.tiers.setdefault(key, []).append((TIERS.index(tier), w))
            for key in w.holds:
                self.tiers.setdefault(key, []).append((0, w))
            by_model[None].append(w)
            by_model.setdefault(w.model_id, []).append(w)

        def cold(w: LiveWorker) -> tuple:
            busy = w.load.running + w.load.waiting
            return (0, -w.load.free_slots, busy, w.id) if w.load.free_slots > 0 else (1, busy, 0, w.id)

        self.cold = {m: sorted(ws, key=cold) for m, ws in by_model.items()}


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    address: str
    holds_adapter: bool
    load: Load
    tier: str = ""  # "DEVICE" | "HOST" | "DISK" | "" (cold)


class Placement:
    def __init__(self, sessions: sessionmaker, catalog: Catalog, lease_seconds: int) -> None:
        self.sessions, self.catalog, self.lease = sessions, catalog, timedelta(seconds=lease_seconds)
        self.fleet = Fleet(catalog.reads)

    def register(
        self,
        address: str,
        model_id: str,
        module_shapes: dict[str, tuple[int, int, int]],
        slots: int,
        max_lora_rank: int = 0,
        max_batch_size: int = 0,
        tensor_parallel_size: int = 1,
        model_aliases: list[str] | None = None,
    ) -> WorkerRow:
        """``module_shapes``: module -> (in, out, num_layers). Replaces any earlier worker at ``address``.

        ``tensor_parallel_size`` 0 (a worker from before the field) is recorded as 1."""
        if not address or not model_id:
            raise InvalidArgument("address and model_id are required")
        if slots <= 0:
            raise InvalidArgument("slots must be positive")
        now = utcnow()
        with self.sessions() as s:
            known = s.get(BaseModelRow, model_id)
            names = [a[:512] for a in model_aliases or () if a and a != model_id]
            if known is None and (module_shapes or names):
                known = BaseModelRow(id=model_id, module_shapes={}, num_layers=0, aliases=[])
                s.add(known)
            if module_shapes:
                shapes = {m: [int(i), int(o)] for m, (i, o, _) in module_shapes.items()}
                layers = max(n for _, _, n in module_shapes.values())
                if not known.module_shapes:  # new, or named by an admin before any worker registered it
                    known.module_shapes, known.num_layers = shapes, layers
                elif known.module_shapes != shapes or known.num_layers != layers:
                    raise FailedPrecondition(f"model {model_id!r} is registered with other module shapes")
            if names:  # the checkpoint's repo id: adapters declaring it fit this model
                known.aliases = [
                    *(known.aliases or []),
                    *(a for a in names if a not in (known.aliases or [])),
                ]
            replaced = list(s.scalars(select(WorkerRow.id).where(WorkerRow.address == address)))
            s.execute(delete(WorkerRow).where(WorkerRow.address == address))
            row = WorkerRow(
                id=uuid.uuid4().hex,
                address=address,
                model_id=model_id,
                slots=slots,
                max_lora_rank=max_lora_rank,
                max_batch_size=max_batch_size,
                tensor_parallel_size=tensor_parallel_size or 1,
                state="READY",
                lease_expires_at=now + self.lease,
                last_heartbeat=now,
                free_slots=slots,
            )
            s.add(row)
            s.commit()
        self.fleet.drop(*replaced)
        self.fleet.put(_live(row, frozenset()))
        return row

    def heartbeat(
        self,
        worker_id: str,
        slots: list[SlotReport],
        load: Load,
        cached: dict[str, str] | None = None,
        usage: dict[str, list[int]] | None = None,
    ) -> tuple[WorkerRow, list[Order]]:
        """Renew the lease, replace the worker's placements, return its pending unload orders."""
        now = utcnow()
        with self.sessions() as s:
            worker = s.get(WorkerRow, worker_id)
            if worker is None or worker.state == "EXPIRED" or as_utc(worker.lease_expires_at) < now:
                raise NotFound(f"worker {worker_id!r} is not registered or its lease expired: register again")
            worker.lease_expires_at, worker.last_heartbeat = now + self.lease, now
            worker.running, worker.waiting = load.running, load.waiting
            worker.free_slots, worker.utilization = load.free_slots, load.utilization
            worker.cached = {a[:160]: t for a, t in (cached or {}).items() if t in ("HOST", "DISK")}
            if usage is not None:
                worker.usage = {a[:160]: [int(x) for x in v[:5]] for a, v in list(usage.items())[:MAX_USAGE]}
            reported = {r.adapter for r in slots if r.adapter}
            on_host = {a for a, t in worker.cached.items() if t == "HOST"}
            # one query for every version of every name in the report: placement ids, READY and retired
            ids: dict[str, int] = {}
            ready, retired = set(), set()
            for adapter_id, name, version, state, is_retired in s.execute(
                select(
                    AdapterRow.id, AdapterRow.name, AdapterRow.version, AdapterRow.state, AdapterRow.retired
                ).where(AdapterRow.name.in_({k.partition("@")[0] for k in reported | on_host}))
            ):
                key = f"{name}@{version}"
                ids[key] = adapter_id
                if state == "READY":
                    (retired if is_retired else ready).add(key)
            # bring the worker's placement rows to the report, touching only the slots that changed (a
            # steady worker's heartbeat writes no placement row)
            held = {
                p.slot: p for p in s.scalars(select(PlacementRow).where(PlacementRow.worker_id == worker_id))
            }
            for r in slots:
                if not r.adapter:
                    continue
                row = held.pop(r.slot, None)
                if row is not None and row.adapter != r.adapter:
                    s.delete(row)
                    s.flush()  # the (worker, slot) pair is unique: the old row goes before the new one
                    row = None
                if row is None:
                    s.add(
                        PlacementRow(
                            worker_id=worker_id,
                            adapter=r.adapter,
                            adapter_id=ids.get(r.adapter),
                            slot=r.slot,
                            state=r.state,
                            pinned=r.pinned,
                            refcount=r.refcount,
                            last_used=now,
                        )
                    )
                elif (row.state, row.pinned, row.refcount) != (r.state, r.pinned, r.refcount):
                    row.state, row.pinned, row.refcount, row.last_used = r.state, r.pinned, r.refcount, now
            for row in held.values():  # slots the report leaves empty
                s.delete(row)
            orders = list(s.scalars(select(UnloadOrderRow).where(UnloadOrderRow.worker_id == worker_id)))
            done = [o for o in orders if o.adapter not in reported]
            for o in done:  # the worker no longer holds it: the order is fulfilled
                s.delete(o)
            pending = [Order(o.adapter, o.reason) for o in orders if o.adapter in reported]
            # An adapter deleted before any heartbeat reported it has no order row: any reported adapter
            # without a READY version is unloaded too, so nothing deleted stays resident. A retired version
            # (an alias moved away from it) is drained: unloaded once no request uses it.
            # Adapters kept in host memory are checked too: a deleted one is forgotten there (and in any
            # weighted mix holding it), so no request can reach it again.
            ordered = {o.adapter for o in pending}
            for key in sorted(reported - ordered):
                if key in retired:
                    pending.append(Order(key, f"{key} is retired: no alias points at it", drain=True))
                elif key not in ready:
                    pending.append(Order(key, f"adapter {key} is not in the registry"))
            for key in sorted(on_host - reported - ordered - ready - retired):
                pending.append(Order(key, f"adapter {key} is not in the registry"))
            s.commit()
        loaded = frozenset(r.adapter for r in slots if r.adapter and r.state == "LOADED")
        self.fleet.put(_live(worker, loaded))
        return worker, pending

    def expire(self) -> list[str]:
        """Drop the placements of every worker whose lease ran out; returns their ids."""
        now = utcnow()
        with self.sessions() as s:
            stale = list(
                s.scalars(
                    select(WorkerRow).where(WorkerRow.state != "EXPIRED", WorkerRow.lease_expires_at < now)
                )
            )
            for w in stale:
                w.state = "EXPIRED"
                s.execute(delete(PlacementRow).where(PlacementRow.worker_id == w.id))
            s.commit()
        self.fleet.drop(*(w.id for w in stale))
        return [w.id for w in stale]

    def list_workers(self, model_id: str = "", include_expired: bool = False) -> list[WorkerRow]:
        self.expire()
        with self.sessions() as s:
            q = select(WorkerRow).options(selectinload(WorkerRow.placements)).order_by(WorkerRow.id)
            if model_id:
                q = q.where(WorkerRow.model_id == model_id)
            if not include_expired:
                q = q.where(WorkerRow.state != "EXPIRED")
            return list(s.scalars(q))

    def locate(self, ref: str, max_candidates: int = 0, routing_key: str = "") -> tuple[str, list[Candidate]]:
        """Resolve ``ref`` (an alias by ``routing_key``) and rank live workers for it; ("", ranking) for the
        base model."""
        limit = min(max_candidates or 3, MAX_CANDIDATES)
        now = utcnow()
        key, model = "", None
        if ref:
            key, model = self.catalog.resolve(ref, routing_key)
        return key, [
            Candidate(w.id, w.address, tier == "DEVICE", w.load, tier)
            for w, tier in self.fleet.rank(key, model, limit, now)
        ]


@dataclass
class VersionStats:
    version: int
    usage: list[int]  # requests, prompt_tokens, completion_tokens, loads, fetched_bytes (live workers)
    holders: list[tuple[str, str, str]]  # (worker_id, address, tier)
    aliases: list[str]


def adapter_stats(placement: Placement, name: str) -> list[VersionStats]:
    """Per READY version of ``name``: usage summed over live workers' heartbeats, holders and their tier,
    aliases. NOT_FOUND when the name has no READY version."""
    with placement.sessions() as s:
        versions = list(
            s.scalars(
                select(AdapterRow.version)
                .where(AdapterRow.name == name, AdapterRow.state == "READY")
                .order_by(AdapterRow.version)
            )
        )
    if not versions:
        raise NotFound(f"adapter {name!r} does not exist")
    aliases = placement.catalog.aliases.of_names([name]).get(name, [])
    workers = placement.list_workers()
    out = []
    for v in versions:
        key = f"{name}@{v}"
        total = [0] * 5
        holders = []
        for w in workers:
            for i, x in enumerate((w.usage or {}).get(key, [])[:5]):
                total[i] += x
            if any(p.adapter == key for p in w.placements):
                holders.append((w.id, w.address, "DEVICE"))
            elif key in (w.cached or {}):
                holders.append((w.id, w.address, w.cached[key]))
        named = [a.alias for a in aliases if any(tv == v for tv, _ in a.targets)]
        out.append(VersionStats(v, total, holders, named))
    return out
