"""Decode throughput: loraserve's engine vs HF transformers and peft, same model, same script.

Workload (docs/design.md §7): random Llama (hidden 1024, 8 layers, intermediate 2816, 16/4 heads, vocab 32000,
~140M parameters, f32), prompts of 64 tokens, 32 new tokens, batch 16, adapters of rank 16 on all seven
modules. The default engine also serves 16 distinct DoRA adapters (rank 16) and 16 distinct two-adapter
weighted mixes (``GenerateRequest.mix``) of rank-8 adapters (a mix's rank is its parts' sum: 16, the same
slot work as one rank-16 adapter), each ÷ base (#16's ≥ 0.85), and the 16 distinct adapters with every row
held to a JSON schema (structured outputs: llguidance's bitmask per row and step over a 32000-token BPE
vocabulary trained here) ÷ the same rows unconstrained (target ≥ 0.90; skipped without llguidance).
Prints human-readable lines, then ONE JSON object as the last line.

    python bench/decode.py            # the full workload (a few minutes on 2 cores)
    python bench/decode.py --tiny     # a seconds-long smoke run (used by the tests)
    python bench/decode.py --shape moe --engines default   # a mixture of experts, expert adapters (#33)
    python bench/decode.py --shape 8b-slice --dtype bfloat16 --batch 1 --engines default \
        --quantization int8_head,int4_head --skip-hf   # a quantized base at 8B widths, 4 layers (#34)
    python bench/decode.py --dtype bfloat16 --batch 1,16 --engines default,async --skip-hf --no-extra \
        --no-json   # async decode (as `loraserve worker` runs) against one step at a time
    python bench/decode.py --shape 3b --dtype bfloat16 --batch 16,64,128 --engines default,pallas,xla_onehot,xla \
        --skip-hf --no-extra --no-json --skip-ttft --lazy-compile   # each LoRA backend's engine, one run (TPU)
    python bench/decode.py --shape 3b --dtype bfloat16 --batch 16 --engines none --quantization int8 \
        --skip-hf --no-extra --no-json --skip-ttft --lazy-compile   # only the int8 base (the bf16 one not loaded)

``bench/tpu_session.sh bench`` runs the last two on a TPU with ``--emit-partial`` (a JSON line after each engine;
an engine that fails is recorded and the next one runs). Every JSON line says how many XLA compilations the run
made and their seconds (``compiles``) and, for a dense model, the bytes a base step reads and the batch's adapter
pools add (``bytes``).

On an accelerator (``bench/device.sh`` runs this): ``--shape 8b --dtype bfloat16`` builds an 8B-shaped
random Llama (hidden 4096, 32 layers, intermediate 14336, 32/8 heads, vocab 128256) in bf16 on the
device (torch on ``cuda`` when there is one), writes the adapters' safetensors directly (peft's names,
one peft-made template) and runs transformers/peft on the same device in the same dtype. ``--batch
64,16`` measures several batches in one process (one model load): one JSON line per batch, as each is
complete. ``--workdir`` keeps the built model for a later run (``--build-only`` only builds it),
``--lazy-compile`` compiles the shapes the rows use instead of every bucket at start-up.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from pathlib import Path
from threading import Event

import _compiles  # in bench/, first on sys.path
import _source_tree
import numpy as np

_source_tree.use()  # loraserve from this repository, installed or not
# On a GPU JAX would take 75 % of the memory at start-up; torch runs in this process too.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

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

# 8B-shaped (Llama-3-8B's sizes, random weights): the accelerator run (bench/device.sh)
EIGHT_B = dict(
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=128256,
    batch=16,
    prompt=64,
    new=32,
    rank=16,
    adapters=16,
)
# Llama-3.2-3B-shaped (random weights, untied head): the full-depth model that fits one 16 GB TPU v5e chip in
# bf16 (6.4 GB of weights), #56's decode workload
THREE_B = dict(
    EIGHT_B,
    hidden_size=3072,
    intermediate_size=8192,
    num_hidden_layers=28,
    num_attention_heads=24,
    num_key_value_heads=8,
)
# Llama-3-8B's widths and vocabulary with 4 of its 32 layers (3.9 GB in bf16): its matrices are a real
# model's, so a CPU's per-matrix kernel rates (quantized ones above all) are what an 8B model would see,
# where the 1024-wide bench model's small matrices leave each call's fixed costs in view
EIGHT_B_SLICE = dict(EIGHT_B, num_hidden_layers=4)
# A mixture of experts (Qwen3-MoE, random): 8 layers, 32 experts top-4 of intermediate 512, hidden 1024;
# adapters of rank 16 on attention's four projections and on every expert's gate/up and down
# (peft's target_parameters). peft cannot batch such adapters ("lora.ParamWrapper does not support mixed
# adapter batches"): its peer row runs one generate per adapter, as a peft user must.
MOE = dict(
    FULL,
    family="qwen3_moe",
    intermediate_size=2816,
    moe_intermediate_size=512,
    num_experts=32,
    num_experts_per_tok=4,
)
MOE_EXPERT_TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
SHAPES = {"bench": FULL, "tiny": TINY, "3b": THREE_B, "8b": EIGHT_B, "8b-slice": EIGHT_B_SLICE, "moe": MOE}
MODEL_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
)


def torch_device() -> str:
    """Where the torch side (the direct build, transformers, peft) runs: ``cuda`` when there is one."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def hf_load(path: Path, dtype: str):
    """``AutoModelForCausalLM.from_pretrained`` in ``dtype`` (``dtype=`` since transformers 4.56, before
    that ``torch_dtype=``)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    return AutoModelForCausalLM.from_pretrained(str(path), **{key: getattr(torch, dtype)})


def build_direct(workdir: Path, w: dict, dtype: str, context: int = 256) -> tuple[Path, list[Path]]:
    """Like :func:`build`, fast enough for an 8B shape: the random model is made in ``dtype`` on the torch
    device and saved; peft makes one adapter (the template: its tensor names, shapes and
    ``adapter_config.json``), and every adapter's weights are then drawn on the device (N(0, 0.01²), seeded
    by its index) and written straight to safetensors in ``dtype``.

    On a GPU the model's values are HF's own init. On a CPU (a TPU host: torch has no device there) HF's init
    draws every value serially (~25-50 M values a second: minutes for a 3B model), so the model is allocated
    without init and filled by :func:`_fill_like_hf_init` on every core instead (HF's distribution, other
    values), and the adapters are drawn on every core too."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from loraserve.testing import make_adapter

    device = torch_device()
    config = AutoConfig.for_model(
        "llama",
        bos_token_id=1,
        eos_token_id=2,
        max_position_embeddings=context,
        **{k: w[k] for k in MODEL_KEYS},
    )
    torch.manual_seed(0)
    if device == "cpu":
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        model = model.to(getattr(torch, dtype)).to_empty(device="cpu")
        _fill_like_hf_init(model, config.initializer_range)
    else:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)
    model = model.to(getattr(torch, dtype)).eval()
    base = workdir / "base"
    # 2 GB files: loading one holds its bytes twice besides the float32 copy (models.checkpoint)
    model.save_pretrained(str(base), safe_serialization=True, max_shard_size="2GB")
    template = workdir / "template"
    make_adapter(model, template, r=w["rank"], alpha=2.0 * w["rank"], targets=MODULES, seed=0, scale=0.01)
    del model
    shapes = {k: tuple(v.shape) for k, v in load_file(str(template / "adapter_model.safetensors")).items()}

    def write(i: int) -> Path:
        out = workdir / f"a{i}"
        out.mkdir(parents=True, exist_ok=True)
        gen = torch.Generator(device=device).manual_seed(i)
        tensors = {
            k: (0.01 * torch.randn(s, generator=gen, device=device)).to(getattr(torch, dtype)).cpu()
            for k, s in shapes.items()
        }
        save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
        shutil.copy(template / "adapter_config.json", out / "adapter_config.json")
        return out

    # torch draws a tensor serially and releases the GIL: on a CPU, one adapter a core
    workers = min(8, os.cpu_count() or 1) if device == "cpu" else 1
    with ThreadPoolExecutor(workers) as pool:
        adapters = list(pool.map(write, range(w["adapters"])))
    return base, adapters


def _fill_like_hf_init(model, std: float, chunk: int = 1 << 23) -> None:
    """Fill an allocated, uninitialised HF Llama as its init would (every matrix N(0, ``std``²), the norms'
    weights 1) with numpy's generator on every core (it releases the GIL), in pieces of ``chunk`` values, each
    seeded by its place: the same values whatever the number of cores."""
    import torch

    work = []
    for i, (_, p) in enumerate(model.named_parameters()):
        if p.ndim == 1:
            with torch.no_grad():
                p.fill_(1.0)
            continue
        rows = max(1, chunk // p[0].numel())
        work += [(i, p, r, rows) for r in range(0, p.shape[0], rows)]

    def fill(item) -> None:
        i, p, r, rows = item
        piece = p[r : r + rows]
        values = np.random.default_rng([i, r]).standard_normal(tuple(piece.shape), dtype=np.float32)
        values *= std
        with torch.no_grad():
            piece.copy_(torch.from_numpy(values))

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        list(pool.map(fill, work))


def build_or_reuse(workdir: Path, w: dict, dtype: str, direct: bool) -> tuple[Path, list[Path]]:
    """:func:`build` / :func:`build_direct` into ``workdir``, unless ``workdir/built.json`` says it holds
    the same model and at least ``w['adapters']`` adapters already (then those are returned)."""
    marker = workdir / "built.json"
    keys = (*MODEL_KEYS, "rank", "family", "num_experts", "num_experts_per_tok", "moe_intermediate_size")
    want = {"model": {k: w.get(k) for k in keys}, "dtype": dtype, "direct": direct}
    if marker.exists():
        have = json.loads(marker.read_text())
        if have.get("key") == want and have.get("adapters", 0) >= w["adapters"]:
            return workdir / "base", [workdir / f"a{i}" for i in range(w["adapters"])]
        marker.unlink()
    workdir.mkdir(parents=True, exist_ok=True)
    base, adapters = build_direct(workdir, w, dtype) if direct else build(workdir, w)
    marker.write_text(json.dumps({"key": want, "adapters": len(adapters)}))
    return base, adapters


def build(workdir: Path, w: dict, context: int = 256) -> tuple[Path, list[Path]]:
    """Save the random base model (``context`` = its max_position_embeddings) and ``w['adapters']`` random
    PEFT adapters; return their folders."""

    from loraserve.testing import build_model

    moe = "num_experts" in w
    keys = [
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
    ]
    if moe:
        keys += ["moe_intermediate_size", "num_experts", "num_experts_per_tok"]
    model = build_model(
        w.get("family", "llama"),
        seed=0,
        vocab_size=w["vocab_size"],
        max_position_embeddings=context,
        **({"head_dim": w["hidden_size"] // w["num_attention_heads"]} if moe else {}),
        **{k: w[k] for k in keys},
    )
    base = workdir / "base"
    model.save_pretrained(str(base), safe_serialization=True)
    return base, save_adapters(workdir, base, w)


def save_adapters(workdir: Path, base: Path, w: dict) -> list[Path]:
    """``w['adapters']`` random rank-``w['rank']`` PEFT adapters of the model in ``base`` (std 0.01: they
    perturb it a little), saved as ``workdir/a<i>``; their folders."""
    from transformers import AutoModelForCausalLM

    from loraserve.testing import make_adapter

    moe = "num_experts" in w
    adapters = []
    targets = MODULES[:4] if moe else MODULES  # a MoE's MLP is its experts
    extra = {"target_parameters": MOE_EXPERT_TARGETS} if moe else {}
    for i in range(w["adapters"]):
        fresh = AutoModelForCausalLM.from_pretrained(str(base))
        make_adapter(
            fresh,
            workdir / f"a{i}",
            r=w["rank"],
            alpha=2.0 * w["rank"],
            targets=targets,
            seed=i,
            scale=0.01,
            **extra,
        )
        adapters.append(workdir / f"a{i}")
    return adapters


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


# The constrained rows' schema: one long string, so every row writes inside it for the whole round (a random
# model given a choice would close a list or an object early and leave the batch) with nearly every token
# allowed: the mask's most expensive state (llguidance walks the whole token trie).
JSON_ROW_SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "minLength": 4000}},
    "required": ["text"],
    "additionalProperties": False,
}


def build_grammars(vocab_size: int):
    """A structured-output compiler over a byte-level BPE of ``vocab_size`` tokens trained here on random
    words (the bench model has no tokenizer; a real one's size and token lengths are what the mask costs),
    or None without llguidance (e.g. the accelerator image)."""
    try:
        import llguidance  # noqa: F401
    except ImportError:
        print("llguidance is not installed: no JSON rows", flush=True)
        return None
    from loraserve.testing import train_bpe
    from loraserve.worker.grammar import Grammars

    rng = np.random.default_rng(0)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"))
    words = ["".join(rng.choice(letters, rng.integers(2, 9))) for _ in range(60_000)]
    fast = train_bpe([" ".join(words[i : i + 50]) for i in range(0, len(words), 50)], vocab_size)
    return Grammars(fast, vocab_size, (fast.eos_token_id,))


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
    """End-to-end and decode-only tok/s of a peer from ``rounds`` rounds of ``new`` tokens.

    ``timed_round(new)`` returns (seconds, the gaps between consecutive tokens). A decode step is the
    median gap over every step of every round, as for our engine (docs/design.md §7): prefill and the first
    token are not in any gap, and one stalled step moves the median by nothing. (The difference of two
    medians of whole rounds, t(new) - t(1), used before, went to zero or below when a stall hit the
    short rounds, which made a peer look thousands of times faster.)
    """
    runs = [timed_round(w["new"]) for _ in range(rounds)]
    gaps = [g for _, round_gaps in runs for g in round_gaps]
    if not gaps:
        raise RuntimeError("the peer gave no per-token timestamps: a round needs at least 2 new tokens")
    step_s = max(statistics.median(gaps), 1e-9)
    return {
        "e2e_tok_s": w["batch"] * w["new"] / statistics.median(t for t, _ in runs),
        "decode_tok_s": w["batch"] / step_s,
        "step_ms": 1000 * step_s,
    }


def engine_rates(runs: list[tuple[float, float, list[float]]], w: dict) -> dict[str, float]:
    """Rates of our engine from rounds of (total seconds, decode-phase seconds, token gaps). The rows'
    rounds are interleaved (base, one adapter, distinct, …, then again), so drift shows in every row alike.

    A decode step is the median gap between a row's consecutive tokens over every step of every round
    (docs/design.md §7: the median over interleaved decode steps): a stall of the VM in one step moves a median
    of hundreds of steps by nothing, where it moved a round's total. The peers below are timed the same
    way, from a stopping criterion that stamps each generated token (``decode_rates``).
    """
    total = statistics.median(r[0] for r in runs)
    gaps = [g for r in runs for g in r[2]]
    step_s = (
        max(statistics.median(gaps), 1e-9)
        if gaps
        else max(statistics.median(r[1] for r in runs), 1e-9) / max(w["new"] - 1, 1)
    )
    return {
        "e2e_tok_s": w["batch"] * w["new"] / total,
        "decode_tok_s": w["batch"] / step_s,
        "step_ms": 1000 * step_s,
    }


def _report(name: str, r: dict[str, float]) -> None:
    print(
        f"{name:56s} decode {r['decode_tok_s']:8.1f} tok/s  e2e {r['e2e_tok_s']:8.1f} tok/s  "
        f"step {r['step_ms']:7.2f} ms",
        flush=True,
    )


# Engine configurations run in the same script: (kernel_backend, lora_dtype, linear_backend, async_decode) and
# the suffix of their keys. _xla_linear: the default with XLA's dot for every base projection (kernels.linear),
# the peer of a bf16 model's C++ decode projections; _async: the default with async decode, as `loraserve
# worker` runs (each step dispatched before the last one's tokens are read); neither in the default --engines.
ENGINES = {
    "": ("auto", "", "auto", False),
    "_bf16_pools": ("auto", "bfloat16", "auto", False),
    "_xla": ("xla", "", "auto", False),
    "_xla_linear": ("auto", "", "xla", False),
    "_async": ("auto", "", "auto", True),
    # one engine per multi-LoRA backend, side by side in one run (on a TPU: which one `auto` should be)
    "_pallas": ("pallas", "", "auto", False),
    "_xla_onehot": ("xla-onehot", "", "auto", False),
}


def run_engine(
    base: Path,
    adapters: list[Path],
    w: dict,
    rounds: int,
    backend: str = "auto",
    lora_dtype: str = "",
    linear_backend: str = "auto",
    ttft: bool = True,
    extra: dict[str, Path] | None = None,
    checkpoint=None,
    dtype: str = "float32",
    lazy: bool = False,
    grammars=None,
    async_decode: bool = False,
) -> dict[str, dict[str, float]]:
    """loraserve's engine for base-only, 1 adapter and len(adapters) distinct adapters (+ TTFTs); with
    ``extra`` (:func:`build_extra`) also distinct DoRA adapters and distinct two-adapter mixes; with
    ``grammars`` (:func:`build_grammars`) the distinct adapters again, every row held to JSON_ROW_SCHEMA.

    ``checkpoint``: ``base`` already loaded (in ``dtype``), shared by several engines. ``lazy``: no
    warm-up; each shape compiles when first run, and one untimed round of every row comes first.
    """
    from loraserve.adapters.sources import LocalAdapterSource
    from loraserve.engine.config import EngineConfig
    from loraserve.engine.engine import Engine
    from loraserve.models.checkpoint import load_checkpoint

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
        dtype=dtype,
        lora_dtype=lora_dtype,
        linear_backend=linear_backend,
        async_decode=async_decode,
    )
    engine = Engine(checkpoint or load_checkpoint(str(base), dtype=dtype), cfg, source=src)
    label = f"loraserve[{engine.backend}, {cfg.pool_dtype} pools{', async' if async_decode else ''}]"
    engine.start(warmup=not lazy)
    try:
        return _serve_rows(engine, label, w, len(adapters), rounds, extra, lazy, grammars, ttft)
    finally:  # a row that failed leaves no engine holding the device
        engine.stop()


def _serve_rows(
    engine, label: str, w: dict, n_adapters: int, rounds: int, extra, lazy: bool, grammars, ttft: bool
) -> dict[str, dict[str, float]]:
    """:func:`run_engine`'s rows (and TTFTs) on its started ``engine``; raises when a request fails."""
    from loraserve.engine.request import EngineRequest, Failed, Finished, Sampling, Token
    from loraserve.protos.v1 import inference_pb2 as pb

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, w["vocab_size"], w["prompt"]).tolist() for _ in range(w["batch"])]

    spec = pb.StructuredOutput(json_schema=json.dumps(JSON_ROW_SCHEMA))

    def one_round(names: list[str], new: int, constrained: bool = False) -> tuple[float, float, list[float]]:
        """Serve one request per name; -> (seconds in all, seconds of the decode phase, the gaps between
        a row's consecutive tokens: one per decode step and row).

        Every prompt is prefilled before the first decode step (prefill_per_step = batch), so the
        decode phase runs from the last row's first token to the last row's last one.
        """
        done = [Event() for _ in names]
        first = [0.0] * len(names)
        last = [0.0] * len(names)
        stamps: list[list[float]] = [[] for _ in names]
        failures: list[str] = []

        def sink(e, i: int) -> None:
            now = time.perf_counter()
            if isinstance(e, Token) or (isinstance(e, Finished) and e.token_id is not None):
                stamps[i].append(now)
            if isinstance(e, Token | Finished) and not first[i]:
                first[i] = now
            if isinstance(e, Finished | Failed):
                last[i] = now
                done[i].set()
            if isinstance(e, Failed):  # a step that failed (e.g. a backend that does not compile here)
                failures.append(e.message)

        start = time.perf_counter()
        for i, (name, prompt) in enumerate(zip(names, prompts, strict=True)):
            engine.submit(
                EngineRequest(
                    uuid.uuid4().hex,
                    name,
                    prompt,
                    Sampling(max_tokens=new, ignore_eos=True),
                    lambda e, i=i: sink(e, i),
                    grammar=grammars.matcher(spec) if constrained else None,
                )
            )
        for ev in done:
            ev.wait(600)
        if failures:
            raise RuntimeError(f"{label}: {len(failures)} of {len(names)} requests failed: {failures[0]}")
        # from a row's second token on: its first decode token can leave in the same engine step as the
        # prefill's token (a ~0 gap that is no decode step)
        gaps = [b - a for row in stamps for a, b in itertools.pairwise(row[1:])]
        if constrained:  # a row that completed its JSON early would leave the batch: not the same work
            short = min(len(row) for row in stamps)
            assert short == new, f"a constrained row stopped after {short} of {new} tokens"
        return max(last) - start, max(last) - max(first), gaps

    rows = adapter_rows(w, n_adapters, extra is not None)
    if grammars is not None:
        rows["distinct_adapters_json"] = rows["distinct_adapters"]
    runs: dict[str, list[tuple[float, float, list[float]]]] = {name: [] for name in rows}
    out: dict[str, dict[str, float]] = {}
    for name, refs in rows.items() if lazy else ():
        one_round(refs, w["new"], name.endswith("_json"))  # compiles what the row runs
    for _ in range(rounds):  # interleaved: the VM's drift over minutes hits every row alike
        for name, refs in rows.items():
            one_round(refs, 2)  # loads the adapters (and writes the mixes) before timing
            runs[name].append(one_round(refs, w["new"], name.endswith("_json")))
    for name in rows:
        out[name] = engine_rates(runs[name], w)
        _report(f"{label} {name}", out[name])
    if ttft:
        one_round(rows["distinct_adapters"], 2)  # a0.. resident again
        out["ttft"] = cold_vs_warm_ttft(engine, prompts[0], n_adapters)
        print(f"TTFT warm {out['ttft']['warm_ms']:.1f} ms, cold {out['ttft']['cold_ms']:.1f} ms", flush=True)
    return out


def cold_vs_warm_ttft(engine, prompt: list[int], n_adapters: int) -> dict[str, float]:
    """Time to first token of one request whose adapter is resident vs one that must be loaded from the
    local store first (unloaded beforehand; no host tier)."""
    from loraserve.engine.request import EngineRequest, Finished, Sampling, Token

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


def run_hf(
    base: Path, adapters: list[Path], ws: list[dict], rounds: int, dtype: str = "float32"
) -> Iterator[tuple[int, dict[str, dict[str, float]]]]:
    """transformers generate (no LoRA) and peft mixed-adapter generate(adapter_names=...), greedy, in
    ``dtype`` on the torch device, for each workload of ``ws``: yields ``(index, {"hf_base": …,
    "peft_mixed": …})`` as each workload's pair is complete. One model serves every workload: first
    transformers, then peft wrapping that same model with ``adapters`` (workload ``w`` names the first
    ``w['adapters']``). In bf16 the adapters stay bf16 (peft would otherwise upcast them to f32)."""
    import inspect

    import torch
    from peft import PeftModel
    from transformers import StoppingCriteria, StoppingCriteriaList

    device = torch_device()

    class Stamps(StoppingCriteria):
        """Called by generate once per new token: records when (after a CUDA sync, so a stamp is the
        token's real time); never stops generation (min/max_new_tokens do)."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            if device == "cuda":
                torch.cuda.synchronize()
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def timer(generate, ids):
        def timed_round(new: int) -> tuple[float, list[float]]:
            stamps = Stamps()
            t = time.perf_counter()
            with torch.no_grad():
                generate(
                    ids,
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                    pad_token_id=0,
                    stopping_criteria=StoppingCriteriaList([stamps]),
                )
            if device == "cuda":
                torch.cuda.synchronize()
            total = time.perf_counter() - t
            return total, [b - a for a, b in itertools.pairwise(stamps.times)]

        timed_round(2)  # warm-up
        return timed_round

    prompts = [
        torch.tensor(np.random.default_rng(0).integers(3, w["vocab_size"], (w["batch"], w["prompt"]))).to(
            device
        )
        for w in ws
    ]
    hf = hf_load(base, dtype).to(device).eval()
    base_rates = []
    for w, ids in zip(ws, prompts, strict=True):
        base_rates.append(decode_rates(timer(hf.generate, ids), w, rounds))
        _report(f"transformers generate, batch {w['batch']}", base_rates[-1])
    kw = {}
    if dtype != "float32":
        accepts = inspect.signature(PeftModel.load_adapter).parameters
        kw = {
            k: v for k, v in (("autocast_adapter_dtype", False), ("low_cpu_mem_usage", True)) if k in accepts
        }
    pm = PeftModel.from_pretrained(hf, str(adapters[0]), adapter_name="a0", **kw)
    for i, path in enumerate(adapters[1 : max(w["adapters"] for w in ws)], start=1):
        pm.load_adapter(str(path), adapter_name=f"a{i}", **kw)
    pm.eval()
    for k, (w, ids) in enumerate(zip(ws, prompts, strict=True)):
        names = [f"a{i % w['adapters']}" for i in range(w["batch"])]
        if "num_experts" in w:  # peft cannot batch expert adapters: one generate per adapter, in turn
            generate = _per_adapter_generate(pm, names)
        else:

            def generate(x, names=names, **kw):
                return pm.generate(input_ids=x, adapter_names=names, **kw)

        rates = decode_rates(timer(generate, ids), w, rounds)
        if "num_experts" in w:  # a batch step is every group's step: the median gap is one group's
            groups = len(set(names))
            rates.update(decode_tok_s=rates["decode_tok_s"] / groups, step_ms=rates["step_ms"] * groups)
        _report(f"peft mixed-adapter generate, batch {w['batch']}", rates)
        yield k, {"hf_base": base_rates[k], "peft_mixed": rates}


def _per_adapter_generate(pm, names: list[str]):
    """``generate`` over a batch whose rows name adapters peft cannot mix: each adapter's rows in their own
    generate call, one after another. The stopping criteria see every call's tokens; a round's gaps then
    hold each call's own steps (the median is one group's step, the round time the sum): ``run_hf``
    multiplies the step by the number of groups (equal groups: rows ÷ the sum of the groups' steps)."""

    def generate(x, stopping_criteria=None, **kw):
        groups: dict[str, list[int]] = {}
        for row, name in enumerate(names):
            groups.setdefault(name, []).append(row)
        for name, rows in groups.items():
            pm.set_adapter(name)
            pm.generate(input_ids=x[rows], stopping_criteria=stopping_criteria, **kw)

    return generate


def machine_peaks(repeats: int = 10, dtype: str = "float32") -> dict[str, float]:
    """f32 matmul GFLOP/s (numpy, 2048²) and memory read GB/s (a jitted sum over 256 MB: a decode step
    streams weights, it does not copy them), measured now; each the best of ``repeats`` runs, since a
    peak is a maximum and this machine's speed drifts. A bf16 model on a CPU also times a jitted bf16
    matmul accumulating in f32 as the model's are ([256, 2048] x [2048, 8192]: CPUs with AMX run it
    ~5x faster than f32) and takes the faster. On an accelerator: a jitted 8192² matmul in ``dtype``
    and a sum over 2 GiB, on the device."""
    import jax
    import jax.numpy as jnp

    flops = []
    if jax.default_backend() == "cpu":
        a = np.random.default_rng(0).standard_normal((2048, 2048), dtype=np.float32)
        a @ a
        for _ in range(repeats):
            t = time.perf_counter()
            a @ a
            flops.append(2 * 2048**3 / (time.perf_counter() - t) / 1e9)
        if dtype != "float32":
            x, w = jnp.ones((256, 2048), dtype), jnp.ones((8192, 2048), dtype)
            dot = jax.jit(
                lambda x, w: jax.lax.dot_general(
                    x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
                )
            )
            dot(x, w).block_until_ready()
            for _ in range(repeats):
                t = time.perf_counter()
                dot(x, w).block_until_ready()
                flops.append(2 * 256 * 2048 * 8192 / (time.perf_counter() - t) / 1e9)
        big = jnp.ones(64 * 1024 * 1024, jnp.float32)  # 256 MB
    else:
        m = jnp.ones((8192, 8192), dtype)
        mm = jax.jit(lambda x: x @ x)
        mm(m).block_until_ready()
        for _ in range(repeats):
            t = time.perf_counter()
            mm(m).block_until_ready()
            flops.append(2 * 8192**3 / (time.perf_counter() - t) / 1e9)
        big = jnp.ones(512 * 1024 * 1024, jnp.float32)  # 2 GiB
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


def roofline_ms(w: dict, peaks: dict[str, float], pool_itemsize: int = 4, weight_itemsize: int = 4) -> float:
    """Lower bound of one decode step: max(flops / peak, bytes / bandwidth), LoRA and KV cache included
    (weights and KV cache of ``weight_itemsize`` bytes an element, slot pools of ``pool_itemsize``)."""
    h, i, L, v = w["hidden_size"], w["intermediate_size"], w["num_hidden_layers"], w["vocab_size"]
    kv = h // w["num_attention_heads"] * w["num_key_value_heads"]
    layer = h * (h + 2 * kv) + h * h + 3 * h * i
    weights = L * layer + v * h  # matmul parameters touched per step (embedding lookups are negligible)
    lora_per_adapter = lora_bytes({**w, "batch": 1, "adapters": 1}) // 4
    seq = w["prompt"] + w["new"] // 2
    flops = 2 * w["batch"] * (weights + lora_per_adapter) + 4 * w["batch"] * L * seq * h
    bytes_ = weight_itemsize * (weights + 2 * w["batch"] * L * seq * kv) + lora_bytes(w, pool_itemsize)
    return 1000 * max(flops / (peaks["peak_gflops"] * 1e9), bytes_ / (peaks["peak_gbs"] * 1e9))


def base_bytes_read(w: dict, quantization: str, itemsize: int) -> int:
    """Bytes one base decode step (no adapters) reads: the layers' projections and the head, quantized as
    ``quantization`` says (QUANTIZED_ROWS: int8 a byte a value + an f32 scale a row, int4 half a byte + an f32
    scale per group of 128 inputs; ``_head``: the head so too, else in ``itemsize``), and the KV cache."""
    h, i, L, v = w["hidden_size"], w["intermediate_size"], w["num_hidden_layers"], w["vocab_size"]
    kv = h // w["num_attention_heads"] * w["num_key_value_heads"]
    shapes = [(h + 2 * kv, h), (h, h), (2 * i, h), (h, i)]  # [out, in]

    def matrix(out: int, inputs: int, q: str) -> int:
        if q == "int8":
            return out * inputs + 4 * out
        if q == "int4":
            return out * inputs // 2 + 4 * out * -(-inputs // 128)
        return itemsize * out * inputs

    method, _, head = quantization.partition("_")
    layers = L * sum(matrix(o, n, method) for o, n in shapes)
    seq = w["prompt"] + w["new"] // 2
    return layers + matrix(v, h, method if head else "") + itemsize * 2 * w["batch"] * L * seq * kv


def adapter_ratio_bound(
    base_step_ms: float, w: dict, peaks: dict[str, float], pool_itemsize: int = 4
) -> float:
    """The distinct-adapters / base decode ratio this machine allows if the adapters' work runs after
    the base model's: the measured base step plus reading the batch's slot pools once at the measured
    read bandwidth (their flops are negligible). The xla backend runs that way; the cpu backend's call
    does not wait for the base matmul, XLA overlaps the two, and the ratio can beat this number."""
    return base_step_ms / (base_step_ms + 1000 * lora_bytes(w, pool_itemsize) / (peaks["peak_gbs"] * 1e9))


# --engines names -> ENGINES keys
ENGINE_NAMES = {
    "default": "",
    "bf16_pools": "_bf16_pools",
    "xla": "_xla",
    "xla_linear": "_xla_linear",
    "async": "_async",
    "pallas": "_pallas",
    "xla_onehot": "_xla_onehot",
    "xla_grouped": "_xla",  # = xla
}
DEFAULT_ENGINES = "default,bf16_pools,xla"


WORKLOAD_KEYS = ("batch", "prompt", "new", "rank", "adapters", "hidden_size", "num_hidden_layers")


def summarize(
    w: dict,
    ours: dict[str, dict[str, float]],
    peers: dict[str, dict[str, float]],
    peaks: dict[str, float],
    dtype: str = "float32",
) -> dict:
    """The JSON object of one workload: rates, ratios and roofline of the engines (and peers) that ran."""
    ours = dict(ours)
    ttft = ours.pop("ttft", None)
    size = 2 if dtype == "bfloat16" else 4
    # bytes an element of each engine's slot pools
    pool = {"": size, "_bf16_pools": 2, "_xla": size, "_xla_linear": size, "_async": size, "_pallas": size,
            "_xla_onehot": size}  # fmt: skip
    ran = [s for s in ENGINES if "base" + s in ours]
    allruns = {**ours, **peers}
    dec = {k: v["decode_tok_s"] for k, v in allruns.items()}
    result: dict = {
        "bench": "decode",
        "workload": {
            k: w[k]
            for k in (*WORKLOAD_KEYS, "family", "num_experts", "num_experts_per_tok", "moe_intermediate_size")
            if k in w
        },
        "decode_tok_s": {k: round(v, 1) for k, v in dec.items()},
        "e2e_tok_s": {k: round(v["e2e_tok_s"], 1) for k, v in allruns.items()},
        "step_ms": {k: round(v["step_ms"], 2) for k, v in allruns.items()},
    }
    if ttft:
        result["ttft_ms"] = {"warm": round(ttft["warm_ms"], 1), "cold": round(ttft["cold_ms"], 1)}
    dense = "num_experts" not in w  # the roofline and serial bound count a dense model's bytes
    if "" in ran and dense:
        roof = roofline_ms(w, peaks, pool[""], size)
        result["roofline_step_ms"] = round(roof, 2)
        result["roofline_fraction"] = round(roof / ours["distinct_adapters"]["step_ms"], 3)
    if "_bf16_pools" in ran and dense:
        roof_bf16 = roofline_ms(w, peaks, 2, size)
        result["roofline_fraction_bf16_pools"] = round(
            roof_bf16 / ours["distinct_adapters_bf16_pools"]["step_ms"], 3
        )
    ratios = result["ratios"] = {}
    for s in ran:
        if s not in ("_xla", "_xla_linear"):
            ratios[f"distinct_adapters{s}_vs_base"] = round(dec["distinct_adapters" + s] / dec["base" + s], 3)
            if dense:
                ratios[f"distinct_adapters{s}_vs_base_serial_bound"] = round(
                    adapter_ratio_bound(ours["base" + s]["step_ms"], w, peaks, pool[s]), 3
                )
    if "_xla" in ran:
        ratios["distinct_adapters_xla_vs_base"] = round(dec["distinct_adapters_xla"] / dec["base_xla"], 3)
    if "_xla_linear" in ran and "" in ran:  # what the C++ base projections bring (bf16 model)
        ratios["base_vs_base_xla_linear"] = round(dec["base"] / dec["base_xla_linear"], 3)
    if "" in ran:
        ratios["one_adapter_vs_base"] = round(dec["one_adapter"] / dec["base"], 3)
    if "_async" in ran and "" in ran:  # async decode ÷ one step at a time, the same rows
        for row in ("base", "one_adapter", "distinct_adapters"):
            ratios[f"{row}_async_vs_{row}"] = round(dec[row + "_async"] / dec[row], 3)
    for q in ("", *QUANTIZED_ROWS):  # a base step's bytes at the measured read rate ÷ its time
        if "base" + (q and "_" + q) in ours and dense:
            roof = 1000 * base_bytes_read(w, q, size) / (peaks["peak_gbs"] * 1e9)
            result[f"base{q and '_' + q}_roofline_fraction"] = round(
                roof / ours["base" + (q and "_" + q)]["step_ms"], 3
            )
    for q in QUANTIZED_ROWS:  # a quantized base ÷ the same rows on the unquantized one
        if "base_" + q in dec and "base" in dec:
            ratios[f"base_{q}_vs_base"] = round(dec["base_" + q] / dec["base"], 3)
            ratios[f"distinct_adapters_{q}_vs_base_{q}"] = round(
                dec["distinct_adapters_" + q] / dec["base_" + q], 3
            )
            if dense:  # the same bound as the unquantized rows': the quantized base step + the pools' bytes
                ratios[f"distinct_adapters_{q}_vs_base_{q}_serial_bound"] = round(
                    adapter_ratio_bound(ours["base_" + q]["step_ms"], w, peaks, pool[""]), 3
                )
    # what a base step reads (weights and KV cache) and what its adapters add (pools in the model's dtype)
    if dense:
        result["bytes"] = {"base": base_bytes_read(w, "", size), "adapters": lora_bytes(w, size)}
        result["bytes"].update(
            {f"base_{q}": base_bytes_read(w, q, size) for q in QUANTIZED_ROWS if "base_" + q in ours}
        )
    if "distinct_adapters_json" in dec:  # structured outputs: masked rows ÷ the same rows unmasked
        ratios["distinct_adapters_json_vs_distinct_adapters"] = round(
            dec["distinct_adapters_json"] / dec["distinct_adapters"], 3
        )
    for s in ran:
        if "distinct_dora" + s in dec:
            ratios[f"distinct_dora{s}_vs_base"] = round(dec["distinct_dora" + s] / dec["base" + s], 3)
            ratios[f"distinct_mixes{s}_vs_base"] = round(dec["distinct_mixes" + s] / dec["base" + s], 3)
    if ttft:
        ratios["cold_vs_warm_ttft"] = round(ttft["ratio"], 2)
    result.update({k: round(v, 1) for k, v in peaks.items()})
    if peers:
        for s in ran:
            ratios[f"distinct_adapters{s}_vs_peft_mixed"] = round(
                dec["distinct_adapters" + s] / dec["peft_mixed"], 2
            )
        if "" in ran:
            ratios["base_vs_transformers"] = round(dec["base"] / dec["hf_base"], 2)
            ratios["e2e_distinct_adapters_vs_peft_mixed"] = round(
                allruns["distinct_adapters"]["e2e_tok_s"] / allruns["peft_mixed"]["e2e_tok_s"], 2
            )
    return result


def platform_info() -> dict[str, str]:
    """The devices loraserve (JAX) and the peers (torch) ran on."""
    import jax
    import torch

    dev = jax.devices()[0]
    return {
        "jax": f"{jax.default_backend()}: {getattr(dev, 'device_kind', dev.platform)} x{jax.device_count()}",
        "torch": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
    }


QUANTIZED_ROWS = ("int8", "int4", "int8_head", "int4_head")  # <q>_head: --quantize-lm-head too


def _quantizations(text: str) -> tuple[str, ...]:
    """--quantization: "none", or a comma-separated list of QUANTIZED_ROWS."""
    names = tuple(dict.fromkeys(t.strip() for t in text.split(",") if t.strip() and t.strip() != "none"))
    bad = [n for n in names if n not in QUANTIZED_ROWS]
    if bad:
        raise argparse.ArgumentTypeError(
            f"unknown quantization {bad[0]!r} (none or a list of {QUANTIZED_ROWS})"
        )
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a seconds-long smoke run (= --shape tiny)")
    parser.add_argument("--shape", choices=tuple(SHAPES), default="bench", help="model and workload")
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="the model's, ours and the peers'"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--batch",
        help="override the batch size (and the number of adapters); a comma list (64,16) runs each in turn "
        "in one process and prints one JSON line per batch",
    )
    parser.add_argument("--adapters", type=int, help="distinct adapters (default: the batch size)")
    parser.add_argument(
        "--engines",
        default=DEFAULT_ENGINES,
        help=f"loraserve configurations to run, in this order: a comma list of {', '.join(ENGINE_NAMES)}"
        f" (default {DEFAULT_ENGINES}), or none (only the --quantization rows; the unquantized model is then"
        " not loaded)",
    )
    parser.add_argument("--no-extra", action="store_true", help="skip the DoRA and mix rows")
    parser.add_argument("--no-json", action="store_true", help="skip the JSON-constrained rows")
    parser.add_argument(
        "--quantization",
        default="none",
        type=_quantizations,
        help="also run the default engine over the base quantized so: a comma list of int8, int4, int8_head,"
        " int4_head (_head: the head quantized too, --quantize-lm-head); rows <name>_<each>",
    )
    parser.add_argument("--skip-ttft", action="store_true", help="skip the cold vs warm TTFT")
    parser.add_argument("--skip-hf", action="store_true", help="skip the transformers/peft peers")
    parser.add_argument("--workdir", help="build the model and adapters here, reuse them when there")
    parser.add_argument("--build-only", action="store_true", help="build (or find) them, then stop")
    parser.add_argument(
        "--lazy-compile",
        action="store_true",
        help="no engine warm-up: compile the shapes the rows run (an untimed round each) instead of all",
    )
    parser.add_argument("--compilation-cache", help="JAX's persistent compilation cache folder")
    parser.add_argument(
        "--emit-partial",
        action="store_true",
        help="after each engine, print the workload's JSON line so far (marked partial): a run cut short"
        " keeps the engines that finished; an engine that fails is recorded (the line's errors) and the next"
        " one runs",
    )
    args = parser.parse_args()
    shape = "tiny" if args.tiny else args.shape
    names = [] if args.engines == "none" else [n.strip() for n in args.engines.split(",") if n.strip()]
    unknown = set(names) - set(ENGINE_NAMES)
    if unknown:
        parser.error(f"unknown engines {sorted(unknown)}; expected some of {', '.join(ENGINE_NAMES)}")
    if not names and not args.quantization:
        parser.error("--engines none runs only the --quantization rows: name some")
    engines = {ENGINE_NAMES[n]: ENGINES[ENGINE_NAMES[n]] for n in names}  # in the order given
    workloads = []
    for b in [int(b) for b in args.batch.split(",")] if args.batch else [0]:
        w = dict(SHAPES[shape])
        if b:
            w.update(batch=b, adapters=b)
        if args.adapters:
            w.update(adapters=args.adapters)
        workloads.append(w)
    n_adapters = max(w["adapters"] for w in workloads)
    direct = shape.startswith(("3b", "8b")) or args.dtype != "float32"
    started = time.perf_counter()

    def progress(what: str) -> None:
        """A phase done, with the seconds since the start, on stderr: a run its time limit cuts still says
        where its time went (a TPU call of 10 minutes builds, loads and compiles before any row is timed)."""
        print(f"[decode {time.perf_counter() - started:7.1f} s] {what}", file=sys.stderr, flush=True)

    _compiles.start()
    with nullcontext(args.workdir) if args.workdir else tempfile.TemporaryDirectory() as tmp:
        base, adapters = build_or_reuse(
            Path(tmp), {**workloads[0], "adapters": n_adapters}, args.dtype, direct
        )
        progress(f"model and {len(adapters)} adapters ready in {base.parent}")
        if args.build_only:
            print(json.dumps({"bench": "decode-build", "seconds": round(time.perf_counter() - started, 1),
                              "shape": shape, "dtype": args.dtype, "adapters": len(adapters),
                              "base_bytes": sum(f.stat().st_size for f in base.iterdir())}))  # fmt: skip
            return
        extra = (
            None
            if args.no_extra or shape == "moe"
            else build_extra(Path(tmp), base, {**workloads[0], "adapters": n_adapters})
        )
        peaks = machine_peaks(repeats=1 if shape == "tiny" else 10, dtype=args.dtype)  # tiny: a smoke run
        progress("the machine's peaks measured")
        if args.compilation_cache:
            from loraserve.engine.engine import enable_compilation_cache

            enable_compilation_cache(args.compilation_cache)
        from loraserve.models.checkpoint import load_checkpoint

        # shared by every engine below
        checkpoint = load_checkpoint(str(base), dtype=args.dtype) if engines else None
        progress("base checkpoint loaded")
        grammars = None if args.no_json or shape == "moe" else build_grammars(workloads[0]["vocab_size"])
        ours: list[dict[str, dict[str, float]]] = [{} for _ in workloads]

        def about() -> dict:
            if args.shape == "bench" and args.dtype == "float32":
                return {"compiles": _compiles.totals()}
            return {
                "shape": shape,
                "dtype": args.dtype,
                "platform": platform_info(),
                # lazy: a shape first seen in a timed round (a prefill the engine split differently) compiles
                # there; the decode phase, timed from the last row's first token, never holds one
                "compile": "lazy" if args.lazy_compile else "warm-up",
                "compiles": _compiles.totals(),
                "seconds": round(time.perf_counter() - started, 1),
            }

        failed: list[dict[str, str]] = [{} for _ in workloads]  # --emit-partial: engine -> why it failed

        def emit(k: int, peers: dict, **more) -> None:
            result = summarize(workloads[k], ours[k], peers, peaks, args.dtype)
            print(
                json.dumps({**result, **about(), **({"errors": failed[k]} if failed[k] else {}), **more}),
                flush=True,
            )

        def attempt(k: int, name: str, run, *a, **kw) -> dict[str, dict[str, float]]:
            """``run(*a, **kw)``; with --emit-partial an engine that fails (a backend that does not compile on
            this device, memory) is recorded in the workload's ``errors`` and the next one runs."""
            if not args.emit_partial:
                return run(*a, **kw)
            try:
                return run(*a, **kw)
            except Exception as exc:
                traceback.print_exc()
                failed[k][name] = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
                return {}

        def quantized_rows(w: dict, quantization: str) -> dict[str, dict[str, float]]:
            method, _, head = quantization.partition("_")
            quantized = load_checkpoint(
                str(base), dtype=args.dtype, quantization=method, quantize_lm_head=head == "head"
            )
            return run_engine(
                base, adapters[: w["adapters"]], w, args.rounds, ttft=False, checkpoint=quantized,
                dtype=args.dtype, lazy=args.lazy_compile,
            )  # fmt: skip

        engine_names = {ENGINE_NAMES[n]: n for n in names}
        for k, (w, mine) in enumerate(zip(workloads, ours, strict=True)):
            for suffix, (backend, lora_dtype, linear_backend, async_decode) in engines.items():
                progress(f"engine {engine_names[suffix]} at batch {w['batch']}: starting")
                runs = attempt(
                    k,
                    engine_names[suffix],
                    run_engine,
                    base,
                    adapters[: w["adapters"]],
                    w,
                    args.rounds,
                    backend,
                    lora_dtype,
                    linear_backend,
                    async_decode=async_decode,
                    ttft=not suffix and not args.skip_ttft,
                    extra=extra
                    if suffix in ("", "_bf16_pools")
                    else None,  # DoRA and mixes on f32 and bf16 pools
                    checkpoint=checkpoint,
                    dtype=args.dtype,
                    lazy=args.lazy_compile,
                    grammars=grammars if not suffix else None,  # the default engine's rows
                )
                mine.update({name + suffix: r for name, r in runs.items()})
                progress(f"engine {engine_names[suffix]} at batch {w['batch']}: {len(runs)} rows")
                gc.collect()  # the engine's slot pools and KV cache off the device before the next one's
                if args.emit_partial:
                    emit(k, {}, partial=True)
            for quantization in args.quantization:  # the default engine over the quantized base, same rows
                runs = attempt(k, quantization, quantized_rows, w, quantization)
                mine.update({f"{name}_{quantization}": r for name, r in runs.items()})
                gc.collect()  # the quantized base too
                if args.emit_partial:
                    emit(k, {}, partial=True)
            if args.skip_hf:  # this workload is complete: its line now, in case a later one does not finish
                emit(k, {})
        del checkpoint
        if args.skip_hf:
            return
        if len(workloads) > 1:  # our numbers, in case the peers do not finish
            for k in range(len(workloads)):
                emit(k, {}, partial=True)
        for k, peers in run_hf(base, adapters, workloads, args.rounds, args.dtype):
            emit(k, peers)


if __name__ == "__main__":
    main()
