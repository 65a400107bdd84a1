"""AdapterRegistry over real gRPC on loopback, against SQLite and PostgreSQL: rows, bytes, codes."""

from __future__ import annotations

import hashlib
import shutil
import threading
from pathlib import Path

import fsspec
import grpc
import pytest

from loraserve.common.errors import LoraserveError
from loraserve.protos.v1 import placement_pb2, registry_pb2
from tests.registry.conftest import TINY_MODEL
from tests.waiting import wait_until

CODE = grpc.StatusCode


def _weights(folder) -> bytes:
    return (folder / "adapter_model.safetensors").read_bytes()


def _blob_path(env, sha: str) -> str:
    return f"{env.store_root}/blobs/sha256/{sha[:2]}/{sha}"


def test_push_get_list_download_delete(reg, adapter_dirs, tmp_path) -> None:
    folder = adapter_dirs["all-r4"]
    data = _weights(folder)
    sent = []
    a = reg.client.push(
        folder,
        "sql-helper",
        TINY_MODEL,
        description="d",
        labels={"team": "x"},
        progress=lambda n, total: sent.append((n, total)),
        chunk_size=4096,
    )
    assert (a.name, a.version, a.base_model, a.rank, a.alpha, a.use_rslora) == (
        "sql-helper",
        1,
        TINY_MODEL,
        4,
        8.0,
        False,
    )
    assert list(a.target_modules) == [
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    ]
    assert a.sha256 == hashlib.sha256(data).hexdigest() and a.size_bytes == len(data)
    assert dict(a.labels) == {"team": "x"} and a.description == "d" and a.created_at.seconds > 0
    assert sent[-1] == (len(data), len(data)) and len(sent) == -(-len(data) // 4096)
    # the bytes sit content-addressed in the store, and the row is in the database
    with fsspec.open(_blob_path(reg, a.sha256), "rb") as f:
        assert f.read() == data
    assert reg.adapter_rows() == [("sql-helper", 1, "READY")]
    # a second push of the same bytes is version 2 and shares the blob
    b = reg.client.push(folder, "sql-helper", TINY_MODEL)
    assert b.version == 2 and b.sha256 == a.sha256
    assert reg.blobs() == [a.sha256]
    assert reg.client.get("sql-helper").version == 2
    assert reg.client.get("sql-helper@1").version == 1
    out = reg.client.download("sql-helper@1", tmp_path / "dl")
    assert out.sha256 == a.sha256 and (tmp_path / "dl/adapter_model.safetensors").read_bytes() == data
    assert (tmp_path / "dl/adapter_config.json").read_bytes() == (folder / "adapter_config.json").read_bytes()
    resp = reg.client.delete("sql-helper@1")
    assert [(d.name, d.version) for d in resp.deleted] == [("sql-helper", 1)]
    with pytest.raises(LoraserveError) as exc:
        reg.client.get("sql-helper@1")
    assert exc.value.code_name == "NOT_FOUND"
    assert reg.client.get("sql-helper").version == 2
    reg.client.delete("sql-helper")
    assert reg.adapter_rows() == [("sql-helper", 1, "DELETED"), ("sql-helper", 2, "DELETED")]
    assert reg.registry.catalog.gc() == [a.sha256] and reg.blobs() == []
    # versions are never reused after a delete
    assert reg.client.push(folder, "sql-helper", TINY_MODEL).version == 3


def test_explicit_version_conflict_and_lookup_errors(reg, adapter_dirs) -> None:
    folder = adapter_dirs["all-r4"]
    assert reg.client.push(folder, "a", TINY_MODEL, version=7).version == 7
    with pytest.raises(LoraserveError) as exc:
        reg.client.push(folder, "a", TINY_MODEL, version=7)
    assert exc.value.code_name == "ALREADY_EXISTS"
    assert reg.client.push(folder, "a", TINY_MODEL).version == 8
    for ref, code in [
        ("nope", "NOT_FOUND"),
        ("a@3", "NOT_FOUND"),
        ("Bad Name", "INVALID_ARGUMENT"),
        ("a@x", "NOT_FOUND"),  # a well-formed alias that was never set
        ("a@0", "INVALID_ARGUMENT"),
        ("a@Prod!", "INVALID_ARGUMENT"),
        ("", "INVALID_ARGUMENT"),
    ]:
        with pytest.raises(LoraserveError) as exc:
            reg.client.get(ref)
        assert exc.value.code_name == code, ref


def test_list_pages_and_filters(reg, adapter_dirs) -> None:
    folder = adapter_dirs["qv-r8-rslora"]
    for name in ("b-one", "a-two", "a-one", "c-x"):
        reg.client.push(folder, name, TINY_MODEL)
    reg.client.push(folder, "a-one", TINY_MODEL)
    reg.client.push(folder, "z-other", "other-model")
    seen, token, pages = [], "", 0
    while True:
        page = reg.client.adapters.ListAdapters(
            registry_pb2.ListAdaptersRequest(page_size=2, page_token=token)
        )
        seen += [f"{a.name}@{a.version}" for a in page.adapters]
        pages += 1
        token = page.next_page_token
        if not token:
            break
    assert seen == ["a-one@1", "a-one@2", "a-two@1", "b-one@1", "c-x@1", "z-other@1"] and pages == 3
    assert [a.name for a in reg.client.list(name_prefix="a-")] == ["a-one", "a-one", "a-two"]
    assert [a.name for a in reg.client.list(base_model="other-model")] == ["z-other"]
    assert list(reg.client.list(name_prefix="a_")) == []  # LIKE wildcards are escaped
    with pytest.raises(grpc.RpcError) as exc:
        reg.client.adapters.ListAdapters(registry_pb2.ListAdaptersRequest(page_token="garbage!"))
    assert exc.value.code() == CODE.INVALID_ARGUMENT


def test_corrupted_blob_is_data_loss(reg, adapter_dirs, tmp_path) -> None:
    a = reg.client.push(adapter_dirs["all-r4"], "x", TINY_MODEL)
    with fsspec.open(_blob_path(reg, a.sha256), "wb") as f:
        f.write(b"\0" * a.size_bytes)
    with pytest.raises(LoraserveError) as exc:
        reg.client.download("x", tmp_path / "dl")
    assert exc.value.code_name == "DATA_LOSS"
    assert not (tmp_path / "dl").exists()


def test_import_from_uri(reg, adapter_dirs) -> None:
    """Imports read only under --import-allow (default: the store; tests/registry/test_imports.py)."""
    inside = Path(reg.store_root) / "imports" / "mlp"
    shutil.copytree(adapter_dirs["mlp-r16"], inside)
    a = reg.client.import_uri(str(inside), "imported", TINY_MODEL)
    assert (a.name, a.version, a.rank) == ("imported", 1, 16)
    assert a.sha256 == hashlib.sha256(_weights(adapter_dirs["mlp-r16"])).hexdigest()
    with pytest.raises(LoraserveError) as exc:
        reg.client.import_uri(str(Path(reg.store_root) / "no-such-folder"), "imported", TINY_MODEL)
    assert exc.value.code_name == "INVALID_ARGUMENT"
    with pytest.raises(LoraserveError) as exc:
        reg.client.import_uri(str(adapter_dirs["mlp-r16"]), "imported", TINY_MODEL)
    assert exc.value.code_name == "PERMISSION_DENIED"
    assert reg.adapter_rows() == [("imported", 1, "READY")]


def test_concurrent_uploads_get_distinct_versions(reg, adapter_dirs) -> None:
    folder = adapter_dirs["all-r4"]
    reg.registry.catalog.upload_slots.limit = 4  # all of them at once (max_concurrent_uploads, default 2)
    results: list = []

    def push(version: int) -> None:
        try:
            results.append(reg.client.push(folder, "race", TINY_MODEL, version=version).version)
        except LoraserveError as exc:
            results.append(exc.code_name)

    threads = [threading.Thread(target=push, args=(0,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [1, 2, 3, 4]
    results.clear()
    threads = [threading.Thread(target=push, args=(9,)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results, key=str) == [9, "ALREADY_EXISTS", "ALREADY_EXISTS"]
    assert sorted(v for n, v, s in reg.adapter_rows()) == [1, 2, 3, 4, 9]


def test_killed_upload_stream_leaves_nothing(reg, adapter_dirs) -> None:
    folder = adapter_dirs["all-r4"]
    data = _weights(folder)
    header = registry_pb2.UploadHeader(
        name="killed",
        base_model=TINY_MODEL,
        adapter_config_json=(folder / "adapter_config.json").read_bytes(),
        weights_size=len(data),
        weights_sha256=hashlib.sha256(data).hexdigest(),
    )
    gate = threading.Event()

    def messages():
        yield registry_pb2.UploadAdapterRequest(header=header)
        yield registry_pb2.UploadAdapterRequest(chunk=data[:100])
        gate.wait(10)  # hang mid-upload until the client cancels

    future = reg.client.adapters.UploadAdapter.future(messages(), timeout=30)
    slots = reg.registry.catalog.upload_slots
    wait_until(lambda: slots.active == 1, "the upload in flight on the registry")
    future.cancel()
    gate.set()
    with pytest.raises(grpc.FutureCancelledError):
        future.result()
    wait_until(lambda: slots.active == 0, "the registry done with the cancelled upload")
    assert reg.adapter_rows() == [] and reg.blobs() == []
    # a short stream (fewer bytes than promised) is refused too
    with pytest.raises(grpc.RpcError) as exc:
        reg.client.adapters.UploadAdapter(
            iter(
                [
                    registry_pb2.UploadAdapterRequest(header=header),
                    registry_pb2.UploadAdapterRequest(chunk=data[:10]),
                ]
            )
        )
    assert exc.value.code() == CODE.INVALID_ARGUMENT
    assert reg.adapter_rows() == [] and reg.blobs() == []


def test_upload_limits(reg, adapter_dirs) -> None:
    header = registry_pb2.UploadHeader(
        name="big",
        base_model=TINY_MODEL,
        adapter_config_json=b"{}",
        weights_size=5 << 20,
        weights_sha256="0" * 64,
    )
    with pytest.raises(grpc.RpcError) as exc:
        reg.client.adapters.UploadAdapter(iter([registry_pb2.UploadAdapterRequest(header=header)]))
    assert exc.value.code() == CODE.RESOURCE_EXHAUSTED
    with pytest.raises(grpc.RpcError) as exc:
        reg.client.adapters.UploadAdapter(iter([registry_pb2.UploadAdapterRequest(chunk=b"x")]))
    assert exc.value.code() == CODE.INVALID_ARGUMENT and "header" in exc.value.details()
    assert reg.adapter_rows() == []


def test_delete_orders_holders_to_unload(reg, adapter_dirs, tiny_shapes) -> None:
    reg.client.push(adapter_dirs["all-r4"], "held", TINY_MODEL)
    shapes = [
        placement_pb2.ModuleShape(module=m, in_features=i, out_features=o, num_layers=n)
        for m, (i, o, n) in tiny_shapes.items()
    ]
    w = reg.client.placement.RegisterWorker(
        placement_pb2.RegisterWorkerRequest(
            address="127.0.0.1:1", model_id=TINY_MODEL, module_shapes=shapes, slots=2
        )
    )
    from loraserve.protos.v1 import worker_admin_pb2 as wa

    slot = wa.SlotInfo(slot=0, adapter="held@1", state=wa.SLOT_STATE_LOADED)
    assert (
        list(
            reg.client.placement.Heartbeat(
                placement_pb2.HeartbeatRequest(worker_id=w.worker_id, slots=[slot])
            ).unload
        )
        == []
    )
    resp = reg.client.delete("held")
    assert resp.unload_orders == 1
    hb = reg.client.placement.Heartbeat(placement_pb2.HeartbeatRequest(worker_id=w.worker_id, slots=[slot]))
    assert [(o.adapter, o.reason) for o in hb.unload] == [("held@1", "adapter held@1 was deleted")]
    hb = reg.client.placement.Heartbeat(placement_pb2.HeartbeatRequest(worker_id=w.worker_id, slots=[]))
    assert list(hb.unload) == []  # fulfilled once the worker no longer reports it
    # Held only in host memory (or inside a weighted mix, which heartbeats report so): forgotten there too.
    on_host = placement_pb2.AdapterResidency(adapter="held@1", tier=placement_pb2.RESIDENCY_TIER_HOST)
    hb = reg.client.placement.Heartbeat(
        placement_pb2.HeartbeatRequest(worker_id=w.worker_id, cached=[on_host])
    )
    assert [(o.adapter, o.drain) for o in hb.unload] == [("held@1", False)]
    reg.client.push(adapter_dirs["all-r4"], "kept", TINY_MODEL)
    kept = placement_pb2.AdapterResidency(adapter="kept@1", tier=placement_pb2.RESIDENCY_TIER_HOST)
    hb = reg.client.placement.Heartbeat(placement_pb2.HeartbeatRequest(worker_id=w.worker_id, cached=[kept]))
    assert list(hb.unload) == []
