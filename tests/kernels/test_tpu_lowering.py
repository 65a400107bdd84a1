"""Lower the Pallas kernels for TPU on this CPU machine, at the shapes the worker serves.

``jax.export.export(jax.jit(f), platforms=["tpu"])`` runs the Pallas → Mosaic lowering, which
enforces TPU's block rules (last two block dims divisible by 8 × 128 or equal to the array's) that
interpret mode ignores. It does not run Mosaic's own compiler (that happens in libtpu on a TPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loraserve.kernels import pallas as pk
from loraserve.kernels.sgmv import segments_to_idx

S, R, D = 16, 16, 4096  # slots, rank, hidden size (Llama-3-8B)


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


def _export(f, *args) -> str:
    exported = jax.export.export(jax.jit(f), platforms=["tpu"])(*args)
    assert exported.platforms == ("tpu",)
    return exported.mlir_module()


def _custom_calls(mlir: str) -> int:
    return mlir.count("tpu_custom_call")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(("d_in", "d_out"), [(D, D), (D, 14336), (14336, D)], ids=["o_proj", "up", "down"])
def test_add_lora_lowers_for_tpu(dtype, d_in: int, d_out: int) -> None:
    T = 64
    f = functools.partial(pk.add_lora, interpret=False)
    mlir = _export(
        f,
        _sds((T, d_out), dtype),  # y
        _sds((T, d_in), dtype),  # x
        _sds((S, d_in, R), dtype),  # A
        _sds((S, R, d_out), dtype),  # B
        _sds((T,), jnp.int32),  # idx
    )
    assert _custom_calls(mlir) == 2  # one shrink kernel, one expand kernel


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("outs", [(D, 1024, 1024), (14336, 14336)], ids=["qkv", "gate_up"])
def test_fused_slices_lower_for_tpu(dtype, outs) -> None:
    T, n = 64, len(outs)
    f = functools.partial(pk.add_lora_slices, interpret=False)
    mlir = _export(
        f,
        _sds((T, sum(outs)), dtype),
        _sds((T, D), dtype),
        _sds((S, D, n * R), dtype),
        tuple(_sds((S, R, o), dtype) for o in outs),
        _sds((T,), jnp.int32),
    )
    assert _custom_calls(mlir) == 1 + n  # one shrink, then each slice expands in place


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("rows", [8, 64, 256])
@pytest.mark.parametrize(
    ("d_in", "outs"),
    [(D, (D, 1024, 1024)), (D, (14336, 14336)), (14336, (D,))],
    ids=["qkv", "gate_up", "down"],
)
def test_the_decode_kernel_lowers_for_tpu(dtype, rows: int, d_in: int, outs) -> None:
    """kernels.pallas_decode at Llama-3-8B's projections, batches 8-256, 64 slots of rank 16: one call each
    (but f32 gate/up at 256 rows, whose 100 MB exceed a v5e's VMEM budget: the backend runs XLA there)."""
    from loraserve.kernels import pallas_decode as pd

    slots, n = 64, len(outs)
    plan = pd.plan_decode(np.zeros(rows, np.int32), slots)
    fits = pd.fits(rows, d_in, n * R, outs, dtype, dtype, dtype, dtype)
    if dtype == jnp.float32 and rows == 256 and n == 2:
        assert not fits
        return
    assert fits
    f = functools.partial(pd.add_lora_slices_decode, interpret=False)
    mlir = _export(
        f,
        _sds((rows, sum(outs)), dtype),
        _sds((rows, d_in), dtype),
        _sds((slots, n * R, d_in), dtype),  # rank-major (kernels.PallasBackend's pools)
        tuple(_sds((slots, R, o), dtype) for o in outs),
        jax.tree.map(lambda v: _sds(v.shape, v.dtype), plan),
    )
    assert _custom_calls(mlir) == 1


def test_prefill_lowers_for_tpu() -> None:
    T, G = 2048, 8

    def prefill(y, x, A, B, seg_slots, seg_lens):
        return pk.add_lora(y, x, A, B, segments_to_idx(seg_slots, seg_lens, T), interpret=False)

    bf = jnp.bfloat16
    mlir = _export(
        prefill,
        _sds((T, D), bf),
        _sds((T, D), bf),
        _sds((S, D, R), bf),
        _sds((S, R, D), bf),
        _sds((G,), jnp.int32),
        _sds((G,), jnp.int32),
    )
    assert _custom_calls(mlir) == 2


def test_the_lowering_catches_an_illegal_block(monkeypatch) -> None:
    """Control: 4-row token blocks break the 8-row rule; interpret mode runs them, TPU lowering refuses."""
    monkeypatch.setattr(pk, "sublanes", lambda dtype: 4)
    x, A, idx = jnp.ones((12, 128)), jnp.ones((2, 128, 8)), jnp.zeros((12,), jnp.int32)
    assert float(pk.lora_shrink(x, A, idx, block_t=4, interpret=True)[0, 0]) == 128.0
    f = functools.partial(pk.lora_shrink, block_t=4, interpret=False)
    with pytest.raises(Exception, match="divisible by 8 and 128"):
        _export(f, x, A, idx)
