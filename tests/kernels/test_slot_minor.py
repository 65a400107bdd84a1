"""The XLA backend's slot-minor layout (A_t [in, S, R]) computes exactly what the reference computes."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from kernels import reference
from kernels import xla as xla_kernels


@pytest.mark.parametrize(
    ("T", "d_in", "S", "R", "outs"),
    [(1, 8, 1, 1, (3,)), (16, 64, 5, 4, (64, 16, 16)), (37, 33, 16, 8, (40, 24))],
)
def test_slot_minor_matches_reference(T, d_in, S, R, outs) -> None:
    rng = np.random.default_rng(T + S)
    n = len(outs)
    x = jnp.asarray(rng.standard_normal((T, d_in), dtype=np.float32))
    A = jnp.asarray(rng.standard_normal((S, d_in, n * R), dtype=np.float32))
    Bs = tuple(jnp.asarray(rng.standard_normal((S, R, o), dtype=np.float32)) for o in outs)
    y = jnp.asarray(rng.standard_normal((T, sum(outs)), dtype=np.float32))
    idx = jnp.asarray(rng.integers(-1, S, T), dtype=jnp.int32)
    want = reference.add_lora_slices(y, x, A, Bs, idx)
    got = xla_kernels.add_lora_slices_t(y, x, jnp.moveaxis(A, 0, 1), Bs, idx)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    rows = np.asarray(idx) < 0
    np.testing.assert_array_equal(np.asarray(got)[rows], np.asarray(y)[rows])  # no adapter: y exactly
    h = xla_kernels.lora_shrink_t(x, jnp.moveaxis(A, 0, 1), idx)
    np.testing.assert_allclose(
        np.asarray(h), np.asarray(reference.lora_shrink(x, A, idx)), atol=2e-5, rtol=2e-5
    )
    with pytest.raises(ValueError):
        xla_kernels.lora_shrink_t(x[:, :-1], jnp.moveaxis(A, 0, 1), idx)
