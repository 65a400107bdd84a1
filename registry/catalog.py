"""The adapter catalog: validate, store and version adapters; list, get, delete and download them.

Plain logic over a sessionmaker and a BlobStore; the gRPC servicer only converts messages. Upload order
(docs/design.md §3): spool the weights to a local temporary file while hashing them (``StagedBlob``) → validate
config and weights tensor by tensor from that file (``adapters.peft_stream``: a few MiB of memory whatever
the size) → write the blob and verify its size and sha256 → commit the row. A failure at any step leaves no
row, and a blob without a READY row is never served (``gc`` removes it). Deleted versions keep their row
(state DELETED) so a version number is never reused.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from sqlalchemy import Row, bindparam, func, or_, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import sessionmaker

from loraserve.adapters import refs
from loraserve.adapters.errors import AdapterError, AdapterMismatchError, AdapterRankError, UnknownModuleError
from loraserve.adapters.peft import parse_config
from loraserve.adapters.peft_stream import AdapterSummary, validate_adapter_file
from loraserve.adapters.refs import Ref
from loraserve.common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from loraserve.registry.aliases import Aliases
from loraserve.registry.base_models import BaseModels
from loraserve.registry.clock import SYSTEM_CLOCK, Clock
from loraserve.registry.db import AdapterRow, AdapterState, BaseModelRow, PlacementRow, UnloadOrderRow
from loraserve.registry.hot_reads import HotReads, ThreadReads
from loraserve.registry.imports import ImportPolicy
from loraserve.registry.running_limits import RunningLimits
from loraserve.registry.storage import BlobStore, StagedBlob

SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
DEFAULT_PAGE, MAX_PAGE = 100, 1000
RESOLVE_TTL_S = 1.0  # how long LocateAdapter trusts a name's resolution (another replica's writes)
RESOLVE_CACHE_SIZE = 100_000
MAX_DESCRIPTION, MAX_LABELS, MAX_LABEL_CHARS = 4096, 64, 256


@dataclass(frozen=True)
class UploadHeader:
    name: str
    base_model: str
    config_bytes: bytes
    weights_size: int
    weights_sha256: str
    description: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    version: int = 0  # 0 = next
    allow_base_mismatch: bool = False


class UploadSlots:
    """At most ``limit`` uploads (and imports) in flight; one more is refused at once (RESOURCE_EXHAUSTED),
    never queued: the registry's memory and temporary disk stay bounded whatever its clients do."""

    def __init__(self, limit: int) -> None:
        self.limit, self.active = limit, 0
        self._lock = threading.Lock()

    def acquire(self) -> None:
        with self._lock:
            if self.active >= self.limit:
                raise ResourceExhausted(
                    f"too many concurrent uploads ({self.limit}), retry later", retry_after=1.0
                )
            self.active += 1

    def release(self) -> None:
        with self._lock:
            self.active -= 1


def parse_ref(ref: str) -> Ref:
    try:
        return refs.parse_ref(ref)
    except AdapterError as exc:
        raise InvalidArgument(str(exc)) from exc


def _encode_token(name: str, version: int) -> str:
    return base64.urlsafe_b64encode(json.dumps([name, version]).encode()).decode()


def _decode_token(token: str) -> tuple[str, int]:
    try:
        name, version = json.loads(base64.urlsafe_b64decode(token.encode()))
        if not isinstance(name, str) or not isinstance(version, int):
            raise ValueError
        return name, version
    except (ValueError, binascii.Error, TypeError, UnicodeDecodeError) as exc:
        raise InvalidArgument("page_token is not a token this registry issued") from exc


# what a ListAdapters page returns of each adapter (registry.server.adapter_to_proto)
LISTED_COLUMNS = tuple(
    AdapterRow.__table__.c[n]
    for n in (
        "name", "version", "base_model", "rank", "alpha", "use_rslora", "target_modules", "size_bytes",
        "sha256", "uri", "created_at", "description", "labels",
    )
)  # fmt: skip
_RESOLVE_COLUMNS = select(AdapterRow.name, AdapterRow.version, AdapterRow.base_model).where(
    AdapterRow.name == bindparam("name"), AdapterRow.state == AdapterState.READY
)
_RESOLVE_LATEST = _RESOLVE_COLUMNS.order_by(AdapterRow.version.desc()).limit(1)
_RESOLVE_VERSION = _RESOLVE_COLUMNS.where(AdapterRow.version == bindparam("version")).limit(1)


def _resolve_statement(parsed: Ref) -> tuple:
    """The prebuilt statement and parameters that resolve a ``name`` or ``name@version`` ref."""
    if parsed.version:
        return _RESOLVE_VERSION, {"name": parsed.name, "version": parsed.version}
    return _RESOLVE_LATEST, {"name": parsed.name}


class Catalog:
    def __init__(
        self,
        sessions: sessionmaker,
        store: BlobStore,
        *,
        max_upload_bytes: int,
        max_lora_rank: int,
        max_concurrent_uploads: int = 2,
        imports: ImportPolicy | None = None,
        reads: sessionmaker | None = None,
        hot: HotReads | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        """``reads``: sessions for single-statement reads on the hot paths (LocateAdapter, ListAdapters),
        in autocommit mode: no BEGIN/ROLLBACK round trips (docs/performance.md).
        ``hot``: how :meth:`resolve_async` awaits its read (``registry.hot_reads``; default: on a thread).
        ``clock``: the registry's (``registry.clock``): times the resolve cache, stamps alias changes."""
        self.sessions, self.store, self.clock = sessions, store, clock
        self.reads = reads or sessions
        self.hot = hot or ThreadReads(self.reads.kw["bind"])
        self._resolved: dict[str, tuple[float, tuple[str, str]]] = {}  # ref -> (expiry, resolve's answer)
        self._generation = 0
        self.max_upload_bytes, self.max_lora_rank = max_upload_bytes, max_lora_rank
        self.upload_slots = UploadSlots(max_concurrent_uploads)  # the servicer holds one per upload/import
        self.imports = imports or ImportPolicy((), store.root_url, max_upload_bytes)
        self.aliases = Aliases(sessions, self.reads, clock)
        self.limits = RunningLimits(sessions, self.reads, clock)
        self.base_models = BaseModels(sessions)

    # ------------------------------------------------------------------ upload
    def check_header(self, h: UploadHeader) -> None:
        """Everything that can be refused before a single weight byte arrives."""
        ref = parse_ref(h.name)
        if ref.version is not None or ref.alias is not None:
            raise InvalidArgument("name must not carry a version or alias; set the version field instead")
        if not h.base_model:
            raise InvalidArgument("base_model is required")
        if len(h.base_model) > 512:
            raise InvalidArgument("base_model is longer than 512 characters")
        if len(h.description) > MAX_DESCRIPTION:
            raise InvalidArgument(f"description is longer than {MAX_DESCRIPTION} characters")
        if len(h.labels) > MAX_LABELS or any(
            len(k) > MAX_LABEL_CHARS or len(v) > MAX_LABEL_CHARS for k, v in h.labels.items()
        ):
            raise InvalidArgument(f"at most {MAX_LABELS} labels of at most {MAX_LABEL_CHARS} characters each")
        if not SHA256_RE.match(h.weights_sha256):
            raise InvalidArgument("weights_sha256 must be 64 lowercase hex characters")
        if h.weights_size <= 0:
            raise InvalidArgument("weights_size must be positive")
        if h.weights_size > self.max_upload_bytes:
            raise ResourceExhausted(
                f"weights_size {h.weights_size} is over the upload limit of {self.max_upload_bytes} bytes"
            )
        if h.version < 0:
            raise InvalidArgument("version must be >= 0")
        try:
            parse_config(h.config_bytes)
        except AdapterError as exc:  # before any weights arrive every config problem is the caller's
            raise InvalidArgument(str(exc)) from exc

    def _validate(self, h: UploadHeader, weights_path: str) -> AdapterSummary:
        """``adapters.peft.parse_adapter``'s rules, tensor by tensor from the staged file."""
        with self.sessions() as s:
            base = s.get(BaseModelRow, h.base_model)
            known = base is not None and bool(base.module_shapes)  # an admin may name a model before workers
            shapes = {k: tuple(v) for k, v in base.module_shapes.items()} if known else None
            layers = base.num_layers if known else None
        try:
            return validate_adapter_file(
                h.config_bytes,
                weights_path,
                module_shapes=shapes,
                num_layers=layers,
                max_rank=self.max_lora_rank,
            )
        except (UnknownModuleError, AdapterRankError) as exc:
            raise InvalidArgument(str(exc)) from exc
        except AdapterMismatchError as exc:
            raise FailedPrecondition(f"adapter does not fit base model {h.base_model!r}: {exc}") from exc
        except AdapterError as exc:
            raise InvalidArgument(str(exc)) from exc

    def create(self, h: UploadHeader, weights: bytes) -> AdapterRow:
        """:meth:`create_staged` of weights already in memory (ImportAdapter's), spooled to a file first."""
        with StagedBlob() as staged:
            staged.write(weights)
            return self.create_staged(h, staged)

    def create_staged(self, h: UploadHeader, staged: StagedBlob) -> AdapterRow:
        """Validate, store and register one adapter version from its weights staged in a local file (the
        whole upload, after all bytes arrived). The caller closes ``staged``."""
        self.check_header(h)
        labels, warnings = self.base_models.check(h.base_model, h.config_bytes, h.allow_base_mismatch)
        if staged.size != h.weights_size:
            raise InvalidArgument(f"received {staged.size} weight bytes, header promised {h.weights_size}")
        lora = self._validate(h, staged.path)
        blob = self.store.put_staged(staged, expected_sha256=h.weights_sha256, expected_size=h.weights_size)
        for _ in range(
            20
        ):  # concurrent uploads of one name race for the next version; the unique key decides
            with self.sessions() as s:
                version = (
                    h.version
                    or (s.scalar(select(func.max(AdapterRow.version)).where(AdapterRow.name == h.name)) or 0)
                    + 1
                )
                row = AdapterRow(
                    name=h.name,
                    version=version,
                    base_model=h.base_model,
                    rank=lora.rank,
                    alpha=lora.alpha,
                    use_rslora=lora.use_rslora,
                    target_modules=list(lora.target_modules),
                    size_bytes=blob.size,
                    sha256=blob.sha256,
                    uri=blob.uri,
                    config=h.config_bytes.decode("utf-8"),
                    description=h.description,
                    labels={**h.labels, **labels},
                    state=AdapterState.READY.value,
                    created_at=self.clock.now(),
                )
                s.add(row)
                try:
                    s.commit()
                    self._changed()
                    row.warnings = warnings  # not a column: told to this caller only
                    return row
                except IntegrityError:
                    s.rollback()
                    if h.version:
                        raise AlreadyExists(f"adapter {h.name}@{h.version} already exists") from None
        raise AlreadyExists(f"could not allocate a version for {h.name}: too many concurrent uploads")

    def import_from(
        self,
        uri: str,
        name: str,
        base_model: str,
        description: str = "",
        labels: dict[str, str] | None = None,
        version: int = 0,
        allow_base_mismatch: bool = False,
    ) -> AdapterRow:
        # the weights stream into a staged file as they are read (counted there against --max-upload-bytes),
        # then are validated from it like an upload: never held whole in memory
        with StagedBlob(max_bytes=self.max_upload_bytes) as staged:
            try:
                config, _ = self.imports.read(uri, staged.write)  # PERMISSION_DENIED outside --import-allow
            except AdapterError as exc:
                raise InvalidArgument(str(exc)) from exc
            except (OSError, ValueError) as exc:
                raise InvalidArgument(f"cannot read a PEFT adapter folder at {uri!r}: {exc}") from exc
            header = UploadHeader(
                name=name,
                base_model=base_model,
                config_bytes=config,
                weights_size=staged.size,
                weights_sha256=staged.sha256,
                description=description,
                labels=dict(labels or {}),
                version=version,
                allow_base_mismatch=allow_base_mismatch,
            )
            return self.create_staged(header, staged)

    # ------------------------------------------------------------------ reads
    def get(self, ref: str, routing_key: str = "") -> AdapterRow:
        """``name`` (latest), ``name@3``, or ``name@alias`` (its version, or one of its split drawn by weight,
        deterministically per ``routing_key`` when given)."""
        return self._read(ref, routing_key, select(AdapterRow), lambda s, q: s.scalars(q).first())

    def resolve(self, ref: str, routing_key: str = "") -> tuple[str, str]:
        """Like :meth:`get`, but only ``("name@version", base_model)``, for LocateAdapter's hot path.

        ``name`` and ``name@3`` answers are cached for ``RESOLVE_TTL_S``: this process's uploads and deletes
        clear the cache at once, another replica's show within the TTL (a worker asked to load an adapter
        deleted meanwhile gets NOT_FOUND from the registry all the same). Aliases are always read."""
        hit = self._cached(ref)
        if hit is not None:
            return hit
        generation, parsed = self._generation, parse_ref(ref)
        if parsed.alias is not None:
            return self._resolve_alias(ref, routing_key)
        # one prebuilt statement on a plain connection: SQLAlchemy reuses its compiled form and cache
        # key, and no ORM session is made (docs/performance.md)
        with self.reads.kw["bind"].connect() as conn:
            row = conn.execute(*_resolve_statement(parsed)).first()
        return self._keep(ref, row, generation)

    async def resolve_async(self, ref: str, routing_key: str = "") -> tuple[str, str]:
        """:meth:`resolve` on the event loop: a cached answer at once, a name's read through ``self.hot``
        (no thread hop on SQLite and PostgreSQL), an alias on a thread."""
        hit = self._cached(ref)
        if hit is not None:
            return hit
        generation, parsed = self._generation, parse_ref(ref)
        if parsed.alias is not None:
            return await asyncio.to_thread(self._resolve_alias, ref, routing_key)
        return self._keep(ref, await self.hot.first(*_resolve_statement(parsed)), generation)

    def _cached(self, ref: str) -> tuple[str, str] | None:
        hit = self._resolved.get(ref)
        return hit[1] if hit is not None and hit[0] > self.clock.monotonic() else None

    def _resolve_alias(self, ref: str, routing_key: str) -> tuple[str, str]:
        cols = select(AdapterRow.name, AdapterRow.version, AdapterRow.base_model)
        name, version, base_model = self._read(ref, routing_key, cols, lambda s, q: s.execute(q).first())
        return f"{name}@{version}", base_model

    def _keep(self, ref: str, row, generation: int) -> tuple[str, str]:
        """A name's resolution read at ``generation``, cached unless a local write came in between."""
        if row is None:
            raise NotFound(f"adapter {ref!r} does not exist")
        name, version, base_model = row
        out = f"{name}@{version}", base_model
        if generation == self._generation:
            if len(self._resolved) >= RESOLVE_CACHE_SIZE:
                self._resolved.clear()
            self._resolved[ref] = (self.clock.monotonic() + RESOLVE_TTL_S, out)
        return out

    def _changed(self) -> None:
        """A local write: forget every cached resolution."""
        self._generation += 1
        self._resolved.clear()

    def _read(self, ref: str, routing_key: str, q, fetch):
        parsed = parse_ref(ref)
        name, version = parsed.name, parsed.version
        if parsed.alias is not None:
            version, _ = self.aliases.resolve(name, parsed.alias, routing_key)
        q = q.where(AdapterRow.name == name, AdapterRow.state == AdapterState.READY)
        q = q.where(AdapterRow.version == version) if version else q.order_by(AdapterRow.version.desc())
        with self.reads() as s:
            row = fetch(s, q.limit(1))
        if row is None:
            raise NotFound(f"adapter {ref!r} does not exist")
        return row

    def list(
        self, page_size: int = 0, page_token: str = "", base_model: str = "", name_prefix: str = ""
    ) -> tuple[list[Row], str]:
        """A page of READY adapters by (name, version) after ``page_token``, as plain rows (``LISTED_COLUMNS``
        of ``AdapterRow``), and the next page's token ("" at the end)."""
        size = min(page_size or DEFAULT_PAGE, MAX_PAGE)
        q = select(AdapterRow).where(AdapterRow.state == AdapterState.READY)
        if base_model:
            q = q.where(AdapterRow.base_model == base_model)
        if name_prefix:
            escaped = name_prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
            q = q.where(AdapterRow.name.like(escaped + "%", escape="\\"))
        if page_token:
            name, version = _decode_token(page_token)
            # ``name >= n`` first: with the OR alone SQLite scans the (name, version) index from its start
            q = q.where(
                AdapterRow.name >= name,
                or_(AdapterRow.name > name, AdapterRow.version > version),
            )
        # plain rows of the listed columns on a plain connection, not ORM objects in a session: a page is
        # read-only, and building 100 mapped objects cost more than the query itself (docs/performance.md);
        # adapter_config.json (``config``), which only GetAdapter returns, is not read
        q = q.with_only_columns(*LISTED_COLUMNS)
        with self.reads.kw["bind"].connect() as conn:
            rows = list(conn.execute(q.order_by(AdapterRow.name, AdapterRow.version).limit(size + 1)))
        token = _encode_token(rows[size - 1].name, rows[size - 1].version) if len(rows) > size else ""
        return rows[:size], token

    def download(self, ref: str, chunk_size: int = 1 << 20) -> tuple[AdapterRow, Iterator[bytes]]:
        """The adapter's row and its blob in chunks, verified against its sha256 before the first one."""
        row = self.get(ref)
        return row, self.store.iter_chunks(row.sha256, chunk_size)

    # ------------------------------------------------------------------ delete / gc
    def delete(self, ref: str) -> tuple[list[AdapterRow], int]:
        """Delete one version (``name@3``) or all versions (``name``); order every holder to unload. A version
        an alias points at is refused (FAILED_PRECONDITION) until the alias moves."""
        parsed = parse_ref(ref)
        if parsed.alias is not None:
            raise InvalidArgument(
                f"{ref!r} is an alias: delete versions by number, or the alias with DeleteAlias"
            )
        name, version = parsed.name, parsed.version
        with self.sessions() as s:
            q = select(AdapterRow).where(AdapterRow.name == name, AdapterRow.state == AdapterState.READY)
            if version:
                q = q.where(AdapterRow.version == version)
            rows = list(s.scalars(q.with_for_update()))
            if not rows:
                raise NotFound(f"adapter {ref!r} does not exist")
            held = self.aliases.pointing_at(s, name, [r.version for r in rows])
            if held:
                raise FailedPrecondition(
                    f"{ref} is the target of alias {', '.join(held)}: move the alias first (loraserve adapters alias)"
                )
            keys = [r.key for r in rows]
            orders = 0
            holders = s.execute(
                select(PlacementRow.worker_id, PlacementRow.adapter).where(PlacementRow.adapter.in_(keys))
            ).all()
            for worker_id, key in holders:
                exists = s.scalar(
                    select(UnloadOrderRow.id).where(
                        UnloadOrderRow.worker_id == worker_id, UnloadOrderRow.adapter == key
                    )
                )
                if exists is None:
                    s.add(
                        UnloadOrderRow(
                            worker_id=worker_id,
                            adapter=key,
                            reason=f"adapter {key} was deleted",
                            created_at=self.clock.now(),
                        )
                    )
                    orders += 1
            for r in rows:
                r.state = AdapterState.DELETED.value
            s.commit()
            self._changed()
            return rows, orders

    def gc(self, min_age_s: float = 0.0) -> list[str]:
        """Delete blobs no READY adapter references and older than ``min_age_s``; returns their sha256.

        On a live registry keep ``min_age_s`` well above an upload's duration: a blob is written just
        before its row is committed, and gc must not take it in between.
        """
        with self.sessions() as s:
            referenced = set(
                s.scalars(select(AdapterRow.sha256).where(AdapterRow.state == AdapterState.READY))
            )
        return self.store.gc(referenced, min_age_s=min_age_s)
