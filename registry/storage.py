"""Content-addressed blob store for adapter weights over one fsspec root URL (docs/design.md §3).

Layout: ``<root>/blobs/sha256/<hex[:2]>/<hex>``; ``<root>/tmp/<uuid>`` only for in-flight local-disk writes.
Bytes are hashed while spooled locally (an upload: :class:`StagedBlob`, a local temporary file the registry
validates before it is stored) and reach the store only once size and sha256 match the promise: object
stores get them in one object write (visible only when complete; never ``mv``, which gcsfs emulators lack),
local folders get ``tmp/<uuid>`` renamed onto the final key. Reads verify the hash before handing out a byte.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import hashlib
import io
import logging
import os
import posixpath
import re
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import fsspec
import grpc
from fsspec.implementations.local import LocalFileSystem

from loraserve.common.errors import LoraserveError

log = logging.getLogger(__name__)

T = TypeVar("T")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HNS_ENV = "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"
_READ_BLOCK = 8 << 20
_RETRIABLE_HTTP = {"408", "429", "500", "501", "502", "503", "504"}
_PERMANENT_OS_ERRORS = (
    FileNotFoundError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
    FileExistsError,
)


class StorageError(LoraserveError):
    """Base of blob-store errors; ``code`` is the gRPC status the servicers return."""


class InvalidDigestError(StorageError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class BlobMismatchError(StorageError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class BlobTooLargeError(StorageError, ValueError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class BlobNotFoundError(StorageError, LookupError):
    code = grpc.StatusCode.NOT_FOUND


class BlobCorruptError(StorageError):
    code = grpc.StatusCode.DATA_LOSS


class StorageUnavailableError(StorageError):
    code = grpc.StatusCode.UNAVAILABLE


@dataclass(frozen=True)
class StoredBlob:
    sha256: str
    size: int
    uri: str
    deduplicated: bool = False


def _check_digest(sha256: str) -> str:
    digest = sha256.lower() if isinstance(sha256, str) else ""
    if not _HEX64.fullmatch(digest):
        raise InvalidDigestError(f"{sha256!r} is not a sha256 hex digest (64 hex characters)")
    return digest


def _check_limits(size: int, expected_size: int | None, max_bytes: int | None, partial: bool = False) -> None:
    """Size checks that can fail before the whole blob arrived: over the limit, or over the promise."""
    if max_bytes is not None and max(size, expected_size or 0) > max_bytes:
        raise BlobTooLargeError(f"blob is larger than the limit of {max_bytes} bytes")
    if expected_size is not None and (expected_size < 0 or (partial and size > expected_size)):
        raise BlobMismatchError(f"blob size mismatch: received more than the promised {expected_size} bytes")


def _is_transient(exc: BaseException) -> bool | None:
    """True: retry; False: a backend error that retrying cannot fix; None: not a backend error at all."""
    if isinstance(exc, _PERMANENT_OS_ERRORS):
        return False
    if isinstance(exc, OSError):  # includes TimeoutError, ConnectionError, aiohttp.ClientOSError
        return True
    retry_mod = sys.modules.get("gcsfs.retry")  # gcsfs errors can only exist once gcsfs is imported
    if retry_mod is not None and isinstance(exc, retry_mod.HttpError):
        return str(exc.code) in _RETRIABLE_HTTP
    aiohttp = sys.modules.get("aiohttp")
    if aiohttp is not None and isinstance(exc, aiohttp.ClientError):
        return True
    return None


def _mtime(info: dict[str, Any]) -> float | None:
    """Modification time of a listing entry (local: mtime float; memory: created; gcsfs: mtime datetime)."""
    for value in (info.get("mtime"), info.get("created"), info.get("LastModified")):
        if isinstance(value, dt.datetime):
            return value.timestamp()
        if isinstance(value, int | float):
            return float(value)
    return None


class _Spool:
    """Bytes kept in memory up to ``limit``, then in a named local temporary file (so it can be uploaded)."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._mem: io.BytesIO | None = io.BytesIO()
        self._file: Any = None  # deleted on close, also when an unconsumed reader is garbage-collected

    def write(self, data: bytes) -> None:
        if self._mem is not None and self._mem.tell() + len(data) > self._limit:
            self._file = tempfile.NamedTemporaryFile(prefix="loraserve-blob-")  # noqa: SIM115
            self._file.write(self._mem.getbuffer())
            self._mem = None
        (self._mem if self._mem is not None else self._file).write(data)

    def upload(self, fs: Any, dest: str) -> None:
        if self._mem is not None:
            fs.pipe_file(dest, self._mem.getvalue())
        else:
            self._file.flush()
            fs.put_file(self._file.name, dest)

    def chunks(self, size: int) -> Iterator[bytes]:
        try:
            src = self._mem if self._mem is not None else self._file
            src.seek(0)
            while chunk := src.read(size):
                yield chunk
        finally:
            self.close()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        self._file = self._mem = None


class StagedBlob:
    """An upload spooled to a local temporary file (``tempfile``'s folder) while it is hashed and counted:
    written chunk by chunk, validated from :attr:`path`, stored with :meth:`BlobStore.put_staged`. ``close``
    deletes the file (also when the object is garbage-collected). Memory: the chunk being written."""

    def __init__(self, expected_size: int | None = None, max_bytes: int | None = None) -> None:
        _check_limits(0, expected_size, max_bytes)
        self.expected_size, self.max_bytes = expected_size, max_bytes
        self._file: Any = tempfile.NamedTemporaryFile(prefix="loraserve-upload-")  # noqa: SIM115
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, chunk: bytes) -> None:
        _check_limits(self.size + len(chunk), self.expected_size, self.max_bytes, partial=True)
        self._hash.update(chunk)
        self._file.write(chunk)
        self.size += len(chunk)

    @property
    def path(self) -> str:
        """The file, everything written so far flushed to it."""
        self._file.flush()
        return self._file.name

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()

    def upload(self, fs: Any, dest: str) -> None:
        fs.put_file(self.path, dest)  # fsspec copies or uploads from the file in blocks

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> StagedBlob:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class BlobStore:
    """Content-addressed adapter blobs under one fsspec root URL (folder, ``memory://…``, ``gs://bucket/prefix``)."""

    def __init__(
        self,
        root_url: str,
        *,
        attempts: int = 3,
        backoff_s: float = 0.1,
        spool_bytes: int = 16 << 20,
        **storage_options: Any,
    ) -> None:
        self.root_url, self.attempts, self.backoff_s = root_url, max(1, attempts), backoff_s
        self.spool_bytes = spool_bytes  # uploads and downloads above this size spool to a local temp file
        protocol = fsspec.utils.get_protocol(root_url)
        if protocol in ("gs", "gcs"):
            # Read by gcsfs at import time: otherwise every bucket probe waits 60 s against an emulator.
            os.environ.setdefault(_HNS_ENV, "false")
            import gcsfs.core

            if os.environ[_HNS_ENV].lower() in ("true", "1"):
                cls: Any = fsspec.get_filesystem_class(protocol)
            else:  # also right when gcsfs was imported earlier with the experimental class registered
                cls = gcsfs.core.GCSFileSystem
            self.fs = cls(**storage_options)
            path = cls._strip_protocol(root_url)
        else:
            self.fs, path = fsspec.core.url_to_fs(root_url, **storage_options)
        self.root = path.rstrip("/") or path
        # Rename is atomic on a local disk; object stores get verified bytes in a single object write.
        self._local = isinstance(self.fs, LocalFileSystem)

    @classmethod
    def from_url(cls, root_url: str, **kwargs: Any) -> BlobStore:
        return cls(root_url, **kwargs)

    def _blob_path(self, digest: str) -> str:
        return f"{self.root}/blobs/sha256/{digest[:2]}/{digest}"

    def uri_for(self, sha256: str) -> str:
        """Full URL of the blob (``file:///…``, ``memory:///…``, ``gs://…``)."""
        return self.fs.unstrip_protocol(self._blob_path(_check_digest(sha256)))

    def _retry(self, what: str, fn: Callable[..., T], *args: Any) -> T:
        for attempt in range(1, self.attempts + 1):
            try:
                return fn(*args)
            except Exception as exc:
                transient = _is_transient(exc)
                if not transient:  # not a backend error, or one retrying cannot fix (incl. not found)
                    raise
                if attempt == self.attempts:
                    raise StorageUnavailableError(
                        f"object storage unavailable: {what} failed {attempt} time(s), "
                        f"last with {type(exc).__name__}: {exc}"
                    ) from exc
                log.warning("object storage %s failed (attempt %d/%d): %r", what, attempt, self.attempts, exc)
                time.sleep(self.backoff_s * 2 ** (attempt - 1))
        raise AssertionError("unreachable")

    def _info(self, path: str) -> dict[str, Any] | None:
        try:
            return self._retry(f"stat {path}", self.fs.info, path)
        except FileNotFoundError:
            return None

    def _find(self, path: str) -> dict[str, dict[str, Any]]:
        try:
            return self._retry(f"list {path}", lambda: self.fs.find(path, detail=True))
        except FileNotFoundError:
            return {}

    def put_bytes(
        self,
        data: bytes,
        expected_sha256: str | None = None,
        expected_size: int | None = None,
        max_bytes: int | None = None,
    ) -> StoredBlob:
        """Store ``data`` after checking it against the promised size and sha256."""
        data = bytes(data)
        _check_limits(len(data), expected_size, max_bytes)
        return self._commit(hashlib.sha256(data).hexdigest(), len(data), data, expected_sha256, expected_size)

    def put_stream(
        self,
        chunks: Iterable[bytes],
        expected_sha256: str | None = None,
        expected_size: int | None = None,
        max_bytes: int | None = None,
    ) -> StoredBlob:
        """Store a stream of chunks, hashed while spooled locally; nothing is stored unless it verifies."""
        _check_limits(0, expected_size, max_bytes)
        if expected_sha256 is not None:
            _check_digest(expected_sha256)
        h, size, spool = hashlib.sha256(), 0, _Spool(self.spool_bytes)
        try:
            for chunk in chunks:
                size += len(chunk)
                _check_limits(size, expected_size, max_bytes, partial=True)  # stop reading early
                h.update(chunk)
                spool.write(chunk)
            return self._commit(h.hexdigest(), size, spool, expected_sha256, expected_size)
        finally:
            spool.close()

    def put_staged(
        self, staged: StagedBlob, expected_sha256: str | None = None, expected_size: int | None = None
    ) -> StoredBlob:
        """Store a staged upload, hashed as it was written, from its file; nothing is stored unless it
        verifies (the staged file stays until its owner closes it)."""
        return self._commit(staged.sha256, staged.size, staged, expected_sha256, expected_size)

    def _commit(
        self,
        digest: str,
        size: int,
        source: bytes | _Spool | StagedBlob,
        expected_sha256: str | None,
        expected_size: int | None,
    ) -> StoredBlob:
        if expected_size is not None and size != expected_size:
            raise BlobMismatchError(f"blob size mismatch: received {size} bytes, promised {expected_size}")
        if expected_sha256 is not None and digest != _check_digest(expected_sha256):
            raise BlobMismatchError(
                f"blob sha256 mismatch: received content hashes to {digest}, promised {expected_sha256.lower()}"
            )
        final = self._blob_path(digest)
        info = self._info(final)
        if info is not None and info.get("size") == size:
            return StoredBlob(digest, size, self.fs.unstrip_protocol(final), deduplicated=True)
        if self._local:
            self._retry(f"write {final}", self._write_local, final, source)
        else:
            self._retry(f"write {final}", self._write_object, final, source)
        info = self._info(final)
        if info is None or info.get("size") != size:
            raise StorageUnavailableError(f"blob {digest} has the wrong size after writing it")
        return StoredBlob(digest, size, self.fs.unstrip_protocol(final), deduplicated=False)

    def _write_object(self, final: str, source: bytes | _Spool | StagedBlob) -> None:
        if isinstance(source, bytes):
            self.fs.pipe_file(final, source)
        else:
            source.upload(self.fs, final)

    def _write_local(self, final: str, source: bytes | _Spool | StagedBlob) -> None:
        tmp = f"{self.root}/tmp/{uuid.uuid4().hex}"
        self.fs.makedirs(f"{self.root}/tmp", exist_ok=True)
        self.fs.makedirs(posixpath.dirname(final), exist_ok=True)
        try:
            self._write_object(tmp, source)
            self.fs.mv(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                self.fs.rm_file(tmp)
            raise

    def read_bytes(self, sha256: str) -> bytes:
        """The whole blob, verified against its hash."""
        digest = _check_digest(sha256)
        path = self._blob_path(digest)
        try:
            data = self._retry(f"read {path}", self.fs.cat_file, path)
        except FileNotFoundError:
            raise BlobNotFoundError(f"blob {digest} is not in the store") from None
        self._verify(digest, hashlib.sha256(data).hexdigest())
        return data

    def iter_chunks(self, sha256: str, chunk_size: int = 1 << 20) -> Iterator[bytes]:
        """Chunks of the blob. The whole blob is fetched and verified first: errors raise here, at the call."""
        digest = _check_digest(sha256)
        path = self._blob_path(digest)

        def fetch() -> tuple[_Spool, str]:
            spool, h = _Spool(self.spool_bytes), hashlib.sha256()
            try:
                with self.fs.open(path, "rb") as f:
                    while chunk := f.read(_READ_BLOCK):  # gcsfs makes one request per read
                        h.update(chunk)
                        spool.write(chunk)
            except BaseException:
                spool.close()
                raise
            return spool, h.hexdigest()

        try:
            spool, got = self._retry(f"read {path}", fetch)
        except FileNotFoundError:
            raise BlobNotFoundError(f"blob {digest} is not in the store") from None
        if got != digest:
            spool.close()
            self._verify(digest, got)
        return spool.chunks(chunk_size)

    def _verify(self, digest: str, got: str) -> None:
        if got != digest:
            log.error("blob %s in %s is corrupt: its content hashes to %s", digest, self.root_url, got)
            raise BlobCorruptError(
                f"stored blob {digest} is corrupt: its content's sha256 ({got}) no longer matches; "
                "it will not be served (re-upload the adapter)"
            )

    def exists(self, sha256: str) -> bool:
        return self._info(self._blob_path(_check_digest(sha256))) is not None

    def delete(self, sha256: str) -> bool:
        """Remove one blob; False when it was not there."""
        path = self._blob_path(_check_digest(sha256))
        try:
            self._retry(f"delete {path}", self.fs.rm_file, path)
        except FileNotFoundError:
            return False
        return True

    def _blob_entries(self) -> dict[str, dict[str, Any]]:
        out = {}
        for path, info in self._find(f"{self.root}/blobs/sha256").items():
            parent, name = posixpath.split(path.rstrip("/"))
            if _HEX64.fullmatch(name) and posixpath.basename(parent) == name[:2]:
                out[name] = info
        return out

    def list_blobs(self) -> list[str]:
        """Hex digests of the blobs present, sorted."""
        return sorted(self._blob_entries())

    def gc(self, referenced: set[str], *, min_age_s: float = 0.0, tmp_max_age_s: float = 3600.0) -> list[str]:
        """Delete blobs not in ``referenced`` (and at least ``min_age_s`` old) plus ``tmp/`` objects older
        than ``tmp_max_age_s``; returns the deleted blobs' digests."""
        keep = {d.lower() for d in referenced if isinstance(d, str)}
        now = time.time()

        def old(info: dict[str, Any], age: float) -> bool:
            mtime = _mtime(info)
            return age <= 0 or mtime is None or now - mtime >= age

        deleted = []
        for digest, info in sorted(self._blob_entries().items()):
            if digest not in keep and old(info, min_age_s) and self.delete(digest):
                deleted.append(digest)
        for path, info in self._find(f"{self.root}/tmp").items():
            if old(info, tmp_max_age_s):
                with contextlib.suppress(FileNotFoundError):
                    self._retry(f"delete {path}", self.fs.rm_file, path)
        if deleted:
            log.info("gc removed %d unreferenced blob(s) from %s", len(deleted), self.root_url)
        return deleted
