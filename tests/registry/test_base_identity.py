"""Base-model identity: an adapter whose adapter_config.json names another base model is refused with
FAILED_PRECONDITION naming both, unless the model is known by that name (an admin's alias, or a worker's
report of its checkpoint's repo id) or the push allows the mismatch (recorded); a local path is accepted with
a warning. Also the CLI and the alias/history commands end to end."""

from __future__ import annotations

import json
import shutil

import pytest

from loraserve.cli import main
from loraserve.common.errors import LoraserveError
from loraserve.protos.v1 import placement_pb2 as pp
from loraserve.protos.v1 import placement_pb2_grpc
from loraserve.registry.base_models import MISMATCH_LABEL
from tests.registry.conftest import TINY_MODEL

INSTRUCT = "meta-llama/Llama-3.2-1B-Instruct"


def _declaring(src, dst, base: str | None):
    shutil.copytree(src, dst)
    config = json.loads((dst / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = base
    (dst / "adapter_config.json").write_text(json.dumps(config))
    return dst


def test_declared_base_must_be_a_name_of_the_model(reg, adapter_dirs, tmp_path) -> None:
    c = reg.client
    folder = _declaring(adapter_dirs["all-r4"], tmp_path / "instruct", INSTRUCT)
    with pytest.raises(LoraserveError) as err:
        c.push(folder, "bot", TINY_MODEL)
    assert err.value.code_name == "FAILED_PRECONDITION"
    assert INSTRUCT in err.value.message and TINY_MODEL in err.value.message
    assert reg.adapter_rows() == [] and reg.blobs() == []

    forced = c.push(folder, "bot", TINY_MODEL, allow_base_mismatch=True)
    assert forced.labels[MISMATCH_LABEL] == INSTRUCT and "allow-base-mismatch" in forced.warnings[0]
    assert c.get("bot@1").labels[MISMATCH_LABEL] == INSTRUCT  # recorded, not only told

    assert list(c.set_base_model_aliases(TINY_MODEL, add=[INSTRUCT]).aliases) == [INSTRUCT]
    clean = c.push(folder, "bot", TINY_MODEL)
    assert (clean.version, list(clean.warnings), MISMATCH_LABEL in clean.labels) == (2, [], False)

    local = c.push(_declaring(adapter_dirs["all-r4"], tmp_path / "local", "/home/me/ckpt"), "bot", TINY_MODEL)
    assert "local path" in local.warnings[0] and local.version == 3
    undeclared = c.push(_declaring(adapter_dirs["all-r4"], tmp_path / "none", None), "bot", TINY_MODEL)
    assert list(undeclared.warnings) == []
    assert list(c.set_base_model_aliases(TINY_MODEL, remove=[INSTRUCT]).aliases) == []
    with pytest.raises(LoraserveError) as err:
        c.push(folder, "bot", TINY_MODEL)
    assert err.value.code_name == "FAILED_PRECONDITION"


def test_workers_report_the_repo_id(reg, adapter_dirs, tmp_path) -> None:
    placement_pb2_grpc.PlacementStub(reg.channel).RegisterWorker(
        pp.RegisterWorkerRequest(
            address="127.0.0.1:7301", model_id="llama-1b", slots=2, model_aliases=[INSTRUCT]
        )
    )
    assert list(reg.client.base_model("llama-1b").aliases) == [INSTRUCT]
    folder = _declaring(adapter_dirs["all-r4"], tmp_path / "instruct", INSTRUCT)
    assert reg.client.push(folder, "bot", "llama-1b").version == 1
    with pytest.raises(LoraserveError) as err:
        reg.client.base_model("never-registered")
    assert err.value.code_name == "NOT_FOUND"


def _run(capsys, *argv) -> tuple[int, str, str]:
    code = main(list(argv))
    out, errout = capsys.readouterr()
    return code, out, errout


def test_cli_push_alias_history_and_base(reg, adapter_dirs, tmp_path, capsys) -> None:
    r = ("--registry", reg.address)
    folder = _declaring(adapter_dirs["all-r4"], tmp_path / "instruct", INSTRUCT)
    code, _, errout = _run(
        capsys, "adapters", "push", str(folder), "--name", "bot", "--base-model", TINY_MODEL, *r
    )
    assert code == 1 and "FAILED_PRECONDITION" in errout and INSTRUCT in errout
    code, out, errout = _run(
        capsys,
        "adapters",
        "push",
        str(folder),
        "--name",
        "bot",
        "--base-model",
        TINY_MODEL,
        "--allow-base-mismatch",
        "--alias",
        "prod",
        *r,
    )
    assert code == 0 and "pushed bot@1" in out and "bot@prod -> 1" in out and "warning:" in errout
    code, out, _ = _run(
        capsys,
        "adapters",
        "push",
        str(adapter_dirs["all-r4"]),
        "--name",
        "bot",
        "--base-model",
        TINY_MODEL,
        *r,
    )
    assert code == 0 and "pushed bot@2" in out
    code, out, _ = _run(capsys, "adapters", "alias", "bot", "prod", "1=90", "2=10", "--actor", "alice", *r)
    assert code == 0 and out.strip() == "bot@prod -> 1=90 2=10"
    code, out, _ = _run(capsys, "adapters", "ls", *r)
    assert code == 0 and "ALIASES" in out and out.count("prod") == 2  # both versions are in the split
    code, out, _ = _run(capsys, "adapters", "history", "bot", "--json", *r)
    history = json.loads(out)
    assert [(h["actor"], [t["version"] for t in h["after"]]) for h in history][-1] == ("alice", [1, 2])
    code, _, errout = _run(capsys, "adapters", "rm", "bot@2", *r)
    assert code == 1 and "FAILED_PRECONDITION" in errout and "bot@prod" in errout
    code, _, errout = _run(capsys, "adapters", "alias", "bot", "prod", "1=x", *r)
    assert code == 1 and "INVALID_ARGUMENT" in errout
    code, out, _ = _run(capsys, "adapters", "base", TINY_MODEL, "--alias", INSTRUCT, *r)
    assert code == 0 and INSTRUCT in out
