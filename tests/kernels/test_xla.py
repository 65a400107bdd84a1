"""Property tests: the ``xla`` backend and the SGMV prefill path equal the ``reference`` backend.

Tolerances (kernels.testing.TOLERANCE, atol = rtol, outputs of order 1): f32 2e-5 (summation order
only), bf16 2e-2 (same bf16 inputs, exact f32 products, ≤ ~1 bf16 ulp after the final rounding).
Rows whose idx is −1 must come back as y bit for bit (shrink: exactly 0).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from loraserve import kernels
from loraserve.kernels.sgmv import segments_to_idx
from loraserve.kernels.testing import tolerance
from tests.kernels.strategies import Problem, assert_matches_reference, problems, run_all_ops

FAST = settings(max_examples=15, deadline=None)


@FAST
@given(problems())
def test_xla_matches_reference(p: Problem) -> None:
    assert_matches_reference(p, run_all_ops(p, "xla-onehot"), run_all_ops(p, "reference"))


@jax.jit
def _sgmv_all(x, A, B, y, A_cat, Bs, seg_slots, seg_lens):
    seg = (seg_slots, seg_lens)
    idx = segments_to_idx(*seg, x.shape[0])
    return {
        "idx": idx,
        "masked/shrink": kernels.lora_shrink_sgmv(x, A, *seg),
        "masked/add": kernels.add_lora_sgmv(y, x, A, B, *seg),
        "masked/slices": kernels.add_lora_slices_sgmv(y, x, A_cat, Bs, *seg),
        "ragged/add": kernels.add_lora_sgmv(y, x, A, B, *seg, method="ragged"),
        "per_token/shrink": kernels.lora_shrink(x, A, idx, backend="reference"),
        "per_token/add": kernels.add_lora(y, x, A, B, idx, backend="reference"),
        "per_token/slices": kernels.add_lora_slices(y, x, A_cat, Bs, idx, backend="reference"),
    }


def _expected_idx(seg_slots: np.ndarray, seg_lens: np.ndarray, T: int) -> np.ndarray:
    idx = []
    for s, n in zip(seg_slots, seg_lens, strict=True):
        idx += [int(s)] * int(n)
    return np.array((idx + [-1] * T)[:T], np.int32)


@settings(max_examples=20, deadline=None)
@given(problems(max_T=200))
def test_sgmv_matches_reference(p: Problem) -> None:
    c = p.case
    out = {
        k: np.asarray(v).astype(np.float32)
        for k, v in _sgmv_all(c.x, c.A, c.B, c.y, p.A_cat, p.Bs, p.seg_slots, p.seg_lens).items()
    }
    T = c.x.shape[0]
    np.testing.assert_array_equal(
        out["idx"], _expected_idx(np.asarray(p.seg_slots), np.asarray(p.seg_lens), T)
    )
    tol = tolerance(p.dtype)
    none = out["idx"] < 0
    for key in out:
        if key.startswith(("per_token", "idx")):
            continue
        op = key.rsplit("/", 1)[1]
        np.testing.assert_allclose(out[key], out[f"per_token/{op}"], atol=tol, rtol=tol, err_msg=key)
        if op != "shrink":
            np.testing.assert_array_equal(
                out[key][none], np.asarray(c.y).astype(np.float32)[none], err_msg=key
            )


def test_sgmv_unknown_method() -> None:
    x = jnp.zeros((4, 3))
    with pytest.raises(ValueError, match="ragged"):
        kernels.lora_shrink_sgmv(
            x, jnp.zeros((2, 3, 2)), jnp.zeros(1, jnp.int32), jnp.ones(1, jnp.int32), method="dense"
        )


def test_xla_ignores_nan_in_rows_without_adapter() -> None:
    """NaN activations of a token with idx −1 stay in that row's (unused) products: masked, not multiplied."""
    x = jnp.array([[1.0, 2.0], [jnp.nan, jnp.inf]])  # [T=2, in=2]
    A = jnp.ones((3, 2, 2))
    B = jnp.ones((3, 2, 2))
    y = jnp.array([[1.0, 1.0], [5.0, 6.0]])
    idx = jnp.array([2, -1], jnp.int32)
    for backend in ("reference", "xla-onehot"):
        out = np.asarray(kernels.add_lora(y, x, A, B, idx, backend=backend))
        np.testing.assert_array_equal(out, [[7.0, 7.0], [5.0, 6.0]], err_msg=backend)
