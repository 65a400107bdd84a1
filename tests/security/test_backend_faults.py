"""Backend faults under a live registry: object storage failing then recovering, PostgreSQL restarting."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from loraserve.common.errors import LoraserveError
from loraserve.registry.config import RegistryConfig
from tests.registry.conftest import TINY_MODEL, start_registry


class FlakyFS:
    """Wraps an fsspec filesystem; while ``failing`` > 0, writes and reads raise a 503-like OSError."""

    def __init__(self, fs) -> None:
        self._fs, self.failing = fs, 0

    def __getattr__(self, name):
        attr = getattr(self._fs, name)
        if name not in ("pipe_file", "cat_file", "put_file", "open"):
            return attr

        def flaky(*args, **kwargs):
            if self.failing > 0:
                self.failing -= 1
                raise OSError("503 Service Unavailable")
            return attr(*args, **kwargs)

        return flaky


def test_storage_errors_are_retried_then_unavailable_with_no_partial_rows(
    reg, adapter_dirs, tmp_path
) -> None:
    store = reg.registry.catalog.store
    store.fs = FlakyFS(store.fs)
    store.fs.failing = 1  # one transient failure: retried inside the store, the upload succeeds
    assert reg.client.push(adapter_dirs["all-r4"], "survives-a-blip", TINY_MODEL).version == 1
    store.fs.failing = 10_000  # storage down
    with pytest.raises(LoraserveError) as exc:
        reg.client.push(adapter_dirs["qv-r8-rslora"], "while-down", TINY_MODEL)
    assert exc.value.code_name == "UNAVAILABLE"
    with pytest.raises(LoraserveError) as exc:
        reg.client.download("survives-a-blip", tmp_path / "dl")
    assert exc.value.code_name == "UNAVAILABLE" and not (tmp_path / "dl").exists()
    assert [n for n, _, _ in reg.adapter_rows()] == ["survives-a-blip"]  # no row for the failed upload
    store.fs.failing = 0  # storage is back
    assert reg.client.push(adapter_dirs["qv-r8-rslora"], "while-down", TINY_MODEL).version == 1
    assert len(reg.blobs()) == 2


def _pg_cluster() -> list[str] | None:
    if not shutil.which("pg_ctlcluster") or not os.path.isdir("/etc/postgresql") or os.geteuid() != 0:
        return None
    version = sorted(os.listdir("/etc/postgresql"))[-1]
    return ["pg_ctlcluster", "--skip-systemctl-redirect", version, "main"]


@pytest.mark.postgres
def test_registry_reconnects_after_a_postgresql_restart(postgres_url, adapter_dirs, tmp_path) -> None:
    cluster = _pg_cluster()
    if cluster is None:
        pytest.skip("needs root and a local pg_ctlcluster to restart PostgreSQL")
    config = RegistryConfig(db=postgres_url, storage=str(tmp_path / "s"))
    with start_registry(config, str(tmp_path / "s")) as env:
        env.client.push(adapter_dirs["all-r4"], "before-restart", TINY_MODEL)
        subprocess.run([*cluster, "restart"], check=True, capture_output=True, timeout=120)
        # the pooled connections died with the server; the next calls reconnect
        assert env.client.get("before-restart").version == 1
        assert env.client.push(adapter_dirs["all-r4"], "after-restart", TINY_MODEL).version == 1
        assert [n for n, _, _ in env.adapter_rows()] == ["before-restart", "after-restart"]
