"""Adapters from the registry: resolve ``name``/``name@3`` with GetAdapter, fetch the bytes straight from
the object store when this worker can read it, else through ``DownloadAdapter``; a local disk cache
keyed by sha256 avoids refetching. Every fetched blob is checked against the registry's sha256.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import threading
import time
from pathlib import Path

import fsspec
import grpc

from loraserve.adapters.errors import AdapterError, AdapterUnavailableError
from loraserve.adapters.refs import parse_ref
from loraserve.adapters.running_caps import TENANT_LABEL, Cap, RunningCaps
from loraserve.adapters.sources import FetchedAdapter, Origin
from loraserve.common.security import channel
from loraserve.protos.v1 import registry_pb2, registry_pb2_grpc

log = logging.getLogger("loraserve.worker.registry_source")
RESOLVE_TTL = 2.0  # seconds a "name" -> "name@version" answer is reused


NOT_FOUND, INVALID_ARGUMENT, DATA_LOSS = (
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.DATA_LOSS,
)


def _adapter_error(exc: grpc.RpcError, doing: str, passed: tuple[grpc.StatusCode, ...]) -> AdapterError:
    """The registry's answer as an adapter error: a status in ``passed`` keeps its code and message; any
    other means the registry could not answer (UNAVAILABLE)."""
    code = exc.code()
    if code in passed:
        return AdapterError(exc.details() or code.name, code)
    return AdapterUnavailableError(f"registry unavailable while {doing}: {code.name}")


class RegistryAdapterSource:
    """``AdapterSource`` backed by the registry at ``target`` (with an optional local sha256 cache)."""

    def __init__(
        self,
        target: str,
        cache_dir: str | None = None,
        timeout: float = 30.0,
        direct_reads: bool = True,
        token: str = "",
        tls_ca: str = "",
    ) -> None:
        self.channel = channel(target, token=token, tls_ca=tls_ca)
        self.stub = registry_pb2_grpc.AdapterRegistryStub(self.channel)
        self.timeout, self.direct_reads = timeout, direct_reads
        self.cache_dir = Path(cache_dir) if cache_dir else None
        if self.cache_dir:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
        self._meta: dict[str, registry_pb2.Adapter] = {}  # "name@version" -> metadata
        self._latest: dict[str, tuple[str, float]] = {}  # "name" -> ("name@version", fetched at)
        self._lock = threading.Lock()
        self.stats = {"direct": 0, "download": 0, "disk_cache": 0}
        self.caps = RunningCaps()  # the engine's running caps: GetAdapter answers and heartbeats fill them

    def disk_keys(self) -> list[str]:
        """Adapters (``name@version``) whose blob sits in the disk cache: a parse away, no object store."""
        if not self.cache_dir:
            return []
        with self._lock:
            metas = list(self._meta.items())
        return sorted(key for key, meta in metas if (self.cache_dir / meta.sha256).exists())

    def close(self) -> None:
        self.channel.close()

    def forget(self, key: str) -> None:
        """``key`` (``name@version``) was deleted: drop its metadata, any ``name`` resolution to it, and its
        disk-cache blob (unless another version kept here has the same content), so nothing serves it again
        without asking the registry."""
        with self._lock:
            meta = self._meta.pop(key, None)
            for name in [n for n, (k, _) in self._latest.items() if k == key]:
                del self._latest[name]
            shared = meta is not None and any(m.sha256 == meta.sha256 for m in self._meta.values())
        if meta is not None and self.cache_dir and not shared:
            (self.cache_dir / meta.sha256).unlink(missing_ok=True)

    def _get(self, ref: str) -> registry_pb2.Adapter:
        try:
            meta = self.stub.GetAdapter(registry_pb2.GetAdapterRequest(adapter=ref), timeout=self.timeout)
        except grpc.RpcError as exc:
            raise _adapter_error(exc, f"resolving {ref!r}", (NOT_FOUND, INVALID_ARGUMENT)) from None
        # capped from its first request on this worker (heartbeats keep the caps up to date afterwards)
        tenant = meta.labels.get(TENANT_LABEL, "") if meta.tenant_max_running else ""
        self.caps.note(meta.name, Cap(meta.max_running, tenant, meta.tenant_max_running))
        return meta

    def resolve(self, ref: str) -> str:
        parsed = parse_ref(ref)
        name, version = parsed.name, parsed.version
        if parsed.alias is not None:  # the registry resolves aliases (and their splits) every time
            meta = self._get(ref)
            key = f"{meta.name}@{meta.version}"
            with self._lock:
                self._meta[key] = meta
            return key
        if version is not None and ref in self._meta:
            return ref
        if version is None:
            with self._lock:
                hit = self._latest.get(name)
            if hit and time.monotonic() - hit[1] < RESOLVE_TTL:
                return hit[0]
        meta = self._get(ref)
        key = f"{meta.name}@{meta.version}"
        with self._lock:
            self._meta[key] = meta
            if version is None:
                self._latest[name] = (key, time.monotonic())
        return key

    def _cached(self, sha256: str) -> bytes | None:
        if not self.cache_dir:
            return None
        path = self.cache_dir / sha256
        if path.exists():
            data = path.read_bytes()
            if hashlib.sha256(data).hexdigest() == sha256:
                self.stats["disk_cache"] += 1
                return data
            path.unlink(missing_ok=True)  # corrupt cache entry: refetch
        return None

    def _store(self, sha256: str, data: bytes) -> None:
        if self.cache_dir:
            tmp = self.cache_dir / f".{sha256}.{os.getpid()}.tmp"
            tmp.write_bytes(data)
            os.replace(tmp, self.cache_dir / sha256)

    def _direct(self, meta: registry_pb2.Adapter) -> bytes | None:
        if not self.direct_reads or not meta.uri:
            return None
        try:
            with fsspec.open(meta.uri, "rb") as f:
                data = f.read()
        except Exception as exc:
            log.debug("direct read of %s failed (%s); downloading through the registry", meta.uri, exc)
            return None
        self.stats["direct"] += 1
        return data

    def _download(self, key: str) -> tuple[bytes, bytes, str]:
        """``key``'s config and weights through ``DownloadAdapter``, and the weights' sha256, hashed as the
        chunks arrive. The chunks go into one growing buffer whose bytes are handed over as they are
        (``BytesIO.getvalue`` shares them): one copy of the blob, not a bytearray and then its bytes."""
        try:
            header, buf, digest = None, io.BytesIO(), hashlib.sha256()
            for msg in self.stub.DownloadAdapter(
                registry_pb2.DownloadAdapterRequest(adapter=key), timeout=self.timeout
            ):
                if msg.WhichOneof("payload") == "header":
                    header = msg.header
                else:
                    digest.update(msg.chunk)
                    buf.write(msg.chunk)
        except grpc.RpcError as exc:
            raise _adapter_error(exc, f"downloading {key}", (NOT_FOUND, DATA_LOSS)) from None
        self.stats["download"] += 1
        assert header is not None
        return header.adapter_config_json, buf.getvalue(), digest.hexdigest()

    def fetch(self, key: str) -> FetchedAdapter:
        """``key``'s files: from the disk cache, else read straight from the store, else downloaded through
        the registry. Each candidate blob is hashed once (a mismatch moves on to the next source); a blob
        that did not come from the disk cache is written there. Returned ``verified`` when it matched."""
        meta = self._meta.get(key)
        if meta is None or not meta.adapter_config_json:
            meta = self._meta[key] = self._get(key)
        config = meta.adapter_config_json
        data = self._cached(meta.sha256)  # hashed there: returned only when it matches
        if data is not None:
            return FetchedAdapter(key, config, data, meta.sha256, origin=Origin.DISK, verified=True)
        data = self._direct(meta)
        if data is not None and hashlib.sha256(data).hexdigest() != meta.sha256:
            data = None  # dropped before the download brings the blob again
        if data is None:
            config, data, digest = self._download(key)
            if digest != meta.sha256:  # the caller raises DATA_LOSS
                return FetchedAdapter(key, config, data, meta.sha256, origin=Origin.STORE)
        self._store(meta.sha256, data)
        return FetchedAdapter(
            key=key,
            config_bytes=config,
            weights_bytes=data,
            sha256=meta.sha256,
            origin=Origin.STORE,
            verified=True,
        )
