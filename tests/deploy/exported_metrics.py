"""The Prometheus names loraserve's servers really export, computed from the metric objects themselves.

Module-level metrics (``common.observability``, ``worker.metrics``) are collected from the default registry
once their modules are imported; the worker's scrape-time ``EngineCollector`` is run on a stub engine whose
snapshot is a real ``EngineSnapshot``. No server is started and no model is built.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache

# what Prometheus' text format adds to a family's name, by type (prometheus_client also adds _created)
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
}


@dataclass(frozen=True)
class Family:
    name: str
    type: str
    labels: frozenset[str]  # label names of its samples (without le)

    def sample_names(self) -> set[str]:
        return {self.name + s for s in SUFFIXES[self.type]}


def _label_names(metric) -> frozenset[str]:
    names = getattr(metric, "_labelnames", None)  # a Counter/Histogram object: its declared labels
    if names is not None:
        return frozenset(names)
    return frozenset(k for s in metric.samples for k in s.labels if k != "le")


class _StubEngine:
    def snapshot(self):
        from loraserve.engine.snapshot import EngineSnapshot

        return EngineSnapshot(
            step=0,
            slots=(),
            running=0,
            waiting=0,
            running_adapters=(),
            waiting_adapters=(),
            adapter_loads=0,
            tokens_out=0,
            requests_done=0,
            host_tier=(),
            max_batch_size=1,
        )


@cache
def exported_families() -> dict[str, Family]:
    """``family name -> Family`` for every ``loraserve_*`` metric of the worker, registry and router."""
    from prometheus_client import REGISTRY

    import loraserve.common.observability as observability  # RPCs, TTFT, ITL, tokens: every server

    # the registry and router servers: importing them declares whatever metrics they define
    for module in ("loraserve.registry.server", "loraserve.router.server"):
        importlib.import_module(module)
    import loraserve.worker.metrics as worker_metrics

    out: dict[str, Family] = {}
    declared = [v for m in (observability, worker_metrics) for v in vars(m).values()]
    by_name = {getattr(v, "_name", None): v for v in declared if hasattr(v, "_labelnames")}
    for family in REGISTRY.collect():
        if family.name.startswith("loraserve_"):
            source = by_name.get(family.name) or by_name.get(family.name + "_total") or family
            out[family.name] = Family(family.name, family.type, _label_names(source))
    for family in worker_metrics.EngineCollector(_StubEngine()).collect():
        out[family.name] = Family(family.name, family.type, _label_names(family))
    from loraserve.engine.accounting import AccountingCollector, AdapterAccounting

    accounting = AdapterAccounting()  # the per-adapter series (one request, so that they carry their labels)
    accounting.request_done("a@1", 3, 2, 2, 1)
    for family in AccountingCollector(accounting).collect():
        out.setdefault(family.name, Family(family.name, family.type, _label_names(family)))
    return out


def exported_sample_names() -> dict[str, Family]:
    """``sample name (as PromQL sees it) -> its Family``: ``loraserve_rpc_seconds_bucket`` and so on."""
    return {s: f for f in exported_families().values() for s in f.sample_names()}
