"""Uploads and downloads in bounded memory (issue #30 item 4), over real gRPC against an in-process registry.

An upload is spooled to a local temporary file while hashed and validated tensor by tensor from there; a
download is sent in chunks; at most ``max_concurrent_uploads`` uploads run at once, the next one is refused
with RESOURCE_EXHAUSTED at once. Peaks are measured with ``tracemalloc`` (Python and numpy allocations of the
whole process: the registry's threads and the test's client, whose own share is a chunk or two).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from loraserve.common.errors import LoraserveError
from loraserve.protos.v1 import placement_pb2, registry_pb2
from loraserve.registry.config import RegistryConfig
from tests.registry.conftest import TINY_MODEL, start_registry
from tests.waiting import settled, wait_until

MiB = 1 << 20
BIG_MODEL = "big-test-model"
HIDDEN, INTERMEDIATE, LAYERS, RANK = 2048, 5632, 20, 16
BIG_SHAPES = {
    **{m: (HIDDEN, HIDDEN) for m in ("q_proj", "k_proj", "v_proj", "o_proj")},
    "gate_proj": (HIDDEN, INTERMEDIATE),
    "up_proj": (HIDDEN, INTERMEDIATE),
    "down_proj": (INTERMEDIATE, HIDDEN),
}
# what the registry may allocate beyond the bound's multiple of the blob: gRPC messages in flight, chunk
# buffers, the database and proto work of one upload
SLACK = 16 * MiB


@pytest.fixture(scope="module")
def big_adapter(tmp_path_factory) -> Path:
    """A ~48 MB PEFT adapter (rank 16, every projection of 20 layers) for BIG_SHAPES, made with numpy."""
    from safetensors.numpy import save_file

    folder = tmp_path_factory.mktemp("big") / "adapter"
    folder.mkdir()
    rng = np.random.default_rng(0)
    tensors = {}
    for layer in range(LAYERS):
        for module, (fan_in, fan_out) in BIG_SHAPES.items():
            part = "mlp" if module.endswith(("gate_proj", "up_proj", "down_proj")) else "self_attn"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.standard_normal((RANK, fan_in), np.float32) * 0.01
            tensors[f"{prefix}.lora_B.weight"] = rng.standard_normal((fan_out, RANK), np.float32) * 0.01
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = (
        '{"peft_type": "LORA", "r": 16, "lora_alpha": 32, "target_modules": '
        '["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}'
    )
    (folder / "adapter_config.json").write_text(config)
    return folder


@pytest.fixture
def big_reg(tmp_path, monkeypatch):
    """A registry that takes uploads of up to 256 MiB, BIG_MODEL's shapes registered; temp files under
    ``tmp_path/tmp`` (so a test sees what an upload left behind)."""
    spool = tmp_path / "tmp"
    spool.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spool))
    store = str(tmp_path / "store")
    config = RegistryConfig(
        db=f"sqlite:///{tmp_path / 'registry.db'}",
        storage=store,
        max_lora_rank=RANK,
        max_upload_bytes=256 * MiB,
    )
    with start_registry(config, store) as env:
        shapes = [
            placement_pb2.ModuleShape(module=m, in_features=i, out_features=o, num_layers=LAYERS)
            for m, (i, o) in BIG_SHAPES.items()
        ]
        env.client.placement.RegisterWorker(
            placement_pb2.RegisterWorkerRequest(
                address="127.0.0.1:9", model_id=BIG_MODEL, module_shapes=shapes, slots=1
            )
        )
        env.spool = spool
        yield env


def _messages(folder: Path, name: str, chunk: int = MiB) -> Iterator[registry_pb2.UploadAdapterRequest]:
    """An upload read from disk a chunk at a time: the client itself never holds the file."""
    weights = folder / "adapter_model.safetensors"
    digest = hashlib.sha256()
    with open(weights, "rb") as f:
        while block := f.read(MiB):
            digest.update(block)
    yield registry_pb2.UploadAdapterRequest(
        header=registry_pb2.UploadHeader(
            name=name,
            base_model=BIG_MODEL,
            adapter_config_json=(folder / "adapter_config.json").read_bytes(),
            weights_size=weights.stat().st_size,
            weights_sha256=digest.hexdigest(),
        )
    )
    with open(weights, "rb") as f:
        while block := f.read(chunk):
            yield registry_pb2.UploadAdapterRequest(chunk=block)


def _peak(fn) -> tuple[object, int]:
    """``fn()``'s result and the peak of traced memory above what was allocated before it."""
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        out = fn()
        return out, tracemalloc.get_traced_memory()[1] - before
    finally:
        tracemalloc.stop()


def test_upload_peak_memory_is_bounded(big_reg, big_adapter) -> None:
    size = (big_adapter / "adapter_model.safetensors").stat().st_size
    assert size > 40 * MiB
    row, peak = _peak(
        lambda: big_reg.client.adapters.UploadAdapter(_messages(big_adapter, "big"), timeout=120)
    )
    print(f"\nupload of {size / MiB:.1f} MiB: traced peak {peak / MiB:.1f} MiB ({peak / size:.2f}x the blob)")
    assert (row.version, row.rank, row.size_bytes) == (1, RANK, size)
    assert list(row.target_modules) == list(BIG_SHAPES)
    assert peak <= 2 * size + SLACK, f"peak {peak / MiB:.1f} MiB for a {size / MiB:.1f} MiB upload"
    # tensor by tensor from a spooled file: not even one whole copy of the blob
    assert peak < size, f"peak {peak / MiB:.1f} MiB for a {size / MiB:.1f} MiB upload"
    assert big_reg.blobs() == [row.sha256] and list(big_reg.spool.iterdir()) == []


def test_download_is_streamed_in_bounded_chunks(big_reg, big_adapter) -> None:
    from loraserve.registry.server import CHUNK
    from loraserve.registry.storage import _READ_BLOCK

    row = big_reg.client.adapters.UploadAdapter(_messages(big_adapter, "big"), timeout=120)
    # the blob is verified before the first byte is sent, through a spool: memory up to spool_bytes (16 MiB
    # by default), a local temporary file beyond; 1 MiB here, so that what is measured is the streaming
    big_reg.registry.catalog.store.spool_bytes = MiB

    def download() -> tuple[int, int, str]:
        sizes, digest = [], hashlib.sha256()
        stream = big_reg.client.adapters.DownloadAdapter(
            registry_pb2.DownloadAdapterRequest(adapter="big@1"), timeout=120
        )
        for i, msg in enumerate(stream):
            assert (msg.WhichOneof("payload") == "header") == (i == 0)
            if i:
                sizes.append(len(msg.chunk))
                digest.update(msg.chunk)
        return max(sizes), sum(sizes), digest.hexdigest()

    (largest, total, sha), peak = _peak(download)
    print(f"\ndownload of {total / MiB:.1f} MiB: traced peak {peak / MiB:.1f} MiB")
    assert (total, sha) == (row.size_bytes, row.sha256)
    assert largest <= CHUNK
    # the store's read blocks and a few chunks in flight
    assert peak <= 2 * _READ_BLOCK + 4 * CHUNK + 4 * MiB, f"peak {peak / MiB:.1f} MiB"
    assert list(big_reg.spool.iterdir()) == []


def test_worker_download_assembles_the_blob_once(big_reg, big_adapter) -> None:
    from loraserve.worker.registry_source import RegistryAdapterSource

    row = big_reg.client.adapters.UploadAdapter(_messages(big_adapter, "big"), timeout=120)
    big_reg.registry.catalog.store.spool_bytes = MiB  # the registry's side of the stream: a block or two
    source = RegistryAdapterSource(big_reg.address, direct_reads=False, timeout=120)
    try:
        key = source.resolve("big")
        got, peak = _peak(lambda: source.fetch(key))
    finally:
        source.close()
    print(f"\nworker fetch of {row.size_bytes / MiB:.1f} MiB: traced peak {peak / MiB:.1f} MiB")
    assert got.verified and hashlib.sha256(got.weights_bytes).hexdigest() == row.sha256
    # the bytes it hands over (1x), the registry's read block and a few chunks in flight: no second copy
    assert peak <= 1.25 * row.size_bytes + 12 * MiB, f"peak {peak / MiB:.1f} MiB"


def _await_active(reg, n: int) -> None:
    """Until ``n`` uploads hold a slot (the registry counts them)."""
    slots = reg.registry.catalog.upload_slots
    wait_until(lambda: slots.active >= n, f"{n} upload(s) holding a slot", interval=0.01)


def test_one_upload_over_the_limit_is_refused_at_once(reg, adapter_dirs, tmp_path, monkeypatch) -> None:
    spool = tmp_path / "tmp"
    spool.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spool))
    limit = 2  # RegistryConfig.max_concurrent_uploads's default
    gate = threading.Event()

    def held(folder: Path, name: str) -> Iterator[registry_pb2.UploadAdapterRequest]:
        """An upload that sends its header and first chunk, then waits for ``gate``."""
        weights = (folder / "adapter_model.safetensors").read_bytes()
        yield registry_pb2.UploadAdapterRequest(
            header=registry_pb2.UploadHeader(
                name=name,
                base_model=TINY_MODEL,
                adapter_config_json=(folder / "adapter_config.json").read_bytes(),
                weights_size=len(weights),
                weights_sha256=hashlib.sha256(weights).hexdigest(),
            )
        )
        yield registry_pb2.UploadAdapterRequest(chunk=weights[:100])
        gate.wait(30)
        yield registry_pb2.UploadAdapterRequest(chunk=weights[100:])

    names = ["first", "second"]
    folders = [adapter_dirs["all-r4"], adapter_dirs["qv-r8-rslora"]]
    calls = [
        reg.client.adapters.UploadAdapter.future(held(f, n), timeout=60)
        for f, n in zip(folders, names, strict=True)
    ]
    try:
        _await_active(reg, limit)
        start = time.monotonic()
        with pytest.raises(LoraserveError) as exc:
            reg.client.push(adapter_dirs["mlp-r16"], "third", TINY_MODEL)
        assert time.monotonic() - start < 5  # refused at once, not queued behind the two
        assert exc.value.code_name == "RESOURCE_EXHAUSTED"
        assert exc.value.message == f"too many concurrent uploads ({limit}), retry later"
        assert exc.value.retry_after == 1.0  # waiting cures it: the client is told how long
    finally:
        gate.set()
    rows = [call.result() for call in calls]
    assert [(r.name, r.version) for r in rows] == [("first", 1), ("second", 1)]
    assert sorted(reg.adapter_rows()) == [("first", 1, "READY"), ("second", 1, "READY")]
    assert reg.blobs() == sorted(r.sha256 for r in rows) and list(spool.iterdir()) == []
    # the slots are free again
    assert reg.client.push(adapter_dirs["mlp-r16"], "third", TINY_MODEL).version == 1


@pytest.mark.parametrize("how", ["nan", "sha256", "cancel"])
def test_a_refused_or_abandoned_upload_leaves_no_row_blob_or_temp_file(
    reg, adapter_dirs, tmp_path, monkeypatch, how
) -> None:
    from safetensors.numpy import load_file, save_file

    spool = tmp_path / "tmp"
    spool.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(spool))
    folder = tmp_path / "a"
    folder.mkdir()
    (folder / "adapter_config.json").write_bytes(
        (adapter_dirs["all-r4"] / "adapter_config.json").read_bytes()
    )
    tensors = load_file(str(adapter_dirs["all-r4"] / "adapter_model.safetensors"))
    if how == "nan":
        key = sorted(k for k in tensors if "lora_B" in k)[-1]
        tensors[key][0, 0] = np.nan
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    weights = (folder / "adapter_model.safetensors").read_bytes()
    header = registry_pb2.UploadHeader(
        name="refused",
        base_model=TINY_MODEL,
        adapter_config_json=(folder / "adapter_config.json").read_bytes(),
        weights_size=len(weights),
        weights_sha256=hashlib.sha256(weights if how != "sha256" else b"other").hexdigest(),
    )
    sent, release = threading.Event(), threading.Event()

    def messages():
        yield registry_pb2.UploadAdapterRequest(header=header)
        yield registry_pb2.UploadAdapterRequest(chunk=weights[:1000])
        if how == "cancel":
            sent.set()
            release.wait(30)  # cancelled meanwhile
        yield registry_pb2.UploadAdapterRequest(chunk=weights[1000:])

    if how == "cancel":
        call = reg.client.adapters.UploadAdapter.future(messages(), timeout=60)
        assert sent.wait(10)
        _await_active(reg, 1)
        wait_until(lambda: any(spool.iterdir()), "the upload's staged file", interval=0.01)
        call.cancel()
        release.set()
        settled(
            lambda: (reg.registry.catalog.upload_slots.active, list(spool.iterdir())),
            lambda state: state == (0, []),
            timeout=5,
            interval=0.01,
        )  # the assertions below say what was left if the registry never cleaned up
    else:
        with pytest.raises(grpc.RpcError) as exc:
            reg.client.adapters.UploadAdapter(messages(), timeout=60)
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert ("NaN" if how == "nan" else "sha256 mismatch") in exc.value.details()
    assert reg.adapter_rows() == [] and reg.blobs() == []
    assert list(spool.iterdir()) == []
    assert reg.registry.catalog.upload_slots.active == 0


def test_max_concurrent_uploads_from_the_environment() -> None:
    assert RegistryConfig().max_concurrent_uploads == 2
    env = {"LORASERVE_REGISTRY_MAX_CONCURRENT_UPLOADS": "5"}
    assert RegistryConfig.from_env(env).max_concurrent_uploads == 5
    with pytest.raises(ValueError, match="max_concurrent_uploads"):
        RegistryConfig(max_concurrent_uploads=0)


def test_client_download_writes_only_verified_files(reg, adapter_dirs, tmp_path) -> None:
    reg.client.push(adapter_dirs["all-r4"], "dl", TINY_MODEL)
    out = reg.client.download("dl", tmp_path / "out")
    assert out.version == 1
    assert (tmp_path / "out" / "adapter_model.safetensors").read_bytes() == (
        adapter_dirs["all-r4"] / "adapter_model.safetensors"
    ).read_bytes()
    assert sorted(os.listdir(tmp_path / "out")) == ["adapter_config.json", "adapter_model.safetensors"]


def test_import_peak_memory_is_bounded(big_reg, big_adapter) -> None:
    """ImportAdapter streams the weights into the staged file as it reads them (``ImportPolicy.read``'s
    sink), then validates from it like an upload: never a whole copy of the blob in memory."""
    import shutil

    folder = Path(big_reg.store_root) / "imports" / "big"  # the storage root is an allowed import prefix
    shutil.copytree(big_adapter, folder)
    size = (folder / "adapter_model.safetensors").stat().st_size
    row, peak = _peak(lambda: big_reg.client.import_uri(str(folder), "big-import", BIG_MODEL))
    print(f"\nimport of {size / MiB:.1f} MiB: traced peak {peak / MiB:.1f} MiB ({peak / size:.2f}x the blob)")
    assert (row.version, row.size_bytes) == (1, size)
    assert peak < size, f"peak {peak / MiB:.1f} MiB for a {size / MiB:.1f} MiB import"
    assert list(big_reg.spool.iterdir()) == []
