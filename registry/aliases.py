"""Adapter aliases: ``name@prod`` points at one version or a weighted split of versions.

Moving an alias is one transaction that also appends the change (who, when, before, after) to
``alias_history``; concurrent moves serialise on the alias row (``SELECT … FOR UPDATE`` on PostgreSQL, the
write lock on SQLite), so the last one wins and the history lists both in order. A version an alias points
at cannot be deleted until the alias moves (``Catalog.delete`` asks ``Aliases.pointing_at``).

A move that takes a version out of every alias of its name (and it is not the latest version, which a bare
``name`` still reaches) retires it, in the same transaction; pointing an alias at it again un-retires it.
Every heartbeat of a worker holding a retired version answers with a *drain* order: unload it once no
request uses it. Requests in flight finish on it; the new version loads next to it meanwhile (an in-place
update, as an RL loop pushing a version a minute needs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy import bindparam, delete, func, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import sessionmaker

from loraserve.adapters.errors import AdapterError
from loraserve.adapters.refs import ALIAS_RE, parse_ref, pick_version
from loraserve.common.errors import InvalidArgument, NotFound, Unavailable
from loraserve.registry.clock import SYSTEM_CLOCK, Clock
from loraserve.registry.db import AdapterRow, AdapterState, AliasChangeRow, AliasRow

MAX_TARGETS = 16
MAX_RETRIES = 50
Targets = list[tuple[int, float]]


@dataclass(frozen=True)
class AliasView:
    name: str
    alias: str
    targets: Targets
    updated_at: object
    updated_by: str


_OF_NAMES = (
    select(AliasRow.name, AliasRow.alias, AliasRow.targets, AliasRow.updated_at, AliasRow.updated_by)
    .where(AliasRow.name.in_(bindparam("names", expanding=True)))
    .order_by(AliasRow.alias)
)


def _view(row: AliasRow) -> AliasView:
    return AliasView(row.name, row.alias, _targets(row.targets), row.updated_at, row.updated_by)


def _targets(raw: Sequence[Sequence[float]] | None) -> Targets:
    return [(int(v), float(w)) for v, w in raw or ()]


def check_alias_name(name: str, alias: str) -> None:
    try:
        parse_ref(name)
    except AdapterError as exc:
        raise InvalidArgument(str(exc)) from exc
    if "@" in name:
        raise InvalidArgument("name must not carry a version or alias")
    if not ALIAS_RE.fullmatch(alias):
        why = " (that is a version number)" if alias.isdigit() else ""
        raise InvalidArgument(f"alias {alias[:64]!r} must match {ALIAS_RE.pattern}{why}")


def check_targets(targets: Sequence[tuple[int, float]]) -> Targets:
    """One target (its weight forced to 1) or a split: distinct versions, finite weights >= 0, total > 0."""
    if not targets:
        raise InvalidArgument("an alias needs at least one target version")
    if len(targets) > MAX_TARGETS:
        raise InvalidArgument(f"an alias splits over at most {MAX_TARGETS} versions")
    if len(targets) == 1:
        return [(int(targets[0][0]), 1.0)]
    versions = [int(v) for v, _ in targets]
    if len(set(versions)) != len(versions):
        raise InvalidArgument(f"versions repeat in the split: {versions}")
    for v, w in targets:
        if not math.isfinite(w) or w < 0:
            raise InvalidArgument(f"weight of version {v} must be finite and >= 0, got {w}")
    if sum(w for _, w in targets) <= 0:
        raise InvalidArgument("the split's weights must sum to more than 0")
    return [(int(v), float(w)) for v, w in targets]


class Aliases:
    def __init__(
        self, sessions: sessionmaker, reads: sessionmaker | None = None, clock: Clock = SYSTEM_CLOCK
    ) -> None:
        self.sessions, self.reads = sessions, reads or sessions  # reads: autocommit, for of_names
        self.clock = clock  # what a change's updated_at and history time read

    def set(self, name: str, alias: str, targets: Sequence[tuple[int, float]], actor: str) -> AliasView:
        check_alias_name(name, alias)
        clean = check_targets(targets)
        if any(v < 1 for v, _ in clean):
            raise InvalidArgument("versions count from 1")
        for _ in range(MAX_RETRIES):  # optimistic: a concurrent move (or create) makes us re-read and retry
            with self.sessions() as s:
                ready = set(
                    s.scalars(
                        select(AdapterRow.version).where(
                            AdapterRow.name == name,
                            AdapterRow.state == AdapterState.READY,
                            AdapterRow.version.in_([v for v, _ in clean]),
                        )
                    )
                )
                missing = [v for v, _ in clean if v not in ready]
                if missing:
                    raise NotFound(f"adapter {name} has no version {', '.join(map(str, missing))}")
                row = s.scalars(
                    select(AliasRow).where(AliasRow.name == name, AliasRow.alias == alias).with_for_update()
                ).first()
                after, now = [[v, w] for v, w in clean], self.clock.now()
                if row is None:
                    before = None
                    s.add(AliasRow(name=name, alias=alias, targets=after, updated_at=now, updated_by=actor))
                else:
                    # Compare-and-set on the generation: SQLite takes no row locks, so a move that read the
                    # alias before another committed must not overwrite it (nor record a stale "before").
                    before = row.targets
                    moved = s.execute(
                        update(AliasRow)
                        .where(AliasRow.id == row.id, AliasRow.generation == row.generation)
                        .values(
                            targets=after, updated_at=now, updated_by=actor, generation=row.generation + 1
                        )
                        .execution_options(synchronize_session=False)
                    )
                    if moved.rowcount != 1:
                        s.rollback()
                        continue
                s.add(AliasChangeRow(name=name, alias=alias, before=before, after=after, actor=actor, at=now))
                try:
                    _retire(s, name, alias, before, after)  # its queries flush the new row: inside the try
                    s.commit()
                except IntegrityError:  # created concurrently: retry as a move
                    s.rollback()
                    continue
                return AliasView(name, alias, _targets(after), now, actor)
        raise Unavailable(f"alias {name}@{alias} is being moved concurrently; try again")

    def delete(self, name: str, alias: str, actor: str) -> AliasView:
        check_alias_name(name, alias)
        with self.sessions() as s:
            row = s.scalars(
                select(AliasRow).where(AliasRow.name == name, AliasRow.alias == alias).with_for_update()
            ).first()
            if row is None:
                raise NotFound(f"alias {name}@{alias} does not exist")
            view = _view(row)
            gone = s.execute(
                delete(AliasRow)
                .where(AliasRow.id == row.id, AliasRow.generation == row.generation)
                .execution_options(synchronize_session=False)
            )
            if gone.rowcount != 1:
                raise Unavailable(f"alias {name}@{alias} moved while being deleted; try again")
            s.add(
                AliasChangeRow(
                    name=name, alias=alias, before=row.targets, after=None, actor=actor, at=self.clock.now()
                )
            )
            _retire(s, name, alias, row.targets, None)
            s.commit()
            return view

    def get(self, name: str, alias: str) -> AliasView:
        with self.sessions() as s:
            row = s.scalars(select(AliasRow).where(AliasRow.name == name, AliasRow.alias == alias)).first()
        if row is None:
            raise NotFound(f"alias {name}@{alias} does not exist")
        return _view(row)

    def resolve(self, name: str, alias: str, routing_key: str = "") -> tuple[int, Targets]:
        """The version this request gets, and the alias's split."""
        view = self.get(name, alias)
        return pick_version(view.targets, routing_key), view.targets

    def of_names(self, names: Sequence[str]) -> dict[str, list[AliasView]]:
        if not names:
            return {}
        out: dict[str, list[AliasView]] = {}
        with self.reads.kw["bind"].connect() as conn:  # a prebuilt statement, plain rows: ListAdapters' path
            for row in conn.execute(_OF_NAMES, {"names": sorted(set(names))}):
                out.setdefault(row.name, []).append(_view(row))
        return out

    def pointing_at(self, s, name: str, versions: Sequence[int]) -> list[str]:
        """Aliases of ``name`` (in session ``s``) whose split names one of ``versions`` with any weight."""
        wanted = set(versions)
        rows = s.scalars(select(AliasRow).where(AliasRow.name == name))
        return [f"{name}@{r.alias}" for r in rows if wanted & {int(v) for v, _ in r.targets}]

    def history(self, name: str, alias: str = "") -> list[AliasChangeRow]:
        with self.sessions() as s:
            q = select(AliasChangeRow).where(AliasChangeRow.name == name)
            if alias:
                q = q.where(AliasChangeRow.alias == alias)
            return list(s.scalars(q.order_by(AliasChangeRow.id)))


def _retire(s, name: str, alias: str, before: Sequence | None, after: Sequence | None) -> None:
    """In session ``s``: the versions ``name@alias`` points at now are not retired; those this move took out of
    every alias of ``name`` are, unless it is the latest READY version (a bare ``name`` reaches it)."""
    now = {int(v) for v, _ in after or ()}
    dropped = {int(v) for v, _ in before or ()} - now
    for targets in s.scalars(select(AliasRow.targets).where(AliasRow.name == name, AliasRow.alias != alias)):
        dropped -= {int(v) for v, _ in targets}
    dropped.discard(
        s.scalar(
            select(func.max(AdapterRow.version)).where(
                AdapterRow.name == name, AdapterRow.state == AdapterState.READY
            )
        )
    )
    for versions, retired in ((now, False), (dropped, True)):
        if versions:
            s.execute(
                update(AdapterRow)
                .where(AdapterRow.name == name, AdapterRow.version.in_(versions))
                .values(retired=retired)
                .execution_options(synchronize_session=False)
            )
