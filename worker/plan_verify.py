"""``loraserve plan --verify``: compile the real decode step ahead of time and read its memory analysis.

Runs in a process of its own (``python -m loraserve.worker.plan_verify``) because it needs a CPU with N
devices (``XLA_FLAGS=--xla_force_host_platform_device_count=N``, set before JAX starts). It lowers the
worker's jitted decode step (``engine.jax_runner``'s, with the tensor-parallel shardings of
``models.sharding.abstract_state``) on abstract shapes — ``jax.ShapeDtypeStruct``s, nothing allocated —
compiles it for the N-device mesh and prints one JSON object: the compiled per-device argument, output,
alias and temporary bytes beside the planner's estimate.

The LoRA pools are compiled with the ``xla-onehot`` backend: the same bytes as the ``pallas`` backend's
(whose A pools are transposed, rank-major), in plain XLA that compiles on a CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

FORCE_DEVICES = "--xla_force_host_platform_device_count"


def verify_in_subprocess(settings: dict[str, Any], timeout: float = 900.0) -> dict[str, Any]:
    """Run this module on ``loraserve plan``'s parsed flags (``vars(args)``) with ``tp`` forced CPU devices;
    returns its JSON (raises with its stderr on failure)."""
    tp = int(settings["tp"])
    env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {FORCE_DEVICES}={tp}".strip()}
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run(
        [sys.executable, "-m", "loraserve.worker.plan_verify", json.dumps(settings)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    if out.returncode != 0:
        raise RuntimeError(f"plan --verify failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def small_input_bytes(
    batch: int, inv_freq_shape: tuple[int, ...], plan_leaves: list[Any], pages_per_row: int, vocab: int
) -> int:
    """Bytes of the decode step's per-step inputs: tokens, positions, page tables, the LoRA plan,
    sampling (token masks included), RoPE table."""
    from loraserve.models.sampling import SamplingArrays

    samp = sum(a.nbytes for a in SamplingArrays.empty(batch, vocab).as_tuple())
    plan = sum(int(getattr(leaf, "nbytes", 0)) for leaf in plan_leaves)
    rope = 4
    for d in inv_freq_shape:
        rope *= d
    return 2 * 4 * batch + 4 * batch * pages_per_row + plan + samp + rope


def compiled_decode_memory(
    cfg: Any,
    *,
    tp: int,
    batch: int,
    context: int,
    max_loras: int,
    rank: int,
    dtype: str,
    lora_dtype: str,
    quantization: str = "none",
    quantize_lm_head: bool = False,
) -> dict[str, int]:
    """Per-device bytes of the compiled decode step (``Compiled.memory_analysis``), nothing allocated."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from loraserve.engine.config import EngineConfig
    from loraserve.engine.jax_runner import jit_steps
    from loraserve.kernels.attention import DecodeAttention, resolve_attention
    from loraserve.kernels.backends import XlaOneHotBackend
    from loraserve.models import sharding
    from loraserve.models.sampling import RowHistory, SamplingArrays
    from loraserve.models.step import DecodeBatch

    config = EngineConfig(
        max_batch_size=batch,
        max_seq_len=context,
        max_loras=max_loras,
        max_lora_rank=rank,
        dtype=dtype,
        lora_dtype=lora_dtype,
        kernel_backend="xla-onehot",
        tensor_parallel_size=tp,
    )
    sharding.check_tensor_parallel(cfg, tp, len(jax.devices()))
    mesh = sharding.make_mesh(tp)
    st = sharding.abstract_state(
        cfg, config, mesh, XlaOneHotBackend(), quantization=quantization, quantize_lm_head=quantize_lm_head
    )
    tcfg, backend = st["model_config"], st["backend"]
    rep = NamedSharding(mesh, P())

    def abstract(x: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype, sharding=rep)

    rows = jax.ShapeDtypeStruct((batch,), jnp.int32, sharding=rep)
    plan = backend.warmup_plans(batch, max_loras)[-1]  # the variant with adapter rows
    inv_freq = np.asarray(tcfg.inv_freq(), np.float32)
    samp = tuple(abstract(a) for a in SamplingArrays.empty(batch, tcfg.vocab_size).as_tuple())
    impl = resolve_attention(config.attention_backend, tcfg.head_dim, config.kv_page_size)  # as the worker
    attention = DecodeAttention.of(impl, backend)
    step = jit_steps(
        tcfg,
        backend,
        attention,
        config.traced_linear_backend,
        st["out_shardings"],  # as the worker
        config.traced_matmul_precision,
    ).decode
    tables = jax.ShapeDtypeStruct((batch, config.pages_per_row), jnp.int32, sharding=rep)  # the widest step
    compiled = step.lower(
        params=st["params"],
        pools=st["pools"],
        cache=st["cache"],
        rope=abstract(inv_freq),
        batch=DecodeBatch(rows, rows, tables, jax.tree.map(abstract, plan)),
        sampling=SamplingArrays(*samp),
        history=jax.tree.map(abstract, RowHistory.zeros(batch, tcfg.vocab_size)),
    ).compile()
    mem = compiled.memory_analysis()
    return {
        "argument_bytes": int(mem.argument_size_in_bytes),
        "output_bytes": int(mem.output_size_in_bytes),
        "alias_bytes": int(mem.alias_size_in_bytes),
        "temp_bytes": int(mem.temp_size_in_bytes),
        "small_input_bytes": small_input_bytes(
            batch, inv_freq.shape, jax.tree.leaves(plan), config.pages_per_row, tcfg.vocab_size
        ),
    }


def main(argv: list[str] | None = None) -> int:
    """``python -m loraserve.worker.plan_verify '<JSON of loraserve plan's flags>'``."""
    from loraserve.models import planner

    settings = json.loads((argv if argv is not None else sys.argv[1:])[0])
    _, cfg = planner.load_model_config(settings["model"])
    result = compiled_decode_memory(
        cfg,
        tp=settings["tp"],
        batch=settings["batch"],
        context=settings["context"],
        max_loras=settings["max_loras"],
        rank=settings["max_lora_rank"],
        dtype=settings["dtype"],
        lora_dtype=settings["lora_dtype"],
        quantization=settings.get("quantization", "none"),
        quantize_lm_head=settings.get("quantize_lm_head", False),
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
