"""The tensor-parallel runs of ``test_tensor_parallel.py``, in a process of their own.

JAX must see several CPU devices, which needs ``XLA_FLAGS=--xla_force_host_platform_device_count=8``
before it starts; the pytest process has already started JAX with one device, so the tests run this
module with ``python -m tests.worker.tp_child`` and read the JSON it prints on its last line.

``serve``: for each N, a ``JaxRunner`` with ``tensor_parallel_size=N`` serves one batch mixing four
adapters and base rows (greedy), hot-swapping a slot no row uses between steps; reports the tokens,
the logits of every decode step, the shardings of params, cache and pools, and the compilations
counted over 200 slot swaps with decode steps in between after warm-up.
"""

from __future__ import annotations

import argparse
import json
import re

import jax
import numpy as np

from loraserve.adapters.files import read_adapter_files
from loraserve.adapters.peft import parse_adapter
from loraserve.engine.config import EngineConfig
from loraserve.engine.jax_runner import JaxRunner
from loraserve.engine.request import SamplingRow
from loraserve.engine.runner import PrefillInput
from loraserve.kernels.testing import count_compilations
from loraserve.models import decoder, sharding
from loraserve.models.checkpoint import load_checkpoint
from loraserve.models.sampling import SamplingArrays
from loraserve.models.step import DecodeBatch, DeviceState

PROMPTS = [[5, 17, 33, 100, 7, 9], [3, 4], [250, 11, 12, 13], [60, 61, 62, 63, 64], [8, 8, 8], [99, 1, 2]]
ROW_SLOTS = [0, 1, 2, 3, -1, 0]  # four adapters, a base row, one adapter on two rows; slot 4 is swapped
SLOTS, RANK = 5, 16


def _spec(array) -> str:
    if hasattr(array, "scale"):  # models.quantization.Int8Weight: its values' spec / its scales'
        return f"{_spec(array.q)}/{_spec(array.scale)}"
    sharding = array.sharding
    return str(tuple(sharding.spec)) if hasattr(sharding, "spec") else "single"


def _signature(tree) -> list:
    """(shape, dtype, PartitionSpec) of every leaf: what abstract and real arrays must agree on."""
    return jax.tree.leaves(jax.tree.map(lambda a: (tuple(a.shape), str(a.dtype), str(a.sharding.spec)), tree))


def serve(
    model: str,
    adapters: list[str],
    backend: str,
    n: int,
    steps: int,
    swaps: int,
    dtype: str = "float32",
    quantization: str = "none",
) -> dict:
    quantization, _, head = quantization.partition("+")  # "int4+head": --quantize-lm-head too
    ck = load_checkpoint(model, dtype=dtype, quantization=quantization, quantize_lm_head=head == "head")
    config = EngineConfig(
        max_batch_size=len(PROMPTS), max_seq_len=32, max_loras=SLOTS, max_lora_rank=RANK,
        kernel_backend=backend, tensor_parallel_size=n, min_prefill_bucket=32, dtype=dtype,
    )  # fmt: skip
    runner = JaxRunner(ck, config)
    runner.warmup()
    cfg = ck.config
    weights = [
        parse_adapter(
            *read_adapter_files(path),
            module_shapes=cfg.adapter_shapes(),
            num_layers=cfg.num_layers,
            max_rank=RANK,
        )
        for path in adapters
    ]
    prepared = [runner.prepare(w) for w in weights]
    for slot, values in enumerate(prepared[:4]):
        runner.write_slot(slot, values)
    greedy = SamplingRow()
    tables = decoder.contiguous_page_tables(len(PROMPTS), config.pages_per_row)
    first = runner.prefill(
        [
            PrefillInput(p, 0, s, tables[row], greedy)
            for row, (p, s) in enumerate(zip(PROMPTS, ROW_SLOTS, strict=True))
        ]
    ).tokens.tolist()
    tokens = np.array(first, np.int32)
    positions = np.array([len(p) for p in PROMPTS], np.int32)
    slots = np.array(ROW_SLOTS, np.int32)
    # the step's logits, the cache not donated (the runner's own step consumes it next)
    logits_fn = jax.jit(
        lambda state, batch: decoder.decode(runner.model_config, runner.backend, state, batch)[0]
    )
    out_tokens, out_logits = [first], []
    base = logits_fn(runner.state(), DecodeBatch(tokens, positions, tables, None))
    for step in range(steps):
        runner.write_slot(4, prepared[step % len(prepared)])  # hot swap of a slot no row uses
        plan = runner.backend.plan(slots, SLOTS)
        logits = logits_fn(runner.state(), DecodeBatch(tokens, positions, tables, plan))
        out_logits.append(np.asarray(logits).tolist())
        tokens = runner.decode(tokens, positions, slots, tables, [greedy] * len(PROMPTS)).tokens
        out_tokens.append(tokens.tolist())
        positions = positions + 1
    layer = runner.params["layers"][0]
    first_layer_pools = {**runner.pools.pools.layers[0], **runner.pools.pools.vocab}  # as one report
    shardings = {
        "params": {k: _spec(v) for k, v in layer.items()},
        "embed": _spec(runner.params["embed"]),
        "lm_head": _spec(runner.params["lm_head"]) if "lm_head" in runner.params else None,
        "cache": [_spec(runner.cache[0][0]), _spec(runner.cache[0][1])],
        "pools": {k: _spec(v) for k, v in first_layer_pools.items()},
        "pool_shapes": {k: list(v.addressable_shards[0].data.shape) for k, v in first_layer_pools.items()},
    }
    abstract = {}
    if runner.mesh is not None:  # what the planner lowers on must be what the runner allocates
        st = sharding.abstract_state(
            cfg,
            config,
            runner.mesh,
            runner.backend,
            quantization=quantization,
            quantize_lm_head=head == "head",
        )
        real = {"params": runner.params, "cache": runner.cache, "pools": runner.pools.pools}
        abstract = {k: _signature(st[k]) == _signature(v) for k, v in real.items()}
    mixes = [[0, 1, 2, 3, -1, 4], [-1] * 6, [4] * 6, [2, 2, 0, -1, 1, 3]]
    rows = len(PROMPTS)
    with count_compilations() as count:
        for i in range(swaps):
            runner.write_slot(i % SLOTS, prepared[i % len(prepared)])
            if i % 20 == 0:
                mix = np.array(mixes[(i // 20) % len(mixes)], np.int32)
                runner.decode(
                    np.full(rows, 9, np.int32), np.full(rows, 20, np.int32), mix, tables, [greedy] * rows
                )
    after = {k: _spec(v) for k, v in {**runner.pools.pools.layers[0], **runner.pools.pools.vocab}.items()}
    return {
        "tokens": out_tokens, "logits": out_logits, "base_logits": np.asarray(base).tolist(), "shardings": shardings, "pools_after_swaps": after,
        "abstract_matches": abstract, "compilations": count.compilations, "compiled": count.names, "devices": len(jax.devices()),
    }  # fmt: skip


COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_OP = re.compile(r"=\s*(\(.*?\)|\S+)\s+(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_SHAPE = re.compile(r"[a-z]+[0-9]*\[([0-9,]*)\]")


def collective_elements(hlo: str) -> dict[str, int]:
    """Elements each collective op kind moves in compiled HLO text (async ``-start`` counted once)."""
    out = dict.fromkeys(COLLECTIVES, 0)
    for line in hlo.splitlines():
        m = _OP.search(line)
        if m is None:
            continue
        for dims in _SHAPE.findall(m.group(1)):
            out[m.group(2)] += int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
    return out


def hlo(model: str, backend: str, n: int) -> dict:
    """Collective elements of the compiled decode step with no LoRA code and with each plan variant."""
    ck = load_checkpoint(model)
    config = EngineConfig(
        max_batch_size=len(PROMPTS), max_seq_len=32, max_loras=SLOTS, max_lora_rank=RANK,
        kernel_backend=backend, tensor_parallel_size=n,
    )  # fmt: skip
    runner = JaxRunner(ck, config)
    rows = config.max_batch_size
    zeros = np.zeros(rows, np.int32)
    tables = np.zeros((rows, config.pages_per_row), np.int32)

    def count(plan) -> dict[str, int]:
        lowered = runner._steps.decode.lower(
            **runner.state().fields(),
            batch=DecodeBatch(zeros, zeros, tables, plan),
            sampling=SamplingArrays.empty(rows),
        )
        return collective_elements(lowered.compile().as_text())

    plans = runner.backend.warmup_plans(rows, SLOTS)
    return {
        "base": count(None), "lora": [count(p) for p in plans if p is not None],
        "layers": ck.config.num_layers, "batch": rows, "rank": RANK,
    }  # fmt: skip


def tpu_export(n: int, attention: str = "xla") -> dict:
    """Export the N-device decode step with the Pallas backend for TPU (Mosaic lowering, no TPU needed),
    on abstract shapes from ``sharding.abstract_state``: a Llama-like bf16 model with 128-wide heads;
    ``attention``: the decode attention impl (``pallas``: JAX's paged-attention kernel per device)."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from loraserve.kernels import pallas as pk
    from loraserve.kernels.attention import DecodeAttention
    from loraserve.kernels.backends import PallasBackend
    from loraserve.models.config import ModelConfig

    pk.default_interpret = lambda: False  # lower the real kernels, not the interpreter
    cfg = ModelConfig(
        model_type="llama", vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_layers=2,
        num_heads=8, num_kv_heads=2, head_dim=128,
    )  # fmt: skip
    config = EngineConfig(
        max_batch_size=16, max_seq_len=256, max_loras=8, max_lora_rank=16, dtype="bfloat16",
        kernel_backend="pallas", tensor_parallel_size=n,
    )  # fmt: skip
    mesh = sharding.make_mesh(n)
    st = sharding.abstract_state(cfg, config, mesh, PallasBackend(), platform="tpu")
    tcfg, backend = st["model_config"], st["backend"]

    attend = DecodeAttention.of(DecodeAttention(attention, interpret=False), backend)

    def step(state: DeviceState, batch: DecodeBatch):
        return decoder.decode(tcfg, backend, state, batch, attend)

    rep = NamedSharding(mesh, P())
    rows = jax.ShapeDtypeStruct((16,), jnp.int32, sharding=rep)
    inv = jax.ShapeDtypeStruct((tcfg.head_dim // 2,), jnp.float32, sharding=rep)
    tables = jax.ShapeDtypeStruct((16, config.pages_per_row), jnp.int32, sharding=rep)
    plan = jax.tree.map(  # the plan variant with adapter rows, as abstract values
        lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=rep),
        backend.warmup_plans(16, config.max_loras)[-1],
    )
    exported = jax.export.export(jax.jit(step, out_shardings=st["out_shardings"]), platforms=["tpu"])(
        DeviceState(st["params"], st["pools"], st["cache"], inv), DecodeBatch(rows, rows, tables, plan)
    )
    mlir = exported.mlir_module()
    return {
        "platforms": list(exported.platforms), "devices": exported.nr_devices,
        "custom_calls": mlir.count("tpu_custom_call"), "psums": mlir.count("all_reduce"),
        "layers": cfg.num_layers, "attention_calls": len(re.findall(r"call @paged_attention(_[0-9]+)?\(", mlir)),
        "attention_mesh": str(attend.mesh.shape) if attend.mesh is not None else None,
    }  # fmt: skip


def paged_attention_tp(n: int) -> dict:
    """``kernels.attention``'s pallas impl (interpreted) inside ``shard_map`` over N devices, q split by
    heads and pages by KV head, against the xla impl on the same sharded arrays; max |difference|."""
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from loraserve.kernels.attention import decode_attention

    mesh = sharding.make_mesh(n)
    rng = np.random.default_rng(n)
    kv, heads, d, pages, page, width = 4, 16, 16, 24, 4, 4
    put = lambda a, spec: jax.device_put(jnp.asarray(a, jnp.float32), NamedSharding(mesh, spec))  # noqa: E731
    # bf16-exact pages: the kernel reads K/V as bf16
    k, v = (rng.standard_normal((kv, pages, page, d)).astype(jnp.bfloat16).astype(np.float32) for _ in "kv")
    k, v = put(k, sharding.CACHE_SPEC), put(v, sharding.CACHE_SPEC)
    q = put(rng.standard_normal((3, heads, d)), P(None, "model", None))
    positions = jnp.asarray([0, 6, width * page - 1], jnp.int32)
    tables = jnp.asarray(np.stack([np.zeros(width), rng.permutation(np.arange(1, pages))[:width],
                                   np.arange(1 + width, 1 + 2 * width)]), jnp.int32)  # fmt: skip
    kw = dict(scale=0.3, softcap=20.0, window=None)
    got = jax.jit(lambda *a: decode_attention(*a, impl="pallas", mesh=mesh, **kw))(q, k, v, positions, tables)
    want = jax.jit(lambda *a: decode_attention(*a, impl="xla", **kw))(q, k, v, positions, tables)
    return {
        "max_abs_diff": float(np.abs(np.asarray(got) - np.asarray(want)).max()),
        "out_spec": str(tuple(got.sharding.spec)), "devices": mesh.size,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="")
    parser.add_argument("--adapters", default="", help="comma-separated PEFT folders")
    parser.add_argument("--backend", default="xla-grouped")
    parser.add_argument("--sizes", default="1,2,4,8")
    parser.add_argument(
        "--runs",
        default="",
        help="several backends in this one process: 'cpu=1,2,4,8 pallas=2' (JSON by backend)",
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--swaps", type=int, default=200)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", default="none")
    parser.add_argument("--hlo", action="store_true", help="count the decode step's collectives instead")
    parser.add_argument("--tpu-export", action="store_true", help="export the Pallas decode step for TPU")
    parser.add_argument("--attention", default="xla", help="decode attention impl for --tpu-export")
    parser.add_argument("--paged-attention", action="store_true", help="sharded pallas attention vs xla")
    args = parser.parse_args()
    if args.tpu_export:
        print(json.dumps({n: tpu_export(int(n), args.attention) for n in args.sizes.split(",")}))
        return
    if args.paged_attention:
        print(json.dumps({n: paged_attention_tp(int(n)) for n in args.sizes.split(",")}))
        return
    if args.hlo:
        print(json.dumps({n: hlo(args.model, args.backend, int(n)) for n in args.sizes.split(",")}))
        return
    adapters = args.adapters.split(",")
    if args.runs:  # one process for several backends: one JAX start, the checkpoint read once per size
        # "cpu=1,2,4,8 pallas=2 cpu:int8=1,2": backend[:quantization]=sizes
        runs = dict(item.split("=") for item in args.runs.split())
        out = {}
        for key, sizes in runs.items():
            backend, _, quantization = key.partition(":")
            out[key] = {
                n: serve(
                    args.model,
                    adapters,
                    backend,
                    int(n),
                    args.steps,
                    args.swaps,
                    args.dtype,
                    quantization or "none",
                )
                for n in sizes.split(",")
            }
        print(json.dumps(out))
        return
    out = {
        n: serve(
            args.model, adapters, args.backend, int(n), args.steps, args.swaps, args.dtype, args.quantization
        )
        for n in args.sizes.split(",")
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
