"""``loraserve plan``: will this model, with these slots, batch and context, fit a TPU slice of N chips?

    loraserve plan --model llama-3-8b --tp 4 --chip v5e --max-loras 32 --max-lora-rank 16 \\
        --batch 64 --context 8192

prints per-device bytes for weights, KV cache, LoRA slot pools and activations, the chip's HBM, whether it
fits and how many hosts the slice spans (``--json`` for one JSON object). ``--model`` takes a preset name,
a ``config.json`` or a checkpoint folder.
"""

from __future__ import annotations

import argparse
import json

from loraserve.models import planner

GiB = planner.GiB


def add_arguments(parser: argparse.ArgumentParser) -> None:
    known = ", ".join(sorted(planner.presets()))
    parser.add_argument("--model", required=True, help=f"preset ({known}), config.json or checkpoint folder")
    parser.add_argument(
        "--tp", type=int, default=1, help="tensor parallel size: chips the model is split over"
    )
    parser.add_argument("--chip", default="v5e", choices=sorted(planner.CHIPS), help="TPU generation")
    parser.add_argument("--max-loras", type=int, default=8, help="adapter slots on the device")
    parser.add_argument("--max-lora-rank", type=int, default=16, help="largest adapter rank a slot holds")
    parser.add_argument("--batch", type=int, default=16, help="decode rows per step")
    parser.add_argument("--context", type=int, default=4096, help="context length (prompt + new tokens)")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(planner.DTYPE_BYTES))
    parser.add_argument("--lora-dtype", default="", help="dtype of the slot pools (default: --dtype)")
    parser.add_argument(
        "--quantization",
        default="none",
        choices=("none", "int8", "int4"),
        help="the worker's --quantization: int8 projections with per-channel scales, int4 with per-group scales",
    )
    parser.add_argument(
        "--quantize-lm-head",
        action="store_true",
        help="the worker's --quantize-lm-head: the head quantized too (a tied model keeps its embedding beside)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--verify",
        action="store_true",
        help="also compile the real decode step ahead of time on abstract shapes on a forced N-device CPU"
        " mesh (nothing allocated) and print XLA's memory analysis beside the estimate",
    )


def render(p: planner.Plan, compiled: dict | None = None) -> str:
    rows = [
        ("weights", p.weights),
        ("KV cache", p.kv_cache),
        ("LoRA slot pools", p.lora_pools),
        ("sampling history", p.sampling_history),
        ("activations (peak)", p.activations),
        ("total", p.total),
        (f"{p.chip} HBM", p.hbm),
    ]
    lines = [f"{p.model} on {p.tp} x {p.chip} ({p.hosts} host{'s' if p.hosts > 1 else ''}), per device:"]
    lines += [f"  {name:<20s}{value / GiB:9.2f} GiB" for name, value in rows]
    verdict = "fits" if p.fits else f"does NOT fit ({(p.total - p.hbm) / GiB:.2f} GiB over)"
    lines.append(f"  {verdict}; {(p.hbm - p.total) / GiB:.2f} GiB left" if p.fits else f"  {verdict}")
    if compiled is not None:
        held = compiled["argument_bytes"] - compiled["small_input_bytes"]
        lines.append(
            f"  compiled decode step (XLA memory analysis, per device): arguments {held / GiB:.2f} GiB"
            f" (estimate: weights + KV + pools + history {p.held / GiB:.2f} GiB),"
            f" temporaries {compiled['temp_bytes'] / GiB:.2f} GiB"
        )
        if p.dtype == "bfloat16":
            lines.append(
                "  (the CPU compile keeps f32 copies of bf16 weights as temporaries; a TPU multiplies bf16)"
            )
    if p.hosts > 1:
        lines.append(
            f"  spans {p.hosts} hosts: run one worker per host, each with --coordinator LEADER:8476"
            f" --num-processes {p.hosts} --process-id 0..{p.hosts - 1} (a LeaderWorkerSet of size {p.hosts}:"
            " deploy/k8s/overlays/gke-tpu-multihost; docs/worker.md)"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    name, cfg = planner.load_model_config(args.model)
    result = planner.plan(
        name,
        cfg,
        args.chip,
        args.tp,
        max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
        batch=args.batch,
        context=args.context,
        dtype=args.dtype,
        lora_dtype=args.lora_dtype,
        quantization=args.quantization,
        quantize_lm_head=args.quantize_lm_head,
    )
    out = result.as_dict()
    if args.verify:
        from loraserve.worker.plan_verify import verify_in_subprocess

        settings = {k: v for k, v in vars(args).items() if not k.startswith("_") and k != "command"}
        out["compiled"] = verify_in_subprocess(settings)
    print(json.dumps(out) if args.json else render(result, out.get("compiled")))
    return 0 if result.fits else 3
