"""The admin CLI against a live registry: adapters push/ls/show/rm, workers ls, registry migrate/gc."""

from __future__ import annotations

import json

import pytest

from loraserve.cli import main
from loraserve.protos.v1 import placement_pb2 as pp
from tests.registry.conftest import TINY_MODEL


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_adapters_commands(reg, adapter_dirs, capsys: pytest.CaptureFixture[str]) -> None:
    folder = str(adapter_dirs["qv-r8-rslora"])
    code, out, err = _run(
        capsys,
        "adapters",
        "push",
        folder,
        "--name",
        "cli-a",
        "--base-model",
        TINY_MODEL,
        "--label",
        "team=search",
        "--registry",
        reg.address,
    )
    assert code == 0 and out.startswith("pushed cli-a@1 (") and "MB" in err  # a progress bar on stderr
    code, out, _ = _run(
        capsys,
        "adapters",
        "push",
        folder,
        "--name",
        "cli-a",
        "--base-model",
        TINY_MODEL,
        "--registry",
        reg.address,
        "--json",
    )
    assert json.loads(out)["version"] == 2
    code, out, _ = _run(capsys, "adapters", "ls", "--registry", reg.address)
    lines = out.splitlines()
    assert lines[0].split() == ["ADAPTER", "BASE", "MODEL", "RANK", "ALPHA", "TARGETS", "BYTES", "ALIASES"]
    assert [line.split()[0] for line in lines[1:]] == ["cli-a@1", "cli-a@2"] and "q_proj,v_proj" in lines[1]
    code, out, _ = _run(capsys, "adapters", "show", "cli-a@1", "--registry", reg.address, "--json")
    shown = json.loads(out)
    assert shown["labels"] == {"team": "search"} and shown["use_rslora"] is True and shown["rank"] == 8
    code, out, _ = _run(capsys, "adapters", "rm", "cli-a@1", "--registry", reg.address)
    assert code == 0 and out.strip() == "deleted cli-a@1; 0 unload order(s) sent"
    code, out, err = _run(capsys, "adapters", "show", "cli-a@1", "--registry", reg.address)
    assert code == 1 and "NOT_FOUND" in err
    code, out, _ = _run(capsys, "adapters", "ls", "--registry", reg.address, "--json")
    assert [(a["name"], a["version"]) for a in json.loads(out)] == [("cli-a", 2)]


def test_workers_ls(reg, tiny_shapes, capsys: pytest.CaptureFixture[str]) -> None:
    wid = reg.client.placement.RegisterWorker(
        pp.RegisterWorkerRequest(
            address="127.0.0.1:7001", model_id=TINY_MODEL, slots=4, tensor_parallel_size=4
        )
    ).worker_id
    code, out, _ = _run(capsys, "workers", "ls", "--registry", reg.address, "--json")
    listed = [(w["worker_id"], w["address"], w["slots"], w["tensor_parallel_size"]) for w in json.loads(out)]
    assert code == 0 and listed == [(wid, "127.0.0.1:7001", 4, 4)]
    code, out, _ = _run(capsys, "workers", "ls", "--registry", reg.address)
    header, row = out.splitlines()[0].split(), out.splitlines()[1].split()
    assert "127.0.0.1:7001" in out and header[:5] == ["WORKER", "ADDRESS", "MODEL", "SLOTS", "TP"]
    assert row[4] == "4"


def test_unreachable_registry_is_a_clear_error(capsys: pytest.CaptureFixture[str], monkeypatch) -> None:
    monkeypatch.setattr("loraserve.client.registry_client.RegistryClient.__init__.__defaults__", (2.0, None))
    code, _, err = _run(capsys, "adapters", "ls", "--registry", "127.0.0.1:1")
    assert code == 1 and "UNAVAILABLE" in err


def test_registry_migrate_and_gc(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    db = f"sqlite:///{tmp_path / 'm.db'}"
    code, out, _ = _run(capsys, "registry", "migrate", "--db", db)
    assert code == 0 and out.strip() == "database at revision 0005"
    store = tmp_path / "store"
    from loraserve.registry.storage import BlobStore

    orphan = BlobStore(str(store)).put_bytes(b"orphan bytes")
    code, out, _ = _run(capsys, "registry", "gc", "--db", db, "--storage", str(store))
    assert code == 0 and out.splitlines() == [
        "removed 0 unreferenced blob(s)"
    ]  # too young: maybe an upload in flight
    code, out, _ = _run(
        capsys, "registry", "gc", "--db", db, "--storage", str(store), "--min-age-seconds", "0"
    )
    assert code == 0 and out.splitlines() == ["removed 1 unreferenced blob(s)", f"  {orphan.sha256}"]
