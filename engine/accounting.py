"""Per-adapter accounting: requests, prompt and completion tokens, loads, load latency by where the bytes came
from (host tier, disk cache, object store, local folder), bytes fetched — as Prometheus series and as heartbeat
totals (the registry sums those: ``loraserve adapters stats NAME``).

Cardinality is bounded: the first ``top_n`` adapters a worker serves get series of their own (label
``adapter``; requests without an adapter count as ``base``), counted from their first request; every later
adapter is summed under ``adapter="other"``. Series only grow, so no counter ever goes down. The heartbeat
totals are exact for every adapter. Thread-safe: the loader threads and the servicers record, scrapes and
heartbeats read.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, fields

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from loraserve.adapters.sources import Origin
from loraserve.common.observability import LATENCY_BUCKETS

BASE = "base"  # the label of requests without an adapter
OTHER = "other"


@dataclass
class Usage:
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    draft_tokens: int = 0  # speculative decoding: tokens proposed for its requests, and kept
    accepted_draft_tokens: int = 0
    loads: int = 0
    fetched_bytes: int = 0
    load_buckets: dict[str, list[int]] = field(default_factory=dict)  # origin -> counts per bucket (+Inf)
    load_sums: dict[str, float] = field(default_factory=dict)

    def add(self, other: Usage) -> None:
        for f in SCALARS:
            setattr(self, f, getattr(self, f) + getattr(other, f))
        for origin, counts in other.load_buckets.items():
            mine = self.load_buckets.setdefault(origin, [0] * len(counts))
            self.load_buckets[origin] = [a + b for a, b in zip(mine, counts, strict=True)]
            self.load_sums[origin] = self.load_sums.get(origin, 0.0) + other.load_sums.get(origin, 0.0)

    def copy(self) -> Usage:
        out = Usage()
        out.add(self)
        return out


SCALARS = tuple(f.name for f in fields(Usage) if f.name not in ("load_buckets", "load_sums"))


class AdapterAccounting:
    def __init__(self, top_n: int = 20) -> None:
        self.top_n = top_n
        self._lock = threading.Lock()
        self._totals: dict[str, Usage] = {}  # every adapter, since start (heartbeats report these)
        self._changed: dict[
            str, None
        ] = {}  # adapters whose totals the registry has not seen yet, oldest first
        self._series: dict[str, Usage] = {}  # adapters with series of their own (at most top_n)
        self._other = Usage()  # every other adapter, summed

    def _record(self, adapter: str, delta: Usage) -> None:
        with self._lock:
            self._totals.setdefault(adapter, Usage()).add(delta)
            self._changed[adapter] = None
            if adapter not in self._series and len(self._series) < self.top_n:
                self._series[adapter] = Usage()
            self._series.get(adapter, self._other).add(delta)

    def request_done(
        self,
        adapter: str,
        prompt_tokens: int,
        completion_tokens: int,
        draft_tokens: int = 0,
        accepted_draft_tokens: int = 0,
    ) -> None:
        """A finished request of ``adapter`` (its resolved "name@version"; "" for the base model), with the
        drafts speculative decoding proposed for it and kept."""
        self._record(
            adapter or BASE,
            Usage(
                requests=1,
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                draft_tokens=draft_tokens,
                accepted_draft_tokens=accepted_draft_tokens,
            ),
        )

    def loaded(self, adapter: str, seconds: float, origin: Origin, fetched_bytes: int) -> None:
        """One preparation of ``adapter`` for a slot: how long it took, where its bytes came from (the
        ``origin`` label) and how many were fetched from object storage."""
        buckets = [1 if seconds <= b else 0 for b in LATENCY_BUCKETS] + [1]
        delta = Usage(
            loads=1,
            fetched_bytes=fetched_bytes,
            load_buckets={origin: buckets},
            load_sums={origin: seconds},
        )
        self._record(adapter, delta)

    def totals(self) -> dict[str, Usage]:
        """Every adapter's usage since this worker started."""
        with self._lock:
            return {k: v.copy() for k, v in self._totals.items()}

    def take_changed(self, limit: int) -> dict[str, Usage]:
        """The totals of at most ``limit`` adapters that changed since they were last taken (oldest change
        first), no longer marked changed: what one heartbeat reports. Give them back with :meth:`mark_changed`
        when the heartbeat fails; the rest waits for the next one."""
        with self._lock:
            keys = list(itertools.islice(self._changed, limit))
            for key in keys:
                del self._changed[key]
            return {k: self._totals[k].copy() for k in keys}

    def mark_changed(self, adapters: Iterable[str] | None = None) -> None:
        """Report ``adapters`` again (a heartbeat that failed), or every adapter (None: a new registration)."""
        with self._lock:
            for key in self._totals if adapters is None else adapters:
                if key in self._totals:
                    self._changed[key] = None

    def labelled(self) -> dict[str, Usage]:
        """The series as exported: at most ``top_n`` adapters and "other"."""
        with self._lock:
            out = {k: v.copy() for k, v in self._series.items()}
            out[OTHER] = self._other.copy()
            return out


class AccountingCollector:
    def __init__(self, accounting: AdapterAccounting) -> None:
        self.accounting = accounting

    def collect(self) -> Iterator:
        series = self.accounting.labelled()
        help_text = {
            "requests": "Finished requests per adapter (top-N adapters, the rest as 'other')",
            "prompt_tokens": "Prompt tokens of finished requests per adapter",
            "completion_tokens": "Generated tokens of finished requests per adapter",
            "draft_tokens": "Speculative decoding: tokens drafted for finished requests per adapter",
            "accepted_draft_tokens": "Speculative decoding: drafted tokens the model kept, per adapter (over"
            " draft_tokens: the acceptance rate)",
            "fetched_bytes": "Adapter bytes fetched from object storage per adapter",
        }
        for name in SCALARS:
            if name == "loads":  # the load histogram's _count per adapter and source says it
                continue
            family = CounterMetricFamily(f"loraserve_adapter_{name}", help_text[name], labels=["adapter"])
            for adapter, usage in sorted(series.items()):
                family.add_metric([adapter], getattr(usage, name))
            yield family
        hist = HistogramMetricFamily(
            "loraserve_adapter_load_seconds_by_source",
            "Adapter load latency per adapter and source (host tier, disk cache, object store, local folder)",
            labels=["adapter", "source"],
        )
        bounds = [str(b) for b in LATENCY_BUCKETS] + ["+Inf"]
        for adapter, usage in sorted(series.items()):
            for origin, counts in sorted(usage.load_buckets.items()):
                hist.add_metric(
                    [adapter, origin], list(zip(bounds, counts, strict=True)), usage.load_sums[origin]
                )
        yield hist
