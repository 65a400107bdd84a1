#!/usr/bin/env bash
# bench/device.sh: loraserve vs transformers+peft on one accelerator, in under 8 minutes (docs/design.md §7, §10.6).
#
#   OUT=/tmp/out bash bench/device.sh           # on an accelerator: an 8B-shaped random Llama in bf16
#   OUT=/tmp/out bash bench/device.sh --tiny    # the same steps on a tiny model (CPU; tests/bench runs it)
#
# Run it from anywhere; it works in the repository it belongs to, which needs no installing: python3 with
# JAX (CUDA), numpy, torch, transformers, peft, safetensors, grpcio and protobuf is all it uses. It installs
# nothing and reaches no network. The steps, each under `timeout`, run in turn; a failed one is recorded
# and the next one runs anyway:
#   device   what JAX and torch see (and nvidia-smi's line), the versions; stops here without an accelerator
#   protos   whether loraserve.protos' generated modules import (generated with grpc_tools when missing
#            and it is there); the engine and these benches run without them
#   build    bench/decode.py --build-only: the random model made in bf16 on the device (~16 GB) and 64
#            rank-16 adapters on all 7 modules (~5 GB), written to $WORK
#   decode   bench/decode.py --batch 64,16: loraserve's engine (base, one adapter, 64 / 16 distinct
#            adapters), then transformers generate and peft mixed-adapter generate on the same device, bf16
#   kernels  bench/kernels.py --shape 8b: the multi-LoRA ops on a 4096 x 14336 projection, bf16
# Each step leaves $OUT/<step>.log and $OUT/<step>.json (its last JSON line, or {"error": ...}); decode
# also $OUT/decode_b64.json and $OUT/decode_b16.json. $OUT/summary.json merges them, with the ratios,
# and is printed last.
#
# Environment: OUT (default ./device-out), WORK (scratch for the model; default a temporary folder,
# removed at the end), PYTHON (default python3), DEVICE_DEADLINE_S (all steps end within it, default
# 450), DEVICE_ROUNDS (timed rounds per row, default 1: a GPU's steps hardly vary), JAX_CACHE (JAX's
# persistent compilation cache: a second run on the same machine compiles nothing; default
# /tmp/loraserve-device-jax-cache). The exit status is 1 when a step failed.
set -euo pipefail

TINY=0
for arg in "$@"; do
    case $arg in
        --tiny) TINY=1 ;;
        *) echo "usage: OUT=DIR bash bench/device.sh [--tiny]" >&2; exit 2 ;;
    esac
done

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-./device-out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
PYTHON=${PYTHON:-python3}
DEADLINE=${DEVICE_DEADLINE_S:-450}
JAX_CACHE=${JAX_CACHE:-/tmp/loraserve-device-jax-cache}
if [[ -z ${WORK:-} ]]; then
    WORK=$(mktemp -d "${TMPDIR:-/tmp}/loraserve-device.XXXXXX")
    trap 'rm -rf "$WORK"' EXIT
fi
mkdir -p "$WORK"
if ((TINY)); then
    SHAPE=tiny BATCHES=8,4
else
    SHAPE=8b BATCHES=64,16
fi
ROUNDS=${DEVICE_ROUNDS:-1}
cd "$ROOT"
for name in device protos build decode kernels summary; do
    rm -f "$OUT/$name.json" "$OUT/$name.log"
done
rm -f "$OUT"/decode_b*.json
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # JAX and torch share the device
export HF_HUB_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1

# The step's JSON: its log's last JSON line (decode: the last per batch, in decode_b<batch>.json), or
# {"error": ...} with the log's tail when it failed; `partial` keeps what a failed step printed.
RECORD=$(cat <<'EOF'
import json, sys
from pathlib import Path

out, name, rc, limit, seconds = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
lines = (out / f"{name}.log").read_text(errors="replace").splitlines()
found = []
for line in lines:
    if line.startswith("{"):
        try:
            found.append(json.loads(line))
        except ValueError:
            pass
found = [f for f in found if isinstance(f, dict)]
if name == "decode":
    per_batch = {}
    for f in found:
        if "workload" in f:
            per_batch[f["workload"]["batch"]] = f  # complete lines come after the partial ones
    for batch, f in per_batch.items():
        (out / f"decode_b{batch}.json").write_text(json.dumps(f))
if rc == 0 and found and "error" not in found[-1]:
    result = found[-1]
else:
    why = {124: f"timed out after {limit} s", 137: f"killed after {limit} s", 200: "not run: no time left"}
    why = why.get(rc, f"exit status {rc}")
    if rc == 0:
        why = found[-1]["error"] if found and "error" in found[-1] else "no JSON line in the log"
    result = {"error": why, "log_tail": lines[-15:]}
    if found:
        result["partial"] = found[-1]
result["step_seconds"] = seconds
(out / f"{name}.json").write_text(json.dumps(result))
print(f"   {name}: {'ERROR ' + result['error'] if 'error' in result else 'ok'} ({seconds} s)")
EOF
)

# step NAME CAP RESERVE CMD...: run CMD for at most CAP seconds, leaving RESERVE seconds of the deadline
# to the steps after it (both for the default deadline of 450 s, scaled to DEVICE_DEADLINE_S)
step() {
    local name=$1 cap=$(($2 * DEADLINE / 450)) reserve=$(($3 * DEADLINE / 450)) rc=0 start=$SECONDS limit
    shift 3
    limit=$((DEADLINE - SECONDS - reserve))
    ((limit < cap)) || limit=$cap
    echo "== $name (at most ${limit} s)"
    if ((limit < 5)); then
        echo "no time left" >"$OUT/$name.log"
        rc=200
    else
        timeout -k 5 "$limit" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
    fi
    "$PYTHON" -c "$RECORD" "$OUT" "$name" "$rc" "$limit" "$((SECONDS - start))"
    if ((rc != 0)); then
        tail -n 15 "$OUT/$name.log" | sed 's/^/   | /'
    fi
    return 0
}

DEVICE_PY=$(cat <<'EOF'
import json, os, sys
from importlib import metadata

import jax

devices = jax.devices()
print(devices)
info = {"backend": jax.default_backend(), "devices": [str(d) for d in devices],
        "kind": getattr(devices[0], "device_kind", ""), "nvidia_smi": os.environ.get("NVIDIA_SMI", "")}
info["versions"] = {"python": sys.version.split()[0]}
import torch  # the peers' device

info["torch"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
for pkg in ("jax", "jaxlib", "numpy", "torch", "transformers", "peft", "safetensors", "grpcio", "protobuf"):
    try:
        info["versions"][pkg] = metadata.version(pkg)
    except metadata.PackageNotFoundError:
        info["versions"][pkg] = None
if info["backend"] == "cpu" and os.environ.get("TINY") != "1":
    info["error"] = "JAX sees no accelerator (backend cpu): an 8B-shaped model is not for this machine; --tiny is"
print(json.dumps(info))
EOF
)

PROTOS_PY=$(cat <<'EOF'
import importlib, json, subprocess, sys

names = ("inference_pb2", "placement_pb2", "registry_pb2", "worker_admin_pb2")
check = "import os, sys; sys.path.insert(0, os.getcwd()); import loraserve; loraserve.__path__.append(os.getcwd()); "
check += "; ".join(f"import loraserve.protos.v1.{n}" for n in names)  # the rooms, found uninstalled too
first = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
if first.returncode == 0:
    print(json.dumps({"protos": "present"}))
    sys.exit(0)
why = first.stderr.strip().splitlines()[-1] if first.stderr.strip() else "import failed"
try:
    importlib.import_module("grpc_tools")
except ImportError:  # the engine runs without them; the servers would not
    print(json.dumps({"protos": "absent", "why": why, "note": "grpc_tools is not here to generate them;"
                      " the benches do not need them (`make protos` where grpcio-tools is makes them)"}))
    sys.exit(0)
subprocess.run([sys.executable, "protos/build.py"], check=True)
again = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
print(again.stderr.strip() or "generated")
print(json.dumps({"protos": "generated"} if again.returncode == 0 else {"error": f"generated, still: {why}"}))
sys.exit(again.returncode)
EOF
)

echo "loraserve device bench: shape $SHAPE, batches $BATCHES, out $OUT, work $WORK"
NVIDIA_SMI=""
if command -v nvidia-smi >/dev/null 2>&1; then
    NVIDIA_SMI=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n 1 || true)
    echo "nvidia-smi: $NVIDIA_SMI"
fi
export NVIDIA_SMI TINY
step device 60 390 "$PYTHON" -c "$DEVICE_PY"
"$PYTHON" -c 'import json, sys; d = json.load(open(sys.argv[1])); print("   jax:", d.get("backend"),
d.get("devices"), "torch:", d.get("torch"))' "$OUT/device.json"
if grep -q '"error"' "$OUT/device.json"; then
    echo "the device step failed: nothing else runs"
else
    step protos 60 360 "$PYTHON" -c "$PROTOS_PY"
    step build 120 240 "$PYTHON" bench/decode.py --shape "$SHAPE" --dtype bfloat16 --batch "$BATCHES" \
        --workdir "$WORK/model" --build-only
    step decode 400 50 "$PYTHON" bench/decode.py --shape "$SHAPE" --dtype bfloat16 --batch "$BATCHES" \
        --workdir "$WORK/model" --rounds "$ROUNDS" --engines default --no-extra --skip-ttft \
        --lazy-compile --compilation-cache "$JAX_CACHE"
    step kernels 75 0 "$PYTHON" bench/kernels.py --shape "$SHAPE" --dtype bfloat16
fi

SUMMARY_PY=$(cat <<'EOF'
import json, sys
from pathlib import Path

out, shape, batches, seconds = Path(sys.argv[1]), sys.argv[2], [int(b) for b in sys.argv[3].split(",")], int(sys.argv[4])
results = {}
for name in ("device", "protos", "build", "decode", "kernels"):
    path = out / f"{name}.json"
    results[name] = json.loads(path.read_text()) if path.exists() else {"error": "not run"}
summary = {"bench": "device", "shape": shape, "dtype": "bfloat16", "batches": batches}
dev = results["device"]
summary["device"] = {k: dev.get(k) for k in ("backend", "kind", "torch", "nvidia_smi")}
summary["versions"] = dev.get("versions", {})
summary["errors"] = {name: r["error"] for name, r in results.items() if "error" in r}
rows = ("base", "one_adapter", "distinct_adapters", "hf_base", "peft_mixed")
summary["decode_tok_s"], summary["step_ms"], summary["ratios"] = {}, {}, {}
for batch in batches:
    path = out / f"decode_b{batch}.json"
    if not path.exists():
        continue
    run = json.loads(path.read_text())
    dec = run.get("decode_tok_s", {})
    summary["decode_tok_s"][f"b{batch}"] = {k: dec[k] for k in rows if k in dec}
    summary["step_ms"][f"b{batch}"] = {k: run["step_ms"][k] for k in rows if k in run.get("step_ms", {})}
    if run.get("partial"):
        summary["decode_tok_s"][f"b{batch}"]["partial"] = True
    pairs = {"distinct_adapters_vs_peft_mixed": ("distinct_adapters", "peft_mixed"),
             "base_vs_transformers": ("base", "hf_base"),
             "distinct_adapters_vs_base": ("distinct_adapters", "base"),
             "one_adapter_vs_base": ("one_adapter", "base")}
    for key, (a, b) in pairs.items():
        if dec.get(a) and dec.get(b):
            summary["ratios"][f"{key}_b{batch}"] = round(dec[a] / dec[b], 3)
big = max(batches)
got = summary["ratios"].get(f"distinct_adapters_vs_peft_mixed_b{big}")
summary["target"] = {"what": f"batch {big}, {big} distinct adapters, decode tok/s: loraserve / peft mixed-adapter generate",
                     "design": ">= 5x (docs/design.md §7, 8B-shaped bf16)", "got": got,
                     "met": None if got is None or shape != "8b" else got >= 5}
kern = results["kernels"]
summary["kernels"] = {k: v for k, v in kern.items() if k.startswith("geomean") or k == "config"}
summary["seconds"] = seconds
summary["results"] = results
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary))
sys.exit(1 if summary["errors"] else 0)
EOF
)
"$PYTHON" -c "$SUMMARY_PY" "$OUT" "$SHAPE" "$BATCHES" "$SECONDS"
