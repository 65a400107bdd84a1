"""The registry's SQL data model (SQLAlchemy 2.0 typed models) and its engine/session factory.

Tables (docs/design.md §4): ``adapters`` (one row per name@version), ``base_models`` (module shapes learned
from workers, used to validate uploads), ``workers`` (address, lease, last heartbeat, load),
``placements`` (which adapter sits in which slot of which worker), ``unload_orders`` (deleted
adapters that workers still hold; delivered with heartbeats) and ``running_limits`` (running caps per
adapter name or tenant, registry.running_limits). SQLite is the embedded default,
PostgreSQL the production database; the schema is created by Alembic (``loraserve registry migrate``).
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    create_engine,
    event,
)
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship, sessionmaker


def utcnow() -> datetime:
    """The columns' default: the registry's own writes stamp its clock's time instead (``registry.clock``)."""
    return datetime.now(UTC)


# The words the string columns hold. ``StrEnum``s whose names are their values: a member is bound and
# stored as that very string, and a string read back compares equal to its member. (On the wire the
# proto enums stay; registry.server maps between them.) ``placements.state`` and ``workers.cached`` hold
# the worker's own ``SlotState`` and ``Tier`` (loraserve.common.slots).


class AdapterState(StrEnum):
    """``adapters.state``."""

    READY = "READY"
    DELETED = "DELETED"


class WorkerState(StrEnum):
    """``workers.state``."""

    READY = "READY"
    DRAINING = "DRAINING"
    EXPIRED = "EXPIRED"


class Base(DeclarativeBase):
    pass


class AdapterRow(Base):
    __tablename__ = "adapters"
    __table_args__ = (
        UniqueConstraint("name", "version", name="uq_adapters_name_version"),
        Index("ix_adapters_base_model_name", "base_model", "name"),
        Index("ix_adapters_sha256", "sha256"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128))
    version: Mapped[int] = mapped_column(Integer)
    base_model: Mapped[str] = mapped_column(String(512))
    rank: Mapped[int] = mapped_column(Integer)
    alpha: Mapped[float] = mapped_column(Float)
    use_rslora: Mapped[bool] = mapped_column(Boolean, default=False)
    target_modules: Mapped[list[str]] = mapped_column(JSON)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    sha256: Mapped[str] = mapped_column(String(64))
    uri: Mapped[str] = mapped_column(Text)
    config: Mapped[str] = mapped_column(Text)  # adapter_config.json, byte for byte (UTF-8)
    description: Mapped[str] = mapped_column(Text, default="")
    labels: Mapped[dict[str, str]] = mapped_column(JSON, default=dict)
    state: Mapped[str] = mapped_column(String(16), default=AdapterState.READY.value)  # AdapterState
    # an alias moved away from it and none points at it: workers unload it once idle (registry/aliases.py); 0003
    retired: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)

    @property
    def key(self) -> str:
        return f"{self.name}@{self.version}"


class BaseModelRow(Base):
    __tablename__ = "base_models"

    id: Mapped[str] = mapped_column(String(512), primary_key=True)
    module_shapes: Mapped[dict[str, Any]] = mapped_column(JSON)  # module -> [in, out]
    num_layers: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    aliases: Mapped[list[str]] = mapped_column(JSON, default=list)  # other names (HF repo ids); 0003


class WorkerRow(Base):
    __tablename__ = "workers"
    __table_args__ = (Index("ix_workers_model_lease", "model_id", "lease_expires_at"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    address: Mapped[str] = mapped_column(String(256))
    model_id: Mapped[str] = mapped_column(String(512))
    slots: Mapped[int] = mapped_column(Integer)
    max_lora_rank: Mapped[int] = mapped_column(Integer, default=0)
    max_batch_size: Mapped[int] = mapped_column(Integer, default=0)
    tensor_parallel_size: Mapped[int] = mapped_column(Integer, default=1, server_default="1")
    state: Mapped[str] = mapped_column(String(16), default=WorkerState.READY.value)  # WorkerState
    lease_expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    last_heartbeat: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    running: Mapped[int] = mapped_column(Integer, default=0)
    waiting: Mapped[int] = mapped_column(Integer, default=0)
    free_slots: Mapped[int] = mapped_column(Integer, default=0)
    utilization: Mapped[float] = mapped_column(Float, default=0.0)
    cached: Mapped[dict[str, str]] = mapped_column(JSON, default=dict)  # adapter -> Tier HOST | DISK; 0003
    # adapter -> [requests, prompt_tokens, completion_tokens, loads, fetched_bytes] since the worker started
    # (registry.placement.ReportedUsage.to_json / from_json)
    usage: Mapped[dict[str, list[int]]] = mapped_column(JSON, default=dict)
    registered_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    # sha256 hex of the worker process's RegisterWorkerRequest.instance_id ("" = none sent); 0004
    identity: Mapped[str] = mapped_column(String(64), default="", server_default="")

    placements: Mapped[list[PlacementRow]] = relationship(
        back_populates="worker", cascade="all, delete-orphan", order_by="PlacementRow.slot"
    )


class PlacementRow(Base):
    __tablename__ = "placements"
    __table_args__ = (
        UniqueConstraint("worker_id", "slot", name="uq_placements_worker_slot"),
        Index("ix_placements_adapter", "adapter"),
    )

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    worker_id: Mapped[str] = mapped_column(ForeignKey("workers.id", ondelete="CASCADE"))
    adapter: Mapped[str] = mapped_column(String(160))  # resolved "name@version"
    adapter_id: Mapped[int | None] = mapped_column(
        ForeignKey("adapters.id", ondelete="SET NULL"), nullable=True
    )
    slot: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16))  # SlotState: LOADING | LOADED
    pinned: Mapped[bool] = mapped_column(Boolean, default=False)
    refcount: Mapped[int] = mapped_column(Integer, default=0)
    loaded_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    last_used: Mapped[datetime | None] = mapped_column(DateTime(timezone=True), nullable=True)

    worker: Mapped[WorkerRow] = relationship(back_populates="placements")


class UnloadOrderRow(Base):
    __tablename__ = "unload_orders"
    __table_args__ = (UniqueConstraint("worker_id", "adapter", name="uq_unload_orders_worker_adapter"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    worker_id: Mapped[str] = mapped_column(ForeignKey("workers.id", ondelete="CASCADE"))
    adapter: Mapped[str] = mapped_column(String(160))
    reason: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class AliasRow(Base):
    """``name@alias`` -> one version or a weighted split: ``targets`` is ``[[version, weight], ...]``."""

    __tablename__ = "adapter_aliases"
    __table_args__ = (UniqueConstraint("name", "alias", name="uq_adapter_aliases_name_alias"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128))
    alias: Mapped[str] = mapped_column(String(64))
    targets: Mapped[list[list[float]]] = mapped_column(JSON)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_by: Mapped[str] = mapped_column(String(256), default="")
    generation: Mapped[int] = mapped_column(Integer, default=0)  # bumped by every move (compare-and-set)


class AliasChangeRow(Base):
    """Every alias move, append-only: ``before``/``after`` are targets lists (None: created / deleted)."""

    __tablename__ = "alias_history"
    __table_args__ = (Index("ix_alias_history_name_id", "name", "id"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(128))
    alias: Mapped[str] = mapped_column(String(64))
    before: Mapped[list[list[float]] | None] = mapped_column(JSON, nullable=True)
    after: Mapped[list[list[float]] | None] = mapped_column(JSON, nullable=True)
    actor: Mapped[str] = mapped_column(String(256), default="")
    at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class RunningLimitRow(Base):
    """A running cap (registry.running_limits): requests of one adapter name or tenant a worker runs at once."""

    __tablename__ = "running_limits"
    __table_args__ = (UniqueConstraint("kind", "key", name="uq_running_limits_kind_key"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    kind: Mapped[str] = mapped_column(String(16))  # LimitKind: adapter | tenant
    key: Mapped[str] = mapped_column(String(128))  # adapter name or tenant
    max_running: Mapped[int] = mapped_column(Integer)
    updated_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    updated_by: Mapped[str] = mapped_column(String(256), default="")


def make_engine(url: str) -> Engine:
    """A SQLAlchemy engine for ``url``; SQLite gets WAL (synchronous=NORMAL), foreign keys and a busy timeout."""
    if url.startswith("sqlite"):
        from sqlalchemy.engine import make_url

        database = make_url(url).database
        if database and database != ":memory:" and not database.startswith("file:"):
            Path(database).parent.mkdir(parents=True, exist_ok=True)  # a fresh machine has no folder yet
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn, _record) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA foreign_keys=ON")
            if ":memory:" not in url:
                # WAL + synchronous=NORMAL: a commit is a WAL append without an fsync (heartbeats commit
                # 40 times a second with 200 workers); the file stays consistent on a crash, and at most
                # the last commits before a power cut are lost (their blobs are then orphans for `gc`)
                cur.execute("PRAGMA journal_mode=WAL")
                cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=10, max_overflow=20)


def make_sessionmaker(engine: Engine) -> sessionmaker:
    return sessionmaker(engine, expire_on_commit=False)


def as_utc(value: datetime | None) -> datetime | None:
    """SQLite returns naive datetimes; treat them as UTC."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=UTC)
