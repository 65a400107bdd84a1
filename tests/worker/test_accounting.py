"""Per-adapter accounting (#17 item 5): exact totals for heartbeats, bounded Prometheus series, counters that
never go down, load latency by source; and the engine feeding it from real loads (host tier vs local folder).

The registry-side view (heartbeats summed, ``loraserve adapters stats``) is tested through a real worker in
tests/router/test_router.py.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from loraserve.common.observability import LATENCY_BUCKETS
from loraserve.engine.accounting import AccountingCollector, AdapterAccounting
from loraserve.engine.config import EngineConfig
from tests.worker.fake_engine import Harness, source_of


def scrape(accounting: AdapterAccounting) -> dict[tuple[str, tuple], float]:
    """``(sample name, sorted labels) -> value`` of the collector's text exposition."""
    registry = CollectorRegistry()
    registry.register(AccountingCollector(accounting))
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_totals_are_exact_per_adapter() -> None:
    acc = AdapterAccounting(top_n=2)
    acc.request_done("a@1", 5, 7)
    acc.request_done("a@1", 3, 1)
    acc.request_done("", 2, 2)
    acc.loaded("a@1", 0.25, "store", 1000)
    acc.loaded("b@2", 0.01, "host", 0)
    totals = acc.totals()
    assert set(totals) == {"a@1", "base", "b@2"}
    a = totals["a@1"]
    assert (a.requests, a.prompt_tokens, a.completion_tokens, a.loads, a.fetched_bytes) == (2, 8, 8, 1, 1000)
    assert (totals["base"].requests, totals["base"].completion_tokens) == (1, 2)
    assert (totals["b@2"].loads, totals["b@2"].fetched_bytes, totals["b@2"].requests) == (1, 0, 0)
    totals["a@1"].requests = 99  # a copy: the accounting is not changed through it
    assert acc.totals()["a@1"].requests == 2


def test_series_are_bounded_and_never_go_down() -> None:
    acc = AdapterAccounting(top_n=2)
    for name in ("a@1", "b@1", "c@1", "d@1"):  # the first two get series of their own
        acc.request_done(name, 1, 1)
    first = scrape(acc)
    requests = {
        dict(k[1])["adapter"]: v for k, v in first.items() if k[0] == "loraserve_adapter_requests_total"
    }
    assert requests == {"a@1": 1.0, "b@1": 1.0, "other": 2.0}
    acc.request_done("c@1", 1, 4)  # still "other": room never reopens
    acc.request_done("a@1", 10, 0)
    second = scrape(acc)
    assert all(second[k] >= v for k, v in first.items() if k in second), "a counter went down"
    key = ("loraserve_adapter_prompt_tokens_total", (("adapter", "other"),))
    assert second[key] == 3.0
    assert second[("loraserve_adapter_prompt_tokens_total", (("adapter", "a@1"),))] == 11.0
    adapters = {dict(k[1]).get("adapter") for k in second}
    assert adapters == {"a@1", "b@1", "other"}  # bounded: top_n + 1 label values


def test_load_latency_histogram_by_source() -> None:
    acc = AdapterAccounting(top_n=4)
    acc.loaded("a@1", 0.003, "host", 0)
    acc.loaded("a@1", 0.7, "store", 2048)
    acc.loaded("a@1", 100.0, "store", 2048)  # beyond the last bucket: only +Inf
    got = scrape(acc)

    def bucket(source: str, le: str) -> float:
        labels = (("adapter", "a@1"), ("le", le), ("source", source))
        return got[("loraserve_adapter_load_seconds_by_source_bucket", labels)]

    assert bucket("host", "+Inf") == 1.0 and bucket("store", "+Inf") == 2.0
    smallest = str(min(b for b in LATENCY_BUCKETS if b >= 0.7))
    assert bucket("store", smallest) == 1.0 and bucket("host", smallest) == 1.0
    store_sum = got[
        ("loraserve_adapter_load_seconds_by_source_sum", (("adapter", "a@1"), ("source", "store")))
    ]
    assert abs(store_sum - 100.7) < 1e-9
    assert got[("loraserve_adapter_fetched_bytes_total", (("adapter", "a@1"),))] == 4096.0
    counts = [v for k, v in got.items() if k[0] == "loraserve_adapter_load_seconds_by_source_count"]
    assert sorted(counts) == [1.0, 2.0]  # loads per adapter and source
    assert not [k for k in got if k[0] == "loraserve_adapter_loads_total"]  # the engine's unlabelled total


def test_residency_records_each_load_with_its_source() -> None:
    """Two adapters through one slot without a host tier, then with one: the first loads come from the
    source ("local"), a re-load after eviction from the host tier ("host"), each with its seconds."""
    for host_slots, second_origin in ((0, "local"), (2, "host")):
        h = Harness(
            EngineConfig(max_batch_size=2, max_loras=1, max_cpu_loras=host_slots), source_of("a", "b")
        )
        acc = AdapterAccounting()
        loads: list[tuple[str, str, int]] = []

        def record(key, seconds, origin, fetched, acc=acc, loads=loads):
            assert seconds >= 0
            loads.append((key, origin, fetched))
            acc.loaded(key, seconds, origin, fetched)

        h.residency.load_recorder = record
        for name in ("a", "b", "a"):
            h.run(h.submit(name, max_tokens=2))
        assert loads == [("a", "local", 0), ("b", "local", 0), ("a", second_origin, 0)]
        assert acc.totals()["a"].loads == 2 and sorted(acc.totals()["a"].load_buckets) == sorted(
            {"local", second_origin}
        )


def test_heartbeats_take_the_changed_totals_in_bounded_batches() -> None:
    """What ``Registration`` sends: the totals of adapters that changed since they were last taken, oldest
    change first, at most ``limit`` at a time; given back after a failed heartbeat; all of them again after
    a new registration. A steady worker's heartbeat carries none."""
    acct = AdapterAccounting()
    for i in range(1200):
        acct.request_done(f"a-{i}@1", 3, 4)
    acct.request_done("a-0@1", 1, 1)  # a-0 changed again: still one entry, its place kept
    first = acct.take_changed(512)
    assert list(first) == [f"a-{i}@1" for i in range(512)]
    assert (first["a-0@1"].requests, first["a-0@1"].prompt_tokens) == (2, 4)
    assert len(acct.take_changed(512)) == 512 and len(acct.take_changed(512)) == 176
    assert acct.take_changed(512) == {}  # nothing changed since: an empty report
    acct.request_done("a-7@1", 1, 1)
    failed = acct.take_changed(512)
    assert list(failed) == ["a-7@1"] and failed["a-7@1"].requests == 2
    acct.mark_changed(failed)  # the heartbeat failed: reported again next time
    assert list(acct.take_changed(512)) == ["a-7@1"]
    acct.mark_changed()  # registered again: every total once more
    assert sum(len(acct.take_changed(512)) for _ in range(3)) == 1200
