"""The benchmarks run and end with one JSON object (tiny workloads; speed is never asserted here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _last_json(args: list[str]) -> dict:
    out = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=600, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_decode_bench_tiny_prints_its_json_last() -> None:
    result = _last_json(["bench/decode.py", "--tiny", "--rounds", "1"])
    assert result["bench"] == "decode"
    engines = {
        f"{mix}{suffix}"
        for mix in ("base", "one_adapter", "distinct_adapters")
        for suffix in ("", "_bf16_pools", "_xla")
    }
    assert set(result["decode_tok_s"]) == engines | {"hf_base", "peft_mixed"}
    assert all(v > 0 for v in result["decode_tok_s"].values())
    ratios = {
        "distinct_adapters_vs_base",
        "distinct_adapters_vs_peft_mixed",
        "base_vs_transformers",
        "cold_vs_warm_ttft",
        "distinct_adapters_vs_base_serial_bound",
        "distinct_adapters_bf16_pools_vs_base",
        "distinct_adapters_bf16_pools_vs_base_serial_bound",
        "distinct_adapters_xla_vs_base",
        "distinct_adapters_bf16_pools_vs_peft_mixed",
    }
    assert ratios <= set(result["ratios"])
    assert 0 < result["ratios"]["distinct_adapters_vs_base_serial_bound"] < 1
    assert 0 < result["ratios"]["distinct_adapters_bf16_pools_vs_base_serial_bound"] < 1
    assert result["ttft_ms"]["cold"] > 0 and result["ttft_ms"]["warm"] > 0


@pytest.mark.slow
def test_kernels_bench_prints_its_json_last() -> None:
    result = _last_json(["bench/kernels.py"])
    assert result["bench"] == "kernels"
    kinds = {row["kind"] for row in result["rows"]}
    assert kinds == {"decode", "prefill"}
    assert all(row["dense_ms"] > 0 and row["xla_ms"] > 0 for row in result["rows"])
    assert all(row["grouped_ms"] > 0 for row in result["rows"] if row["kind"] == "decode")
    assert all(row["cpu_ms"] > 0 and row["cpu_bf16_ms"] > 0 for row in result["rows"])  # g++ is here
