"""Where adapter bytes come from: the interface the engine loads through, and a local implementation.

``AdapterSource.resolve`` turns a reference (``name`` or ``name@3``) into the exact key served
(``name@3``); ``fetch`` returns the PEFT files for that key. The local source serves folders or fsspec
URLs registered by name (``WorkerAdmin.LoadAdapter`` with ``source_uri``) or found under a root folder.
The registry client implements the same interface.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

import fsspec

from loraserve.adapters.errors import AdapterDataLossError, AdapterNotFoundError
from loraserve.adapters.files import CONFIG_FILE, WEIGHTS_FILE, read_adapter_files
from loraserve.adapters.refs import NAME_RE, split_ref


class Origin(StrEnum):
    """Where an adapter's bytes came from, fastest first (a mix reports its slowest part's). The value is
    the ``origin`` label of the worker's adapter-load metrics."""

    HOST = "host"  # the worker's host tier: fetched and prepared before
    LOCAL = "local"  # a local folder or fsspec URL
    DISK = "disk"  # the worker's disk cache of registry blobs
    STORE = "store"  # the registry's object store

    @property
    def cost(self) -> int:
        """How slow it is to come from there: the order above."""
        return list(Origin).index(self)


@dataclass(frozen=True)
class FetchedAdapter:
    key: str  # resolved "name@version" (or "name" for unversioned local adapters)
    config_bytes: bytes
    weights_bytes: bytes
    sha256: str = ""  # expected hash when the source knows it; a mismatch is DATA_LOSS
    origin: Origin = Origin.LOCAL
    verified: bool = False  # the source already hashed these bytes against ``sha256`` (no second pass)


class AdapterSource(Protocol):
    def resolve(self, ref: str) -> str: ...

    def fetch(self, key: str) -> FetchedAdapter: ...


def verify_sha256(fetched: FetchedAdapter) -> None:
    if fetched.verified:
        return
    if fetched.sha256 and hashlib.sha256(fetched.weights_bytes).hexdigest() != fetched.sha256:
        raise AdapterDataLossError(f"adapter {fetched.key}: stored weights do not match their sha256")


class LocalAdapterSource:
    """Adapters from PEFT folders: registered by name, or ``<root>/<name>`` when a root is given."""

    def __init__(self, root: str | None = None) -> None:
        self.root = root.rstrip("/") if root else None
        self._uris: dict[str, str] = {}
        self._lock = threading.Lock()

    def register(self, name: str, uri: str) -> None:
        split_ref(name)
        with self._lock:
            self._uris[name] = uri

    def _uri(self, name: str) -> str | None:
        with self._lock:
            if name in self._uris:
                return self._uris[name]
        if self.root:
            fs, path = fsspec.core.url_to_fs(f"{self.root}/{name}")
            if fs.exists(f"{path}/{CONFIG_FILE}") or fs.exists(f"{path}/{WEIGHTS_FILE}"):
                return f"{self.root}/{name}"
        return None

    def known(self) -> list[str]:
        """Every adapter this source can serve: the registered names and the PEFT folders under the root."""
        with self._lock:
            names = set(self._uris)
        if self.root:
            fs, path = fsspec.core.url_to_fs(self.root)
            with contextlib.suppress(OSError):
                for entry in fs.ls(path, detail=False):
                    name = entry.rstrip("/").rsplit("/", 1)[-1]
                    if NAME_RE.fullmatch(name) and self._uri(name) is not None:
                        names.add(name)
        return sorted(names)

    def resolve(self, ref: str) -> str:
        name, version = split_ref(ref)
        key = ref if version is not None else name
        if self._uri(key) is None:
            raise AdapterNotFoundError(f"adapter {ref!r} is not known to this worker")
        return key

    def fetch(self, key: str) -> FetchedAdapter:
        uri = self._uri(key)
        if uri is None:
            raise AdapterNotFoundError(f"adapter {key!r} is not known to this worker")
        config, weights = read_adapter_files(uri)
        return FetchedAdapter(key=key, config_bytes=config, weights_bytes=weights)
