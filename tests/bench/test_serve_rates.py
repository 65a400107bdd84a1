"""bench/serve.py's choice of rates: the sweep stops at saturation, and a system that misses the SLO at the
lowest swept rate is probed at halvings below it until it meets the SLO or reaches --min-rate."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import serve

ARGS = argparse.Namespace(slo_ttft=2.0, saturated=5.0, min_rate=1 / 16, min_requests=30, duration=40.0)


def _run(rates: list[float], p99_at) -> list[float]:
    """The rates ``_rates_to_run`` asks for when a system's p99 TTFT at rate r is ``p99_at(r)``."""
    rows: list[dict] = []
    for rate in serve._rates_to_run(rates, rows, ARGS):
        rows.append({"rate": rate, "errors": 0, "ttft_s": {"p99": p99_at(rate)}})
    return [r["rate"] for r in rows]


def test_a_system_meeting_the_slo_runs_the_sweep_until_it_saturates() -> None:
    assert _run([0.25, 0.5, 1, 2], lambda r: 0.5) == [0.25, 0.5, 1, 2]
    assert _run([0.25, 0.5, 1, 2], lambda r: 0.5 if r < 1 else 30.0) == [0.25, 0.5, 1]  # 30 s > 5 x 2 s


def test_a_system_missing_the_slo_at_the_lowest_rate_is_probed_below_it() -> None:
    # meets it at 0.0625 (1/16): the halvings stop there
    assert _run([0.25, 0.5], lambda r: 1.0 if r <= 1 / 16 else 20.0) == [0.25, 0.125, 0.0625]
    # meets it nowhere: down to --min-rate and no further
    assert _run([0.25, 0.5], lambda r: 20.0) == [0.25, 0.125, 0.0625]
    # missed at 0.25 without saturating: the sweep goes on, then the probes start below 0.25
    assert _run([0.25, 0.5], lambda r: 3.0 if r >= 0.25 else 1.0) == [0.25, 0.5, 0.125]


def test_probes_are_off_with_min_rate_zero() -> None:
    args = argparse.Namespace(**{**vars(ARGS), "min_rate": 0})
    rows: list[dict] = []
    for rate in serve._rates_to_run([0.25], rows, args):
        rows.append({"rate": rate, "errors": 0, "ttft_s": {"p99": 20.0}})
    assert [r["rate"] for r in rows] == [0.25]


def test_a_low_rate_trace_lasts_long_enough_for_min_requests() -> None:
    assert serve._duration(0.125, ARGS, serve.FULL) == 240.0  # 30 requests at 0.125/s
    assert serve._duration(2.0, ARGS, serve.FULL) == 40.0  # --duration already gives 80
    tiny = argparse.Namespace(**{**vars(ARGS), "min_requests": None, "duration": None})
    assert serve._duration(0.5, tiny, serve.TINY) == serve.TINY["duration"]  # --tiny: no stretching


def test_a_sweep_over_adapters_or_alpha_replays_the_same_requests() -> None:
    def requests(n: int, alpha: float) -> list[tuple]:
        return [(a.at, a.prompt, a.max_tokens) for a in serve.make_trace(0, 1.0, 60, n, alpha, serve.FULL)]

    same = requests(10, 1.0)
    assert len(same) > 30 and same == requests(1000, 1.0) == requests(100, 0.5)
    picks = [a.adapter for a in serve.make_trace(0, 1.0, 60, 1000, 1.0, serve.FULL)]
    assert max(picks) < 1000 and len(set(picks)) > 10  # Zipf over all 1000, not the first few
    assert serve.make_trace(0, 1.0, 60, 1000, 1.0, serve.FULL) == serve.make_trace(
        0, 1.0, 60, 1000, 1.0, serve.FULL
    )
