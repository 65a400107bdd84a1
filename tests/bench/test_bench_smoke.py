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
    assert set(result["decode_tok_s"]) == engines | {"hf_base", "peft_mixed", "distinct_dora", "distinct_mixes"}
    assert all(v > 0 for v in result["decode_tok_s"].values())
    ratios = {
        "distinct_dora_vs_base",
        "distinct_mixes_vs_base",
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


@pytest.mark.slow
def test_kv_bench_tiny_prints_its_json_last() -> None:
    result = _last_json(["bench/kv.py", "--tiny"])
    assert result["bench"] == "kv"
    cap = result["capacity"]
    # tiny capacity model: 2 layers x 2 KV heads x head_dim 16, f32, keys and values -> 512 B a token;
    # the default budget is 2 contexts of 512 tokens, i.e. 64 pages of 16 tokens, one the null page
    assert cap["bytes_per_token"] == 512
    assert cap["budget_bytes"] == 2 * 512 * 512
    assert cap["dense_rows"] == 2
    assert cap["kv_pages"] == 63
    assert 1 <= cap["peak_running"] < cap["max_batch_size"]  # the pages, not the rows, were the limit
    assert cap["steps_saturated"] > 0 and 0 < cap["kv_utilisation_saturated"] <= 1
    # 8 prompts: one 64-token prefix (4 pages) + 8 distinct tokens; the first computes all 72 tokens,
    # each other one only its suffix
    pre = result["prefix_cache"]
    assert pre["tokens_identical"] is True
    assert pre["computed_off"] == 8 * 72
    assert pre["computed_on"] == 72 + 7 * 8
    assert pre["hit_tokens"] == 7 * 64 and pre["query_tokens"] == 8 * 72
    assert set(result["prefill_tok_s"]) == {"base", "distinct_adapters"}
    assert all(v > 0 for v in result["prefill_tok_s"].values())
    ratios = result["ratios"]
    assert ratios["capacity_peak_vs_dense"] == round(cap["peak_running"] / 2, 2)
    assert ratios["prefix_computed_on_vs_off"] == round(128 / 576, 4)
    assert {
        "capacity_mean_vs_dense",
        "prefix_prefill_time_on_vs_off",
        "prefill_distinct_adapters_vs_base",
        "prefill_base_vs_matmul_peak",
        "prefill_distinct_adapters_vs_matmul_peak",
    } <= set(ratios)
    assert all(v > 0 for v in ratios.values())
