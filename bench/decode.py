"""Decode throughput: loraserve's engine vs HF transformers and peft, same model, same script.

Workload (DESIGN.md §7): random Llama (hidden 1024, 8 layers, intermediate 2816, 16/4 heads, vocab 32000,
~140M parameters, f32), prompts of 64 tokens, 32 new tokens, batch 16, adapters of rank 16 on all seven
modules. The default engine also serves 16 distinct DoRA adapters (rank 16) and 16 distinct two-adapter
weighted mixes (``GenerateRequest.mix``) of rank-8 adapters (a mix's rank is its parts' sum: 16, the same
slot work as one rank-16 adapter), each ÷ base (#16's ≥ 0.85). Prints human-readable lines, then ONE JSON
object as the last line.

    python bench/decode.py            # the full workload (a few minutes on 2 cores)
    python bench/decode.py --tiny     # a seconds-long smoke run (used by the tests)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from threading import Event

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
FULL = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=4,
    vocab_size=32000,
    batch=16,
    prompt=64,
    new=32,
    rank=16,
    adapters=16,
)
TINY = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=384,
    batch=4,
    prompt=8,
    new=4,
    rank=4,
    adapters=4,
)


def build(workdir: Path, w: dict, context: int = 256) -> tuple[Path, list[Path]]:
    """Save the random base model (``context`` = its max_position_embeddings) and ``w['adapters']`` random
    PEFT adapters; return their folders."""
    from transformers import AutoModelForCausalLM

    from loraserve.testing import build_model, make_adapter

    model = build_model(
        "llama",
        seed=0,
        vocab_size=w["vocab_size"],
        max_position_embeddings=context,
        **{
            k: w[k]
            for k in (
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
            )
        },
    )
    base = workdir / "base"
    model.save_pretrained(str(base), safe_serialization=True)
    adapters = []
    for i in range(w["adapters"]):
        fresh = AutoModelForCausalLM.from_pretrained(str(base))
        make_adapter(
            fresh, workdir / f"a{i}", r=w["rank"], alpha=2.0 * w["rank"], targets=MODULES, seed=i, scale=0.01
        )
        adapters.append(workdir / f"a{i}")
    return base, adapters


def build_extra(workdir: Path, base: Path, w: dict) -> dict[str, Path]:
    """The DoRA and mix rows' adapters: ``d<i>`` DoRA (rank ``w['rank']``) and ``h<i>`` plain of half that
    rank, ``w['adapters']`` of each, made with peft."""
    from transformers import AutoModelForCausalLM

    from loraserve.testing import make_adapter

    out = {}
    for i in range(w["adapters"]):
        for name, r, kw in ((f"d{i}", w["rank"], {"use_dora": True}), (f"h{i}", w["rank"] // 2, {})):
            fresh = AutoModelForCausalLM.from_pretrained(str(base))
            make_adapter(
                fresh, workdir / name, r=r, alpha=2.0 * r, targets=MODULES, seed=1000 + i, scale=0.01, **kw
            )
            out[name] = workdir / name
    return out


def adapter_rows(w: dict, n_adapters: int, extra: bool) -> dict[str, list[str]]:
    """Row name -> the adapter ref of each request of a round ("" = base; a mix ref for a mix)."""
    from loraserve.adapters.mixes import MixPart, mix_ref

    rows = {
        "base": [""] * w["batch"],
        "one_adapter": ["a0"] * w["batch"],
        "distinct_adapters": [f"a{i % n_adapters}" for i in range(w["batch"])],
    }
    if extra:
        rows["distinct_dora"] = [f"d{i % n_adapters}" for i in range(w["batch"])]
        rows["distinct_mixes"] = [
            mix_ref([MixPart(f"h{i % n_adapters}", 0.6), MixPart(f"h{(i + 1) % n_adapters}", 0.4)])
            for i in range(w["batch"])
        ]
    return rows


def decode_rates(timed_round, w: dict, rounds: int) -> dict[str, float]:
    """End-to-end and decode-only tok/s from rounds of ``new`` and of 1 new token(s).

    decode-only = batch * (new - 1) / (t(new) - t(1)): the prefill and the first token cancel out, so
    engines that prefill differently compare on decode alone. ``step_ms`` is one decode step.
    """
    t_new = statistics.median(timed_round(w["new"]) for _ in range(rounds))
    t_one = statistics.median(timed_round(1) for _ in range(rounds))
    decode_s = max(t_new - t_one, 1e-9)
    return {
        "e2e_tok_s": w["batch"] * w["new"] / t_new,
        "decode_tok_s": w["batch"] * (w["new"] - 1) / decode_s,
        "step_ms": 1000 * decode_s / (w["new"] - 1),
    }


def engine_rates(runs: list[tuple[float, float]], w: dict) -> dict[str, float]:
    """Rates of our engine from rounds of (total seconds, decode-phase seconds), medians. The rows' rounds
    are interleaved (base, one adapter, distinct, …, then again), so drift shows in every row alike.

    The decode phase is timed from token timestamps, so the prefill's noise (most of a round's time
    at 64 rows) stays out of it; the peers below, which give no timestamps, use t(new) - t(1).
    """
    total = statistics.median(r[0] for r in runs)
    decode_s = max(statistics.median(r[1] for r in runs), 1e-9)
    return {
        "e2e_tok_s": w["batch"] * w["new"] / total,
        "decode_tok_s": w["batch"] * (w["new"] - 1) / decode_s,
        "step_ms": 1000 * decode_s / (w["new"] - 1),
    }


def _report(name: str, r: dict[str, float]) -> None:
    print(
        f"{name:56s} decode {r['decode_tok_s']:8.1f} tok/s  e2e {r['e2e_tok_s']:8.1f} tok/s  "
        f"step {r['step_ms']:7.2f} ms",
        flush=True,
    )


# Engine configurations run in the same script: (kernel_backend, lora_dtype) and the suffix of their keys.
ENGINES = {"": ("auto", ""), "_bf16_pools": ("auto", "bfloat16"), "_xla": ("xla", "")}


def run_engine(
    base: Path,
    adapters: list[Path],
    w: dict,
    rounds: int,
    backend: str = "auto",
    lora_dtype: str = "",
    ttft: bool = True,
    extra: dict[str, Path] | None = None,
) -> dict[str, dict[str, float]]:
    """loraserve's engine for base-only, 1 adapter and len(adapters) distinct adapters (+ TTFTs); with
    ``extra`` (:func:`build_extra`) also distinct DoRA adapters and distinct two-adapter mixes."""
    from loraserve.adapters.sources import LocalAdapterSource
    from loraserve.worker.checkpoint import load_checkpoint
    from loraserve.worker.config import EngineConfig
    from loraserve.worker.engine import Engine
    from loraserve.worker.requests import EngineRequest, Finished, Sampling, Token

    src = LocalAdapterSource()
    for i, path in enumerate(adapters):
        src.register(f"a{i}", str(path))
    for name, path in (extra or {}).items():
        src.register(name, str(path))
    cfg = EngineConfig(
        max_batch_size=w["batch"],
        # the smallest power of two that holds a request: fewer prefill buckets to compile at warm-up
        max_seq_len=max(16, 1 << (w["prompt"] + w["new"] - 1).bit_length()),
        max_loras=len(adapters),
        max_lora_rank=w["rank"],
        prefill_per_step=w["batch"],
        min_prefill_bucket=w["prompt"],
        max_cpu_loras=0,  # every load reads the local store: the cold TTFT below is really cold
        kernel_backend=backend,
        lora_dtype=lora_dtype,
    )
    engine = Engine(load_checkpoint(str(base)), cfg, source=src)
    label = f"loraserve[{engine.backend}, {cfg.pool_dtype} pools]"
    engine.start()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, w["vocab_size"], w["prompt"]).tolist() for _ in range(w["batch"])]

    def one_round(names: list[str], new: int) -> tuple[float, float]:
        """Serve one request per name; -> (seconds in all, seconds of the decode phase).

        Every prompt is prefilled before the first decode step (prefill_per_step = batch), so the
        decode phase runs from the last row's first token to the last row's last one.
        """
        done = [Event() for _ in names]
        first = [0.0] * len(names)
        last = [0.0] * len(names)

        def sink(e, i: int) -> None:
            now = time.perf_counter()
            if isinstance(e, Token | Finished) and not first[i]:
                first[i] = now
            if isinstance(e, Finished):
                last[i] = now
                done[i].set()

        start = time.perf_counter()
        for i, (name, prompt) in enumerate(zip(names, prompts, strict=True)):
            engine.submit(
                EngineRequest(
                    uuid.uuid4().hex,
                    name,
                    prompt,
                    Sampling(max_tokens=new, ignore_eos=True),
                    lambda e, i=i: sink(e, i),
                )
            )
        for ev in done:
            ev.wait(600)
        return max(last) - start, max(last) - max(first)

    rows = adapter_rows(w, len(adapters), extra is not None)
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in rows}
    out: dict[str, dict[str, float]] = {}
    for _ in range(rounds):  # interleaved: the VM's drift over minutes hits every row alike
        for name, refs in rows.items():
            one_round(refs, 2)  # loads the adapters (and writes the mixes) before timing
            runs[name].append(one_round(refs, w["new"]))
    for name in rows:
        out[name] = engine_rates(runs[name], w)
        _report(f"{label} {name}", out[name])
    if ttft:
        one_round(rows["distinct_adapters"], 2)  # a0.. resident again
        out["ttft"] = cold_vs_warm_ttft(engine, prompts[0], len(adapters))
        print(f"TTFT warm {out['ttft']['warm_ms']:.1f} ms, cold {out['ttft']['cold_ms']:.1f} ms", flush=True)
    engine.stop()
    return out


def cold_vs_warm_ttft(engine, prompt: list[int], n_adapters: int) -> dict[str, float]:
    """Time to first token of one request whose adapter is resident vs one that must be loaded from the
    local store first (unloaded beforehand; no host tier)."""
    from loraserve.worker.requests import EngineRequest, Finished, Sampling, Token

    def ttft(adapter: str) -> float:
        first = Event()
        start = time.perf_counter()
        engine.submit(
            EngineRequest(
                uuid.uuid4().hex,
                adapter,
                prompt,
                Sampling(max_tokens=1),
                lambda e: first.set() if isinstance(e, Token | Finished) else None,
            )
        )
        first.wait(600)
        return time.perf_counter() - start

    warm_name = f"a{n_adapters - 1}"
    warm = statistics.median(ttft(warm_name) for _ in range(5))
    colds = []
    for i in range(min(3, n_adapters - 1)):
        engine.unload_adapter(f"a{i}").result(60)
        colds.append(ttft(f"a{i}"))
    cold = statistics.median(colds)
    return {"warm_ms": 1000 * warm, "cold_ms": 1000 * cold, "ratio": cold / warm}


def run_hf(base: Path, adapters: list[Path], w: dict, rounds: int) -> dict[str, dict[str, float]]:
    """transformers generate (no LoRA) and peft mixed-adapter generate(adapter_names=...), greedy."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    rng = np.random.default_rng(0)
    ids = torch.tensor(rng.integers(3, w["vocab_size"], (w["batch"], w["prompt"])))

    def timer(generate):
        def timed_round(new: int) -> float:
            t = time.perf_counter()
            with torch.no_grad():
                generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
            return time.perf_counter() - t

        timed_round(2)  # warm-up
        return timed_round

    hf = AutoModelForCausalLM.from_pretrained(str(base)).eval()
    out = {"hf_base": decode_rates(timer(hf.generate), w, rounds)}
    _report("transformers generate", out["hf_base"])
    pm = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(base)), str(adapters[0]), adapter_name="a0"
    )
    for i, path in enumerate(adapters[1:], start=1):
        pm.load_adapter(str(path), adapter_name=f"a{i}")
    pm.eval()
    names = [f"a{i % len(adapters)}" for i in range(w["batch"])]
    out["peft_mixed"] = decode_rates(
        timer(lambda x, **kw: pm.generate(input_ids=x, adapter_names=names, **kw)), w, rounds
    )
    _report("peft mixed-adapter generate", out["peft_mixed"])
    return out


def machine_peaks(repeats: int = 10) -> dict[str, float]:
    """f32 matmul GFLOP/s (numpy, 2048²) and memory read GB/s (a jitted sum over 256 MB: a decode step
    streams weights, it does not copy them), measured now; each the best of ``repeats`` runs, since a
    peak is a maximum and this machine's speed drifts."""
    import jax
    import jax.numpy as jnp

    a = np.random.default_rng(0).standard_normal((2048, 2048), dtype=np.float32)
    a @ a
    flops = []
    for _ in range(repeats):
        t = time.perf_counter()
        a @ a
        flops.append(2 * 2048**3 / (time.perf_counter() - t) / 1e9)
    big = jnp.ones(64 * 1024 * 1024, jnp.float32)  # 256 MB
    total = jax.jit(jnp.sum)
    total(big).block_until_ready()
    reads = []
    for _ in range(repeats):
        t = time.perf_counter()
        total(big).block_until_ready()
        reads.append(big.nbytes / (time.perf_counter() - t) / 1e9)
    return {"peak_gflops": max(flops), "peak_gbs": max(reads)}


def lora_bytes(w: dict, itemsize: int = 4) -> int:
    """Bytes of the slot pools one decode step must read: every adapter in the batch, all 7 modules."""
    h, i, L = w["hidden_size"], w["intermediate_size"], w["num_hidden_layers"]
    kv = h // w["num_attention_heads"] * w["num_key_value_heads"]
    per_adapter = L * w["rank"] * ((h + h) + (h + kv) * 2 + (h + h) + (h + i) * 2 + (i + h))
    return itemsize * min(w["batch"], w["adapters"]) * per_adapter


def roofline_ms(w: dict, peaks: dict[str, float], pool_itemsize: int = 4) -> float:
    """Lower bound of one decode step: max(flops / peak, bytes / bandwidth), LoRA and KV cache included."""
    h, i, L, v = w["hidden_size"], w["intermediate_size"], w["num_hidden_layers"], w["vocab_size"]
    kv = h // w["num_attention_heads"] * w["num_key_value_heads"]
    layer = h * (h + 2 * kv) + h * h + 3 * h * i
    weights = L * layer + v * h  # matmul parameters touched per step (embedding lookups are negligible)
    lora_per_adapter = lora_bytes({**w, "batch": 1, "adapters": 1}) // 4
    seq = w["prompt"] + w["new"] // 2
    flops = 2 * w["batch"] * (weights + lora_per_adapter) + 4 * w["batch"] * L * seq * h
    bytes_ = 4 * (weights + 2 * w["batch"] * L * seq * kv) + lora_bytes(w, pool_itemsize)
    return 1000 * max(flops / (peaks["peak_gflops"] * 1e9), bytes_ / (peaks["peak_gbs"] * 1e9))


def adapter_ratio_bound(
    base_step_ms: float, w: dict, peaks: dict[str, float], pool_itemsize: int = 4
) -> float:
    """The distinct-adapters / base decode ratio this machine allows if the adapters' work runs after
    the base model's: the measured base step plus reading the batch's slot pools once at the measured
    read bandwidth (their flops are negligible). The xla backend runs that way; the cpu backend's call
    does not wait for the base matmul, XLA overlaps the two, and the ratio can beat this number."""
    return base_step_ms / (base_step_ms + 1000 * lora_bytes(w, pool_itemsize) / (peaks["peak_gbs"] * 1e9))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a seconds-long smoke run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, help="override the batch size (and the number of adapters)")
    parser.add_argument("--skip-hf", action="store_true", help="skip the transformers/peft peers")
    args = parser.parse_args()
    w = dict(TINY if args.tiny else FULL)
    if args.batch:
        w.update(batch=args.batch, adapters=args.batch)
    with tempfile.TemporaryDirectory() as tmp:
        base, adapters = build(Path(tmp), w)
        extra = build_extra(Path(tmp), base, w)
        peaks = machine_peaks()
        ours: dict[str, dict[str, float]] = {}
        for suffix, (backend, lora_dtype) in ENGINES.items():
            runs = run_engine(
                base,
                adapters,
                w,
                args.rounds,
                backend,
                lora_dtype,
                ttft=not suffix,
                extra=None if suffix else extra,
            )
            ours.update({name + suffix: r for name, r in runs.items()})
        peers = {} if args.skip_hf else run_hf(base, adapters, w, args.rounds)
    ttft = ours.pop("ttft")
    roof = roofline_ms(w, peaks)
    roof_bf16 = roofline_ms(w, peaks, pool_itemsize=2)
    allruns = {**ours, **peers}
    dec = {k: v["decode_tok_s"] for k, v in allruns.items()}
    result = {
        "bench": "decode",
        "workload": {
            k: w[k]
            for k in ("batch", "prompt", "new", "rank", "adapters", "hidden_size", "num_hidden_layers")
        },
        "decode_tok_s": {k: round(v, 1) for k, v in dec.items()},
        "e2e_tok_s": {k: round(v["e2e_tok_s"], 1) for k, v in allruns.items()},
        "step_ms": {k: round(v["step_ms"], 2) for k, v in allruns.items()},
        "ttft_ms": {"warm": round(ttft["warm_ms"], 1), "cold": round(ttft["cold_ms"], 1)},
        "roofline_step_ms": round(roof, 2),
        "roofline_fraction": round(roof / ours["distinct_adapters"]["step_ms"], 3),
        "roofline_fraction_bf16_pools": round(roof_bf16 / ours["distinct_adapters_bf16_pools"]["step_ms"], 3),
        "ratios": {
            "distinct_adapters_vs_base": round(dec["distinct_adapters"] / dec["base"], 3),
            "distinct_adapters_vs_base_serial_bound": round(
                adapter_ratio_bound(ours["base"]["step_ms"], w, peaks), 3
            ),
            "distinct_adapters_bf16_pools_vs_base": round(
                dec["distinct_adapters_bf16_pools"] / dec["base_bf16_pools"], 3
            ),
            "distinct_adapters_bf16_pools_vs_base_serial_bound": round(
                adapter_ratio_bound(ours["base_bf16_pools"]["step_ms"], w, peaks, pool_itemsize=2), 3
            ),
            "distinct_adapters_xla_vs_base": round(dec["distinct_adapters_xla"] / dec["base_xla"], 3),
            "one_adapter_vs_base": round(dec["one_adapter"] / dec["base"], 3),
            "distinct_dora_vs_base": round(dec["distinct_dora"] / dec["base"], 3),
            "distinct_mixes_vs_base": round(dec["distinct_mixes"] / dec["base"], 3),
            "cold_vs_warm_ttft": round(ttft["ratio"], 2),
        },
        **{k: round(v, 1) for k, v in peaks.items()},
    }
    if peers:
        for suffix in ENGINES:
            result["ratios"][f"distinct_adapters{suffix}_vs_peft_mixed"] = round(
                dec["distinct_adapters" + suffix] / dec["peft_mixed"], 2
            )
        result["ratios"]["base_vs_transformers"] = round(dec["base"] / dec["hf_base"], 2)
        result["ratios"]["e2e_distinct_adapters_vs_peft_mixed"] = round(
            allruns["distinct_adapters"]["e2e_tok_s"] / allruns["peft_mixed"]["e2e_tok_s"], 2
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
