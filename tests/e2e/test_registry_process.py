"""``loraserve registry serve`` as a real process: health, reflection, CLI push/ls, clean shutdown."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.e2e.procs import loraserve_process, wait_healthy

pytestmark = pytest.mark.e2e


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "loraserve", *args], capture_output=True, text=True, timeout=120
    )


def test_registry_process_serves_and_shuts_down(tmp_path, adapter_dirs) -> None:
    env = {
        "LORASERVE_REGISTRY_DB": f"sqlite:///{tmp_path / 'reg.db'}",
        "LORASERVE_REGISTRY_STORAGE": str(tmp_path / "store"),
    }
    with loraserve_process(["registry", "serve", "--port", "0"], env=env) as proc:
        wait_healthy(proc.address)
        with grpc.insecure_channel(proc.address) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            resp = next(
                stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            )
            names = {s.name for s in resp.list_services_response.service}
        assert {"loraserve.v1.AdapterRegistry", "loraserve.v1.Placement", "grpc.health.v1.Health"} <= names
        pushed = _cli(
            "adapters",
            "push",
            str(adapter_dirs["all-r4"]),
            "--name",
            "proc-a",
            "--base-model",
            "m",
            "--registry",
            proc.address,
            "--json",
        )
        assert pushed.returncode == 0, pushed.stderr
        assert json.loads(pushed.stdout)["version"] == 1
        listed = _cli("adapters", "ls", "--registry", proc.address, "--json")
        assert [a["name"] for a in json.loads(listed.stdout)] == ["proc-a"]
        assert proc.stop() == 0  # SIGTERM: drains and exits cleanly
    assert (tmp_path / "reg.db").exists() and any((tmp_path / "store").rglob("*"))
