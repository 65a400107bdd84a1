"""Decode throughput: loraserve's engine vs HF transformers and peft, same model, same script.

Workload (DESIGN.md §7): random Llama (hidden 1024, 8 layers, intermediate 2816, 16/4 heads, vocab 32000,
~140M parameters, f32), prompts of 64 tokens, 32 new tokens, batch 16, adapters of rank 16 on all seven
modules. Prints human-readable lines, then ONE JSON object as the last line.

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


def build(workdir: Path, w: dict) -> tuple[Path, list[Path]]:
    """Save the random base model and ``w['adapters']`` random PEFT adapters; return their folders."""
    from transformers import AutoModelForCausalLM

    from worker.testing import build_model, make_adapter

    model = build_model(
        "llama",
        seed=0,
        vocab_size=w["vocab_size"],
        max_position_embeddings=256,
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


def run_engine(base: Path, adapters: list[Path], w: dict, rounds: int) -> dict[str, float]:
    """tok/s of loraserve's engine for base-only, 1 adapter and len(adapters) distinct adapters."""
    from worker.checkpoint import load_checkpoint
    from worker.config import EngineConfig
    from worker.engine import Engine
    from worker.requests import EngineRequest, Finished, Sampling
    from worker.sources import LocalAdapterSource

    src = LocalAdapterSource()
    for i, path in enumerate(adapters):
        src.register(f"a{i}", str(path))
    cfg = EngineConfig(
        max_batch_size=w["batch"],
        max_seq_len=128,
        max_loras=len(adapters),
        max_lora_rank=w["rank"],
        prefill_per_step=w["batch"],
        min_prefill_bucket=w["prompt"],
    )
    engine = Engine(load_checkpoint(str(base)), cfg, source=src)
    engine.start()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, w["vocab_size"], w["prompt"]).tolist() for _ in range(w["batch"])]

    def one_round(names: list[str]) -> float:
        done = [Event() for _ in names]
        start = time.perf_counter()
        for name, prompt, ev in zip(names, prompts, done, strict=True):
            engine.submit(
                EngineRequest(
                    uuid.uuid4().hex,
                    name,
                    prompt,
                    Sampling(max_tokens=w["new"], ignore_eos=True),
                    lambda e, ev=ev: ev.set() if isinstance(e, Finished) else None,
                )
            )
        for ev in done:
            ev.wait(600)
        return w["batch"] * w["new"] / (time.perf_counter() - start)

    out = {}
    mixes = {
        "base": [""] * w["batch"],
        "one_adapter": ["a0"] * w["batch"],
        "distinct_adapters": [f"a{i % len(adapters)}" for i in range(w["batch"])],
    }
    for name in mixes:  # load the adapters before timing
        one_round(mixes[name])
    for name, mix in mixes.items():
        out[name] = statistics.median(one_round(mix) for _ in range(rounds))
        print(f"loraserve {name:18s} {out[name]:8.1f} tok/s", flush=True)
    out["step_ms"] = decode_step_ms(engine, w)
    engine.stop()
    return out


def decode_step_ms(engine, w: dict) -> float:
    """Median wall time of one decode step with every row busy on a distinct adapter."""
    from worker.sampling import SamplingArrays

    b = engine.config.max_batch_size
    tokens, positions = np.full(b, 5, np.int32), np.full(b, w["prompt"], np.int32)
    slots = (np.arange(b) % engine.config.max_loras).astype(np.int32)
    samp = SamplingArrays.empty(b).as_tuple()
    times = []
    for _ in range(12):
        t = time.perf_counter()
        out, engine.cache = engine._decode(
            engine.params, engine.pools.pools, tokens, positions, slots, engine.cache, engine.inv_freq, samp
        )
        np.asarray(out)
        times.append(time.perf_counter() - t)
    return 1000 * statistics.median(times[2:])


def run_hf(base: Path, adapters: list[Path], w: dict, rounds: int) -> dict[str, float]:
    """tok/s of transformers generate (no LoRA) and peft mixed-adapter generate(adapter_names=...)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    ids = torch.tensor(rng.integers(3, w["vocab_size"], (w["batch"], w["prompt"])))
    kwargs = dict(max_new_tokens=w["new"], min_new_tokens=w["new"], do_sample=False, pad_token_id=0)

    def timed(fn) -> float:
        fn()  # warm-up
        rates = []
        for _ in range(rounds):
            t = time.perf_counter()
            fn()
            rates.append(w["batch"] * w["new"] / (time.perf_counter() - t))
        return statistics.median(rates)

    hf = AutoModelForCausalLM.from_pretrained(str(base)).eval()
    with torch.no_grad():
        out = {"hf_base": timed(lambda: hf.generate(ids, **kwargs))}
    print(f"transformers base        {out['hf_base']:8.1f} tok/s", flush=True)
    pm = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(base)), str(adapters[0]), adapter_name="a0"
    )
    for i, path in enumerate(adapters[1:], start=1):
        pm.load_adapter(str(path), adapter_name=f"a{i}")
    pm.eval()
    names = [f"a{i % len(adapters)}" for i in range(w["batch"])]
    with torch.no_grad():
        out["peft_mixed"] = timed(lambda: pm.generate(input_ids=ids, adapter_names=names, **kwargs))
    print(f"peft mixed adapters      {out['peft_mixed']:8.1f} tok/s", flush=True)
    return out


def machine_peaks() -> dict[str, float]:
    """f32 matmul GFLOP/s and memory GB/s of this machine, measured now (numpy)."""
    a = np.random.default_rng(0).standard_normal((2048, 2048), dtype=np.float32)
    a @ a
    t = time.perf_counter()
    for _ in range(5):
        a @ a
    gflops = 5 * 2 * 2048**3 / (time.perf_counter() - t) / 1e9
    big = np.ones(64 * 1024 * 1024, np.float32)  # 256 MB
    dst = np.empty_like(big)
    np.copyto(dst, big)
    t = time.perf_counter()
    for _ in range(5):
        np.copyto(dst, big)
    gbs = 5 * 2 * big.nbytes / (time.perf_counter() - t) / 1e9
    return {"peak_gflops": gflops, "peak_gbs": gbs}


def roofline_ms(w: dict, peaks: dict[str, float]) -> float:
    """Lower bound of one decode step: max(flops / peak, bytes / bandwidth), LoRA and KV cache included."""
    h, i, L, v = w["hidden_size"], w["intermediate_size"], w["num_hidden_layers"], w["vocab_size"]
    kv = h // w["num_attention_heads"] * w["num_key_value_heads"]
    layer = h * (h + 2 * kv) + h * h + 3 * h * i
    weights = L * layer + v * h  # matmul parameters touched per step (embedding lookups are negligible)
    lora_per_adapter = L * w["rank"] * ((h + h) + (h + kv) * 2 + (h + h) + (h + i) * 2 + (i + h))
    seq = w["prompt"] + w["new"] // 2
    flops = 2 * w["batch"] * (weights + lora_per_adapter) + 4 * w["batch"] * L * seq * h
    bytes_ = 4 * (weights + min(w["batch"], w["adapters"]) * lora_per_adapter + 2 * w["batch"] * L * seq * kv)
    return 1000 * max(flops / (peaks["peak_gflops"] * 1e9), bytes_ / (peaks["peak_gbs"] * 1e9))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a seconds-long smoke run")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-hf", action="store_true", help="skip the transformers/peft peers")
    args = parser.parse_args()
    w = TINY if args.tiny else FULL
    with tempfile.TemporaryDirectory() as tmp:
        base, adapters = build(Path(tmp), w)
        peaks = machine_peaks()
        ours = run_engine(base, adapters, w, args.rounds)
        peers = {} if args.skip_hf else run_hf(base, adapters, w, max(1, args.rounds - 1))
    roof = roofline_ms(w, peaks)
    result = {
        "bench": "decode",
        "workload": {
            k: w[k]
            for k in ("batch", "prompt", "new", "rank", "adapters", "hidden_size", "num_hidden_layers")
        },
        "tok_s": {
            **{k: round(v, 1) for k, v in ours.items() if k != "step_ms"},
            **{k: round(v, 1) for k, v in peers.items()},
        },
        "step_ms_distinct_adapters": round(ours["step_ms"], 2),
        "roofline_step_ms": round(roof, 2),
        "roofline_fraction": round(roof / ours["step_ms"], 3),
        "ratios": {
            "distinct_adapters_vs_base": round(ours["distinct_adapters"] / ours["base"], 3),
            "one_adapter_vs_base": round(ours["one_adapter"] / ours["base"], 3),
        },
        **{k: round(v, 1) for k, v in peaks.items()},
    }
    if peers:
        result["ratios"]["distinct_adapters_vs_peft_mixed"] = round(
            ours["distinct_adapters"] / peers["peft_mixed"], 2
        )
        result["ratios"]["base_vs_transformers"] = round(ours["base"] / peers["hf_base"], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
