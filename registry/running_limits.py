"""Running caps: how many requests of one adapter name, or of one tenant, each worker runs at once.

A cap on an adapter name covers all its versions; a tenant is the value of an adapter's ``tenant`` label
(set at upload), and a tenant's cap covers every adapter so labelled. Caps are per worker: a worker runs at
most K requests of that name (tenant) in its decode batch; the rest wait in its queue while other adapters'
requests are admitted past them (engine.scheduler), so a flood for one adapter or tenant cannot take every row.
Workers learn the caps of the names they hold from every heartbeat reply (the full set, which replaces what
they knew) and of a name they resolve from GetAdapter (``Adapter.max_running`` / ``tenant_max_running``), so a
new adapter is capped from its first request and a changed cap reaches every worker within a heartbeat.

The ``running_limits`` table is small (one row per cap); a registry with no caps answers heartbeats with one
indexed read of it (``caps_for`` returns at once when it is empty).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import sessionmaker

from loraserve.adapters.errors import AdapterError
from loraserve.adapters.refs import parse_ref
from loraserve.adapters.running_caps import TENANT_LABEL, Cap
from loraserve.common.errors import InvalidArgument, NotFound, Unavailable
from loraserve.registry.clock import SYSTEM_CLOCK, Clock
from loraserve.registry.db import AdapterRow, AdapterState, RunningLimitRow, as_utc

NAMES_PER_QUERY = 1000  # adapter names per labels query (PostgreSQL takes at most 65 535 parameters)
MAX_RUNNING = 1 << 20  # far above any decode batch; keeps the value in a uint32 and the column's range
TENANT_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}$")


class LimitKind(StrEnum):
    """``running_limits.kind``."""

    ADAPTER = "adapter"
    TENANT = "tenant"


@dataclass(frozen=True)
class LimitView:
    kind: LimitKind
    key: str
    max_running: int  # 0: cleared
    updated_at: datetime
    updated_by: str


def check_limit(kind: LimitKind, key: str, max_running: int, clear: bool) -> None:
    """Refuse what cannot be a cap, naming the field: INVALID_ARGUMENT."""
    if kind is LimitKind.ADAPTER:
        try:
            ref = parse_ref(key)
        except AdapterError as exc:
            raise InvalidArgument(f"adapter: {exc}") from None
        if ref.version is not None or ref.alias is not None:
            raise InvalidArgument("adapter: a cap covers every version of a name; give the name alone")
    elif not TENANT_RE.fullmatch(key):
        raise InvalidArgument(f"tenant {key[:64]!r} must match {TENANT_RE.pattern}")
    if clear:
        if max_running:
            raise InvalidArgument("max_running must be 0 when clear is set")
        return
    if not 1 <= max_running <= MAX_RUNNING:
        raise InvalidArgument(
            f"max_running must be an integer from 1 to {MAX_RUNNING} (got {max_running}); "
            "clear the cap to remove it"
        )


def _view(row: RunningLimitRow) -> LimitView:
    return LimitView(LimitKind(row.kind), row.key, row.max_running, as_utc(row.updated_at), row.updated_by)


class RunningLimits:
    def __init__(
        self, sessions: sessionmaker, reads: sessionmaker | None = None, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self.sessions, self.reads, self.clock = sessions, reads or sessions, clock

    def set(self, kind: LimitKind, key: str, max_running: int, actor: str) -> LimitView:
        """Create or change a cap. An adapter cap needs the name to exist (NOT_FOUND); a tenant's does not
        (adapters may be labelled later)."""
        check_limit(kind, key, max_running, clear=False)
        for _ in range(2):  # a concurrent create of the same cap: the second try updates it
            with self.sessions() as s:
                if kind is LimitKind.ADAPTER and not s.scalar(
                    select(AdapterRow.id).where(
                        AdapterRow.name == key, AdapterRow.state == AdapterState.READY
                    )
                ):
                    raise NotFound(f"adapter {key} does not exist")
                row = s.scalars(
                    select(RunningLimitRow).where(RunningLimitRow.kind == kind, RunningLimitRow.key == key)
                ).first()
                now = self.clock.now()
                if row is None:
                    row = RunningLimitRow(kind=kind.value, key=key)
                    s.add(row)
                row.max_running, row.updated_at, row.updated_by = max_running, now, actor
                try:
                    s.commit()
                except IntegrityError:
                    s.rollback()
                    continue
                return _view(row)
        raise Unavailable(f"the {kind} cap of {key} is being set concurrently; try again")

    def clear(self, kind: LimitKind, key: str, actor: str) -> LimitView:
        check_limit(kind, key, 0, clear=True)
        with self.sessions() as s:
            gone = s.execute(
                delete(RunningLimitRow)
                .where(RunningLimitRow.kind == kind, RunningLimitRow.key == key)
                .execution_options(synchronize_session=False)
            )
            if gone.rowcount != 1:
                raise NotFound(f"{kind} {key} has no running cap")
            s.commit()
        return LimitView(kind, key, 0, self.clock.now(), actor)

    def list(self) -> list[LimitView]:
        with self.reads() as s:
            rows = s.scalars(select(RunningLimitRow).order_by(RunningLimitRow.kind, RunningLimitRow.key))
            return [_view(r) for r in rows]

    def caps_for(self, names: Iterable[str]) -> dict[str, Cap]:
        """The caps of each of ``names`` (adapter names) that has one, directly or through its tenant."""
        wanted = sorted(set(names))
        if not wanted:
            return {}
        with self.reads() as s:
            limits = {(r.kind, r.key): r.max_running for r in s.scalars(select(RunningLimitRow))}
            if not limits:
                return {}
            tenants: dict[str, str] = {}
            if any(kind == LimitKind.TENANT for kind, _ in limits):
                # the newest READY version's label names the tenant (labels are per version); in chunks, so
                # that a worker holding thousands of adapters stays under the driver's bound-parameter limit
                for start in range(0, len(wanted), NAMES_PER_QUERY):
                    rows = s.execute(
                        select(AdapterRow.name, AdapterRow.labels)
                        .where(
                            AdapterRow.name.in_(wanted[start : start + NAMES_PER_QUERY]),
                            AdapterRow.state == AdapterState.READY,
                        )
                        .order_by(AdapterRow.name, AdapterRow.version)
                    )
                    for name, labels in rows:
                        tenants[name] = str((labels or {}).get(TENANT_LABEL, ""))
        out: dict[str, Cap] = {}
        for name in wanted:
            tenant = tenants.get(name, "")
            cap = Cap(
                limits.get((LimitKind.ADAPTER, name), 0),
                tenant,
                limits.get((LimitKind.TENANT, tenant), 0) if tenant else 0,
            )
            if cap.max_running or cap.tenant_max_running:
                out[name] = cap
        return out
