"""The worker's registry source (``worker.registry_source``) against a real registry: which path the bytes
take (disk cache, direct store read, download), that each path hands over verified bytes, that a cache hit
is not written again, and that a damaged cache entry or blob is never served."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import grpc
import pytest

from loraserve.adapters.errors import AdapterError
from loraserve.adapters.sources import verify_sha256
from loraserve.worker.registry_source import RegistryAdapterSource
from tests.registry.conftest import TINY_MODEL


@pytest.fixture
def pushed(reg, adapter_dirs):
    reg.client.push(adapter_dirs["all-r4"], "fetched", TINY_MODEL)
    weights = (adapter_dirs["all-r4"] / "adapter_model.safetensors").read_bytes()
    return reg, weights, hashlib.sha256(weights).hexdigest()


def test_store_then_disk_cache_each_verified_and_cached_once(pushed, tmp_path: Path) -> None:
    reg, weights, sha = pushed
    source = RegistryAdapterSource(reg.address, cache_dir=str(tmp_path / "cache"))
    key = source.resolve("fetched")
    assert key == "fetched@1"
    first = source.fetch(key)
    assert (first.origin, first.verified, first.weights_bytes, first.sha256) == ("store", True, weights, sha)
    cached = tmp_path / "cache" / sha
    assert cached.read_bytes() == weights and source.stats["direct"] == 1
    stamp = cached.stat().st_mtime_ns
    os.utime(cached, ns=(stamp - 10**9, stamp - 10**9))  # a rewrite would move the mtime forward again
    second = source.fetch(key)
    assert (second.origin, second.verified, second.weights_bytes) == ("disk", True, weights)
    assert cached.stat().st_mtime_ns == stamp - 10**9 and source.stats["disk_cache"] == 1
    verify_sha256(second)  # verified bytes: no second hash, no error
    source.close()


def test_a_damaged_cache_entry_is_dropped_and_fetched_again(pushed, tmp_path: Path) -> None:
    reg, weights, sha = pushed
    source = RegistryAdapterSource(reg.address, cache_dir=str(tmp_path / "cache"))
    key = source.resolve("fetched")
    source.fetch(key)
    (tmp_path / "cache" / sha).write_bytes(b"bit rot")
    again = source.fetch(key)
    assert (again.origin, again.verified, again.weights_bytes) == ("store", True, weights)
    assert (tmp_path / "cache" / sha).read_bytes() == weights
    source.close()


def test_without_direct_reads_the_bytes_come_through_download(pushed, tmp_path: Path) -> None:
    reg, weights, _ = pushed
    source = RegistryAdapterSource(reg.address, cache_dir=None, direct_reads=False)
    got = source.fetch(source.resolve("fetched"))
    assert (got.origin, got.verified, got.weights_bytes) == ("store", True, weights)
    assert source.stats == {"direct": 0, "download": 1, "disk_cache": 0}
    source.close()


def test_a_damaged_blob_is_data_loss_and_never_cached(pushed, tmp_path: Path) -> None:
    reg, weights, sha = pushed
    blob = next(Path(reg.store_root).rglob(sha))  # the content-addressed blob in the local store
    blob.write_bytes(b"x" + weights[1:])
    source = RegistryAdapterSource(reg.address, cache_dir=str(tmp_path / "cache"))
    key = source.resolve("fetched")
    with pytest.raises(AdapterError) as err:  # direct read mismatched; the registry refuses to stream it
        source.fetch(key)
    assert err.value.code == grpc.StatusCode.DATA_LOSS and "corrupt" in str(err.value)
    assert source.stats["direct"] == 1 and source.stats["download"] == 0
    assert not (tmp_path / "cache" / sha).exists()
    source.close()
