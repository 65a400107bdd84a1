"""Serving a new mix of adapters must never compile: slot ids and slot contents are data, not shapes."""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loraserve import kernels
from loraserve.kernels.testing import count_compilations, random_lora_case
from tests.platform import backends

T, D_IN, D_OUT, S, R = 24, 32, 48, 6, 8


@functools.partial(jax.jit, donate_argnames=("A", "B"))
def _swap(A, B, slot, a, b):
    """Write one adapter into a slot in place (what the worker does on a swap)."""
    return A.at[slot].set(a), B.at[slot].set(b)


@pytest.mark.parametrize("backend", backends(*kernels.BACKENDS))
def test_new_ids_and_slot_contents_never_recompile(backend: str) -> None:
    c = random_lora_case(0, T=T, d_in=D_IN, d_out=D_OUT, S=S, R=R)
    step = jax.jit(functools.partial(kernels.add_lora, backend=backend))
    A, B = jnp.array(c.A), jnp.array(c.B)
    rng = np.random.default_rng(1)
    new_a = jnp.asarray(rng.standard_normal((D_IN, R)), jnp.float32)
    new_b = jnp.asarray(rng.standard_normal((R, D_OUT)), jnp.float32)
    first = step(c.y, c.x, A, B, c.idx)  # warm-up: compiles
    A, B = _swap(A, B, jnp.int32(0), new_a, new_b)
    step(c.y, c.x, A, B, c.idx).block_until_ready()

    ids = [jnp.asarray(rng.integers(-1, S, size=T), jnp.int32) for _ in range(6)]
    contents = [jnp.asarray(rng.standard_normal((D_IN, R)), jnp.float32) for _ in range(6)]
    outs = []
    with count_compilations() as count:  # (eager jnp ops in here would count too: keep them out)
        for i in range(6):
            A, B = _swap(A, B, jnp.int32(i % S), contents[i], new_b)
            outs.append(step(c.y, c.x, A, B, ids[i]))
        jax.block_until_ready(outs)
    assert count.compilations == 0, count.names
    assert count.traces == 0
    # and the outputs really changed with the ids and contents
    assert not np.allclose(np.asarray(outs[2]), np.asarray(first))


def test_new_segments_never_recompile() -> None:
    c = random_lora_case(2, T=T, d_in=D_IN, d_out=D_OUT, S=S, R=R)
    step = jax.jit(kernels.add_lora_sgmv)
    step(c.y, c.x, c.A, c.B, jnp.array([1, 2, -1], jnp.int32), jnp.array([5, 5, 5], jnp.int32))
    with count_compilations() as count:
        for lens in ([0, 24, 0], [10, 3, 11], [30, 0, 0]):
            step(c.y, c.x, c.A, c.B, jnp.array([3, -1, 5], jnp.int32), jnp.array(lens, jnp.int32))
    assert count.compilations == 0, count.names


def test_count_compilations_sees_new_shapes_and_other_threads() -> None:
    """Control for the tests above: the counter does count real compilations, from any thread."""
    step = jax.jit(functools.partial(kernels.add_lora, backend="xla-onehot"))
    c = random_lora_case(3, T=5, d_in=7, d_out=9, S=2, R=3)
    step(c.y, c.x, c.A, c.B, c.idx)
    with count_compilations() as count:
        d = random_lora_case(3, T=6, d_in=7, d_out=9, S=2, R=3)  # one more token: a new shape
        step(d.y, d.x, d.A, d.B, d.idx)
        e = random_lora_case(3, T=7, d_in=7, d_out=9, S=2, R=3)
        worker = threading.Thread(target=lambda: step(e.y, e.x, e.A, e.B, e.idx).block_until_ready())
        worker.start()
        worker.join()
    assert count.compilations >= 2
    assert count.traces >= 2
    assert any("add_lora" in name for name in count.names), count.names
