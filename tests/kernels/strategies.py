"""Hypothesis strategies and the "run every op once" helper shared by the kernel tests."""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st

from loraserve import kernels
from loraserve.kernels.testing import LoraCase, random_lora_case, tolerance

DTYPES = (jnp.float32, jnp.bfloat16)


@dataclass(frozen=True)
class Problem:
    """A LoraCase plus the extra operands of expand / the fused-slice ops / the segment ops."""

    case: LoraCase
    h: jax.Array  # [T, R]
    A_cat: jax.Array  # [S, in, n*R]
    Bs: tuple[jax.Array, ...]  # n × [S, R, out_i], sum(out_i) = out
    seg_slots: jax.Array  # [G]
    seg_lens: jax.Array  # [G]

    @property
    def dtype(self):
        return self.case.x.dtype


@st.composite
def problems(draw, *, max_T=300, max_dim=48, max_S=64, max_R=64, max_slices=3) -> Problem:
    T = draw(st.integers(1, max_T))
    d_in = draw(st.integers(1, max_dim))
    n = draw(st.integers(1, max_slices))
    d_out = draw(st.integers(n, max(n, max_dim)))
    S = draw(st.integers(1, max_S))
    R = draw(st.integers(1, max_R))
    dtype = draw(st.sampled_from(DTYPES))
    p_none = draw(st.sampled_from([0.0, 0.25, 1.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    case = random_lora_case(seed, T=T, d_in=d_in, d_out=d_out, S=S, R=R, dtype=dtype, p_none=p_none)

    rng = np.random.default_rng(seed + 1)
    cuts = np.sort(rng.choice(np.arange(1, d_out), size=n - 1, replace=False)) if n > 1 else np.array([], int)
    bounds = [0, *cuts.tolist(), d_out]
    # sliced and converted on the host: every example has new shapes, and each eager op would compile
    B = np.asarray(case.B)
    Bs = tuple(jnp.asarray(B[:, :, a:b]) for a, b in itertools.pairwise(bounds))
    A_cat = jnp.asarray(
        (rng.standard_normal((S, d_in, n * R)) / np.sqrt(d_in)).astype(np.float32).astype(dtype)
    )
    h = jnp.asarray(rng.standard_normal((T, R)).astype(np.float32).astype(dtype))

    G = draw(st.integers(1, 6))
    lens = rng.multinomial(draw(st.integers(0, T)), np.ones(G) / G)  # sum <= T: a padding tail
    if draw(st.booleans()):
        lens[-1] += T  # or a segment that runs past T (clipped)
    slots = rng.integers(-1, S, size=G)
    return Problem(case, h, A_cat, Bs, jnp.asarray(slots, jnp.int32), jnp.asarray(lens, jnp.int32))


OPS = ("shrink", "shrink_f32", "expand", "add_lora", "expand_slices", "add_lora_slices")


@functools.cache
def all_ops(backend: str, ops: tuple[str, ...] = OPS, **options):
    """A jitted function computing the per-token ``ops`` of ``backend`` on a Problem's arrays.

    ``options`` go to the backend module directly (e.g. ``block_t`` for pallas).
    """
    mod = kernels.backend_module(backend)

    def run(x, A, B, y, idx, h, A_cat, Bs):
        fns = {
            "shrink": lambda: mod.lora_shrink(x, A, idx, **options),
            "shrink_f32": lambda: mod.lora_shrink(x, A, idx, out_dtype=jnp.float32, **options),
            "expand": lambda: mod.lora_expand(h, B, idx, y, **options),
            "add_lora": lambda: mod.add_lora(y, x, A, B, idx, **options),
            "expand_slices": lambda: mod.lora_expand_slices(
                jnp.concatenate([h] * len(Bs), 1), Bs, idx, y, **options
            ),
            "add_lora_slices": lambda: mod.add_lora_slices(y, x, A_cat, Bs, idx, **options),
        }
        return {name: fns[name]() for name in ops}

    return jax.jit(run)


def run_all_ops(p: Problem, backend: str, ops: tuple[str, ...] = OPS, **options) -> dict[str, np.ndarray]:
    c = p.case
    out = all_ops(backend, ops, **options)(c.x, c.A, c.B, c.y, c.idx, p.h, p.A_cat, p.Bs)
    return {k: np.asarray(v).astype(np.float32) for k, v in out.items()}


def assert_matches_reference(p: Problem, got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    """Every op within the dtype's tolerance; rows without an adapter equal y bit for bit."""
    tol = tolerance(p.dtype)
    for name, w in want.items():
        np.testing.assert_allclose(got[name], w, atol=tol, rtol=tol, err_msg=name)
        assert np.isfinite(got[name]).all(), name
    none = np.asarray(p.case.idx) < 0
    y = np.asarray(p.case.y).astype(np.float32)
    for name in set(want) & {"expand", "add_lora", "expand_slices", "add_lora_slices"}:
        np.testing.assert_array_equal(got[name][none], y[none], err_msg=f"{name}: idx -1 rows changed")
    for name in set(want) & {"shrink", "shrink_f32"}:
        np.testing.assert_array_equal(got[name][none], 0.0, err_msg=f"{name}: idx -1 rows not 0")
