"""``kernels.linear``'s bf16 path through the C++ kernel (``kernels.cpu.linear_bf16``) against float64.

Tolerance: the kernel sums bf16 products in f32 (exact products, f32 rounding of the running sums over
16-lane partials), so against a float64 product of the same bf16 inputs the error stays below
``1e-5 * sqrt(K) * max|y|`` on standard-normal inputs (seen: ~5e-7 scaled). Both code paths run on every
x86 CI machine: the AVX-512 BF16 one where the CPU has it (native build), the f32-widening one in a child
process built for ``x86-64-v3`` (``LORASERVE_KERNEL_MARCH``). On a CPU with AMX tiles the native build
multiplies on them (f32 sums of 32-element steps, the same bound) and a child runs the AVX-512 path
(``LORASERVE_KERNEL_AMX=0``, tests/kernels/test_linear_quant.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loraserve.engine.config import EngineConfig
from loraserve.kernels import cpu
from loraserve.kernels import linear as L
from tests.platform import ON_TPU, cpp_only

pytestmark = [
    cpp_only,
    pytest.mark.skipif(
        not ON_TPU and not cpu.available(), reason="C++ kernels unavailable (test_cpu fails then)"
    ),
]

# M: 1..64 rows (AMX_KERNEL_MAX_ROWS) and the 4-column tile tails; K: the 32-element step and its masked
# tail; N: the 4-row weight blocks, their 1-row tail and the 256-row work items split over threads.
SHAPES = [(1, 1, 1), (1, 31, 3), (2, 32, 4), (3, 33, 5), (4, 100, 255), (5, 768, 257), (7, 1000, 600)]
SHAPES += [(8, 64, 513), (13, 257, 9), (16, 1024, 1030), (17, 96, 64), (24, 130, 300)]
SHAPES += [(40, 100, 70), (64, 33, 48)]  # three and four 16-row groups of x on AMX tiles


def _check(M: int, K: int, N: int, seed: int = 0) -> float:
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((N, K)), jnp.bfloat16)
    got = np.asarray(jax.jit(cpu.linear_bf16)(x, w))
    want = np.asarray(w, np.float64) @ np.asarray(x, np.float64).T
    assert got.shape == (N, M) and got.dtype == np.float32
    err = float(np.abs(got - want).max() / (np.sqrt(K) * max(1.0, np.abs(want).max())))
    assert err < 1e-5, (M, K, N, err)
    return err


@pytest.mark.parametrize(("M", "K", "N"), SHAPES)
def test_linear_bf16_matches_float64(M: int, K: int, N: int) -> None:
    _check(M, K, N)


def test_a_rows_bits_do_not_depend_on_the_batch() -> None:
    """Batch invariance: each x row's outputs are the same bits alone and among 3, 16, 17, 24, 40 or 64 rows
    (one to four 16-row groups on AMX tiles; one and several 4-row tiles elsewhere)."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((64, 200)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((300, 200)), jnp.bfloat16)
    full = np.asarray(jax.jit(cpu.linear_bf16)(x, w))
    for m in (1, 3, 16, 17, 24, 40):
        np.testing.assert_array_equal(np.asarray(jax.jit(cpu.linear_bf16)(x[:m], w)), full[:, :m])
    np.testing.assert_array_equal(np.asarray(jax.jit(cpu.linear_bf16)(x[63:], w))[:, 0], full[:, 63])


def test_linear_bf16_empty_and_bad_shapes() -> None:
    x = jnp.zeros((3, 0), jnp.bfloat16)
    assert (
        np.asarray(jax.jit(cpu.linear_bf16)(x, jnp.zeros((5, 0), jnp.bfloat16))).tolist() == [[0.0] * 3] * 5
    )
    with pytest.raises(ValueError, match=r"x \[M, K\] and w \[N, K\]"):
        cpu.linear_bf16(jnp.zeros((2, 4), jnp.bfloat16), jnp.zeros((3, 5), jnp.bfloat16))
    with pytest.raises(ValueError, match="bfloat16 x and w, got float32"):
        cpu.linear_bf16(jnp.zeros((2, 4), jnp.float32), jnp.zeros((3, 4), jnp.bfloat16))


def _kernel_calls(fn, *args) -> int:
    # a new function each time: jax.jit caches a trace per function, whatever backend was in force then
    return jax.jit(lambda *a: fn(*a)).lower(*args).as_text().count("loraserve_linear_bf16")


def test_backend_choice_decides_the_lowering() -> None:
    """cpu and auto lower bf16 products of up to kernel_max_rows() rows to the kernel (auto on every CPU the
    kernels build on: widening bf16 to f32 still streams the weights many times faster than XLA's dot), xla
    never; f32 and more rows stay XLA's. Values agree with XLA's within bf16 sums."""
    w = jnp.asarray(np.random.default_rng(1).standard_normal((300, 128)), jnp.bfloat16)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((2, 3, 128)), jnp.bfloat16)  # 6 rows
    assert L.kernel_max_rows() == (L.AMX_KERNEL_MAX_ROWS if cpu.amx() else L.KERNEL_MAX_ROWS)
    big = jnp.zeros((L.kernel_max_rows() + 1, 128), jnp.bfloat16)
    with L.use_backend("cpu"):
        assert _kernel_calls(L.linear, x, w) == 1
        assert _kernel_calls(L.linear, big, w) == 0
        assert _kernel_calls(L.linear, x.astype(jnp.float32), w.astype(jnp.float32)) == 0
        got = np.asarray(jax.jit(lambda *a: L.linear(*a))(x, w))
    with L.use_backend("xla"):
        assert _kernel_calls(L.linear, x, w) == 0
        want = np.asarray(jax.jit(lambda *a: L.linear(*a))(x, w))
    assert got.shape == want.shape == (2, 3, 300)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-3 * np.abs(want).max())
    with L.use_backend("auto"):
        assert _kernel_calls(L.linear, x, w) == 1  # wherever the kernels build (this test's premise)
        assert _kernel_calls(L.linear, big, w) == 0
    assert L.resolve_backend("auto") == "cpu"
    assert L.resolve_backend("xla") == "xla"


def test_traced_with_holds_the_backend_for_later_traces() -> None:
    """jit traces at first call, outside any ``with``: traced_with carries the choice there, and greedy
    argmax over the kernel's [out, rows] layout picks XLA's token."""
    w = jnp.asarray(np.random.default_rng(3).standard_normal((500, 64)), jnp.bfloat16)

    def pick(x):
        return L.argmax_last(L.linear(x, w))

    kernel, plain = jax.jit(L.traced_with("cpu", pick)), jax.jit(L.traced_with("xla", pick))
    x = jnp.asarray(np.random.default_rng(4).standard_normal((5, 64)), jnp.bfloat16)
    assert "loraserve_linear_bf16" in kernel.lower(x).as_text()
    assert "loraserve_linear_bf16" not in plain.lower(x).as_text()
    ref = np.argmax(np.asarray(x, np.float64) @ np.asarray(w, np.float64).T, axis=-1)
    assert np.asarray(kernel(x)).tolist() == np.asarray(plain(x)).tolist() == ref.tolist()


def test_backend_names_and_config() -> None:
    with pytest.raises(ValueError, match="linear backend must be one of auto, xla, cpu, got 'gpu'"):
        L.check_backend("gpu")
    with pytest.raises(ValueError, match="linear_backend must be one of auto, xla, cpu, got 'fast'"):
        EngineConfig(linear_backend="fast")
    with pytest.raises(ValueError, match="linear_backend cpu runs on one device"):
        EngineConfig(linear_backend="cpu", tensor_parallel_size=2)
    assert EngineConfig().linear_backend == "auto"
    assert EngineConfig(tensor_parallel_size=2).traced_linear_backend == "xla"
    assert EngineConfig(linear_backend="cpu").traced_linear_backend == "cpu"


def test_flag_and_environment_twin() -> None:
    import argparse

    from loraserve.common.config import config_from_args, field_help
    from loraserve.worker.cli import add_arguments
    from loraserve.worker.config import ENV_PREFIX, WorkerConfig

    env = WorkerConfig.from_env({"LORASERVE_WORKER_LINEAR_BACKEND": "xla"})
    assert env.engine_config().linear_backend == "xla"
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--linear-backend", "cpu"])
    assert config_from_args(WorkerConfig, ENV_PREFIX, args).engine_config().linear_backend == "cpu"
    assert field_help(WorkerConfig, "linear_backend").startswith(
        "the base model's bfloat16 projections of a few rows"
    )


def test_bf16_runner_decodes_through_the_kernel(llama_dir) -> None:
    """A bf16 checkpoint in the runner: its compiled decode step calls the kernel with linear_backend cpu
    and not with xla; one decode step's logits of the two agree within bf16 rounding of the activations
    (|diff| <= 3e-2 * max|logit|), and the greedy tokens agree wherever the top two logits are further
    apart than that."""
    from functools import partial

    from loraserve.engine.jax_runner import JaxRunner
    from loraserve.engine.request import SamplingRow
    from loraserve.engine.runner import PrefillInput
    from loraserve.models import decoder
    from loraserve.models.checkpoint import load_checkpoint
    from loraserve.models.step import DecodeBatch

    ck = load_checkpoint(str(llama_dir), "bfloat16")
    prompts = [[5, 17, 33, 100, 7, 9, 11, 12, 40, 41], [3, 4], [9, 8, 7]]
    logits, tokens = {}, {}
    for name in ("cpu", "xla"):
        config = EngineConfig(max_batch_size=3, max_seq_len=32, kv_page_size=4, dtype="bfloat16",
                              kernel_backend="xla-grouped", linear_backend=name)  # fmt: skip
        runner = JaxRunner(ck, config)
        tables = decoder.contiguous_page_tables(3, config.pages_per_row)
        greedy = SamplingRow()
        batch = [PrefillInput(p, 0, -1, tables[i], greedy) for i, p in enumerate(prompts)]
        first = np.array(runner.prefill(batch).tokens, np.int32)
        positions = np.array([len(p) for p in prompts], np.int32)
        # the step's logits, the cache not donated (the runner's own step consumes it next)
        step = jax.jit(L.traced_with(name, partial(decoder.decode, runner.model_config, runner.backend)))
        args = (runner.state(), DecodeBatch(first, positions, tables, None))
        assert ("loraserve_linear_bf16" in step.lower(*args).as_text()) == (name == "cpu")
        logits[name] = np.asarray(step(*args)[0], np.float32)
        tokens[name] = runner.decode(first, positions, np.full(3, -1), tables, [greedy] * 3).tokens.tolist()
    diff, scale = np.abs(logits["cpu"] - logits["xla"]).max(), np.abs(logits["xla"]).max()
    assert diff <= 3e-2 * scale, (diff, scale)
    top2 = np.sort(logits["xla"], axis=-1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > 2 * diff
    assert clear.any()
    for row in np.flatnonzero(clear):
        assert tokens["cpu"][row] == tokens["xla"][row] == int(np.argmax(logits["xla"][row]))


@pytest.mark.parametrize("per_example_w", [False, True])
# 8 x 4 rows: past 24, XLA's dot in the batch rule (on AMX tiles 17 x 4: past 64)
@pytest.mark.parametrize("segments", [2, 8, 17])
def test_vmap_over_segments(per_example_w: bool, segments: int) -> None:
    """``jax.vmap`` of a kernel product (the packed prefill's map over prompts) equals XLA's."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.standard_normal((segments, 4, 96)), jnp.bfloat16)
    shape = (segments, 40, 96) if per_example_w else (40, 96)
    w = jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
    axes = (0, 0 if per_example_w else None)
    out = {}
    for name in ("cpu", "xla"):
        fn = jax.jit(jax.vmap(L.traced_with(name, L.linear), in_axes=axes))
        out[name] = np.asarray(fn(x, w))
    ws = np.broadcast_to(np.asarray(w, np.float64), (segments, 40, 96))
    want = np.einsum("gmk,gnk->gmn", np.asarray(x, np.float64), ws)
    for got in out.values():
        assert got.shape == (segments, 4, 40)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())
