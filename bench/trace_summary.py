"""Sum a jax.profiler trace's device time per row and op: what ``bench/kernels.py --scan --profile DIR`` wrote.

    python bench/trace_summary.py DIR [--top 12]

``DIR`` holds one trace per profiled row (``DIR/plugins/profile/<run>/perfetto_trace.json.gz``, Perfetto's JSON
that ``create_perfetto_trace=True`` writes beside the xplane), each of a few calls of one compiled program inside
a trace annotation (``scan pallas B128``). Per trace, from its device lanes (a TPU's ``/device:TPU:0`` process:
its "XLA Modules" thread has one event per program run, its "XLA Ops" thread one per op; on a CPU, the XLA
client threads of ``/host:CPU`` stand in for them):

* ``calls``: the annotation's count; ``module_us``: device time per call (the modules' events, or the ops' span);
* ``ops``: the ``--top`` ops by device time per call (µs), with their share of ``module_us``;
* ``busy_us`` / ``idle_us``: per call, the time some op runs, and the gaps between ops inside the modules.

Prints a table per row, then ONE JSON object as the last line (``{"bench": "trace_summary", "rows": [...]}``).
No JAX needed: it runs wherever the trace was brought back to.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import sys
from pathlib import Path

DEVICE_PROCESS = ("/device:TPU", "/device:GPU", "TPU:", "GPU:")
MODULE_THREADS = ("XLA Modules",)
OP_THREADS = ("XLA Ops",)
CPU_OP_THREADS = ("XLAPjRtCpuClient", "XLAEigen")


def _names(events: list[dict]) -> tuple[dict[int, str], dict[tuple[int, int], str]]:
    processes, threads = {}, {}
    for e in events:
        if e.get("ph") != "M":
            continue
        if e.get("name") == "process_name":
            processes[e["pid"]] = e["args"]["name"]
        elif e.get("name") == "thread_name":
            threads[(e["pid"], e.get("tid"))] = e["args"]["name"]
    return processes, threads


def _merged_busy(spans: list[tuple[float, float]]) -> float:
    """The length of the union of ``spans`` (start, end)."""
    busy, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if a > end:
            busy += b - a
            end = b
        elif b > end:
            busy += b - end
            end = b
    return busy


def summarize(events: list[dict], top: int = 12) -> dict | None:
    """One trace's row (module doc), or None when it holds no annotation named ``scan ...``."""
    processes, threads = _names(events)
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    labels = collections.Counter(e["name"] for e in spans if str(e.get("name", "")).startswith("scan "))
    if not labels:
        return None
    label, calls = labels.most_common(1)[0]
    device = {pid for pid, name in processes.items() if any(d in name for d in DEVICE_PROCESS)}

    def lane(e, wanted) -> bool:
        return any(w in threads.get((e["pid"], e.get("tid")), "") for w in wanted)

    if device:
        ops = [e for e in spans if e["pid"] in device and lane(e, OP_THREADS)]
        modules = [e for e in spans if e["pid"] in device and lane(e, MODULE_THREADS)]
        platform = processes[min(device)]
    else:  # a CPU trace: the client threads run the ops (their "end: op" markers are not ops)
        ops = [
            e
            for e in spans
            if lane(e, CPU_OP_THREADS)
            and not str(e["name"]).startswith(("end: ", "Threadpool", "ThunkExecutor"))
        ]
        modules = []
        platform = "/host:CPU"
    by_op: collections.Counter[str] = collections.Counter()
    for e in ops:
        by_op[e["name"]] += e["dur"]
    busy = _merged_busy([(e["ts"], e["ts"] + e["dur"]) for e in ops])
    if modules:
        module_total = sum(e["dur"] for e in modules)
        inside = _merged_busy([(e["ts"], e["ts"] + e["dur"]) for e in modules])
    else:
        module_total = inside = (
            (max(e["ts"] + e["dur"] for e in ops) - min(e["ts"] for e in ops)) if ops else 0.0
        )
    per = max(calls, 1)
    module_us = module_total / per
    return {
        "label": label,
        "platform": platform,
        "calls": calls,
        "module_us": round(module_us, 1),
        "busy_us": round(busy / per, 1),
        "idle_us": round(max(inside - busy, 0.0) / per, 1),
        "ops": [
            {
                "op": name,
                "us": round(us / per, 1),
                "share": round(us / module_total, 3) if module_total else None,
            }
            for name, us in by_op.most_common(top)
        ],
    }


def traces(root: Path) -> list[Path]:
    return sorted(root.glob("**/perfetto_trace.json.gz"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", help="the --profile folder")
    parser.add_argument("--top", type=int, default=12, help="ops per row")
    args = parser.parse_args()
    rows = []
    for path in traces(Path(args.dir)):
        with gzip.open(path, "rt") as f:
            data = json.load(f)
        row = summarize(data["traceEvents"] if isinstance(data, dict) else data, args.top)
        if row is None:
            continue
        rows.append(row)
        print(
            f"{row['label']:28s} {row['calls']} calls  {row['module_us']:9.1f} us a call"
            f"  busy {row['busy_us']:9.1f}  idle {row['idle_us']:8.1f}  ({row['platform']})"
        )
        for op in row["ops"]:
            print(
                f"    {op['us']:9.1f} us  {op['share'] if op['share'] is not None else '':>6}  {op['op'][:90]}"
            )
    if not rows:
        print(f"no profiled row under {args.dir}", file=sys.stderr)
    print(json.dumps({"bench": "trace_summary", "dir": args.dir, "rows": rows}, separators=(",", ":")))
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
