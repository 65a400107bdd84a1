"""BlobStore over three backends: a local folder, ``memory://`` and ``gs://`` on the in-process emulator.

Fixtures live here (not in conftest.py): ``make_store`` builds a store on the parametrised backend with fast
retries; ``raw`` lists and reads the objects underneath with plain fsspec, bypassing the store.
"""

from __future__ import annotations

import hashlib
import math
import os
import random
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest

from loraserve.registry.gcs_emulator import GcsEmulator, start_gcs_emulator
from loraserve.registry.storage import (
    BlobCorruptError,
    BlobMismatchError,
    BlobNotFoundError,
    BlobStore,
    BlobTooLargeError,
    InvalidDigestError,
    StorageUnavailableError,
    _is_transient,
)

BACKENDS = ["local", "memory", pytest.param("gcs", marks=pytest.mark.gcs)]
WRITE_METHODS = ("pipe_file", "put_file")
READ_METHODS = ("cat_file", "open")


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def gcs_emulator() -> Iterator[GcsEmulator]:
    with start_gcs_emulator("loraserve-test") as emu:
        yield emu


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest, tmp_path) -> tuple[str, dict[str, Any]]:
    """(root URL, storage options) of a fresh, empty root on one backend."""
    if request.param == "local":
        return f"file://{tmp_path}/store", {}
    if request.param == "memory":
        root = f"memory://loraserve-test-{uuid.uuid4().hex}"
        memfs = fsspec.filesystem("memory")
        request.addfinalizer(lambda: memfs.exists(root) and memfs.rm(root, recursive=True))
        return root, {}
    emu = request.getfixturevalue("gcs_emulator")
    return emu.url(f"t-{uuid.uuid4().hex}"), emu.storage_options


@pytest.fixture
def make_store(backend) -> Callable[..., BlobStore]:
    root, options = backend

    def make(**kwargs: Any) -> BlobStore:
        return BlobStore(root, attempts=3, backoff_s=0.001, **options, **kwargs)

    return make


@pytest.fixture
def store(make_store) -> BlobStore:
    return make_store()


class Raw:
    """The objects under a store's root, seen through plain fsspec rather than the store."""

    def __init__(self, store: BlobStore, options: dict[str, Any]) -> None:
        self.store, self.options = store, options
        self.fs = fsspec.core.url_to_fs(store.root_url, **options)[0]

    def objects(self) -> list[str]:
        return sorted(p[len(self.store.root) + 1 :] for p in self.fs.find(self.store.root))

    def read(self, uri: str) -> bytes:
        with fsspec.open(uri, "rb", **self.options) as f:
            return f.read()

    def overwrite(self, digest: str, data: bytes) -> None:
        self.fs.pipe_file(f"{self.store.root}/blobs/sha256/{digest[:2]}/{digest}", data)
        self.fs.invalidate_cache()


@pytest.fixture
def raw(store, backend) -> Raw:
    return Raw(store, backend[1])


class FlakyFS:
    """Wraps a filesystem; the named methods raise OSError for the first ``failures`` calls."""

    def __init__(self, fs: Any, methods: tuple[str, ...], failures: float = 1) -> None:
        self._fs, self._methods, self.failures = fs, set(methods), failures
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._fs, name)
        if name not in self._methods:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            if self.failures > 0:
                self.failures -= 1
                raise OSError(f"injected transient failure in {name}")
            return attr(*args, **kwargs)

        return call


def blob_key(digest: str) -> str:
    return f"blobs/sha256/{digest[:2]}/{digest}"


# ---------------------------------------------------------------------------------------------- writes/reads
def test_round_trip_stores_exact_bytes_at_content_address(store: BlobStore, raw: Raw) -> None:
    data = os.urandom(3000) + b"\x00end"
    blob = store.put_bytes(data, expected_sha256=sha(data).upper(), expected_size=len(data))
    assert (blob.sha256, blob.size, blob.deduplicated) == (sha(data), len(data), False)
    assert blob.uri == store.uri_for(blob.sha256) and blob.uri.endswith(blob_key(blob.sha256))
    assert raw.objects() == [blob_key(blob.sha256)]  # nothing left in tmp/
    assert raw.read(blob.uri) == data
    assert store.read_bytes(blob.sha256) == data
    chunks = list(store.iter_chunks(blob.sha256, chunk_size=1000))
    assert [len(c) for c in chunks] == [1000, 1000, 1000, 4] and b"".join(chunks) == data
    assert store.exists(blob.sha256) and store.list_blobs() == [blob.sha256]


def test_second_put_of_same_bytes_is_deduplicated_without_rewrite(store: BlobStore, raw: Raw) -> None:
    data = b"adapter weights" * 100
    first = store.put_bytes(data)
    spy = store.fs = FlakyFS(store.fs, (*WRITE_METHODS, "mv"), failures=0)
    second = store.put_stream(iter([data[:7], data[7:]]), expected_sha256=sha(data), expected_size=len(data))
    assert second.deduplicated and not first.deduplicated
    assert (second.sha256, second.size, second.uri) == (first.sha256, first.size, first.uri)
    assert sum(spy.calls.values()) == 0
    assert raw.objects() == [blob_key(first.sha256)]


@pytest.mark.parametrize("how", ["put_bytes", "put_stream"])
@pytest.mark.parametrize("wrong", ["size", "sha256"])
def test_mismatch_is_refused_and_leaves_nothing(store: BlobStore, raw: Raw, how: str, wrong: str) -> None:
    data = b"x" * 5000
    size, digest = len(data), sha(data)
    if wrong == "size":
        size += 1
    else:
        digest = sha(b"something else")
    with pytest.raises(BlobMismatchError, match=f"{wrong} mismatch") as info:
        if how == "put_bytes":
            store.put_bytes(data, expected_sha256=digest, expected_size=size)
        else:
            store.put_stream([data[:100], data[100:]], expected_sha256=digest, expected_size=size)
    assert info.value.code_name == "INVALID_ARGUMENT" and isinstance(info.value, ValueError)
    assert raw.objects() == [] and store.list_blobs() == []


def test_stream_longer_than_promised_stops_early(store: BlobStore, raw: Raw) -> None:
    pulled = []

    def chunks() -> Iterator[bytes]:
        for i in range(100):
            pulled.append(i)
            yield b"y" * 10

    with pytest.raises(BlobMismatchError, match="more than the promised 25 bytes"):
        store.put_stream(chunks(), expected_size=25)
    assert len(pulled) == 3 and raw.objects() == []


def test_max_bytes_is_enforced_and_nothing_stored(store: BlobStore, raw: Raw) -> None:
    pulled = []

    def chunks() -> Iterator[bytes]:
        for i in range(1000):
            pulled.append(i)
            yield b"z" * 100

    with pytest.raises(BlobTooLargeError, match="limit of 1000 bytes") as info:
        store.put_stream(chunks(), max_bytes=1000)
    assert info.value.code_name == "RESOURCE_EXHAUSTED" and len(pulled) == 11  # stopped reading at the limit
    with pytest.raises(BlobTooLargeError):  # a promise over the limit is refused before reading anything
        store.put_stream(chunks(), expected_size=5000, max_bytes=1000)
    assert len(pulled) == 11
    with pytest.raises(BlobTooLargeError):
        store.put_bytes(b"z" * 1001, max_bytes=1000)
    assert raw.objects() == []
    assert store.put_stream([b"z" * 1000], max_bytes=1000).size == 1000  # exactly at the limit is fine


def test_put_stream_many_chunks_spilling_to_a_temp_file(make_store, raw: Raw) -> None:
    store = make_store(spool_bytes=4096)  # spool and read-back both spill to local temp files
    rng = random.Random(7)
    chunks = [rng.randbytes(rng.randrange(0, 700)) for _ in range(400)]
    data = b"".join(chunks)
    blob = store.put_stream(
        iter(chunks), expected_sha256=sha(data), expected_size=len(data), max_bytes=1 << 20
    )
    assert blob.size == len(data) > 100_000 and raw.read(blob.uri) == data
    out = list(store.iter_chunks(blob.sha256, chunk_size=8192))
    assert b"".join(out) == data and all(len(c) == 8192 for c in out[:-1])
    assert raw.objects() == [blob_key(blob.sha256)]


# ---------------------------------------------------------------------------------------------- corruption
@pytest.mark.parametrize("damage", ["flipped", "truncated"])
def test_corrupt_blob_is_data_loss_and_never_served(store: BlobStore, raw: Raw, damage: str) -> None:
    data = os.urandom(5000)
    digest = store.put_bytes(data).sha256
    bad = bytes([data[0] ^ 1]) + data[1:] if damage == "flipped" else data[:-10]
    raw.overwrite(digest, bad)
    with pytest.raises(BlobCorruptError, match="no longer matches") as info:
        store.read_bytes(digest)
    assert info.value.code_name == "DATA_LOSS"
    seen: list[bytes] = []
    with pytest.raises(BlobCorruptError):
        for chunk in store.iter_chunks(digest, chunk_size=100):
            seen.append(chunk)
    assert seen == []
    if damage == "truncated":  # a wrong-size object is not taken for a duplicate: re-upload repairs it
        assert not store.put_bytes(data).deduplicated
        assert store.read_bytes(digest) == data


# ---------------------------------------------------------------------------------------------- housekeeping
def test_delete_and_missing_blobs(store: BlobStore, raw: Raw) -> None:
    digest = store.put_bytes(b"to be deleted").sha256
    assert store.delete(digest) is True
    assert not store.exists(digest) and raw.objects() == []
    assert store.delete(digest) is False
    with pytest.raises(BlobNotFoundError) as info:
        store.read_bytes(digest)
    assert info.value.code_name == "NOT_FOUND"
    with pytest.raises(BlobNotFoundError):
        store.iter_chunks(digest)
    with pytest.raises(InvalidDigestError):
        store.read_bytes("not-a-digest")


def test_gc_removes_unreferenced_blobs_and_stale_tmp(store: BlobStore, raw: Raw) -> None:
    keep, drop1, drop2 = (store.put_bytes(b"blob %d" % i).sha256 for i in range(3))
    tmp_key = f"{store.root}/tmp/{uuid.uuid4().hex}"
    raw.fs.pipe_file(tmp_key, b"left behind by a crashed upload")
    assert store.gc({keep.upper()}, min_age_s=3600) == []  # all blobs are younger than an hour
    assert store.gc({keep.upper()}) == sorted([drop1, drop2])  # the tmp object is younger than an hour too
    assert store.list_blobs() == [keep] and f"tmp/{tmp_key.rsplit('/', 1)[1]}" in raw.objects()
    assert store.gc({keep}, tmp_max_age_s=0) == []
    assert raw.objects() == [blob_key(keep)] and store.read_bytes(keep) == b"blob 0"


# ---------------------------------------------------------------------------------------------- failures
@pytest.mark.parametrize("op", ["put", "read_bytes", "iter_chunks"])
def test_transient_failure_is_retried(store: BlobStore, raw: Raw, op: str) -> None:
    data = b"retry me" * 50
    if op != "put":
        store.put_bytes(data)
    flaky = store.fs = FlakyFS(store.fs, WRITE_METHODS if op == "put" else READ_METHODS, failures=2)
    if op == "put":
        assert store.put_bytes(data).size == len(data)
    elif op == "read_bytes":
        assert store.read_bytes(sha(data)) == data
    else:
        assert b"".join(store.iter_chunks(sha(data), chunk_size=64)) == data
    assert sum(flaky.calls.values()) == 3 and flaky.failures == 0
    assert raw.objects() == [blob_key(sha(data))]


@pytest.mark.parametrize("op", ["put", "read_bytes", "iter_chunks"])
def test_persistent_failure_is_unavailable(store: BlobStore, raw: Raw, op: str) -> None:
    data = b"never stored" * 10
    if op != "put":
        store.put_bytes(data)
    flaky = store.fs = FlakyFS(store.fs, WRITE_METHODS if op == "put" else READ_METHODS, failures=math.inf)
    start = time.monotonic()
    with pytest.raises(StorageUnavailableError, match="failed 3 time") as info:
        if op == "put":
            store.put_bytes(data)
        elif op == "read_bytes":
            store.read_bytes(sha(data))
        else:
            store.iter_chunks(sha(data))
    assert info.value.code_name == "UNAVAILABLE" and isinstance(info.value.__cause__, OSError)
    assert sum(flaky.calls.values()) == 3 and time.monotonic() - start < 5
    assert raw.objects() == ([] if op == "put" else [blob_key(sha(data))])


def test_local_rename_failure_leaves_no_tmp_and_no_blob(tmp_path) -> None:
    store = BlobStore(str(tmp_path / "store"), attempts=2, backoff_s=0.001)
    assert store.root == str(tmp_path / "store") and store.uri_for("a" * 64).startswith("file:///")
    flaky = store.fs = FlakyFS(store.fs, ("mv",), failures=math.inf)
    with pytest.raises(StorageUnavailableError):
        store.put_bytes(b"half written", expected_size=12)
    assert flaky.calls["mv"] == 2
    assert [p for p in (tmp_path / "store").rglob("*") if p.is_file()] == []
    store.fs = flaky._fs
    blob = store.put_bytes(b"half written", expected_size=12)
    files = [p for p in (tmp_path / "store").rglob("*") if p.is_file()]
    assert files == [tmp_path / "store" / blob_key(blob.sha256)] and blob.uri == files[0].as_uri()


def test_transient_classification() -> None:
    from gcsfs.retry import HttpError

    assert _is_transient(HttpError({"code": 503, "message": "backend error"}))
    assert _is_transient(HttpError({"code": 429, "message": "slow down"}))
    assert _is_transient(HttpError({"code": 403, "message": "forbidden"})) is False
    assert _is_transient(TimeoutError()) and _is_transient(ConnectionResetError())
    assert _is_transient(FileNotFoundError()) is False and _is_transient(PermissionError()) is False
    assert _is_transient(KeyError("bug")) is None


@pytest.mark.gcs
def test_gcs_emulator_starts_fast_in_memory() -> None:
    from gcp_storage_emulator import settings

    disk = Path(settings.STORAGE_BASE, settings.STORAGE_DIR)
    had_disk = disk.exists()
    start = time.monotonic()
    with start_gcs_emulator("quick") as emu:
        store = BlobStore(emu.url("p"), **emu.storage_options)
        blob = store.put_bytes(b"hello")
        assert store.read_bytes(blob.sha256) == b"hello" and blob.uri.startswith("gs://quick/p/blobs/")
    assert time.monotonic() - start < 5
    assert os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"] == "false"
    assert disk.exists() == had_disk  # in-memory: no .cloudstorage folder appears
