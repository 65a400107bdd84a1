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

import asyncio
import bisect
import hashlib
import hmac
import threading
import uuid
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import Connection, Row, bindparam, delete, insert, select, update
from sqlalchemy.orm import selectinload, sessionmaker

from loraserve.common.addresses import parse_address
from loraserve.common.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from loraserve.common.slots import SlotState, Tier
from loraserve.registry.catalog import Catalog
from loraserve.registry.clock import SYSTEM_CLOCK, Clock
from loraserve.registry.db import (
    AdapterRow,
    AdapterState,
    BaseModelRow,
    PlacementRow,
    UnloadOrderRow,
    WorkerRow,
    WorkerState,
    as_utc,
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
    state: SlotState
    pinned: bool = False
    refcount: int = 0


@dataclass(frozen=True)
class ReportedLoad:
    """A worker's load as its heartbeat reports it (the wire's ``WorkerLoad``)."""

    running: int = 0
    waiting: int = 0
    free_slots: int = 0
    utilization: float = 0.0


@dataclass(frozen=True)
class ReportedUsage:
    """One adapter's usage totals as a worker reports them (since it started), or a sum of such totals.

    Stored per adapter in ``workers.usage`` as the JSON list ``[requests, prompt_tokens, completion_tokens,
    loads, fetched_bytes]`` (:meth:`to_json`, :meth:`from_json`)."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    loads: int = 0
    fetched_bytes: int = 0

    def __add__(self, other: ReportedUsage) -> ReportedUsage:
        return ReportedUsage(*(a + b for a, b in zip(self.to_json(), other.to_json(), strict=True)))

    def to_json(self) -> list[int]:
        return [self.requests, self.prompt_tokens, self.completion_tokens, self.loads, self.fetched_bytes]

    @classmethod
    def from_json(cls, value: list[int]) -> ReportedUsage:
        """A stored list; missing trailing fields are 0, extra ones ignored."""
        return cls(*(int(x) for x in value[:5]))


TIERS = (Tier.DEVICE, Tier.HOST, Tier.DISK)  # fastest first; a worker holding nothing is a cold load
CACHE_TIERS = (Tier.HOST, Tier.DISK)  # the tiers of workers.cached (a device slot is a placement row)
MAX_USAGE = 4096  # adapters of a heartbeat's usage report kept (bounds a worker row)
# adapters of a heartbeat's host/disk-cache report kept: bounds the worker row, the statements that look them up
# (PostgreSQL binds at most 65 535 parameters) and the unload orders a reply can carry
MAX_CACHED = 16_384
FLEET_TTL_S = 1.0  # the live-fleet view is re-read from the database at least this often


@dataclass(frozen=True)
class LiveWorker:
    """What ``locate`` needs of one READY worker: its lease, load, what it holds and in which tier."""

    id: str
    address: str
    model_id: str
    lease_expires_at: datetime
    load: ReportedLoad
    cached: dict[str, str] = field(default_factory=dict)  # adapter -> Tier HOST | DISK
    holds: frozenset[str] = frozenset()  # adapters LOADED in a device slot


def _live(row: WorkerRow, holds: frozenset[str]) -> LiveWorker:
    return LiveWorker(
        row.id,
        row.address,
        row.model_id,
        as_utc(row.lease_expires_at),
        ReportedLoad(row.running, row.waiting, row.free_slots, row.utilization),
        dict(row.cached or {}),
        holds,
    )


_FLEET_WORKERS = select(
    WorkerRow.id,
    WorkerRow.address,
    WorkerRow.model_id,
    WorkerRow.lease_expires_at,
    WorkerRow.running,
    WorkerRow.waiting,
    WorkerRow.free_slots,
    WorkerRow.utilization,
    WorkerRow.cached,
).where(WorkerRow.state == WorkerState.READY)
_FLEET_HOLDS = select(PlacementRow.worker_id, PlacementRow.adapter).where(
    PlacementRow.state == SlotState.LOADED
)


def _tiers_of(w: LiveWorker) -> dict[str, int]:
    """Adapter -> the index in ``TIERS`` of where ``w`` keeps it (a device slot wins over a cache)."""
    out = {key: TIERS.index(tier) for key, tier in w.cached.items() if tier in TIERS}
    out.update(dict.fromkeys(w.holds, 0))
    return out


def _cold_key(w: LiveWorker) -> tuple:
    """A worker's place among cold candidates: free slots first (most free, then the least busy), then the
    least busy; ties by id (so every key is unique)."""
    busy = w.load.running + w.load.waiting
    return (0, -w.load.free_slots, busy, w.id) if w.load.free_slots > 0 else (1, busy, 0, w.id)


class Fleet:
    """The READY workers as last read from the database or written by this process (thread-safe).

    Indexed for :meth:`rank`, and kept indexed as each worker changes (a heartbeat moves one worker):
    per adapter, the workers holding or caching it with their tier; per model (and ``None``: every model),
    the workers in cold order, as sorted lists of ``(_cold_key, id)``. ``clock.monotonic`` times the TTL."""

    def __init__(
        self, sessions: sessionmaker, ttl_s: float = FLEET_TTL_S, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self.sessions, self.ttl_s, self.clock = sessions, ttl_s, clock
        self._lock = threading.Lock()
        self._workers: dict[str, LiveWorker] = {}
        self._tiers: dict[str, dict[str, int]] = {}  # adapter -> {worker id: tier index}
        self._cold: dict[str | None, list[tuple[tuple, str]]] = {None: []}
        self._written: dict[str, float] = {}  # worker id -> when this process last wrote it (monotonic)
        self._read_at = float("-inf")

    def put(self, worker: LiveWorker) -> None:
        with self._lock:
            self._unindex(worker.id)
            self._index(worker)
            self._written[worker.id] = self.clock.monotonic()

    def drop(self, *worker_ids: str) -> None:
        with self._lock:
            for wid in worker_ids:
                self._unindex(wid)
                self._written[wid] = self.clock.monotonic()

    def rank(self, key: str, model: str | None, limit: int, now: datetime) -> list[tuple[LiveWorker, str]]:
        """The ``limit`` best live workers of ``model`` (any model if None) for adapter ``key`` ("" = the base
        model), each with its tier for ``key``: device slot > host memory > disk cache (the least busy first
        within a tier), then workers with free slots (most free first, then the least busy), then the least
        busy; ties by worker id.

        Costs O(holders of ``key`` + ``limit``), not a sort of the fleet (docs/performance.md)."""
        self._refresh()

        def fits(w: LiveWorker) -> bool:
            return w.lease_expires_at > now and (model is None or w.model_id == model)

        with self._lock:
            warm = []
            for wid, t in self._tiers.get(key, {}).items() if key else ():
                w = self._workers[wid]
                if fits(w):
                    warm.append(((t, w.load.running + w.load.waiting, wid), w))
            warm.sort(key=lambda item: item[0])
            out = [(w, TIERS[t]) for (t, _, _), w in warm[:limit]]
            taken = {w.id for w, _ in out}
            for _, wid in self._cold.get(model, ()):
                if len(out) >= limit:
                    break
                w = self._workers[wid]
                if wid not in taken and fits(w):
                    out.append((w, ""))
        return out

    def _index(self, w: LiveWorker) -> None:
        self._workers[w.id] = w
        for key, t in _tiers_of(w).items():
            self._tiers.setdefault(key, {})[w.id] = t
        item = (_cold_key(w), w.id)
        for m in (None, w.model_id):
            bisect.insort(self._cold.setdefault(m, []), item)

    def _unindex(self, wid: str) -> None:
        w = self._workers.pop(wid, None)
        if w is None:
            return
        for key in _tiers_of(w):
            holders = self._tiers[key]
            del holders[wid]
            if not holders:
                del self._tiers[key]
        item = (_cold_key(w), wid)
        for m in (None, w.model_id):
            order = self._cold[m]
            del order[bisect.bisect_left(order, item)]

    def stale(self) -> bool:
        """Whether the next :meth:`rank` re-reads the fleet from the database first."""
        return self.clock.monotonic() - self._read_at > self.ttl_s

    def _refresh(self) -> None:
        if self.stale():
            self._reload()

    def _reload(self) -> None:
        started = self.clock.monotonic()
        with self.sessions.kw["bind"].connect() as conn:  # plain rows: no ORM objects for a whole fleet
            rows = list(conn.execute(_FLEET_WORKERS))
            holds: dict[str, set[str]] = {}
            for wid, adapter in conn.execute(_FLEET_HOLDS):
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
            self._workers, self._tiers, self._cold = fresh, {}, {None: []}
            for w in fresh.values():
                for key, t in _tiers_of(w).items():
                    self._tiers.setdefault(key, {})[w.id] = t
                for m in (None, w.model_id):
                    self._cold.setdefault(m, []).append((_cold_key(w), w.id))
            for order in self._cold.values():
                order.sort()
            self._read_at = started


def worker_identity(instance_id: str) -> str:
    """What the registry keeps of a worker's instance id: its sha256 (hex); "" for none."""
    return hashlib.sha256(instance_id.encode()).hexdigest() if instance_id else ""


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    address: str
    holds_adapter: bool
    load: ReportedLoad
    tier: str = ""  # a Tier, or "" (cold)


_RENEW_VALUES = dict(
    lease_expires_at=bindparam("lease"),
    last_heartbeat=bindparam("now"),
    running=bindparam("running"),
    waiting=bindparam("waiting"),
    free_slots=bindparam("free_slots"),
    utilization=bindparam("utilization"),
    cached=bindparam("cached", type_=WorkerRow.cached.type),
)
_RENEW = (
    update(WorkerRow)
    .where(
        WorkerRow.id == bindparam("wid"),
        WorkerRow.state != WorkerState.EXPIRED,
        WorkerRow.lease_expires_at >= bindparam("now"),
    )
    .values(**_RENEW_VALUES)
    .returning(WorkerRow.address, WorkerRow.model_id)
)
_RENEW_WITH_USAGE = _RENEW.values(usage=bindparam("usage", type_=WorkerRow.usage.type))
_USAGE = select(WorkerRow.usage).where(WorkerRow.id == bindparam("wid"))
_SET_USAGE = (
    update(WorkerRow)
    .where(WorkerRow.id == bindparam("wid"))
    .values(usage=bindparam("usage", type_=WorkerRow.usage.type))
)
_VERSIONS = select(
    AdapterRow.id, AdapterRow.name, AdapterRow.version, AdapterRow.state, AdapterRow.retired
).where(AdapterRow.name.in_(bindparam("names", expanding=True)))
_PLACEMENTS = select(
    PlacementRow.id,
    PlacementRow.slot,
    PlacementRow.adapter,
    PlacementRow.state,
    PlacementRow.pinned,
    PlacementRow.refcount,
).where(PlacementRow.worker_id == bindparam("wid"))
_PLACEMENT_STATE = (
    update(PlacementRow)
    .where(PlacementRow.id == bindparam("pid"))
    .values(
        state=bindparam("state"),
        pinned=bindparam("pinned"),
        refcount=bindparam("refcount"),
        last_used=bindparam("last_used"),
    )
)
_ORDERS = select(UnloadOrderRow.id, UnloadOrderRow.adapter, UnloadOrderRow.reason).where(
    UnloadOrderRow.worker_id == bindparam("wid")
)


# Placement.heartbeat's steps, in the order they run on its one connection.


def _renew_lease(
    conn: Connection,
    worker_id: str,
    now: datetime,
    lease: datetime,
    load: ReportedLoad,
    cached: dict[str, str],
    usage: dict[str, list[int]] | None,
) -> Row:
    """Renew the worker's lease and record its load and caches (and its whole ``usage``, unless None):
    one UPDATE … RETURNING its address and model. NOT_FOUND when it has no live lease."""
    values = {
        "wid": worker_id,
        "now": now,
        "lease": lease,
        "running": load.running,
        "waiting": load.waiting,
        "free_slots": load.free_slots,
        "utilization": load.utilization,
        "cached": cached,
    }
    renew = _RENEW
    if usage is not None:
        values["usage"] = usage
        renew = _RENEW_WITH_USAGE
    worker = conn.execute(renew, values).first()
    if worker is None:
        raise NotFound(f"worker {worker_id!r} is not registered or its lease expired: register again")
    return worker


def _merge_usage(conn: Connection, worker_id: str, reported: dict[str, list[int]]) -> None:
    """Merge the usage totals that changed into the worker's row (a read and a write): the reported
    adapters move to the end, and the last ``MAX_USAGE`` are kept (the most recently reported)."""
    held = conn.execute(_USAGE, {"wid": worker_id}).scalar() or {}
    for key in reported:
        held.pop(key, None)  # re-inserted last: the most recently reported are kept
    held.update(reported)
    merged = dict(list(held.items())[-MAX_USAGE:])
    conn.execute(_SET_USAGE, {"wid": worker_id, "usage": merged})


@dataclass
class _Versions:
    """What the registry holds of the reported adapters' names: placement ids by ``name@version``, and
    which versions are READY (and not retired) or retired."""

    ids: dict[str, int] = field(default_factory=dict)
    ready: set[str] = field(default_factory=set)
    retired: set[str] = field(default_factory=set)


def _versions_of(conn: Connection, keys: set[str]) -> _Versions:
    """One query for every version of every name in ``keys`` (``name@version``s)."""
    out = _Versions()
    names = sorted({k.partition("@")[0] for k in keys})
    for adapter_id, name, version, state, is_retired in conn.execute(_VERSIONS, {"names": names}):
        key = f"{name}@{version}"
        out.ids[key] = adapter_id
        if state == AdapterState.READY:
            (out.retired if is_retired else out.ready).add(key)
    return out


def _reconcile_placements(
    conn: Connection, worker_id: str, slots: list[SlotReport], ids: dict[str, int], now: datetime
) -> None:
    """Bring the worker's placement rows to the report, touching only the slots that changed (a steady
    worker's heartbeat writes no placement row)."""
    held = {row.slot: row for row in conn.execute(_PLACEMENTS, {"wid": worker_id})}
    gone, added, changed = [], [], []
    for r in slots:
        if not r.adapter:
            continue
        row = held.pop(r.slot, None)
        if row is not None and row.adapter != r.adapter:
            gone.append(row.id)  # the (worker, slot) pair is unique: the old row goes first
            row = None
        if row is None:
            added.append(
                dict(
                    worker_id=worker_id,
                    adapter=r.adapter,
                    adapter_id=ids.get(r.adapter),
                    slot=r.slot,
                    state=r.state,
                    pinned=r.pinned,
                    refcount=r.refcount,
                    loaded_at=now,
                    last_used=now,
                )
            )
        elif (row.state, row.pinned, row.refcount) != (r.state, r.pinned, r.refcount):
            changed.append(
                dict(pid=row.id, state=r.state, pinned=r.pinned, refcount=r.refcount, last_used=now)
            )
    gone += [row.id for row in held.values()]  # slots the report leaves empty
    if gone:
        conn.execute(delete(PlacementRow).where(PlacementRow.id.in_(gone)))
    if added:
        conn.execute(insert(PlacementRow), added)
    if changed:
        conn.execute(_PLACEMENT_STATE, changed)


def _collect_unload_orders(
    conn: Connection, worker_id: str, reported: set[str], cached_keys: set[str], versions: _Versions
) -> list[Order]:
    """The worker's pending unload orders: its order rows for adapters it still holds (the others are
    fulfilled and deleted), then orders for what it holds or caches that has no READY version."""
    orders = list(conn.execute(_ORDERS, {"wid": worker_id}))
    done = [o.id for o in orders if o.adapter not in reported]
    if done:  # the worker no longer holds it: the order is fulfilled
        conn.execute(delete(UnloadOrderRow).where(UnloadOrderRow.id.in_(done)))
    pending = [Order(o.adapter, o.reason) for o in orders if o.adapter in reported]
    # An adapter deleted before any heartbeat reported it has no order row: any reported adapter
    # without a READY version is unloaded too, so nothing deleted stays resident. A retired version
    # (an alias moved away from it) is drained: unloaded once no request uses it.
    # Adapters kept in host memory or the disk cache are checked too: a deleted one is forgotten there
    # (and in any weighted mix holding it), so no request can reach it again.
    ready, retired = versions.ready, versions.retired
    ordered = {o.adapter for o in pending}
    for key in sorted(reported - ordered):
        if key in retired:
            pending.append(Order(key, f"{key} is retired: no alias points at it", drain=True))
        elif key not in ready:
            pending.append(Order(key, f"adapter {key} is not in the registry"))
    for key in sorted(cached_keys - reported - ordered - ready - retired):
        pending.append(Order(key, f"adapter {key} is not in the registry"))
    return pending


class Placement:
    def __init__(
        self, sessions: sessionmaker, catalog: Catalog, lease_seconds: int, clock: Clock | None = None
    ) -> None:
        """``clock``: what leases, heartbeats and expiry read as now, and what times the fleet view's TTL
        (default: the catalog's, the machine's unless a test passed its own)."""
        self.sessions, self.catalog, self.lease = sessions, catalog, timedelta(seconds=lease_seconds)
        self.clock = clock or catalog.clock
        self.engine = sessions.kw["bind"]
        self.fleet = Fleet(catalog.reads, clock=self.clock)

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
        instance_id: str = "",
    ) -> WorkerRow:
        """``module_shapes``: module -> (in, out, num_layers). Replaces any earlier worker at ``address``:
        one whose lease expired, or a live one registered with the same ``instance_id`` (the worker process's
        secret identity; a retry, a re-registration). A live worker of another identity keeps the address:
        ALREADY_EXISTS, nothing changed (nobody takes over a live worker's address and its requests).

        ``address`` is where routers dial the worker: ``host:port`` or ``unix:/absolute/path`` (recorded in
        the canonical form, ``common.addresses``; anything else is INVALID_ARGUMENT).
        ``tensor_parallel_size`` 0 (a worker from before the field) is recorded as 1."""
        if not address or not model_id:
            raise InvalidArgument("address and model_id are required")
        address = str(parse_address(address, what="worker address"))
        if slots <= 0:
            raise InvalidArgument("slots must be positive")
        now = self.clock.now()
        identity = worker_identity(instance_id)
        with self.sessions() as s:
            for held in s.scalars(select(WorkerRow).where(WorkerRow.address == address)):
                until = as_utc(held.lease_expires_at)
                same = bool(identity) and hmac.compare_digest(held.identity or "", identity)
                if held.state != WorkerState.EXPIRED and until >= now and not same:
                    raise AlreadyExists(
                        f"address {address} is held by a live worker until {until.isoformat(timespec='seconds')}"
                        " (another process): a restarted worker registers once that lease ends"
                    )
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
                identity=identity,
                state=WorkerState.READY.value,
                lease_expires_at=now + self.lease,
                last_heartbeat=now,
                registered_at=now,
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
        load: ReportedLoad,
        cached: dict[str, str] | None = None,
        usage: dict[str, ReportedUsage] | None = None,
        usage_changed_only: bool = False,
    ) -> tuple[LiveWorker, list[Order]]:
        """Renew the lease, replace the worker's placements, return its pending unload orders.

        ``usage`` (adapter -> totals since the worker started) replaces what the worker's row holds, or with
        ``usage_changed_only`` (the adapters whose totals changed since the last heartbeat) is merged into it
        (at most ``MAX_USAGE`` adapters kept, the most recently reported).

        Every worker heartbeats every few seconds (40 a second at 200 workers), so this runs prebuilt Core
        statements on one connection, no ORM session: an UPDATE … RETURNING renews the lease (and finds
        out whether there is one), one read each for the reported names' versions, the worker's placement
        rows and its unload orders, and writes only for slots whose adapter or state changed (a steady
        worker's heartbeat writes its worker row only; docs/performance.md has the measurement)."""
        now = self.clock.now()
        lease = now + self.lease
        cached = {a[:160]: t for a, t in list((cached or {}).items())[:MAX_CACHED] if t in CACHE_TIERS}
        usage_json = {a[:160]: u.to_json() for a, u in list((usage or {}).items())[:MAX_USAGE]}  # stored form
        reported = {r.adapter for r in slots if r.adapter}
        cached_keys = set(cached)  # host memory or disk cache: a deleted version must go from there too
        with self.engine.begin() as conn:
            worker = _renew_lease(
                conn,
                worker_id,
                now,
                lease,
                load,
                cached,
                usage_json if usage is not None and not usage_changed_only else None,
            )
            if usage_changed_only and usage_json:  # only when something changed: a read and a write
                _merge_usage(conn, worker_id, usage_json)
            versions = _versions_of(conn, reported | cached_keys)
            _reconcile_placements(conn, worker_id, slots, versions.ids, now)
            pending = _collect_unload_orders(conn, worker_id, reported, cached_keys, versions)
        live = LiveWorker(
            worker_id,
            worker.address,
            worker.model_id,
            lease,
            load,
            cached,
            frozenset(r.adapter for r in slots if r.adapter and r.state == SlotState.LOADED),
        )
        self.fleet.put(live)
        return live, pending

    def expire(self) -> list[str]:
        """Drop the placements of every worker whose lease ran out; returns their ids."""
        now = self.clock.now()
        with self.sessions() as s:
            stale = list(
                s.scalars(
                    select(WorkerRow).where(
                        WorkerRow.state != WorkerState.EXPIRED, WorkerRow.lease_expires_at < now
                    )
                )
            )
            for w in stale:
                w.state = WorkerState.EXPIRED.value
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
                q = q.where(WorkerRow.state != WorkerState.EXPIRED)
            return list(s.scalars(q))

    def locate(self, ref: str, max_candidates: int = 0, routing_key: str = "") -> tuple[str, list[Candidate]]:
        """Resolve ``ref`` (an alias by ``routing_key``) and rank live workers for it; ("", ranking) for the
        base model."""
        key, model = self.catalog.resolve(ref, routing_key) if ref else ("", None)
        return key, self._candidates(key, model, max_candidates)

    async def locate_async(
        self, ref: str, max_candidates: int = 0, routing_key: str = ""
    ) -> tuple[str, list[Candidate]]:
        """:meth:`locate` on the event loop (LocateAdapter's path): the name's read is awaited
        (``Catalog.resolve_async``) and the ranking runs in place, except when the fleet view is due for its
        re-read from the database, which runs on a thread (once a second at most)."""
        key, model = await self.catalog.resolve_async(ref, routing_key) if ref else ("", None)
        if self.fleet.stale():
            return key, await asyncio.to_thread(self._candidates, key, model, max_candidates)
        return key, self._candidates(key, model, max_candidates)

    def _candidates(self, key: str, model: str | None, max_candidates: int) -> list[Candidate]:
        limit = min(max_candidates or 3, MAX_CANDIDATES)
        return [
            Candidate(w.id, w.address, tier == Tier.DEVICE, w.load, tier)
            for w, tier in self.fleet.rank(key, model, limit, self.clock.now())
        ]


@dataclass
class VersionStats:
    version: int
    usage: ReportedUsage  # summed over live workers
    holders: list[tuple[str, str, str]]  # (worker_id, address, tier)
    aliases: list[str]


def adapter_stats(placement: Placement, name: str) -> list[VersionStats]:
    """Per READY version of ``name``: usage summed over live workers' heartbeats, holders and their tier,
    aliases. NOT_FOUND when the name has no READY version."""
    with placement.sessions() as s:
        versions = list(
            s.scalars(
                select(AdapterRow.version)
                .where(AdapterRow.name == name, AdapterRow.state == AdapterState.READY)
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
        total = ReportedUsage()
        holders = []
        for w in workers:
            total += ReportedUsage.from_json((w.usage or {}).get(key, []))
            if any(p.adapter == key for p in w.placements):
                holders.append((w.id, w.address, Tier.DEVICE))
            elif key in (w.cached or {}):
                holders.append((w.id, w.address, w.cached[key]))
        named = [a.alias for a in aliases if any(tv == v for tv, _ in a.targets)]
        out.append(VersionStats(v, total, holders, named))
    return out
