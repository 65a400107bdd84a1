"""deploy/grafana/loraserve.json names only metrics the servers really export, with labels they really carry.

The exported names come from the metric objects themselves (tests/deploy/exported_metrics.py): a panel over
a renamed or never-exported metric would draw nothing in Grafana and nobody would notice.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.deploy.exported_metrics import exported_sample_names

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = json.loads((ROOT / "deploy" / "grafana" / "loraserve.json").read_text())

# Labels Prometheus adds when it scrapes a pod (Kubernetes service discovery / PodMonitor relabelling).
TARGET_LABELS = {"namespace", "pod", "instance", "job", "container", "service"}
PROMQL_WORDS = {
    "sum", "avg", "min", "max", "count", "by", "without", "rate", "irate", "increase", "histogram_quantile",
    "label_values", "and", "or", "unless", "on", "ignoring", "group_left", "group_right", "offset", "bool",
    "topk", "bottomk", "clamp_min", "clamp_max", "abs", "time", "vector", "scalar",
}  # fmt: skip


def panels(dashboard: dict) -> list[dict]:
    out = []
    for p in dashboard["panels"]:
        out.append(p)
        out += p.get("panels", [])  # panels inside collapsed rows
    return out


def expressions() -> list[str]:
    exprs = [t["expr"] for p in panels(DASHBOARD) for t in p.get("targets", [])]
    for var in DASHBOARD["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(var["query"]["query"] if isinstance(var["query"], dict) else var["query"])
    return exprs


def strip_strings(expr: str) -> str:
    return re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)


def metric_names(expr: str) -> list[str]:
    """Identifiers of ``expr`` that name series: not functions, keywords, labels or Grafana variables."""
    e = strip_strings(expr)
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\b(by|without)\s*\([^)]*\)", "", e)  # grouping labels
    e = re.sub(r"\[[^\]]*\]", "", e)  # ranges ([5m], [$__rate_interval])
    e = re.sub(r"label_values\(([^,]*),[^)]*\)", r"(\1)", e)  # its second argument is a label
    e = re.sub(r"\$\w+", "", e)
    words = re.findall(r"(?<![\w.])[a-zA-Z_:][a-zA-Z0-9_:]*", e)
    return [w for w in words if w not in PROMQL_WORDS and not re.fullmatch(r"\d.*", w)]


def selectors(expr: str) -> list[tuple[str, list[str]]]:
    """``(metric, [label names in its matcher])`` for every ``metric{...}`` of ``expr``."""
    e = strip_strings(expr)
    return [
        (m.group(1), re.findall(r"(\w+)\s*(?:=~|!~|!=|=)", m.group(2)))
        for m in re.finditer(r"([a-zA-Z_:][\w:]*)\{([^}]*)\}", e)
    ]


def test_the_dashboard_has_a_prometheus_datasource_variable_that_every_panel_uses() -> None:
    variables = {v["name"]: v for v in DASHBOARD["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for p in panels(DASHBOARD):
        if p["type"] == "row":
            continue
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
    ids = [p["id"] for p in panels(DASHBOARD)]
    assert len(ids) == len(set(ids))


def test_every_expression_names_only_exported_metrics() -> None:
    exported = exported_sample_names()
    seen = set()
    for expr in expressions():
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        for name in names:
            assert name in exported, f"{name!r} in {expr!r} is not exported by any loraserve server"
            seen.add(exported[name].name)
    # the panels docs/design.md §10.4 asks for are there
    wanted = {
        "loraserve_generation_tokens",  # tokens/s
        "loraserve_time_to_first_token_seconds",
        "loraserve_inter_token_latency_seconds",
        "loraserve_requests_waiting",
        "loraserve_requests_running",
        "loraserve_kv_cache_utilisation",
        "loraserve_lora_slots_used",
        "loraserve_adapter_loads",
        "loraserve_rpc_requests",
    }
    assert wanted <= seen, wanted - seen


def test_functions_fit_metric_types() -> None:
    """rate() over counters and histogram parts only; histogram_quantile over _bucket series by le."""
    exported = exported_sample_names()
    for expr in expressions():
        e = strip_strings(expr)
        for m in re.finditer(r"\b(?:rate|irate|increase)\(\s*([a-zA-Z_:][\w:]*)", e):
            family = exported[m.group(1)]
            assert family.type in ("counter", "histogram"), f"rate() over the {family.type} {m.group(1)}"
            assert not m.group(1).endswith("_created"), expr
        for m in re.finditer(r"histogram_quantile\(\s*[\d.]+\s*,(.*)", e):
            inner = m.group(1)
            assert re.search(r"by \([^)]*\ble\b", inner), f"histogram_quantile without `by (le, ...)`: {expr}"
            assert all(n.endswith("_bucket") for n in metric_names(inner)), expr


def test_every_label_is_one_the_series_carry() -> None:
    exported = exported_sample_names()
    for expr in expressions():
        for metric, labels in selectors(expr):
            family = exported[metric]
            for label in labels:
                assert label in family.labels | TARGET_LABELS, f"{metric} has no label {label!r}: {expr}"
        e = strip_strings(expr)
        names = metric_names(expr)
        allowed = set(TARGET_LABELS) | {"le"}
        for name in names:
            allowed |= exported[name].labels
        for group in re.findall(r"\bby\s*\(([^)]*)\)", e):
            for label in (g.strip() for g in group.split(",")):
                assert label in allowed, f"by ({label}) in {expr!r}: no such label"


@pytest.mark.parametrize("expr", ["sum(rate(vllm:num_requests_waiting[5m]))", "loraserve_made_up_metric"])
def test_the_check_catches_an_unknown_metric(expr: str) -> None:
    exported = exported_sample_names()
    assert any(name not in exported for name in metric_names(expr))


def test_legends_name_labels_the_query_keeps() -> None:
    for p in panels(DASHBOARD):
        for t in p.get("targets", []):
            legend_labels = set(re.findall(r"\{\{(\w+)\}\}", t.get("legendFormat", "")))
            by = set()
            for group in re.findall(r"\bby\s*\(([^)]*)\)", t["expr"]):
                by |= {g.strip() for g in group.split(",")}
            if by:  # an aggregated query keeps only its by() labels (minus le, which the quantile drops)
                assert legend_labels <= by - {"le"}, (p["title"], t["expr"])
