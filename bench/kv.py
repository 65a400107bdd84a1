"""Paged KV cache: capacity in a fixed KV budget vs a dense cache, prefix-cache prefill saving, and
multi-adapter prefill throughput (issue #14 item 6, docs/design.md §7 and §10.3), all on the real engine.

1. capacity: a tiny-width random Llama (hidden 64, 2 layers, context 4096; compute is small, the memory
   accounting is what is measured) gets 160 greedy requests of mixed lengths at once, prompt + 32 new
   tokens log-uniform over 64..4096 (mean ~970; the 160 quantiles in a seeded order), in a pool of
   ``--kv-cache-bytes`` (default: 8 full contexts). ``engine.snapshot().running`` is sampled after every
   step: its peak, and its mean over the steps while requests still waited (the pool is the limit
   then), each divided by the rows a dense cache of the same bytes holds, which is computed (not run):
   budget // (max_seq_len * bytes per token).
2. prefix caching: ``requests`` prompts of one adapter sharing a ``prefix``-token prefix, distinct
   suffixes, arriving together, on the bench model (docs/design.md §7 shape) with prefix caching on and off:
   prefill tokens computed (snapshot prefix_query_tokens - prefix_hit_tokens; every prompt token when
   off), wall time of the prefill phase (to the first token of the last request), and the generated
   tokens, asserted identical.
3. prefill throughput: 16 prompts of 256 tokens arriving together, base model vs 16 distinct adapters
   (rank 16, all 7 modules): prompt tokens / time to the first token of the last request (the prefill
   phase), median of interleaved rounds; also as a fraction of the machine's f32 matmul peak.

Prints human-readable lines, then ONE JSON object as the last line.

    python bench/kv.py            # the full workload (minutes on 2 cores)
    python bench/kv.py --tiny     # a smoke run (used by the tests)
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from threading import Event

import numpy as np
from decode import FULL as DECODE_FULL
from decode import TINY as DECODE_TINY
from decode import build, machine_peaks

FULL = dict(
    # 1. capacity (tiny-width model, long context)
    cap_hidden=64,
    cap_layers=2,
    cap_heads=4,
    cap_kv_heads=2,
    cap_vocab=512,
    cap_context=4096,
    cap_min_len=64,
    cap_new=32,
    cap_dense_rows=8,  # the default budget: this many full contexts
    cap_requests=160,
    cap_rows=64,  # decode rows: more than the pool can hold, so pages are the limit
    page_size=16,
    # 2. prefix caching (bench model)
    prefix=512,
    suffix=32,
    prefix_requests=32,
    prefix_new=8,
    # 3. prefill throughput (bench model)
    prefill_prompts=16,
    prefill_len=256,
    adapters=16,
    rank=16,
    rounds=3,
    bench_model=DECODE_FULL,
    warmup=True,
)
TINY = dict(
    cap_hidden=64,
    cap_layers=2,
    cap_heads=4,
    cap_kv_heads=2,
    cap_vocab=384,
    cap_context=512,
    cap_min_len=32,
    cap_new=8,
    cap_dense_rows=2,
    cap_requests=24,
    cap_rows=16,
    page_size=16,
    prefix=64,
    suffix=8,
    prefix_requests=8,
    prefix_new=4,
    prefill_prompts=4,
    prefill_len=32,
    adapters=4,
    rank=4,
    rounds=1,
    bench_model=DECODE_TINY,
    warmup=False,  # a smoke run: compile only the shapes it uses
)


@dataclass
class Outcome:
    tokens: list[int] = field(default_factory=list)
    first: float = 0.0  # perf_counter of the first token
    last: float = 0.0  # of the finish
    error: str = ""


def serve(
    engine, jobs: list[tuple[str, list[int], int]], watch=None, timeout: float = 3600
) -> tuple[float, list[Outcome]]:
    """Submit every (adapter, prompt, new tokens) job at once, greedy and ignoring EOS, and wait for all;
    ``watch(snapshot)`` is called about every millisecond meanwhile. -> (start perf_counter, outcomes)."""
    from loraserve.engine.request import EngineRequest, Failed, Finished, Sampling, Token

    outs = [Outcome() for _ in jobs]
    left = [len(jobs)]
    all_done = Event()

    def sink(e, i: int) -> None:  # the engine thread
        now, o = time.perf_counter(), outs[i]
        if isinstance(e, Token | Finished) and not o.first:
            o.first = now
        if isinstance(e, Token):
            o.tokens.append(e.token_id)
        elif isinstance(e, Finished | Failed):
            if isinstance(e, Finished) and e.token_id is not None:
                o.tokens.append(e.token_id)
            o.last, o.error = now, e.message if isinstance(e, Failed) else ""
            left[0] -= 1
            if not left[0]:
                all_done.set()

    start = time.perf_counter()
    for i, (adapter, prompt, new) in enumerate(jobs):
        sampling = Sampling(max_tokens=new, ignore_eos=True)
        engine.submit(EngineRequest(uuid.uuid4().hex, adapter, prompt, sampling, partial(sink, i=i)))
    deadline = start + timeout
    while not all_done.wait(0.001 if watch else 1.0):
        if watch:
            watch(engine.snapshot())
        if time.perf_counter() > deadline:
            raise TimeoutError(f"{left[0]} of {len(jobs)} requests still running after {timeout} s")
    errors = [o.error for o in outs if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, e.g. {errors[0]}")
    return start, outs


def make_engine(checkpoint_dir: Path, adapters: list[Path], warmup: bool = True, **config):
    from loraserve.adapters.sources import LocalAdapterSource
    from loraserve.engine.config import EngineConfig
    from loraserve.engine.engine import Engine
    from loraserve.models.checkpoint import load_checkpoint

    src = LocalAdapterSource()
    for i, path in enumerate(adapters):
        src.register(f"a{i}", str(path))
    engine = Engine(load_checkpoint(str(checkpoint_dir)), EngineConfig(**config), source=src)
    engine.start(warmup=warmup)  # without it (--tiny) shapes compile on first use: timings mean nothing
    return engine


# ----------------------------------------------------------------------------------------- 1. capacity
def capacity(workdir: Path, w: dict, budget: int | None) -> dict:
    """Concurrent running sequences of mixed lengths in a fixed KV budget, paged vs dense."""
    from loraserve.models import decoder
    from loraserve.models.checkpoint import read_config
    from loraserve.models.config import ModelConfig
    from loraserve.testing import build_model

    path = workdir / "capacity_model"
    build_model(
        "llama",
        seed=1,
        vocab_size=w["cap_vocab"],
        hidden_size=w["cap_hidden"],
        intermediate_size=2 * w["cap_hidden"],
        num_hidden_layers=w["cap_layers"],
        num_attention_heads=w["cap_heads"],
        num_key_value_heads=w["cap_kv_heads"],
        max_position_embeddings=w["cap_context"],
    ).save_pretrained(str(path), safe_serialization=True)
    context, page = w["cap_context"], w["page_size"]
    token_bytes = decoder.kv_page_bytes(ModelConfig.from_hf(read_config(str(path))), 1, "float32")
    budget = budget or w["cap_dense_rows"] * context * token_bytes
    dense_rows = budget // (context * token_bytes)  # what a dense cache of the same bytes holds
    engine = make_engine(
        path,
        [],
        max_batch_size=w["cap_rows"],
        max_seq_len=context,
        max_waiting=w["cap_requests"],
        prefill_per_step=w["cap_rows"],
        min_prefill_bucket=64,
        kv_page_size=page,
        kv_cache_bytes=budget,
        enable_prefix_caching=False,  # random prompts share nothing; every page is a held token's
        kernel_backend="xla-onehot",  # no adapters here: the backend with the fewest decode variants
        warmup=w["warmup"],
    )
    # lengths at the n quantile midpoints of log-uniform(min, context), in a seeded random order: the
    # distribution's mean without the sampling noise of a few long draws
    rng, n = np.random.default_rng(0), w["cap_requests"]
    quantiles = (np.arange(n) + 0.5) / n
    lengths = np.exp(math.log(w["cap_min_len"]) + quantiles * math.log(context / w["cap_min_len"]))
    lengths = rng.permutation(np.round(lengths).astype(int))
    new = w["cap_new"]
    jobs = [("", rng.integers(3, w["cap_vocab"], length - new).tolist(), new) for length in lengths]
    # decode step -> (running, waiting, kv utilisation) after it; requests that finished in the step are
    # gone already, so a step's batch is under-counted by those (about one per step)
    steps: dict[int, tuple[int, int, float]] = {}
    peak = [0]

    def watch(snap) -> None:
        peak[0] = max(peak[0], snap.running)
        if snap.step:  # step 0: nothing admitted yet
            steps.setdefault(snap.step, (snap.running, snap.waiting, snap.kv_utilisation))

    start, _ = serve(engine, jobs, watch)
    wall = time.perf_counter() - start
    snap = engine.snapshot()
    engine.stop()
    saturated = [s for s in steps.values() if s[1] > 0]  # requests waited: the pool was the limit
    mean_sat = statistics.mean(s[0] for s in saturated) if saturated else 0.0
    out = {
        "context": context,
        "lengths": f"log-uniform {w['cap_min_len']}..{context} quantiles (prompt + {w['cap_new']} new)",
        "mean_length": round(float(lengths.mean()), 1),
        "requests": w["cap_requests"],
        "budget_bytes": budget,
        "bytes_per_token": token_bytes,
        "kv_pages": snap.kv_pages_total,
        "max_batch_size": w["cap_rows"],
        "dense_rows": dense_rows,
        "peak_running": peak[0],
        "mean_running_saturated": round(mean_sat, 2),
        "mean_running": round(statistics.mean(s[0] for s in steps.values()), 2),
        "kv_utilisation_saturated": round(statistics.mean(s[2] for s in saturated), 3) if saturated else 0.0,
        "steps_sampled": len(steps),
        "steps_saturated": len(saturated),
        "preemptions": snap.preemptions,
        "wall_s": round(wall, 1),
    }
    print(
        f"capacity: budget {budget / 2**20:.1f} MiB = {dense_rows} dense rows of {context} tokens "
        f"(computed: budget // ({context} x {token_bytes} B/token)); paged: {snap.kv_pages_total} pages of "
        f"{page} tokens; {w['cap_requests']} requests, mean length {out['mean_length']}",
        flush=True,
    )
    print(
        f"capacity: running peak {peak[0]}, mean {mean_sat:.1f} over {len(saturated)} saturated steps "
        f"(KV utilisation {out['kv_utilisation_saturated']:.2f}), {snap.preemptions} preemptions; "
        f"paged / dense: peak {peak[0] / dense_rows:.2f}x, mean {mean_sat / dense_rows:.2f}x",
        flush=True,
    )
    if peak[0] >= w["cap_rows"]:
        print("capacity: WARNING the decode rows, not the pages, were the limit", flush=True)
    return out


# ----------------------------------------------------------------------------------- 2. prefix caching
def bench_engine(base: Path, adapters: list[Path], w: dict, context: int, caching: bool):
    """The engine of rows 2 and 3 on the bench model: a row per prefix request, every prompt of a burst
    prefilled before the first decode step (``prefill_per_step`` = rows)."""
    rows = max(w["prefix_requests"], w["prefill_prompts"])
    return make_engine(
        base,
        adapters,
        max_batch_size=rows,
        max_seq_len=context,
        max_loras=len(adapters),
        max_lora_rank=w["rank"],
        prefill_per_step=rows,
        min_prefill_bucket=32,
        kv_page_size=w["page_size"],
        enable_prefix_caching=caching,
        warmup=w["warmup"],
    )


def prefix_jobs(w: dict) -> list[tuple[str, list[int], int]]:
    """``prefix_requests`` prompts of adapter a0: one shared random prefix, distinct random suffixes."""
    rng = np.random.default_rng(1)
    vocab = w["bench_model"]["vocab_size"]
    prefix = rng.integers(3, vocab, w["prefix"]).tolist()
    suffixes = [rng.integers(3, vocab, w["suffix"]).tolist() for _ in range(w["prefix_requests"])]
    return [("a0", prefix + s, w["prefix_new"]) for s in suffixes]


def prefix_run(engine, jobs: list[tuple[str, list[int], int]], caching: bool) -> dict:
    """Serve the prefix jobs on a fresh engine (prefix cache empty); its counters are this run's alone."""
    engine.load_adapter("a0").result(600)
    start, outs = serve(engine, jobs)
    snap = engine.snapshot()
    prompt_tokens = sum(len(p) for _, p, _ in jobs)
    assert snap.preemptions == 0
    assert snap.prefix_query_tokens == (prompt_tokens if caching else 0)
    run = {
        "computed": prompt_tokens - snap.prefix_hit_tokens,
        "hit_tokens": snap.prefix_hit_tokens,
        "query_tokens": snap.prefix_query_tokens,
        "prefill_s": max(o.first for o in outs) - start,
        "tokens": [o.tokens for o in outs],
    }
    print(
        f"prefix caching {'on ' if caching else 'off'}: {run['computed']} of {prompt_tokens} prompt tokens "
        f"computed, prefill phase {run['prefill_s'] * 1000:.0f} ms",
        flush=True,
    )
    return run


def prefix_result(w: dict, on: dict, off: dict) -> dict:
    """Row 2's numbers; asserts that caching changed no generated token."""
    assert on["tokens"] == off["tokens"], "the prefix cache changed the generated tokens"
    assert all(len(t) == w["prefix_new"] for t in on["tokens"])
    return {
        "requests": w["prefix_requests"],
        "prefix": w["prefix"],
        "suffix": w["suffix"],
        "computed_on": on["computed"],
        "computed_off": off["computed"],
        "hit_tokens": on["hit_tokens"],
        "query_tokens": on["query_tokens"],
        "prefill_ms_on": round(1000 * on["prefill_s"], 1),
        "prefill_ms_off": round(1000 * off["prefill_s"], 1),
        "tokens_identical": True,
    }


# ------------------------------------------------------------------------------- 3. prefill throughput
def prefill_flops(bm: dict, prompts: int, length: int) -> float:
    """Model FLOPs of prefilling ``prompts`` prompts of ``length`` tokens: the layers' matmuls, causal
    attention (QK and PV over the positions each token sees) and one lm_head row per prompt; LoRA excluded."""
    h, i, L, v = bm["hidden_size"], bm["intermediate_size"], bm["num_hidden_layers"], bm["vocab_size"]
    kv = h // bm["num_attention_heads"] * bm["num_key_value_heads"]
    layer = h * (h + 2 * kv) + h * h + 3 * h * i
    attention = 2 * 2 * h * length * (length + 1) / 2
    return prompts * (2 * L * layer * length + L * attention + 2 * v * h)


def prefill_throughput(engine, w: dict) -> dict:
    """Prompt tokens/s of ``prefill_prompts`` prompts arriving together: base vs distinct adapters (one
    new token each, so a round is its prefill phase). The engine's prefix cache must be off."""
    assert not engine.config.enable_prefix_caching, "the rounds repeat the prompts"
    n, length, adapters = w["prefill_prompts"], w["prefill_len"], w["adapters"]
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, w["bench_model"]["vocab_size"], length).tolist() for _ in range(n)]
    mixes = {"base": [""] * n, "distinct_adapters": [f"a{i % adapters}" for i in range(n)]}

    def one_round(names: list[str]) -> float:
        start, outs = serve(engine, [(a, p, 1) for a, p in zip(names, prompts, strict=True)])
        return max(o.first for o in outs) - start

    for mix in mixes.values():
        one_round(mix)  # loads the adapters and touches every path before timing
    times: dict[str, list[float]] = {name: [] for name in mixes}
    for _ in range(w["rounds"]):
        for name, mix in mixes.items():  # interleaved: the machine's drift hits both alike
            times[name].append(one_round(mix))
    out = {}
    for name, ts in times.items():
        out[name] = n * length / statistics.median(ts)
        print(
            f"prefill {name:18s} {out[name]:9.1f} tok/s (median of {len(ts)}: {n} x {length} tokens)",
            flush=True,
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a smoke run")
    parser.add_argument("--rounds", type=int, help="prefill rounds per mix (default 3, tiny 1)")
    parser.add_argument(
        "--kv-cache-bytes", type=int, help="the capacity row's KV budget (default 8 contexts)"
    )
    args = parser.parse_args()
    w = dict(TINY if args.tiny else FULL)
    if args.rounds:
        w["rounds"] = args.rounds
    bm = {**w["bench_model"], "adapters": w["adapters"], "rank": w["rank"]}
    context = max(w["prefix"] + w["suffix"] + w["prefix_new"], w["prefill_len"] + 1)
    context = -(-context // 64) * 64
    with tempfile.TemporaryDirectory() as tmp:
        cap = capacity(Path(tmp), w, args.kv_cache_bytes)
        base, adapters = build(Path(tmp), bm, context=context)
        jobs = prefix_jobs(w)
        engine = bench_engine(base, adapters, w, context, caching=False)
        off = prefix_run(engine, jobs, caching=False)
        tput = prefill_throughput(engine, w)
        engine.stop()
        engine = bench_engine(base, adapters[:1], w, context, caching=True)
        pre = prefix_result(w, prefix_run(engine, jobs, caching=True), off)
        engine.stop()
        peak_gflops = machine_peaks(repeats=3 if args.tiny else 10)["peak_gflops"]
    flops = prefill_flops(bm, w["prefill_prompts"], w["prefill_len"])
    gflops = {k: v / w["prefill_len"] / w["prefill_prompts"] * flops / 1e9 for k, v in tput.items()}
    dense = cap["dense_rows"]
    result = {
        "bench": "kv",
        "workload": {
            "page_size": w["page_size"],
            "capacity_model": {
                k[4:]: w[k] for k in ("cap_hidden", "cap_layers", "cap_heads", "cap_kv_heads")
            },
            "bench_model": {k: bm[k] for k in ("hidden_size", "num_hidden_layers", "vocab_size")},
            "prefill": {
                "prompts": w["prefill_prompts"],
                "tokens": w["prefill_len"],
                "adapters": w["adapters"],
            },
            "rank": w["rank"],
        },
        "capacity": cap,
        "prefix_cache": pre,
        "prefill_tok_s": {k: round(v, 1) for k, v in tput.items()},
        "prefill_gflops": {k: round(v, 1) for k, v in gflops.items()},
        "peak_gflops": round(peak_gflops, 1),
        "ratios": {
            "capacity_peak_vs_dense": round(cap["peak_running"] / dense, 2),
            "capacity_mean_vs_dense": round(cap["mean_running_saturated"] / dense, 2),
            "prefix_computed_on_vs_off": round(pre["computed_on"] / pre["computed_off"], 4),
            "prefix_prefill_time_on_vs_off": round(pre["prefill_ms_on"] / pre["prefill_ms_off"], 3),
            "prefill_distinct_adapters_vs_base": round(tput["distinct_adapters"] / tput["base"], 3),
            # three significant digits, not places: the tiny smoke run's fractions are far below 0.001
            "prefill_base_vs_matmul_peak": float(f"{gflops['base'] / peak_gflops:.3g}"),
            "prefill_distinct_adapters_vs_matmul_peak": float(
                f"{gflops['distinct_adapters'] / peak_gflops:.3g}"
            ),
        },
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
