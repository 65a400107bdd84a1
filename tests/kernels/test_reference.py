"""Hand-computed cases for the ``reference`` backend (the truth), the API's dispatch and its errors."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from loraserve import kernels
from loraserve.kernels import reference as ref
from tests.platform import ON_TPU, backends

# the function-level backends a program on this platform can call (not the C++ `cpu` kernels on a TPU)
RUNNABLE = tuple(b for b in kernels.BACKENDS if b != "cpu" or not ON_TPU)

# S=2 slots, in=2, R=2, out=2, T=3 tokens using slot 1, no adapter, slot 0.
A = jnp.array([[[1, 0], [0, 1]], [[1, 2], [3, 4]]], jnp.float32)  # [S, in, R]
B = jnp.array([[[1, 1], [0, 1]], [[2, 0], [0, -1]]], jnp.float32)  # [S, R, out]
X = jnp.array([[1, 2], [3, 4], [5, 6]], jnp.float32)  # [T, in]
Y = jnp.array([[10, 20], [30, 40], [50, 60]], jnp.float32)  # [T, out]
IDX = jnp.array([1, -1, 0], jnp.int32)

# t0: [1,2] @ [[1,2],[3,4]] = [7, 10]; t1: no adapter -> 0; t2: [5,6] @ I = [5, 6]
H = [[7, 10], [0, 0], [5, 6]]
# t0: y + [7,10] @ [[2,0],[0,-1]] = [10+14, 20-10]; t1: y; t2: y + [5,6] @ [[1,1],[0,1]] = [50+5, 60+11]
OUT = [[24, 10], [30, 40], [55, 71]]


def test_reference_shrink_expand_by_hand() -> None:
    h = ref.lora_shrink(X, A, IDX)
    np.testing.assert_array_equal(h, H)
    np.testing.assert_array_equal(ref.lora_expand(h, B, IDX, Y), OUT)
    np.testing.assert_array_equal(ref.add_lora(Y, X, A, B, IDX), OUT)


def test_reference_slices_by_hand() -> None:
    # Two rank-1 slices: A_cat[s][:, 0] feeds slice 0 (out 1), A_cat[s][:, 1] feeds slice 1 (out 2).
    Bs = (
        jnp.array([[[1]], [[2]]], jnp.float32),  # [S, 1, 1]
        jnp.array([[[1, -1]], [[0, 3]]], jnp.float32),  # [S, 1, 2]
    )
    y = jnp.zeros((3, 3), jnp.float32)
    # t0 (slot 1): h = [7, 10] -> [7*2 | 10*[0, 3]]; t2 (slot 0): h = [5, 6] -> [5*1 | 6*[1, -1]]
    want = [[14, 0, 30], [0, 0, 0], [5, 6, -6]]
    np.testing.assert_array_equal(ref.add_lora_slices(y, X, A, Bs, IDX), want)
    np.testing.assert_array_equal(ref.lora_expand_slices(jnp.array(H, jnp.float32), Bs, IDX, y), want)


@pytest.mark.parametrize("backend", backends(*kernels.BACKENDS))
def test_every_backend_gets_the_hand_case_exactly(backend: str) -> None:
    """Small integers are exact in f32, so every backend must hit the numbers above exactly."""
    np.testing.assert_array_equal(kernels.lora_shrink(X, A, IDX, backend=backend), H)
    np.testing.assert_array_equal(kernels.add_lora(Y, X, A, B, IDX, backend=backend), OUT)
    bf = kernels.add_lora(Y.astype(jnp.bfloat16), X.astype(jnp.bfloat16), A, B, IDX, backend=backend)
    assert bf.dtype == jnp.bfloat16  # output dtype = y's dtype
    np.testing.assert_array_equal(bf.astype(jnp.float32), OUT)


def test_out_of_range_slot_means_no_adapter() -> None:
    idx = jnp.array([2, 7, -5], jnp.int32)  # S = 2
    for backend in ("reference", "xla-onehot"):
        np.testing.assert_array_equal(kernels.add_lora(Y, X, A, B, idx, backend=backend), Y)
        np.testing.assert_array_equal(kernels.lora_shrink(X, A, idx, backend=backend), np.zeros((3, 2)))


def test_segments_to_idx_by_hand() -> None:
    slots = jnp.array([1, -1, 0], jnp.int32)
    np.testing.assert_array_equal(
        kernels.segments_to_idx(slots, jnp.array([2, 1, 3], jnp.int32), 8), [1, 1, -1, 0, 0, 0, -1, -1]
    )
    np.testing.assert_array_equal(  # lengths past T are clipped; empty segments take no tokens
        kernels.segments_to_idx(slots, jnp.array([0, 2, 10], jnp.int32), 4), [-1, -1, 0, 0]
    )


def test_sgmv_by_hand() -> None:
    # 3 tokens: a segment (slot 1, 1 token), a segment (slot 0, 1 token), then 1 padding token
    seg_slots, seg_lens = jnp.array([1, 0], jnp.int32), jnp.array([1, 1], jnp.int32)
    x = X[jnp.array([0, 2, 1])]  # [[1, 2], [5, 6], [3, 4]]
    # t0 (slot 1): h = [7, 10] -> y0 + [14, -10]; t1 (slot 0): h = [5, 6] -> y1 + [5, 11]; t2: y2
    want = [[24, 10], [35, 51], [50, 60]]
    runs = [(b, "masked") for b in RUNNABLE] + [("xla-onehot", "ragged")]
    for backend, method in runs:
        got = kernels.add_lora_sgmv(Y, x, A, B, seg_slots, seg_lens, backend=backend, method=method)
        np.testing.assert_array_equal(got, want, err_msg=f"{backend}/{method}")


def test_unknown_backend_lists_the_choices() -> None:
    with pytest.raises(ValueError, match=r"'cuda'.*reference.*xla.*pallas"):
        kernels.add_lora(Y, X, A, B, IDX, backend="cuda")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: kernels.lora_shrink(X, A[:, :1], IDX), "in="),
        (lambda: kernels.lora_shrink(X, A, IDX[:2]), "idx has 2 entries"),
        (lambda: kernels.lora_shrink(X, A, IDX.astype(jnp.float32)), "integer"),
        (lambda: kernels.lora_expand(jnp.zeros((3, 3)), B, IDX, Y), "R="),
        (lambda: kernels.lora_expand(jnp.zeros((3, 2)), B, IDX, Y[:, :1]), "y must be"),
        (lambda: kernels.lora_expand_slices(jnp.zeros((3, 3)), (B, B), IDX, Y), "multiple of the 2"),
        (lambda: kernels.add_lora_slices(jnp.zeros((3, 3)), X, A, (B[:, :1], B[:, 1:]), IDX), "sum"),
    ],
)
def test_shape_errors_name_the_argument(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()
