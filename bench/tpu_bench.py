"""Merge what ``bench/tpu_session.sh bench`` ran into one JSON object: ``OUT/tpu-bench.json``, printed last.

    python3 bench/tpu_bench.py OUT NAME:RC:LIMIT_S:SECONDS ... --command "..."

Each ``NAME:RC:LIMIT_S:SECONDS`` is one sub-step: its log is ``OUT/bench-NAME.log`` (the command on its first
line, after ``$``), RC its exit status (124/137: stopped at LIMIT_S; 200: not run, no time left). The sub-steps:

* ``kernels-<shape>``: ``bench/kernels.py --scan``; a row per (batch, backend) of its last JSON line, with
  ``hbm_fraction`` = the row's GB/s ÷ the chip's HBM bandwidth (``--hbm-gbs``, default 819: a TPU v5e);
* ``decode``: ``bench/decode.py`` with one engine per LoRA backend; a row per (batch, backend): the base
  (no adapter), one-adapter and distinct-adapters decode steps in ms, ``distinct_vs_base`` (base step ÷
  distinct step = decode tok/s ratio), ``base_hbm_fraction`` (the bytes a base step reads, weights and KV
  cache, ÷ its time ÷ the HBM bandwidth), ``distinct_hbm_fraction`` (the batch's adapter pools added) and
  ``serial_bound`` (base step ÷ (base step + reading those pools at the read rate decode.py measured): the
  ratio of adapters that run after the base product; overlapping them beats it);
* ``quant``: ``bench/decode.py --quantization``; a row per (batch, quantization): the quantized base's steps,
  its ``base_hbm_fraction`` and ``speedup_vs_bf16`` = the unquantized base step (this run's, else the decode
  sub-step's ``xla-grouped`` engine at that batch: what ``auto`` is on a TPU) ÷ the quantized one.

* ``speculative``: ``bench/speculative.py``; its rows as they are (per batch and workload: plain and speculative
  tok/s, ``speedup``, the share of drafts kept, verify ÷ decode step cost).

A decode line marked ``partial`` (``--emit-partial``: a run stopped between engines) gives the rows of the
engines that finished. Nothing here opens the accelerator.
"""

from __future__ import annotations

import argparse
import datetime
import json
from importlib import metadata
from pathlib import Path

HBM_GBS = 819.0  # TPU v5e: 819 GB/s
# decode.py's key suffix -> the LoRA backend (or engine configuration) of the row
BACKENDS = {
    "": "auto",
    "_pallas": "pallas",
    "_xla_onehot": "xla-onehot",
    "_xla": "xla-grouped",
    "_bf16_pools": "auto-bf16-pools",
    "_xla_linear": "auto-xla-linear",
    "_async": "auto-async",
}
# decode.py's --engines names (its ENGINE_NAMES) -> key suffixes
ENGINES = {"default": "", "bf16_pools": "_bf16_pools", "xla": "_xla", "xla_linear": "_xla_linear", "async": "_async",
           "pallas": "_pallas", "xla_onehot": "_xla_onehot", "xla_grouped": "_xla"}  # fmt: skip
QUANTIZED = ("int8", "int4", "int8_head", "int4_head")  # decode.py's QUANTIZED_ROWS
WHY = {124: "timed out", 137: "killed at its time limit", 200: "not run: no time left"}


def json_lines(path: Path) -> tuple[str, list[dict]]:
    """The command on a log's first line (after ``$ ``) and every JSON object printed on a line of its own."""
    if not path.exists():
        return "", []
    lines = path.read_text(errors="replace").splitlines()
    command = lines[0][2:] if lines and lines[0].startswith("$ ") else ""
    found = []
    for line in lines:
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                found.append(value)
    return command, found


def _fraction(nbytes: float | None, ms: float | None, hbm_gbs: float) -> float | None:
    if not nbytes or not ms:
        return None
    return _sig(nbytes / (ms / 1e3) / (hbm_gbs * 1e9))


def _sig(x: float) -> float:
    return float(f"{x:.3g}")  # 3 significant digits: a tiny smoke run's fractions are ~1e-4


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def kernels_rows(result: dict, hbm_gbs: float) -> list[dict]:
    config = result.get("config", {})
    shape = {
        "shape": result.get("shape"),
        "in": config.get("in"),
        "out": config.get("out"),
        "layers": config.get("layers"),
        "dtype": config.get("dtype"),
    }
    rows = []
    for row in result.get("rows", []):
        out = {"bench": "kernels_scan", **shape, **row}
        if row.get("gbps") is not None:
            out["hbm_fraction"] = _sig(row["gbps"] / hbm_gbs)
        rows.append(out)
    return rows


def per_batch(results: list[dict]) -> dict[int, dict]:
    """decode.py's lines by batch: the last one of each (a complete line comes after its partial ones)."""
    out: dict[int, dict] = {}
    for result in results:
        if result.get("bench") == "decode" and "workload" in result:
            out[result["workload"]["batch"]] = result
    return out


def _steps(result: dict) -> tuple[dict, dict, dict]:
    return result.get("step_ms", {}), result.get("bytes", {}), result.get("ratios", {})


def decode_rows(result: dict, hbm_gbs: float) -> list[dict]:
    step, nbytes, _ = _steps(result)
    w = result["workload"]
    rows = []
    ran = [key.removeprefix("base") for key in step if key.startswith("base")]  # in the order they ran
    for suffix in (s for s in ran if s in BACKENDS):
        base, backend = step["base" + suffix], BACKENDS[suffix]
        distinct = step.get("distinct_adapters" + suffix)
        adapter_bytes = nbytes.get("adapters") if suffix != "_bf16_pools" else None
        # base ÷ (base + reading the batch's pools at the read rate decode.py measured): adapters run after it
        serial = None
        if adapter_bytes is not None and result.get("peak_gbs"):
            serial = _ratio(base, base + 1e3 * adapter_bytes / (result["peak_gbs"] * 1e9))
        rows.append(
            {
                "bench": "decode",
                "shape": result.get("shape"),
                "dtype": result.get("dtype"),
                "batch": w["batch"],
                "adapters": min(w["batch"], w["adapters"]),
                "backend": backend,
                "base_step_ms": base,
                "one_adapter_step_ms": step.get("one_adapter" + suffix),
                "distinct_step_ms": distinct,
                "distinct_vs_base": _ratio(base, distinct),
                "one_adapter_vs_base": _ratio(base, step.get("one_adapter" + suffix)),
                "base_hbm_fraction": _fraction(nbytes.get("base"), base, hbm_gbs),
                "distinct_hbm_fraction": _fraction(
                    nbytes.get("base", 0) + adapter_bytes if adapter_bytes is not None else None,
                    distinct,
                    hbm_gbs,
                ),
                "serial_bound": serial,
                "partial": bool(result.get("partial")),
            }
        )
    return rows


def quant_rows(result: dict, hbm_gbs: float, bf16: dict[int, dict]) -> list[dict]:
    step, nbytes, _ = _steps(result)
    w = result["workload"]
    rows = []
    for q in QUANTIZED:
        base = step.get(f"base_{q}")
        if base is None:
            continue
        ref, source = step.get("base"), "this run (auto engine)"
        if ref is None and w["batch"] in bf16:  # the decode sub-step's engine that auto is on a TPU
            ref, source = bf16[w["batch"]].get("step_ms", {}).get("base_xla"), "decode sub-step (xla-grouped)"
        distinct = step.get(f"distinct_adapters_{q}")
        rows.append(
            {
                "bench": "decode_quant",
                "shape": result.get("shape"),
                "dtype": result.get("dtype"),
                "batch": w["batch"],
                "quantization": q,
                "base_step_ms": base,
                "distinct_step_ms": distinct,
                "distinct_vs_base": _ratio(base, distinct),
                "base_bytes": nbytes.get(f"base_{q}"),
                "base_hbm_fraction": _fraction(nbytes.get(f"base_{q}"), base, hbm_gbs),
                "bf16_base_step_ms": ref,
                "speedup_vs_bf16": _ratio(ref, base),
                "bf16_base_from": source if ref is not None else None,
                "partial": bool(result.get("partial")),
            }
        )
    return rows


def versions() -> dict[str, str | None]:
    out = {}
    for name in ("jax", "jaxlib", "libtpu", "libtpu-nightly", "torch", "transformers"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return out


def merge(
    out_dir: Path, steps: list[str], command: str, hbm_gbs: float = HBM_GBS, env: dict | None = None
) -> dict:
    """The merged object (module doc) of the sub-steps ``steps`` ("NAME:RC:LIMIT_S:SECONDS") in ``out_dir``."""
    merged: dict = {
        "bench": "tpu",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": command,
        "env": env or {},
        "versions": versions(),
        "jax": None,
        "device_kind": None,
        "backend": None,
        "hbm_gbs": hbm_gbs,
        "steps": {},
        "errors": {},
        "rows": [],
        "results": {},
    }
    merged["jax"] = merged["versions"].get("jax")
    results: dict[str, list[dict]] = {}
    for spec in steps:
        name, rc, limit, seconds = spec.rsplit(":", 3)
        rc = int(rc)
        cmd, found = json_lines(out_dir / f"bench-{name}.log")
        results[name] = found
        entry = {"command": cmd, "rc": rc, "limit_s": int(limit), "seconds": int(seconds)}
        last = found[-1] if found else {}
        for key in ("compiles", "seconds"):
            if key in last:
                entry["own_" + key if key == "seconds" else key] = last[key]
        if rc != 0 or not found:
            entry["error"] = WHY.get(rc, f"exit status {rc}") if rc else "no JSON line in its log"
            merged["errors"][name] = entry["error"]
        merged["steps"][name] = entry
    decode = per_batch(results.get("decode", []))
    for name, found in results.items():
        if name.startswith("kernels-"):
            scans = [r for r in found if r.get("bench") == "kernels_scan"]
            if scans:
                merged["rows"] += kernels_rows({**scans[-1], "shape": name.removeprefix("kernels-")}, hbm_gbs)
                merged["results"][name] = scans[-1]
        elif name == "speculative":
            specs = [r for r in found if r.get("bench") == "speculative"]
            if specs:
                merged["rows"] += [
                    {"bench": "speculative", "shape": specs[-1].get("shape"), **r} for r in specs[-1]["rows"]
                ]
                merged["results"][name] = specs[-1]
        elif name in ("decode", "quant"):
            lines = per_batch(found)
            for batch, result in lines.items():
                if name == "decode":
                    merged["rows"] += decode_rows(result, hbm_gbs)
                else:
                    merged["rows"] += quant_rows(result, hbm_gbs, decode)
                for engine, why in result.get("errors", {}).items():  # an engine that failed (--emit-partial)
                    key = "quantization" if engine in QUANTIZED else "backend"
                    label = engine if engine in QUANTIZED else BACKENDS[ENGINES.get(engine, "")]
                    bench = "decode_quant" if engine in QUANTIZED else "decode"
                    merged["rows"].append({"bench": bench, "batch": batch, key: label, "error": why})
                    merged["errors"][f"{name} {label} batch {batch}"] = why
            merged["results"][name] = list(lines.values())
        for (
            result
        ) in found:  # kernels.py: {"backend": "tpu", "device": ...}; decode.py: {"jax": "tpu: KIND xN"}
            platform = result.get("platform")
            if not isinstance(platform, dict) or merged["device_kind"]:
                continue
            if "device" in platform:
                merged["backend"], merged["device_kind"] = platform.get("backend"), platform["device"]
            elif "jax" in platform:
                backend, _, kind = platform["jax"].partition(": ")
                merged["backend"], merged["device_kind"] = backend, kind.rsplit(" x", 1)[0]
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the folder of the sub-steps' logs; tpu-bench.json goes there")
    parser.add_argument("steps", nargs="*", help="NAME:RC:LIMIT_S:SECONDS per sub-step, in the order run")
    parser.add_argument("--command", default="", help="the command that ran the bench (recorded)")
    parser.add_argument("--hbm-gbs", type=float, default=HBM_GBS, help="the chip's HBM bandwidth, GB/s")
    parser.add_argument(
        "--env", action="append", default=[], help="NAME=VALUE of a setting that ran (recorded)"
    )
    parser.add_argument("--seconds", type=int, help="the whole bench step's seconds (recorded)")
    args = parser.parse_args()
    env = dict(e.partition("=")[::2] for e in args.env)
    merged = merge(args.out, args.steps, args.command, args.hbm_gbs, env)
    if args.seconds is not None:
        merged["seconds"] = args.seconds
    (args.out / "tpu-bench.json").write_text(json.dumps(merged, indent=1) + "\n")
    print(json.dumps(merged, separators=(",", ":")))


if __name__ == "__main__":
    main()
