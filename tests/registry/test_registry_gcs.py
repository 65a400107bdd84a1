"""The registry's gs:// path end to end, on the in-process GCS emulator through gcsfs."""

from __future__ import annotations

import uuid

import fsspec
import pytest

from loraserve.registry.gcs_emulator import start_gcs_emulator

pytestmark = pytest.mark.gcs


@pytest.fixture(scope="module")
def gcs():
    em = start_gcs_emulator("loraserve-test")
    yield em
    em.stop()


def test_registry_over_gcs_emulator(gcs, adapter_dirs, tmp_path, monkeypatch) -> None:
    """The gcsfs path end to end: upload, download, dedup, delete + gc, and DATA_LOSS on a corrupted blob."""
    from loraserve.common.errors import LoraserveError
    from loraserve.registry.config import RegistryConfig
    from tests.registry.conftest import TINY_MODEL, start_registry

    monkeypatch.setenv(
        "STORAGE_EMULATOR_HOST", gcs.endpoint
    )  # how gcsfs (and the compose stack) find an emulator
    root = f"gs://loraserve-test/{uuid.uuid4().hex}"
    config = RegistryConfig(db=f"sqlite:///{tmp_path / 'r.db'}", storage=root, lease_seconds=5)
    with start_registry(config, root) as env:
        folder = adapter_dirs["all-r4"]
        data = (folder / "adapter_model.safetensors").read_bytes()
        a = env.client.push(folder, "gcs-adapter", TINY_MODEL)
        assert a.uri.startswith(root) and a.uri.endswith(a.sha256)
        assert fsspec.open(a.uri, "rb").open().read() == data
        assert env.client.push(folder, "gcs-adapter", TINY_MODEL).version == 2 and env.blobs() == [a.sha256]
        env.client.download("gcs-adapter@1", tmp_path / "dl")
        assert (tmp_path / "dl/adapter_model.safetensors").read_bytes() == data
        with fsspec.open(a.uri, "wb") as f:  # corrupt the stored object behind the registry's back
            f.write(b"\0" * len(data))
        with pytest.raises(LoraserveError) as exc:
            env.client.download("gcs-adapter@2", tmp_path / "dl2")
        assert exc.value.code_name == "DATA_LOSS"
        env.client.delete("gcs-adapter")
        assert env.registry.catalog.gc() == [a.sha256] and env.blobs() == []
