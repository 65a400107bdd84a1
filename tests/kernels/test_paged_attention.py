"""Decode attention over the paged KV cache (``kernels/attention.py``): the ``xla`` and ``pallas`` impls.

* ``xla`` against a float64 numpy reference of paged attention (scattered page tables, rows of
  different lengths, GQA, soft-cap, sliding window, finite garbage in pages no row may read): f32
  within 2e-5 (atol = rtol; measured ~1e-6, f32 summation order only).
* ``pallas`` (JAX's TPU kernel) runs on this CPU in Pallas' TPU interpret mode, which simulates its
  DMAs and semaphores (``pltpu.force_tpu_interpret_mode``, what ``decode_attention`` uses off a TPU).
  The kernel rounds K and V to bfloat16 inside (its dequantization helper casts to bf16 even without
  scales), so it is compared with ``xla`` on the same pages rounded to bf16: then only f32 summation
  order and the online softmax differ, within 2e-5 (measured ~1e-6). Sliding-window layers fall back
  to ``xla``: exactly equal.
* the whole model's decode step with ``pallas`` attention (interpreted) against ``xla`` on tiny
  Llama / Gemma 2 (soft-cap, sliding layers) / Gemma 3 (q/k norm, sliding layers) checkpoints: logits
  within 2e-2 (the kernel's bf16 K/V; measured <= 5.3e-3 over the six tiny families, logits of
  magnitude ~2.3) and the same greedy tokens.
* TPU lowering: ``jax.export(..., platforms=["tpu"])`` of the whole decode step with ``pallas``
  attention runs the Mosaic lowering of the kernel (no TPU needed): a ``tpu_custom_call``, called once
  per full-attention layer, never for sliding ones. Tensor parallelism (tp = 2, 4, inside ``shard_map``) is
  checked in ``tests/worker/test_tensor_parallel.py`` (8 forced CPU devices, in a subprocess):
  the step exported at tp = 2, 4, 8 and the kernel interpreted over 2 and 4 devices against xla.
"""

from __future__ import annotations

import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loraserve.kernels import get_backend
from loraserve.kernels import pallas as pallas_kernels
from loraserve.kernels.attention import (
    DecodeAttention,
    decode_attention,
    pages_per_compute_block,
    pallas_takes,
    resolve_attention,
    tpu_kernel_faster,
)
from loraserve.models import decoder
from loraserve.models.checkpoint import load_checkpoint
from loraserve.models.config import ModelConfig
from loraserve.models.lora import layout
from loraserve.models.sharding import param_shapes
from loraserve.models.step import DecodeBatch, DeviceState
from tests.platform import ON_TPU, cpp_only
from tests.worker.model_steps import ModelSteps

TOL = 2e-5
# On a TPU the soft-capped cases are bounded by SOFTCAP_TOL_TPU: the chip's f32 tanh is its own
# approximation (0.292029 where numpy's tanh gives 0.291991: 3.9e-5 at softcap 5.0 over logits ~10, measured
# on a v5e with every matmul at `highest`); without a soft-cap the chip stays within TOL.
SOFTCAP_TOL_TPU = 2e-4
MODEL_TOL = 2e-2


def reference(q, k_pages, v_pages, positions, tables, scale, softcap, window) -> np.ndarray:
    """float64 paged attention, one (row, head) at a time: position p of row b lives at offset
    ``p % P`` of page ``tables[b, p // P]``."""
    q, k_pages, v_pages = (np.asarray(a, np.float64) for a in (q, k_pages, v_pages))
    b_rows, heads, _ = q.shape
    kv, _, page, _ = k_pages.shape
    out = np.zeros_like(q)
    for b in range(b_rows):
        pos = int(positions[b])
        first = 0 if window is None else max(0, pos - window + 1)
        keys = np.arange(first, pos + 1)
        pages, offsets = np.asarray(tables)[b, keys // page], keys % page
        for h in range(heads):
            g = h // (heads // kv)
            s = k_pages[g, pages, offsets] @ q[b, h] * scale
            if softcap is not None:
                s = np.tanh(s / softcap) * softcap
            p = np.exp(s - s.max())
            out[b, h] = (p / p.sum()) @ v_pages[g, pages, offsets]
    return out


def case(seed=0, rows=5, heads=8, kv=2, d=16, page=4, width=6, pages=40, dtype=jnp.float32):
    """Scattered page tables (a shuffled pool), rows of lengths 1 .. width*page (one idle row: all-null
    table at position 0), and large finite garbage in every page no row lists."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((kv, pages, page, d))
    v = rng.standard_normal((kv, pages, page, d))
    tables = np.zeros((rows, width), np.int32)
    pool = rng.permutation(np.arange(1, pages))
    positions = np.array([0, 3, width * page - 1, 9, 4][:rows], np.int32)  # 0: the idle row
    used = set()
    for b in range(1, rows):
        n = int(positions[b]) // page + 1
        tables[b, :n] = pool[:n]
        used |= set(pool[:n].tolist())
        pool = pool[n:]
    garbage = [p for p in range(1, pages) if p not in used]
    k[:, garbage], v[:, garbage] = 100.0, -100.0
    q = rng.standard_normal((rows, heads, d)) * 3
    cast = lambda a: jnp.asarray(a, dtype)  # noqa: E731
    return cast(q), cast(k), cast(v), jnp.asarray(positions), jnp.asarray(tables)


PARAMS = [  # (heads, kv, softcap, window)
    (8, 2, None, None),  # GQA groups of 4
    (8, 8, None, None),  # MHA
    (16, 2, None, None),  # groups of 8 (the kernel's other q layout)
    (8, 2, 5.0, None),  # Gemma 2 soft-cap (logits of magnitude ~10 before it)
    (8, 2, None, 5),  # sliding window of 5 positions
    (8, 2, 5.0, 7),
]


@pytest.mark.parametrize(("heads", "kv", "softcap", "window"), PARAMS)
def test_xla_matches_numpy_reference(heads, kv, softcap, window) -> None:
    q, k, v, pos, tables = case(heads=heads, kv=kv)
    scale = 0.25
    got = decode_attention(q, k, v, pos, tables, scale=scale, softcap=softcap, window=window, impl="xla")
    want = reference(q, k, v, pos, tables, scale, softcap, window)
    tol = SOFTCAP_TOL_TPU if ON_TPU and softcap is not None else TOL
    np.testing.assert_allclose(np.asarray(got), want, atol=tol, rtol=tol)


def _bf16_rounded(a):
    return a.astype(jnp.bfloat16).astype(jnp.float32)


# head size 16 (the test models'): the kernel interpreted on a CPU, the xla fallback on a TPU (Mosaic takes
# multiples of 128 only: kernels.attention.pallas_takes); 128 interpreted on a CPU; on a TPU these f32
# layers fall back to xla too (the chip's kernel takes bf16 q only): test_the_chip_kernel_in_bf16 below
@pytest.mark.parametrize("d", [16, 128])
@pytest.mark.parametrize(("heads", "kv", "softcap", "window"), PARAMS)
def test_pallas_matches_xla(heads, kv, softcap, window, d) -> None:
    q, k, v, pos, tables = case(heads=heads, kv=kv, d=d)
    k, v = _bf16_rounded(k), _bf16_rounded(v)  # what the kernel reads them as
    kw = dict(scale=0.25, softcap=softcap, window=window)
    got = jax.jit(partial(decode_attention, impl="pallas", **kw))(q, k, v, pos, tables)
    want = jax.jit(partial(decode_attention, impl="xla", **kw))(q, k, v, pos, tables)
    if not pallas_takes(d, window, pallas_kernels.default_interpret(), q.dtype):  # the fallback: same bits
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    else:
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOL, rtol=TOL)


@cpp_only
@pytest.mark.parametrize(("heads", "kv", "softcap", "window"), PARAMS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "bf16 bits"])
def test_cpu_kernel_matches_xla(heads, kv, softcap, window, dtype) -> None:
    """The C++ kernel reads pages in place with the xla impl's arithmetic: bf16 pages (and their uint16
    bits, as the CPU cache stores them) give the same bits, f32 ones agree within 1e-6."""
    q, k, v, pos, tables = case(heads=heads, kv=kv)
    kw = dict(scale=0.25, softcap=softcap, window=window)
    if dtype != "float32":
        q, k, v = (jnp.asarray(a, jnp.bfloat16) for a in (q, k, v))
    want = jax.jit(partial(decode_attention, impl="xla", **kw))(q, k, v, pos, tables)
    if dtype == "bf16 bits":
        k, v = (jax.lax.bitcast_convert_type(a, jnp.uint16) for a in (k, v))
    got = jax.jit(partial(decode_attention, impl="cpu", **kw))(q, k, v, pos, tables)
    assert got.dtype == want.dtype
    if dtype == "float32":
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-6)
    else:
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_pallas_bf16_cache_matches_the_reference() -> None:
    """A bf16 cache and q, as served on a TPU: within 2e-2 of the f64 reference (outputs of magnitude
    <= 3, whose bf16 rounding alone is up to 7.8e-3; measured 7.7e-3, the xla impl 8.0e-3)."""
    q, k, v, pos, tables = case(seed=3, dtype=jnp.bfloat16)
    kw = dict(scale=0.25, softcap=None, window=None)
    got = decode_attention(q, k, v, pos, tables, impl="pallas", **kw)
    assert got.dtype == jnp.bfloat16
    want = reference(q, k, v, pos, tables, 0.25, None, None)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not ON_TPU, reason="the kernel compiled for the chip: needs a TPU (interpreted above)")
@pytest.mark.parametrize("d", [128, 256])
@pytest.mark.parametrize(("heads", "kv", "softcap"), [(8, 2, None), (16, 2, None), (8, 8, 5.0)])
def test_the_chip_kernel_in_bf16_matches_the_reference(heads, kv, softcap, d) -> None:
    """What a bf16 model with head size 128 or 256 attends through on a TPU (``--attention-backend pallas``;
    ``auto`` at 256): the kernel compiled by Mosaic, whatever precision the caller's context asks
    (the test process asks for ``highest``), within 2e-2 of the f64 reference like the xla impl (interpreted
    on a CPU: <= 7.8e-3, the xla impl <= 1.25e-2)."""
    q, k, v, pos, tables = case(seed=3, heads=heads, kv=kv, d=d, page=16, width=4, dtype=jnp.bfloat16)
    assert pallas_takes(d, None, False, q.dtype)
    kw = dict(scale=0.25, softcap=softcap, window=None)
    got = jax.jit(partial(decode_attention, impl="pallas", interpret=False, **kw))(q, k, v, pos, tables)
    xla = jax.jit(partial(decode_attention, impl="xla", **kw))(q, k, v, pos, tables)
    want = reference(q, k, v, pos, tables, 0.25, softcap, None)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(np.asarray(xla, np.float32), want, atol=2e-2, rtol=2e-2)


def test_which_layers_the_tpu_kernel_takes_and_where_auto_wants_it() -> None:
    """Compiled for the chip, JAX's kernel takes head sizes that are multiples of 128 and no window (Mosaic
    refused 16, 64, 80 and 96 on a TPU v5e); interpreted, every head size. ``auto`` wants it where it was
    measured faster than xla on the chip: head size >= 256 with pages >= 16 (docs/kernels.md)."""
    assert [d for d in (16, 64, 80, 96, 128, 192, 256) if pallas_takes(d)] == [128, 256]
    assert not pallas_takes(128, window=4096)
    assert pallas_takes(16, interpret=True) and not pallas_takes(16, window=5, interpret=True)
    # compiled: bf16 q only (the chip refused f32 q at `highest`; its bf16 K/V would undercut f32's precision)
    assert pallas_takes(128, dtype=jnp.bfloat16) and not pallas_takes(256, dtype=jnp.float32)
    assert pallas_takes(16, interpret=True, dtype=jnp.float32)
    faster = [(d, p) for d in (64, 128, 256, 512) for p in (4, 8, 16, 64) if tpu_kernel_faster(d, p)]
    assert faster == [(256, 16), (256, 64), (512, 16), (512, 64)]


def test_pages_per_compute_block_divides_the_table_width() -> None:
    assert pages_per_compute_block(16, 16) == 16
    assert pages_per_compute_block(64, 16) == 16
    assert pages_per_compute_block(24, 16) == 8
    assert pages_per_compute_block(63, 16) == 1  # an odd max_seq_len / page_size: one page at a time
    assert pages_per_compute_block(16, 64) == 8  # at most 512 positions per block
    assert pages_per_compute_block(16, 1024) == 1  # a page alone is larger


def test_resolve_and_object() -> None:
    # a CPU where the C++ kernels build; on a TPU, JAX's kernel only where it was measured faster
    assert resolve_attention("auto") == ("xla" if ON_TPU else "cpu")
    if ON_TPU:
        assert resolve_attention("auto", 128, 16) == "xla"
        assert resolve_attention("auto", 256, 16) == "pallas"
        assert resolve_attention("auto", 64, 16) == "xla"
    assert resolve_attention("pallas") == "pallas"
    with pytest.raises(ValueError, match="auto, xla, pallas, cpu"):
        resolve_attention("flash")
    with pytest.raises(ValueError, match="xla, pallas, cpu"):
        DecodeAttention("auto")
    assert DecodeAttention.of("pallas") == DecodeAttention("pallas")
    assert hash(DecodeAttention("xla")) == hash(DecodeAttention.of("xla", get_backend("cpu")))


# ---------------------------------------------------------------- the model's decode step

FAMILIES = ("llama", "gemma2", "gemma3_text")


@pytest.mark.parametrize("family", FAMILIES)
def test_model_decode_with_pallas_attention_matches_xla(model_dirs, family: str) -> None:
    ck = load_checkpoint(str(model_dirs[family]))
    cfg, backend = ck.config, get_backend("xla-grouped")
    pools = layout.empty_lora(cfg, 2, 4, jnp.float32, backend)
    page, width, rows = 4, 4, 3
    cache = decoder.init_cache(cfg, 1 + rows * width + 3, page, jnp.float32)
    tables = np.flip(decoder.contiguous_page_tables(rows, width), axis=1).copy()  # pages in reverse order
    tables[0, 3] = 0  # row 0 holds 3 pages; the null page in its last entry
    prompts = [[5, 17, 33, 100, 7, 9, 11, 12, 40, 41], [3, 4], [250, 11, 12, 13, 60, 61, 62, 63, 64]]
    steps = ModelSteps(cfg, backend, ck.params, pools, cache)
    for row, p in enumerate(prompts):
        tokens = np.zeros(16, np.int32)
        tokens[: len(p)] = p
        steps.prefill_one(tokens, len(p), 0, -1, tables[row])
    batch = DecodeBatch(
        np.array([8, 9, 10], np.int32), np.array([len(p) for p in prompts], np.int32), tables, None
    )
    out = {}
    for impl in ("xla", "pallas") if ON_TPU else ("xla", "pallas", "cpu"):  # one cache for each: not donated
        step = jax.jit(lambda state, batch, impl=impl: decoder.decode(cfg, backend, state, batch, impl)[0])
        out[impl] = np.asarray(step(steps.state(), batch))
    np.testing.assert_allclose(out["pallas"], out["xla"], atol=MODEL_TOL, rtol=MODEL_TOL)
    np.testing.assert_array_equal(out["pallas"].argmax(-1), out["xla"].argmax(-1))
    if "cpu" in out:
        np.testing.assert_allclose(
            out["cpu"], out["xla"], atol=1e-5, rtol=1e-5
        )  # f32 cache: sums' order only
        np.testing.assert_array_equal(out["cpu"].argmax(-1), out["xla"].argmax(-1))


# ---------------------------------------------------------------- TPU lowering (tp = 1)


def kernel_calls(mlir: str) -> int:
    """Calls of the paged-attention kernel in an exported module: ``paged_attention`` is a ``jax.jit``
    function, exported once as a private function holding the ``tpu_custom_call``, called per layer."""
    if "tpu_custom_call" not in mlir:
        return 0
    return len(re.findall(r"call @paged_attention(_[0-9]+)?\(", mlir))


def _tpu_export_kernel_calls(cfg: ModelConfig, impl: str, dtype=jnp.bfloat16) -> int:
    """``jax.export`` for TPU of the decode step (no LoRA code) on abstract bf16 shapes; the kernel
    calls in its module (:func:`kernel_calls`)."""
    rows, page, width, pages = 16, 16, 16, 257
    attention = DecodeAttention(impl, interpret=False)  # lower the kernel, not the interpreter
    backend = get_backend("xla-grouped")

    def step(state: DeviceState, batch: DecodeBatch):
        return decoder.decode(cfg, backend, state, batch, attention)

    sds = jax.ShapeDtypeStruct
    params = jax.tree.map(lambda s: sds(s, dtype), param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    page_shape = (cfg.num_kv_heads, pages, page, cfg.head_dim)
    cache = [(sds(page_shape, dtype), sds(page_shape, dtype)) for _ in range(cfg.num_layers)]
    pools = jax.eval_shape(lambda: layout.empty_lora(cfg, 2, 16, dtype, backend))
    ints = sds((rows,), jnp.int32)
    exported = jax.export.export(jax.jit(step), platforms=["tpu"])(
        DeviceState(params, pools, cache, sds((cfg.head_dim // 2,), jnp.float32)),
        DecodeBatch(ints, ints, sds((rows, width), jnp.int32), None),
    )
    assert exported.platforms == ("tpu",)
    return kernel_calls(exported.mlir_module())


LLAMA = dict(model_type="llama", vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_layers=3,
             num_heads=8, num_kv_heads=2, head_dim=128)  # fmt: skip


@pytest.mark.parametrize("kv", [2, 1], ids=["groups-of-4", "groups-of-8"])
def test_decode_step_lowers_for_tpu_with_the_kernel(kv: int) -> None:
    cfg = ModelConfig(**{**LLAMA, "num_kv_heads": kv})
    assert _tpu_export_kernel_calls(cfg, "pallas") == cfg.num_layers
    assert _tpu_export_kernel_calls(cfg, "xla") == 0


def test_sliding_layers_lower_without_the_kernel() -> None:
    cfg = ModelConfig(**{**LLAMA, "num_layers": 4}, sliding_window=512,
                      layer_types=("sliding_attention", "full_attention") * 2, attn_logit_softcap=50.0)  # fmt: skip
    assert _tpu_export_kernel_calls(cfg, "pallas") == 2  # the two full-attention layers


# ---------------------------------------------------------------- selection: config, flag, runner


def test_config_flag_and_environment_twin() -> None:
    import argparse

    from loraserve.common.config import config_from_args, field_help
    from loraserve.engine.config import EngineConfig
    from loraserve.worker.cli import add_arguments
    from loraserve.worker.config import ENV_PREFIX, WorkerConfig

    assert EngineConfig().attention_backend == "auto"
    with pytest.raises(
        ValueError, match="attention_backend must be one of auto, xla, pallas, cpu, got 'flash'"
    ):
        EngineConfig(attention_backend="flash")
    env = WorkerConfig.from_env({"LORASERVE_WORKER_ATTENTION_BACKEND": "pallas"})
    assert env.engine_config().attention_backend == "pallas"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--attention-backend", "xla"])
    assert config_from_args(WorkerConfig, ENV_PREFIX, args).engine_config().attention_backend == "xla"
    assert field_help(WorkerConfig, "attention_backend").startswith(
        "decode attention over the paged KV cache: auto"
    )


def test_runner_serves_the_same_tokens_with_either_attention(llama_dir) -> None:
    """The runner resolves ``attention_backend`` and its jitted decode step uses it: greedy tokens of two
    rows (one prompt spanning pages) over 4 steps are the same with auto (the C++ kernel here), xla and the
    TPU kernel (interpreted)."""
    from loraserve.engine.config import EngineConfig
    from loraserve.engine.jax_runner import JaxRunner
    from loraserve.engine.request import SamplingRow
    from loraserve.engine.runner import PrefillInput

    ck = load_checkpoint(str(llama_dir))
    prompts = [[5, 17, 33, 100, 7, 9, 11, 12, 40, 41], [3, 4]]
    out = {}
    for name in ("auto", "xla", "pallas"):
        config = EngineConfig(max_batch_size=2, max_seq_len=32, kv_page_size=4, kernel_backend="xla-grouped",
                              attention_backend=name)  # fmt: skip
        runner = JaxRunner(ck, config)
        auto = "xla" if ON_TPU else "cpu"  # head size 16: no TPU kernel; a CPU's C++ kernel
        assert runner.attention == DecodeAttention(auto if name == "auto" else name)
        tables = decoder.contiguous_page_tables(2, config.pages_per_row)
        greedy = SamplingRow()
        batch = [PrefillInput(p, 0, -1, tables[i], greedy) for i, p in enumerate(prompts)]
        tokens = np.array(runner.prefill(batch).tokens, np.int32)
        positions = np.array([len(p) for p in prompts], np.int32)
        steps = [tokens.tolist()]
        for _ in range(4):
            tokens = runner.decode(tokens, positions, np.full(2, -1), tables, [greedy] * 2).tokens
            positions = positions + 1
            steps.append(tokens.tolist())
        out[name] = steps
    assert out["pallas"] == out["auto"] == out["xla"]
