"""The accelerator scripts at tiny shapes on this CPU: ``bench/device.sh`` (a GPU machine's set) and
``bench/tpu_session.sh`` (a TPU VM's), each running the bench scripts and merging their JSON. A file of their own
so that the test processes share the slow smoke runs (``--dist loadfile`` keeps a file in one process)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata

import pytest

from tests.bench.test_bench_smoke import ROOT, SMOKE_ENV

DEVICE_SH = ROOT / "bench" / "device.sh"


def test_device_script_parses_and_reaches_no_network() -> None:
    """bench/device.sh is valid bash and fetches or installs nothing (an accelerator machine has no network)."""
    subprocess.run(["bash", "-n", str(DEVICE_SH)], check=True)
    text = DEVICE_SH.read_text()
    assert re.findall(r"\b(?:pip3?|curl|wget|apt-get|conda)\b|https?://|git clone", text) == []
    assert text.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in text


@pytest.mark.slow
def test_device_script_tiny_writes_every_step_and_a_summary(tmp_path) -> None:
    """`bash bench/device.sh --tiny`: every step's log and JSON, decode per batch, a summary with positive
    decode rates and ratios for both batches, no step in error, the summary printed last, no scratch left."""
    out = tmp_path / "out"
    env = {**SMOKE_ENV, "OUT": str(out), "PYTHON": sys.executable, "TMPDIR": str(tmp_path)}
    env["JAX_CACHE"] = str(tmp_path / "jax-cache")
    env.pop("WORK", None)
    proc = subprocess.run(
        ["bash", str(DEVICE_SH), "--tiny"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = ("device", "protos", "build", "decode", "kernels")
    for name in (*steps, "decode_b8", "decode_b4", "summary"):
        assert (out / f"{name}.json").is_file(), name
    for name in steps:
        assert (out / f"{name}.log").is_file(), name
        assert "error" not in json.loads((out / f"{name}.json").read_text()), name
    summary = json.loads((out / "summary.json").read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == summary
    assert {"bench", "shape", "dtype", "batches", "device", "versions", "errors", "decode_tok_s", "step_ms",
            "ratios", "target", "kernels", "seconds", "results"} <= set(summary)  # fmt: skip
    assert summary["shape"] == "tiny" and summary["dtype"] == "bfloat16" and summary["batches"] == [8, 4]
    assert summary["errors"] == {} and summary["device"]["backend"] == "cpu"
    rows = {"base", "one_adapter", "distinct_adapters", "hf_base", "peft_mixed"}
    for batch in (8, 4):
        rates = summary["decode_tok_s"][f"b{batch}"]
        assert set(rates) == rows and all(v > 0 for v in rates.values()), rates
        for ratio in ("distinct_adapters_vs_peft_mixed", "base_vs_transformers", "distinct_adapters_vs_base"):
            assert summary["ratios"][f"{ratio}_b{batch}"] > 0
        decode = json.loads((out / f"decode_b{batch}.json").read_text())
        assert decode["workload"]["batch"] == decode["workload"]["adapters"] == batch
        assert decode["dtype"] == "bfloat16" and "partial" not in decode
    assert summary["target"]["got"] == summary["ratios"]["distinct_adapters_vs_peft_mixed_b8"]
    assert summary["target"]["met"] is None  # judged on the 8B shape only
    assert summary["kernels"]["config"]["dtype"] == "bfloat16"
    assert summary["results"]["build"]["adapters"] == 8
    assert not list(tmp_path.glob("loraserve-device.*"))  # its scratch folder is gone


TPU_SESSION = ROOT / "bench" / "tpu_session.sh"


@pytest.mark.slow
def test_tpu_session_bench_tiny_merges_every_sub_step_into_one_json(tmp_path) -> None:
    """`TPU_BENCH_TINY=1 bash bench/tpu_session.sh bench` on this CPU, one LoRA engine and two kernel backends
    to stay short (every backend's scan row: test_bench_smoke): the kernels scan (Pallas interpreted), the
    decode engine's rows, the int8 base's and speculative decoding's, each sub-step's log, and one merged
    tpu-bench.json (versions, device, a row per batch and backend) printed as the last line."""

    out = tmp_path / "out"
    env = {**SMOKE_ENV, "OUT": str(out), "PYTHON": sys.executable, "TPU_BENCH_TINY": "1",
           "TPU_BENCH_ENGINES": "xla_grouped", "TPU_BENCH_ROUNDS": "1", "TPU_BENCH_WORK": str(tmp_path / "work"),
           "TPU_BENCH_KERNEL_BACKENDS": "reference pallas", "TPU_BENCH_STEPS": "kernels decode quant speculative"}  # fmt: skip
    proc = subprocess.run(
        ["bash", str(TPU_SESSION), "bench"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    merged = json.loads((out / "tpu-bench.json").read_text())
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == merged
    assert merged["bench"] == "tpu" and merged["errors"] == {}, merged["errors"]
    assert merged["jax"] == metadata.version("jax") and merged["device_kind"] == "cpu"
    assert merged["command"] == "bash bench/tpu_session.sh bench" and merged["env"]["TPU_BENCH_TINY"] == "1"
    assert list(merged["steps"]) == ["kernels-tiny", "decode", "quant", "speculative"]
    for name, step in merged["steps"].items():
        assert step["rc"] == 0 and step["compiles"]["count"] > 0, name
        assert (out / f"bench-{name}.log").read_text().startswith(f"$ {sys.executable} "), name
    rows = merged["rows"]
    kernels = [(r["batch"], r["backend"]) for r in rows if r["bench"] == "kernels_scan"]
    assert kernels == [(4, n) for n in ("dense", "reference", "pallas")]
    assert all(r["hbm_fraction"] >= 0 and r["shape"] == "tiny" for r in rows if r["bench"] == "kernels_scan")
    (decode,) = [r for r in rows if r["bench"] == "decode"]
    assert (decode["backend"], decode["batch"], decode["adapters"]) == ("xla-grouped", 4, 4)
    assert not decode["partial"]
    for key in ("base_step_ms", "distinct_step_ms", "distinct_vs_base", "base_hbm_fraction"):
        assert decode[key] > 0, key
    assert decode["distinct_hbm_fraction"] > 0 and decode["one_adapter_vs_base"] > 0
    (quant,) = [r for r in rows if r["bench"] == "decode_quant"]
    assert (quant["quantization"], quant["batch"]) == ("int8", 4)
    assert quant["bf16_base_step_ms"] == decode["base_step_ms"] and quant["speedup_vs_bf16"] > 0
    bf16_bytes = merged["results"]["decode"][0]["bytes"]["base"]
    assert quant["base_hbm_fraction"] > 0 and 0 < quant["base_bytes"] < bf16_bytes
    spec = [r for r in rows if r["bench"] == "speculative"]
    assert [(r["batch"], r["workload"]) for r in spec] == [(2, w) for w in ("predicted", "edited", "ngram")]
    assert all(r["shape"] == "tiny" and r["speedup"] > 0 and 0 <= r["identical_rows"] <= 1 for r in spec)
    assert merged["results"]["speculative"]["config"]["dtype"] == "bfloat16"


def test_tpu_bench_merge_keeps_what_a_cut_run_finished(tmp_path) -> None:
    """bench/tpu_bench.py: a decode sub-step stopped between engines gives the rows of its last partial line and
    the engines that failed in it, a step that was not run is an error, and nothing there needs JAX's device."""
    line = {"bench": "decode", "workload": {"batch": 16, "adapters": 16}, "shape": "3b", "dtype": "bfloat16",
            "step_ms": {"base_xla": 10.0, "one_adapter_xla": 11.0, "distinct_adapters_xla": 12.5},
            "bytes": {"base": 8.19e9, "adapters": 0}, "ratios": {}, "platform": {"jax": "tpu: TPU v5 lite x1"},
            "errors": {"pallas": "Mosaic failed"}}  # fmt: skip
    (tmp_path / "bench-decode.log").write_text(
        "$ python3 bench/decode.py\nbuilding\n" + json.dumps({**line, "partial": True}) + "\nTraceback\n"
    )
    (tmp_path / "bench-quant.log").write_text("$ python3 bench/decode.py\nnot run: 12 s left\n")
    out = subprocess.run(
        [sys.executable, "bench/tpu_bench.py", str(tmp_path), "decode:124:300:315", "quant:200:12:0", "--command", "x"],
        cwd=ROOT, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    merged = json.loads(out.stdout.strip().splitlines()[-1])
    assert merged == json.loads((tmp_path / "tpu-bench.json").read_text())
    assert merged["errors"] == {
        "decode": "timed out",
        "decode pallas batch 16": "Mosaic failed",
        "quant": "not run: no time left",
    }
    assert (merged["device_kind"], merged["backend"]) == ("TPU v5 lite", "tpu")
    assert merged["steps"]["decode"]["command"] == "python3 bench/decode.py"
    row, failed = merged["rows"]
    assert failed == {"bench": "decode", "batch": 16, "backend": "pallas", "error": "Mosaic failed"}
    assert (row["backend"], row["partial"], row["distinct_vs_base"]) == ("xla-grouped", True, 0.8)
    assert row["base_hbm_fraction"] == 1.0  # 8.19 GB in 10 ms at 819 GB/s
