"""Placement: workers register with a lease, heartbeat their slots and load, and get ranked for adapters.

A worker whose lease expires loses its placements (``expire``); its row stays as EXPIRED until it
registers again. ``locate`` ranks live workers of the adapter's base model: those holding the adapter
(least loaded first), then those with free slots (most free first), then the least loaded.

``locate`` is the router's hot path, so it ranks an in-memory view of the live fleet (:class:`Fleet`)
instead of reading every worker row per call: this process's registrations, heartbeats and expiries
update the view as they commit, and it is re-read from the database every ``FLEET_TTL_S`` seconds (what
other registry replicas wrote shows up within that). The adapter itself is always read from the
database, so a deleted or moved alias is seen at once.
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

    def put(self, worker: LiveWorker) -> None:
        with self._lock:
            self._workers[worker.id] = worker
            self._written[worker.id] = time.monotonic()

    def drop(self, *worker_ids: str) -> None:
        with self._lock:
            for wid in worker_ids:
                self._workers.pop(wid, None)
                self._written[wid] = time.monotonic()

    def live(self, now: datetime) -> list[LiveWorker]:
        """Workers whose lease runs past ``now`` (re-read first if the view is older than the TTL)."""
        if time.monotonic() - self._read_at > self.ttl_s:
            self._reload()
        with self._lock:
            return [w for w in self._workers.values() if w.lease_expires_at > now]

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
            self._workers, self._read_at = fresh, started


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
        workers = [w for w in self.fleet.live(now) if model is None or w.model_id == model]

        def tier(w: LiveWorker) -> str:
            return ("DEVICE" if key in w.holds else w.cached.get(key, "")) if key else ""

        def rank(w: LiveWorker) -> tuple:
            """Device slot > host memory > disk cache > cold (free slots first), then the least busy."""
            busy, t = w.load.running + w.load.waiting, tier(w)
            if t:
                return (TIERS.index(t), busy, 0, w.id)
            if w.load.free_slots > 0:
                return (3, -w.load.free_slots, busy, w.id)
            return (4, busy, 0, w.id)

        ranked = sorted(workers, key=rank)[:limit]
        return key, [
            Candidate(w.id, w.address, bool(key) and key in w.holds, w.load, tier(w)) for w in ranked
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
