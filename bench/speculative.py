"""Speculative decoding against plain decoding: the same engine, the same requests, the same tokens.

For each batch of ``--batch`` (default 1 and 16; rows of distinct rank-16 adapters, so the batch-16 rows are a
mixed-adapter batch) two engines serve one workload each round: ``plain`` (``--speculative off``) and
``speculative`` (``--speculative ngram``, ``--num-speculative-tokens 4``, the measured rule of
docs/speculative.md). An engine's batch is the batch measured (``--max-batch-size``: a single-stream deployment
runs batch 1). Workloads, greedy, ``--shape``'s prompt length and ``--new`` tokens (64 at the bench shape):

* ``predicted``   every request carries a prediction of its answer (OpenAI's predicted outputs) equal to the
  answer plain decoding gives: a copy-heavy workload at its best (a code edit that changes nothing);
* ``edited``      the same predictions with every tenth token replaced: drafts that fail now and then;
* ``ngram``       no prediction: prompt lookup over each row's random prompt and output. The models here are
  random, so this is what a row that is *not* copy-heavy costs (nothing to find, or loops of a random model):
  the rule's floor, which should stay at or above 0.95 of plain decoding.

Every speculative row's tokens are checked equal to plain decoding's in float32 (the bench fails otherwise). In
bfloat16 a verify step's logits round differently from a decode step's (k + 1 positions in one forward: other
fusions and attention reductions, each rounded to bf16), and a random model's near-flat logits make its argmax
flip on such differences, so there each row reports ``identical_rows`` (the share of rows equal to plain
decoding's) and ``first_divergence`` (the earliest position where one differed) instead; ``plain_identical_rows``
is plain decoding's own agreement with its first round (batch invariance). Per row:
tokens per second of the decode phase (first token to last) and end to end, the speed-up over plain
(``speedup`` = its tok/s ÷ plain's, decode phase), the share of drafted tokens kept, verify steps and probes.
Medians over ``--rounds`` (default 3) rounds, the engines interleaved. The last line is one JSON object.

``--shape copy`` runs the same workloads on a small Llama trained here to quote its prompt (``COPY``): its
``ngram`` rows are the copy-heavy workload, where prompt lookup finds what the model goes on to say.

    python bench/speculative.py                  # the bench model (~140M, f32) on this machine
    python bench/speculative.py --shape copy     # the copy model (trained first, ~1 min; kept in --workdir)
    python bench/speculative.py --shape tiny --batch 2 --rounds 1 --lazy-compile   # the smoke run (tests/bench)
    python bench/speculative.py --dtype bfloat16 --rounds 2   # on a TPU (bench/tpu_session.sh's speculative step)

Like every number of this repository, a ratio from one run on one machine (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from threading import Event

import _compiles  # in bench/, first on sys.path
import decode  # bench/decode.py: its shapes and model builder (importing it makes loraserve this checkout's)

WORKLOADS = ("predicted", "edited", "ngram")
K = 4
# --shape copy: a small Llama trained here to continue a text by quoting it (an induction copy: after a token
# it has seen, the token that followed it), the copy-heavy n-gram workload a random model cannot give.
# Its prompts are a random segment of COPY_SEGMENT tokens followed by its first COPY_CUE tokens: the answer
# quotes the rest of the segment and then the segment again, which prompt lookup finds.
COPY = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=512,
    prompt=40,
    new=64,
    rank=16,
    adapters=16,
)
COPY_SEGMENT, COPY_CUE = 32, 8
COPY_STEPS, COPY_BATCH, COPY_LEN = 800, 32, 128  # training: steps, sequences a step, tokens a sequence


def train_copy_model(w: dict, seed: int = 0, steps: int = COPY_STEPS):
    """The ``--shape copy`` model: a Llama of ``w``'s widths trained (AdamW, ``COPY_STEPS`` steps, ~1 min on
    2 CPU cores) on sequences of a random segment repeated, so the loss of every repeat teaches it to quote.
    Returns the model and the loss on the repeats of held-out sequences (nats a token)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=w["vocab_size"], hidden_size=w["hidden_size"], intermediate_size=w["intermediate_size"],
        num_hidden_layers=w["num_hidden_layers"], num_attention_heads=w["num_attention_heads"],
        num_key_value_heads=w["num_key_value_heads"], max_position_embeddings=256, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)

    def batch(n: int):
        seg = torch.randint(3, w["vocab_size"], (n, COPY_SEGMENT), generator=gen)
        reps = -(-COPY_LEN // COPY_SEGMENT)
        ids = seg.repeat(1, reps)[:, :COPY_LEN]
        labels = ids.clone()
        labels[:, :COPY_SEGMENT] = -100  # the first pass is random: only the repeats are learnt
        return ids, labels

    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=2e-3, total_steps=steps, pct_start=0.1)
    model.train()
    for _ in range(steps):
        ids, labels = batch(COPY_BATCH)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
    model.eval()
    with torch.no_grad():
        ids, labels = batch(64)
        held_out = float(model(input_ids=ids, labels=labels).loss)
    return model, held_out


def build_copy(workdir: Path, w: dict, steps: int = COPY_STEPS) -> tuple[Path, list[Path], float]:
    """The trained copy model and ``w['adapters']`` random rank-``w['rank']`` adapters (small: they leave it a
    copier) in ``workdir``, reused when ``workdir/built.json`` says so; and the model's held-out repeat loss."""
    marker = workdir / "built.json"
    want = {"copy": {k: w[k] for k in decode.MODEL_KEYS}, "steps": steps, "rank": w["rank"]}
    if marker.exists():
        have = json.loads(marker.read_text())
        if have.get("key") == want and have.get("adapters", 0) >= w["adapters"]:
            return workdir / "base", [workdir / f"a{i}" for i in range(w["adapters"])], have["repeat_loss"]
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    model, loss = train_copy_model(w, steps=steps)
    print(
        f"copy model trained in {time.perf_counter() - t0:.0f} s: held-out repeat loss {loss:.3f}", flush=True
    )
    base = workdir / "base"
    model.save_pretrained(str(base), safe_serialization=True)
    adapters = decode.save_adapters(workdir, base, w)
    marker.write_text(json.dumps({"key": want, "adapters": len(adapters), "repeat_loss": loss}))
    return base, adapters, loss


def _prompts(w: dict, batch: int, rng) -> list[list[int]]:
    """Random prompts; at ``--shape copy`` a random segment and its first tokens again (module doc)."""
    if not w.get("copy"):
        return [rng.integers(3, w["vocab_size"], w["prompt"]).tolist() for _ in range(batch)]
    out = []
    for _ in range(batch):
        seg = rng.integers(3, w["vocab_size"], COPY_SEGMENT).tolist()
        out.append(seg + seg[:COPY_CUE])
    return out


def _engine(base: Path, adapters: list[Path], w: dict, batch: int, method: str, checkpoint, lazy: bool):
    from loraserve.adapters.sources import LocalAdapterSource
    from loraserve.engine.config import EngineConfig
    from loraserve.engine.engine import Engine

    src = LocalAdapterSource()
    for i, path in enumerate(adapters):
        src.register(f"a{i}", str(path))
    cfg = EngineConfig(
        max_batch_size=batch,
        max_seq_len=max(16, 1 << (w["prompt"] + w["new"] - 1).bit_length()),
        max_loras=max(batch, 1),
        max_lora_rank=w["rank"],
        prefill_per_step=batch,
        min_prefill_bucket=w["prompt"],
        max_cpu_loras=0,
        speculative=method,
        num_speculative_tokens=K,
    )
    engine = Engine(checkpoint, cfg, source=src)
    engine.start(warmup=not lazy)  # lazy: each shape compiles at its first use (the warm rounds below)
    return engine


def _serve(engine, names: list[str], prompts: list[list[int]], new: int, predictions) -> dict:
    """One request per name, all at once; -> tokens per row, seconds (decode phase, end to end), counters."""
    from loraserve.engine.request import EngineRequest, Failed, Finished, Sampling, Token

    done = [Event() for _ in names]
    first, last = [0.0] * len(names), [0.0] * len(names)
    tokens: list[list[int]] = [[] for _ in names]
    failures: list[str] = []

    def sink(e, i: int) -> None:
        now = time.perf_counter()
        if isinstance(e, Token | Finished) and getattr(e, "token_id", None) is not None:
            tokens[i].append(e.token_id)
            first[i] = first[i] or now
        if isinstance(e, Failed):
            failures.append(e.message)
        if isinstance(e, Finished | Failed):
            last[i] = now
            done[i].set()

    s = engine.scheduler
    before = (s.spec_steps, s.spec_proposed, s.spec_accepted, s.steps, getattr(s.costs, "probes", 0))
    start = time.perf_counter()
    for i, (name, prompt) in enumerate(zip(names, prompts, strict=True)):
        req = EngineRequest(
            uuid.uuid4().hex,
            name,
            prompt,
            Sampling(max_tokens=new, ignore_eos=True),
            lambda e, i=i: sink(e, i),
        )
        req.prediction = None if predictions is None else list(predictions[i])
        engine.submit(req)
    for ev in done:
        ev.wait(600)
    if failures:
        raise RuntimeError(f"{len(failures)} requests failed: {failures[0]}")
    after = (s.spec_steps, s.spec_proposed, s.spec_accepted, s.steps, getattr(s.costs, "probes", 0))
    verify, proposed, kept, steps, probes = (b - a for a, b in zip(before, after, strict=True))
    return {
        "tokens": tokens,
        "decode_s": max(last) - max(first),
        "e2e_s": max(last) - start,
        "verify_steps": verify,
        "steps": steps,
        "proposed": proposed,
        "kept": kept,
        "probes": probes,
    }


def _edited(answer: list[int], vocab: int) -> list[int]:
    """``answer`` with every tenth token (the 5th, 15th, ...) replaced by another id."""
    return [(t + 1) % vocab if i % 10 == 4 else t for i, t in enumerate(answer)]


def _agreement(runs: list[dict], answers: list[list[int]]) -> tuple[float, int | None]:
    """The share of rows (over ``runs``) whose tokens equal ``answers``, and the earliest position at which one
    differs (None when none does)."""
    same, first = 0, None
    for run in runs:
        for got, want in zip(run["tokens"], answers, strict=True):
            if got == want:
                same += 1
                continue
            at = next(
                (i for i, (g, t) in enumerate(zip(got, want, strict=False)) if g != t),
                min(len(got), len(want)),
            )
            first = at if first is None else min(first, at)
    return round(same / (len(runs) * len(answers)), 3), first


def bench_batch(
    base, adapters, w, batch: int, rounds: int, checkpoint, lazy: bool = False, exact: bool = True
) -> list[dict]:
    import numpy as np

    rng = np.random.default_rng(batch)
    prompts = _prompts(w, batch, rng)
    names = [f"a{i}" for i in range(batch)]
    new = w["new"]
    engines = {m: _engine(base, adapters, w, batch, m, checkpoint, lazy) for m in ("off", "ngram")}
    try:
        plain = _serve(engines["off"], names, prompts, new, None)  # the answers (and a warm round)
        answers = plain["tokens"]
        predictions = {
            "predicted": answers,
            "edited": [_edited(a, w["vocab_size"]) for a in answers],
            "ngram": None,
        }
        runs: dict[tuple[str, str], list[dict]] = {}
        for m in ("off", "ngram"):  # a warm round of each workload
            for wl in WORKLOADS:
                _serve(engines[m], names, prompts, new, predictions[wl] if m == "ngram" else None)
        for _ in range(rounds):
            for wl in WORKLOADS:
                for m in ("off", "ngram"):
                    got = _serve(engines[m], names, prompts, new, predictions[wl] if m == "ngram" else None)
                    if exact and got["tokens"] != answers:
                        raise AssertionError(f"{m} {wl}: tokens differ from plain decoding's")
                    runs.setdefault((wl, m), []).append(got)
        ratio = engines["ngram"].scheduler.costs.ratio
    finally:
        for e in engines.values():
            e.stop()
    rows = []
    generated = batch * new
    for wl in WORKLOADS:
        plain_runs, spec_runs = runs[(wl, "off")], runs[(wl, "ngram")]
        p_dec = statistics.median(r["decode_s"] for r in plain_runs)
        s_dec = statistics.median(r["decode_s"] for r in spec_runs)
        p_e2e = statistics.median(r["e2e_s"] for r in plain_runs)
        s_e2e = statistics.median(r["e2e_s"] for r in spec_runs)
        proposed = sum(r["proposed"] for r in spec_runs)
        kept = sum(r["kept"] for r in spec_runs)
        decode_tokens = generated - batch  # the first token of every row comes from its prefill
        same, diverged_at = _agreement(spec_runs, answers)
        row = {
            "workload": wl,
            "batch": batch,
            "plain_tok_s": round(decode_tokens / p_dec, 1),
            "speculative_tok_s": round(decode_tokens / s_dec, 1),
            "speedup": round(p_dec / s_dec, 3),
            "e2e_speedup": round(p_e2e / s_e2e, 3),
            "kept_share": round(kept / proposed, 3) if proposed else None,
            "verify_steps": statistics.median(r["verify_steps"] for r in spec_runs),
            "steps": statistics.median(r["steps"] for r in spec_runs),
            "plain_steps": statistics.median(r["steps"] for r in plain_runs),
            "probes": sum(r["probes"] for r in spec_runs),
            "verify_over_decode": None if ratio is None else round(ratio, 2),
            "identical_rows": same,  # 1.0 unless bfloat16 (checked equal otherwise)
            "first_divergence": diverged_at,
            "plain_identical_rows": _agreement(plain_runs, answers)[0],
        }
        rows.append(row)
        print(
            f"batch {batch:3d} {wl:10s} plain {row['plain_tok_s']:8.1f} tok/s  speculative"
            f" {row['speculative_tok_s']:8.1f} tok/s  x{row['speedup']:.2f}  kept {row['kept_share']}"
            f"  steps {row['steps']} vs {row['plain_steps']}",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=("bench", "tiny", "copy", "8b-slice", "3b"), default="bench")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the model's dtype (bfloat16 on a TPU, where float32 matmuls run at 'highest': docs/tpu.md)",
    )
    parser.add_argument("--batch", default="1,16", help="a comma list of batches (distinct adapters = batch)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--new", type=int, help="new tokens per request (default: the shape's, 64 for bench)")
    parser.add_argument("--workdir", help="keep the built model here (default: a temporary folder)")
    parser.add_argument(
        "--copy-steps", type=int, default=COPY_STEPS, help="--shape copy: training steps of the copy model"
    )
    parser.add_argument(
        "--lazy-compile", action="store_true", help="no warm-up: each shape compiles when first run (untimed)"
    )
    args = parser.parse_args()
    _compiles.start()  # the run's XLA compilations, reported in its JSON
    from loraserve.models.checkpoint import load_checkpoint

    w = dict(COPY, copy=True) if args.shape == "copy" else dict(decode.SHAPES[args.shape])
    batches = [int(b) for b in args.batch.split(",")]
    w["adapters"] = max(batches)
    w["new"] = args.new or (w["new"] if args.shape == "tiny" else 64)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.workdir or tmp)
        # the large shapes' random weights are drawn in their dtype (decode.build_direct), the others by HF
        direct = args.shape in ("8b-slice", "3b")
        if args.shape == "copy":
            base, adapters, w["repeat_loss"] = build_copy(workdir, w, args.copy_steps)
        else:
            base, adapters = decode.build_or_reuse(workdir, w, args.dtype, direct=direct)
        checkpoint = load_checkpoint(str(base), dtype=args.dtype)
        rows = [
            row
            for b in batches
            for row in bench_batch(
                base,
                adapters,
                w,
                b,
                args.rounds,
                checkpoint,
                args.lazy_compile,
                exact=args.dtype == "float32",
            )
        ]
    import jax

    print(
        json.dumps(
            {
                "bench": "speculative",
                "shape": args.shape,
                "config": {
                    k: w[k]
                    for k in ("hidden_size", "num_hidden_layers", "vocab_size", "prompt", "new", "rank")
                }
                | {"k": K, "dtype": args.dtype}
                | (
                    {"copy_steps": args.copy_steps, "repeat_loss": round(w["repeat_loss"], 4)}
                    if "copy" in w
                    else {}
                ),
                "rows": rows,
                "platform": {
                    "backend": jax.default_backend(),
                    "device": jax.devices()[0].device_kind,
                    "cpus": os.cpu_count(),
                },
                "compiles": _compiles.totals(),
                "seconds": round(time.perf_counter() - t0, 1),
            },
            separators=(",", ":"),
        )
    )


if __name__ == "__main__":
    sys.exit(main())
