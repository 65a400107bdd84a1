"""The benchmarks run and end with one JSON object (tiny workloads; speed is never asserted here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TEST_XLA_FLAGS

ROOT = Path(__file__).resolve().parents[2]
# The smoke runs are compile-bound (tiny models, every engine warming up its buckets) and their numbers are
# not what these tests check: XLA:CPU at backend optimisation level 0, as in the in-process tests
# (tests/conftest.py), for the benchmarks and every server they start (decode --tiny: 80 -> 55 s alone).
SMOKE_ENV = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS}".strip()}


def _last_json(args: list[str]) -> dict:
    out = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=SMOKE_ENV,
        capture_output=True,
        text=True,
        timeout=480,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_speculative_bench_copy_serves_plain_decoding_s_tokens(tmp_path) -> None:
    """bench/speculative.py --shape copy (its model trained only briefly here: 40 steps): plain and speculative
    engines on the predicted, edited and n-gram workloads; the bench itself fails when a speculative row's
    tokens differ from plain decoding's (float32). The tiny shape's run: test_device_scripts."""
    result = _last_json(
        ["bench/speculative.py", "--shape", "copy", "--copy-steps", "40", "--batch", "1", "--rounds", "1",
         "--new", "32", "--lazy-compile", "--workdir", str(tmp_path)]
    )  # fmt: skip
    assert result["bench"] == "speculative" and result["config"]["k"] == 4
    assert result["config"]["copy_steps"] == 40 and result["config"]["repeat_loss"] > 0
    assert [(r["batch"], r["workload"]) for r in result["rows"]] == [
        (1, w) for w in ("predicted", "edited", "ngram")
    ]
    for row in result["rows"]:
        assert row["plain_tok_s"] > 0 and row["speculative_tok_s"] > 0 and row["speedup"] > 0, row
        assert row["verify_steps"] <= row["steps"] and row["identical_rows"] == 1.0, row
    assert json.loads((tmp_path / "built.json").read_text())["adapters"] == 1


@pytest.mark.slow
def test_decode_bench_tiny_prints_its_json_last() -> None:
    # --lazy-compile: each engine compiles the shapes its rows run, not every bucket (55 -> 33 s alone;
    # the warm-up path itself is tests/worker's)
    result = _last_json(
        ["bench/decode.py", "--tiny", "--rounds", "1", "--lazy-compile", "--quantization", "int8_head"]
    )
    assert result["bench"] == "decode"
    engines = {
        f"{mix}{suffix}"
        for mix in ("base", "one_adapter", "distinct_adapters")
        for suffix in ("", "_bf16_pools", "_xla")
    }
    assert set(result["decode_tok_s"]) == engines | {
        "hf_base",
        "peft_mixed",
        "distinct_dora",
        "distinct_mixes",
        "distinct_dora_bf16_pools",
        "distinct_mixes_bf16_pools",
        "distinct_adapters_json",
        "base_int8_head",
        "one_adapter_int8_head",
        "distinct_adapters_int8_head",
    }
    assert all(v > 0 for v in result["decode_tok_s"].values())
    ratios = {
        "distinct_dora_vs_base",
        "distinct_mixes_vs_base",
        "distinct_dora_bf16_pools_vs_base",
        "distinct_mixes_bf16_pools_vs_base",
        "distinct_adapters_vs_base",
        "distinct_adapters_vs_peft_mixed",
        "base_vs_transformers",
        "cold_vs_warm_ttft",
        "distinct_adapters_vs_base_serial_bound",
        "distinct_adapters_bf16_pools_vs_base",
        "distinct_adapters_bf16_pools_vs_base_serial_bound",
        "distinct_adapters_xla_vs_base",
        "distinct_adapters_bf16_pools_vs_peft_mixed",
        "distinct_adapters_json_vs_distinct_adapters",
        "base_int8_head_vs_base",
        "distinct_adapters_int8_head_vs_base_int8_head",
        "distinct_adapters_int8_head_vs_base_int8_head_serial_bound",
    }
    assert ratios <= set(result["ratios"])
    # base / (base + pool read time): below 1, but the tiny model's pools read in microseconds, so the
    # ratio rounded to 3 digits can be 1.0 when the base step is slow (CI: once in a run)
    assert 0 < result["ratios"]["distinct_adapters_vs_base_serial_bound"] <= 1
    assert 0 < result["ratios"]["distinct_adapters_bf16_pools_vs_base_serial_bound"] <= 1
    assert 0 < result["ratios"]["distinct_adapters_int8_head_vs_base_int8_head_serial_bound"] <= 1
    assert result["ttft_ms"]["cold"] > 0 and result["ttft_ms"]["warm"] > 0
    # a base step's bytes (int8 projections and head here) at the measured read rate ÷ its time
    assert result["base_roofline_fraction"] > 0 and result["base_int8_head_roofline_fraction"] > 0


@pytest.mark.slow
def test_kernels_bench_prints_its_json_last() -> None:
    # --shape tiny: a 128-square projection and fewer timed runs, as the docstring of bench/kernels.py says
    # the smoke test runs (the default 1024-square bench shape: 24 -> 6 s alone)
    result = _last_json(["bench/kernels.py", "--shape", "tiny"])
    assert result["bench"] == "kernels"
    kinds = {row["kind"] for row in result["rows"]}
    assert kinds == {"decode", "prefill"}
    assert all(row["dense_ms"] > 0 and row["xla_ms"] > 0 for row in result["rows"])
    assert all(row["grouped_ms"] > 0 for row in result["rows"] if row["kind"] == "decode")
    assert all(row["cpu_ms"] > 0 and row["cpu_bf16_ms"] > 0 for row in result["rows"])  # g++ is here


@pytest.mark.slow
def test_kernels_scan_bench_times_every_backend_against_the_reference(tmp_path) -> None:
    """``--scan``: per batch a ``dense`` row and one row per backend (Pallas interpreted at this tiny shape),
    each computing what the reference backend computes through the layers, with its ratios. With
    ``--profile`` every row's trace is summed per op by bench/trace_summary.py (here the CPU's client threads
    stand in for a device's lanes)."""
    result = _last_json(
        ["bench/kernels.py", "--scan", "--shape", "tiny", "--batch", "4", "--profile", str(tmp_path / "prof")]
    )
    assert result["bench"] == "kernels_scan"
    assert result["config"] == {
        "in": 128,
        "out": 256,
        "layers": 2,
        "rank": 16,
        "dtype": "float32",
        "layout": "unrolled",
    }
    names = [
        "dense",
        "reference",
        "xla-onehot",
        "xla-grouped",
        "pallas",
        "pallas-vpu",
        "pallas-d256",
        "pallas-d512",
        "pallas-tiled",
        "cpu",
    ]  # g++ is here
    assert [(r["batch"], r["backend"]) for r in result["rows"]] == [(4, n) for n in names]
    for row in result["rows"]:
        assert row["ms"] > 0 and row["gbps"] > 0, row
        if row["backend"] != "dense":
            assert row["adapters"] == row["batch"] and row["max_abs_diff"] < 1e-4, row
            assert 0 < row["serial_bound"] < 1 and row["over_dense"] > 0, row
    summary = _last_json(["bench/trace_summary.py", str(tmp_path / "prof"), "--top", "3"])
    labels = [r["label"] for r in summary["rows"]]
    assert sorted(labels) == sorted(f"scan {n} B4" for n in names), labels
    for row in summary["rows"]:
        assert row["calls"] == 3 and row["module_us"] > 0 and row["busy_us"] > 0 and row["ops"], row
    # the lax.scan over stacked layers, two backends: the same numbers to compare
    stacked = _last_json(
        [
            "bench/kernels.py",
            "--scan",
            "--shape",
            "tiny",
            "--batch",
            "4",
            "--stacked",
            "--backends",
            "reference,pallas",
        ]
    )
    assert stacked["config"]["layout"] == "stacked"
    assert [r["backend"] for r in stacked["rows"]] == ["dense", "reference", "pallas"]
    assert stacked["rows"][2]["max_abs_diff"] < 1e-4


@pytest.mark.slow
def test_kernels_bench_quant_prints_its_json_last() -> None:
    """``--quant``: the base-weight kernels at 1 and 16 rows, each precision's time, rate and speed-up, and which
    paths this CPU takes (the int8 fixed-point rows are what ``kernels.cpu`` reports here)."""
    from loraserve.kernels import cpu

    result = _last_json(["bench/kernels.py", "--quant", "--shape", "tiny"])
    assert result["bench"] == "kernels_quant"
    config = result["config"]
    assert (config["N"], config["K"], config["group"]) == (128, 128, 128)
    assert config["int8_fixed_rows"] == cpu.quant_fixed_rows(128) and config["amx"] == cpu.amx()
    assert config["weight_bytes"] == {
        "bf16": 128 * 128 * 2,
        "int8": 128 * 128 + 128 * 4,
        "int4": 128 * 64 + 128 * 4,
    }
    assert [row["M"] for row in result["rows"]] == [1, 16]
    for row in result["rows"]:
        assert all(row[f"{n}_ms"] > 0 and row[f"{n}_gb_s"] > 0 for n in ("bf16", "int8", "int4"))
        # the ms are rounded to 0.1 us: at this tiny shape that moves the ratio by up to ~1 %
        assert row["speedup_int8"] == pytest.approx(row["bf16_ms"] / row["int8_ms"], rel=2e-2)


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


def _processes_mentioning(text: str) -> list[str]:
    """Command lines of running processes that contain ``text`` (read from /proc)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in args and "pytest" not in args:
            found.append(args)
    return found


@pytest.fixture(scope="module")
def serve_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The --workdir of both serve.py runs: the second reuses the model and adapters the first built and the
    programs its workers compiled (serve.py keeps their compilation cache there)."""
    return tmp_path_factory.mktemp("serve") / "work"


@pytest.mark.slow
def test_serve_bench_tiny_replays_one_trace_through_every_system(tmp_path, serve_workdir) -> None:
    """One rate, every system (the stack, max_loras=1, no prefix cache, no fair sharing of slots, the peft
    loop): a JSON line per system with every request served, the summary last (with the rarest decile's p99
    TTFT with and without fair sharing), the plot written, and no process left behind."""
    work, png = serve_workdir, tmp_path / "serve.png"
    out = subprocess.run(
        [sys.executable, "bench/serve.py", "--tiny", "--rates", "4", "--workdir", str(work), "--plot", str(png)],
        cwd=ROOT, env=SMOKE_ENV, capture_output=True, text=True, timeout=480, check=True,
    )  # fmt: skip
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    rows, summary = lines[:-1], lines[-1]
    systems = ["loraserve", "max_loras_1", "no_prefix_cache", "no_fair_slots", "peft"]
    assert [r["system"] for r in rows] == systems
    n = rows[0]["requests"]
    assert n > 0 and all(
        r["requests"] == n and r["errors"] == 0 and r["rate"] == 4.0 for r in rows
    )  # one trace
    for r in rows:
        assert (
            r["ttft_s"]["p50"] <= r["ttft_s"]["p99"]
            and r["throughput_tok_s"] > 0
            and 0 <= r["slo_attainment"] <= 1
        )
    assert rows[0]["adapter_loads"] > 0 and rows[1]["adapter_loads"] >= rows[0]["adapter_loads"]
    assert summary["bench"] == "serve" and summary["errors"] == 0 and summary["requests"] == 5 * n
    assert set(summary["max_rate_meeting_slo"]) == set(systems)
    assert set(summary["ratios"]) == {f"loraserve_vs_{s}" for s in systems[1:]}
    rare = rows[0]["rare_ttft_s"]  # the rarest decile of the 6 tiny adapters: the last one's requests
    assert rare["requests"] > 0 and rare["p50"] <= rare["p99"]
    assert summary["rare_decile_p99_ttft_s"] == {
        "4.0": {"fair": rare["p99"], "no_fair_slots": rows[3]["rare_ttft_s"]["p99"]}
    }
    peak = summary["peak_throughput_tok_s"]
    assert peak == {r["system"]: r["throughput_tok_s"] for r in rows}  # one rate: its throughput
    assert summary["peak_throughput_ratios"]["loraserve_vs_peft"] == round(
        peak["loraserve"] / peak["peft"], 2
    )
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _processes_mentioning(str(work)) == []
    assert not list(work.glob("stack-*"))  # each stack's database, store and caches went with it


def _children(pid: int) -> set[int]:
    """Process ids whose parent is ``pid`` (from /proc/*/stat)."""
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == pid:
            out.add(int(stat.parent.name))
    return out


@pytest.mark.slow
def test_serve_bench_leaves_no_process_behind_on_ctrl_c(serve_workdir) -> None:
    """Ctrl-C while a rate is being driven: the registry, worker and router processes it started are gone."""
    import signal
    import time

    proc = subprocess.Popen(
        [sys.executable, "bench/serve.py", "--tiny", "--systems", "loraserve", "--rates", "1", "--duration", "60",
         "--workdir", str(serve_workdir), "--plot", ""],
        cwd=ROOT, env=SMOKE_ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while len(_children(proc.pid)) < 3 and time.monotonic() < deadline:
        time.sleep(0.2)  # registry, worker and router started
    servers = _children(proc.pid)
    assert len(servers) == 3, servers
    time.sleep(5)  # ... and serving the trace
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() for pid in servers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert [pid for pid in servers if Path(f"/proc/{pid}").exists()] == []
