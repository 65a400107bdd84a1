"""What a quantized base costs in quality: top-1 agreement and mean KL against the unquantized model (#34).

    python bench/quality.py                          # the decode bench model, int8 and int4
    python bench/quality.py --quantization int8_head,int4_head   # the head quantized too
    python bench/quality.py --tiny                   # the tiny model (seconds)
    python bench/quality.py --dtype bfloat16 --quantization int4 --prompts 16 --steps 64
    python bench/quality.py --model /models/Llama-3.1-8B --dtype bfloat16   # a real checkpoint's numbers
    python bench/quality.py --trained                # a small model trained here first (~5 min on 2 cores)

Each of ``--prompts`` random prompts is prefilled into its own row, then the unquantized model decodes
``--steps`` greedy tokens (all rows in one batch). Every quantized model is run on the very same tokens
(teacher-forced), so the two are compared at the same ``1 + steps`` positions a row: top-1 agreement (the
quantized model's argmax is the token the unquantized one picked) and the mean KL(unquantized ‖ quantized)
of the next-token distributions (nats). The model is the random decode bench model (bench/decode.py's
``--shape``), whose weights are Hugging Face's random initialisation: its next-token distributions are
nearly flat (the median top-1 margin and probability are reported), so top-1 agreement there measures how
often a near-tie flips, a harsher test than a trained model's peaked distributions. ``--model`` compares a
checkpoint folder instead (a trained model's numbers, read through the worker's loader; its prompts are
random token ids of ``--prompt-len``). ``--trained`` trains a small byte-level Llama on this repository's own
text first (no download: the text is the clone's ``.py`` and ``.md`` files; cached in ``--workdir``) and
prompts it with held-out text, so its greedy steps have the peaked distributions of a model that learned
something. One JSON object is printed last.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np


def run(
    checkpoint, prompts: np.ndarray, forced: np.ndarray | None, steps: int
) -> tuple[np.ndarray, np.ndarray]:
    """Prefill each prompt in its own row, then ``steps`` decode steps of all rows: greedy on the model's own
    tokens when ``forced`` is None, else on ``forced [rows, steps]``. Returns (logits [rows, 1 + steps, V]
    f32, the tokens fed [rows, steps])."""
    import jax.numpy as jnp

    from loraserve.engine.jax_runner import jit_steps
    from loraserve.kernels.backends import XlaGroupedBackend
    from loraserve.models import decoder
    from loraserve.models.lora import layout
    from loraserve.models.step import DecodeBatch, DeviceState, PrefillBatch

    cfg, dtype = checkpoint.config, jnp.dtype(checkpoint.dtype)
    rows, length = prompts.shape
    page = 16
    per_row = -(-(length + steps + 1) // page)
    cache = decoder.init_cache(cfg, rows * per_row + 1, page, dtype)
    tables = decoder.contiguous_page_tables(rows, per_row)
    backend = XlaGroupedBackend()
    pools = layout.empty_lora(cfg, 2, 4, dtype, backend)
    fns = jit_steps(cfg, backend, "xla", "auto")
    rope = jnp.asarray(cfg.inv_freq(), jnp.float32)
    blocks = decoder.whole_row_key_blocks(page, per_row)
    logits = [[] for _ in range(rows)]
    for row in range(rows):
        batch = PrefillBatch.single(prompts[row], length, 0, -1, tables[row], blocks)
        out, cache = fns.prefill(**DeviceState(checkpoint.params, pools, cache, rope).fields(), batch=batch)
        logits[row].append(np.asarray(out[0], np.float32))
    fed = np.zeros((rows, steps), np.int32)
    plan = backend.plan(np.full(rows, -1), 2)
    for step in range(steps):
        last = np.array([lg[-1] for lg in logits])
        fed[:, step] = forced[:, step] if forced is not None else last.argmax(-1)
        positions = np.full(rows, length + step, np.int32)
        batch = DecodeBatch(fed[:, step], positions, tables, plan)
        out, cache = fns.decode(**DeviceState(checkpoint.params, pools, cache, rope).fields(), batch=batch)
        for row in range(rows):
            logits[row].append(np.asarray(out[row], np.float32))
    return np.stack([np.stack(lg) for lg in logits]), fed


TRAINED = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,  # bytes
    prompt=96,
)


def corpus(root: Path) -> bytes:
    """The repository's own text: every ``.py`` and ``.md`` file under ``root`` (virtual environments and
    hidden folders skipped), in sorted path order."""
    skip = {".venv", "node_modules", "__pycache__"}
    files = sorted(
        f
        for f in root.rglob("*")
        if f.suffix in (".py", ".md")
        and f.is_file()
        and not any(part in skip or part.startswith(".") for part in f.relative_to(root).parts[:-1])
    )
    return b"\n".join(f.read_bytes() for f in files)


def train_byte_model(
    out: Path, text: bytes, steps: int, batch: int = 16, seq: int = 128, seed: int = 0, **shape: int
) -> dict:
    """Train a byte-level Llama (:data:`TRAINED`'s shape, overridable) on the first 90 % of ``text`` with
    AdamW (warm-up, then cosine decay) and save it to ``out`` as a Hugging Face checkpoint. Returns the
    training loss (nats a byte, the mean of the last 20 steps) and the held-out loss."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    w = {k: v for k, v in {**TRAINED, **shape}.items() if k != "prompt"}
    torch.manual_seed(seed)
    config = LlamaConfig(
        **w, max_position_embeddings=512, bos_token_id=None, eos_token_id=None, tie_word_embeddings=False
    )
    model = LlamaForCausalLM(config)
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    split = len(data) * 9 // 10
    train, held = data[:split], data[split:]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: min(1.0, (i + 1) / warm) * 0.5 * (1 + np.cos(np.pi * min(i, steps) / steps))
    )
    gen = torch.Generator().manual_seed(seed)
    losses = []
    model.train()
    for _ in range(steps):
        starts = torch.randint(0, len(train) - seq - 1, (batch,), generator=gen)
        x = torch.stack([train[s : s + seq + 1] for s in starts])
        loss = model(input_ids=x, labels=x.clone()).loss  # the model shifts the labels itself
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        if len(losses) % 100 == 0:
            print(f"step {len(losses)}: loss {np.mean(losses[-100:]):.3f} nats a byte", flush=True)
    model.eval()
    with torch.no_grad():
        starts = torch.arange(0, len(held) - seq - 1, max(1, (len(held) - seq - 1) // 32))[:32]
        x = torch.stack([held[s : s + seq] for s in starts])
        held_loss = float(model(input_ids=x, labels=x.clone()).loss)
    model.save_pretrained(str(out), safe_serialization=True)
    return {"train_loss": round(float(np.mean(losses[-20:])), 3), "held_out_loss": round(held_loss, 3)}


def held_out_prompts(text: bytes, rows: int, length: int) -> np.ndarray:
    """``rows`` prompts of ``length`` bytes from the held-out last 10 % of ``text``, evenly spaced."""
    held = np.frombuffer(text[len(text) * 9 // 10 :], np.uint8).astype(np.int32)
    starts = np.linspace(0, len(held) - length - 1, rows).astype(int)
    return np.stack([held[s : s + length] for s in starts])


def compare(full: np.ndarray, fed: np.ndarray, quant: np.ndarray) -> dict:
    """Top-1 agreement and mean KL(full ‖ quant) over every position but the last of each row (the last
    position's token is not fed, so it is compared too: all 1 + steps)."""

    def log_softmax(x: np.ndarray) -> np.ndarray:
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    picked = full.argmax(
        -1
    )  # the unquantized model's greedy token at every position (fed[:, i] = picked[:, i])
    assert (picked[:, :-1] == fed).all()
    lp, lq = log_softmax(full.astype(np.float64)), log_softmax(quant.astype(np.float64))
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    top2 = np.sort(full, axis=-1)[..., -2:]
    return {
        "positions": int(picked.size),
        "top1_agreement": round(float((quant.argmax(-1) == picked).mean()), 4),
        "mean_kl": float(f"{kl.mean():.3g}"),
        "max_kl": float(f"{kl.max():.3g}"),
        "max_abs_logit_diff": round(float(np.abs(full - quant).max()), 4),
        # how peaked the unquantized model is: a random model's near-ties flip under any perturbation
        "median_top1_margin": round(float(np.median(top2[..., 1] - top2[..., 0])), 4),
        "median_top1_prob": round(float(np.median(np.exp(lp.max(-1)))), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("bench", "tiny"), default="bench", help="bench/decode.py's model")
    parser.add_argument("--tiny", action="store_true", help="--shape tiny")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument(
        "--quantization",
        default="int8,int4",
        help="comma-separated: int8, int4, int8_head, int4_head (_head: the head quantized too)",
    )
    parser.add_argument("--prompts", type=int, default=8, help="rows (random prompts of the shape's length)")
    parser.add_argument("--steps", type=int, default=32, help="greedy decode steps a row")
    parser.add_argument("--workdir", help="build the model here, reuse it when there (bench/decode.py's)")
    parser.add_argument("--model", help="a checkpoint folder to compare instead of the bench model")
    parser.add_argument("--prompt-len", type=int, help="tokens a prompt (default: the shape's prompt length)")
    parser.add_argument(
        "--trained",
        action="store_true",
        help="train (or reuse from --workdir) a small byte-level model on this repository's text; "
        "prompts are held-out text",
    )
    parser.add_argument("--train-steps", type=int, default=600, help="--trained's optimiser steps")
    args = parser.parse_args()
    from decode import SHAPES, build_or_reuse  # this folder's; tests import the functions above alone

    shape = "tiny" if args.tiny else args.shape
    w = dict(SHAPES[shape], adapters=1)
    quantizations = [q for q in args.quantization.split(",") if q]
    for q in quantizations:
        if q not in ("int8", "int4", "int8_head", "int4_head"):
            parser.error(f"unknown quantization {q!r}")

    from loraserve.models.checkpoint import load_checkpoint, open_checkpoint

    training = None
    with tempfile.TemporaryDirectory() as scratch:
        if args.trained:
            text = corpus(Path(__file__).resolve().parents[1])
            base = Path(args.workdir or scratch) / f"trained-{args.train_steps}"
            marker = base / "training.json"
            if marker.exists():
                training = json.loads(marker.read_text())
            else:
                began = time.perf_counter()
                training = train_byte_model(base, text, args.train_steps)
                training.update(steps=args.train_steps, corpus_bytes=len(text))
                training["seconds"] = round(time.perf_counter() - began, 1)
                marker.write_text(json.dumps(training))
            print(f"trained: {training}", flush=True)
            w = dict(TRAINED)
            shape = "trained"
        elif args.model:
            base = Path(args.model)
            cfg = open_checkpoint(str(base), dtype=args.dtype).config  # headers only
            w = dict(w, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                     num_hidden_layers=cfg.num_layers, vocab_size=cfg.vocab_size)  # fmt: skip
            shape = str(base)
        else:
            base, _ = build_or_reuse(Path(args.workdir or scratch), w, args.dtype, direct=shape != "tiny")
        length = args.prompt_len or w["prompt"]
        if args.trained:
            prompts = held_out_prompts(text, args.prompts, length)
        else:
            prompts = np.random.default_rng(0).integers(3, w["vocab_size"], (args.prompts, length))
            prompts = prompts.astype(np.int32)
        started = time.perf_counter()
        full, fed = run(load_checkpoint(str(base), dtype=args.dtype), prompts, None, args.steps)
        results = {}
        for q in quantizations:
            method, _, head = q.partition("_")
            ck = load_checkpoint(
                str(base), dtype=args.dtype, quantization=method, quantize_lm_head=head == "head"
            )
            got, _ = run(ck, prompts, fed, args.steps)
            results[q] = compare(full, fed, got)
            print(f"{q}: {results[q]}", flush=True)
    about = {k: w[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")}
    print(
        json.dumps(
            {
                "bench": "quality",
                "shape": shape,
                "dtype": args.dtype,
                "model": about,
                "prompts": args.prompts,
                "steps": args.steps,
                "quality": results,
                **({"training": training} if training else {}),
                "seconds": round(time.perf_counter() - started, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
