"""Grouped multi-LoRA for decode batches on XLA:CPU: every row's own adapter, no one-hot over slots.

The one-hot backend (:mod:`kernels.xla`) multiplies every row with every slot: ``S×`` the useful
flops, which a TPU's MXU absorbs but a CPU does not (on the bench model, 16 rows × 16 slots of rank
16: 20 ms of LoRA per decode step against a 45 ms base step). Here the rows are grouped by slot on
the host (:func:`plan_groups`, ~50 µs of numpy per step) and two mechanisms split them:

* **light rows** (at most ``J`` per slot): in place, batched over the slot axis. Row b is column j
  of its slot's group, ``X[s] = [x[b] for the rows of s]`` padded to ``J`` with zeros, then for every
  slot ``h[s] = A_t[s] @ X[s].T`` (``[n*R, in] @ [in, J]``) and ``d[s] = B_t[s] @ h[s]``. Every pool
  is read once, no pool is copied; the work is ``S·J`` matvecs.
* **heavy slots** (more than ``J`` rows): a loop over those slots; each reads its slot's matrices and
  multiplies ALL rows with them (``[n*R, in] @ [in, T]``), rows of other slots zeroed going in and
  selected out coming back (so a NaN in that slot never reaches them: row isolation). A batch whose
  adapter rows all use ONE slot (the common one-fine-tune deployment) runs that as straight-line
  code instead of a loop (``single``: 2.9 instead of 4.6 ms on the bench model).

``plan_groups`` picks ``J`` from :data:`LIGHT_J` with a cost model measured on the bench model
(docs/kernels.md): 16 distinct adapters → J=1 (6.9 ms instead of 20), one adapter for every row →
``single`` (2.9 ms). ``J`` and ``single`` are static (one compilation each, all made at warm-up); the
slot ids, row lists and the number of heavy slots are traced, so new adapter mixes never recompile.

Pools are *weights first*, Hugging Face's LoRA layout with a leading slot axis: ``A_t [S, n*R, in]``
and ``B_t [S, out, R]``; XLA:CPU multiplies ``W @ x.T`` faster than ``x @ W`` when ``x`` has few rows
(see :mod:`kernels.linear`). Scaling is folded into B, as everywhere. Prefill (every token of one
prompt on one slot) multiplies that slot's matrices directly: :func:`add_lora_slices_one_slot`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from loraserve.kernels.linear import linear
from loraserve.kernels.shapes import ACC_DTYPE

# Rows per slot handled in place; 0 = every adapter row goes through the heavy-slot loop.
LIGHT_J: tuple[int, ...] = (0, 1, 4)
# Every compiled variant (light J, single); plan_groups only ever returns these.
VARIANTS: tuple[tuple[int, bool], ...] = ((0, True), *((j, False) for j in LIGHT_J))
# Cost model, in units of "one slot's pools read once by the batched path" (measured on the bench
# model, docs/kernels.md): the in-place path reads all S slots (x1.0 at J=1, x1.35 at J=4: more
# flops per byte), each heavy slot costs about six slot reads (a [n*R, in] @ [in, T] GEMM per slot).
_LIGHT_COST = {0: 0.0, 1: 1.0, 4: 1.35}
_HEAVY_COST = 6.0

_CONTRACT_MINOR = (((1,), (1,)), ((), ()))  # [N, K] x [M, K] -> [N, M]


@jax.tree_util.register_pytree_node_class
@dataclass(frozen=True)
class GroupPlan:
    """Which rows go where, for one decode step. Built on the host by :func:`plan_groups`.

    ``light`` (J) and ``single`` are static (pytree aux data: one compilation per variant, see
    :data:`VARIANTS`); the arrays are traced.
    """

    light: int
    single: bool  # all adapter rows use heavy[0]: no loop, no light part (light == 0)
    slots: jax.Array  # [T] int32, slot per row or -1
    heavy: jax.Array  # [S] int32, slot ids handled by the loop (first n_heavy valid)
    n_heavy: jax.Array  # [] int32
    rows: jax.Array  # [S, max(J, 1)] int32, row of (slot, j); T = none
    flat: jax.Array  # [T] int32, s*J + j for light rows, -1 otherwise

    def tree_flatten(self):
        return (self.slots, self.heavy, self.n_heavy, self.rows, self.flat), (self.light, self.single)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*aux, *children)

    @property
    def variant(self) -> tuple[int, bool]:
        return self.light, self.single


def plan_groups(
    idx: np.ndarray, num_slots: int, lights: Sequence[int] = LIGHT_J, single: bool = True
) -> GroupPlan | None:
    """Group the rows of one decode batch by slot; ``None`` when no row has an adapter.

    ``idx`` [T] holds each row's slot, −1 (or anything outside ``[0, S)``) for none. One slot in
    use (and ``single``) -> the straight-line single-slot variant; otherwise the cheapest ``J`` of
    ``lights`` under the cost model wins, and slots with more than ``J`` rows become heavy.
    """
    idx = np.asarray(idx, np.int64)
    T, S = idx.shape[0], num_slots
    valid = (idx >= 0) & (idx < S)
    if not valid.any():
        return None
    counts = np.bincount(idx[valid], minlength=S)

    def cost(j: int) -> float:
        return _LIGHT_COST[j] * S * (j > 0) + _HEAVY_COST * int((counts > j).sum())

    one_slot = single and int((counts > 0).sum()) == 1
    J = 0 if one_slot else min(lights, key=cost)
    heavy_ids = np.flatnonzero(counts > J)
    heavy = np.zeros(S, np.int32)
    heavy[: heavy_ids.size] = heavy_ids
    rows = np.full((S, max(J, 1)), T, np.int32)
    flat = np.full(T, -1, np.int32)
    if J:
        light_rows = np.flatnonzero(valid & (counts[np.where(valid, idx, 0)] <= J))
        fill = np.zeros(S, np.int64)
        for b in light_rows:  # at most T iterations of plain integer work
            s = idx[b]
            rows[s, fill[s]] = b
            flat[b] = s * J + fill[s]
            fill[s] += 1
    slots = np.where(valid, idx, -1).astype(np.int32)
    return GroupPlan(J, one_slot, slots, heavy, np.int32(heavy_ids.size), rows, flat)


def empty_plan(rows: int, num_slots: int, light: int, single: bool = False) -> GroupPlan:
    """A plan of variant ``(light, single)`` with no adapter rows: compiles it (warm-up), adds nothing."""
    return GroupPlan(
        light,
        single,
        np.full(rows, -1, np.int32),
        np.zeros(num_slots, np.int32),
        np.int32(0),
        np.full((num_slots, max(light, 1)), rows, np.int32),
        np.full(rows, -1, np.int32),
    )


def _expand_t(Bs_t: Sequence, h, batch: bool):
    """Stack the expands of the n slices: h [.., n*R, M] -> [.., sum(out_i), M] (f32)."""
    R = Bs_t[0].shape[-1]
    dims = (((2,), (1,)), ((0,), (0,))) if batch else (((1,), (0,)), ((), ()))
    parts = [
        jax.lax.dot_general(
            B, h[..., i * R : (i + 1) * R, :].astype(B.dtype), dims, preferred_element_type=ACC_DTYPE
        )
        for i, B in enumerate(Bs_t)
    ]
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-2)


def add_lora_slices_grouped(y, x, A_t, Bs_t: Sequence, plan: GroupPlan):  # [T, sum(out_i)]
    """Fused-projection LoRA with weights-first pools.

    Args:
      y: ``[T, sum(out_i)]``; x: ``[T, in]``; A_t: ``[S, n*R, in]``; Bs_t: n × ``[S, out_i, R]``;
      plan: from :func:`plan_groups` over the same T rows and S slots.

    *Semantics:* ``out[t, off_i:off_i+out_i] = y[t, …] + B_t[i][s] @ (A_t[s, i*R:(i+1)*R] @ x[t])``
    with ``s = plan.slots[t]``; rows without a slot get ``y[t]`` exactly. Math in f32.
    """
    T, d_in = x.shape
    S, nR, _ = A_t.shape
    d_out = sum(B.shape[1] for B in Bs_t)
    if y.shape != (T, d_out) or A_t.shape[2] != d_in or nR != len(Bs_t) * Bs_t[0].shape[2]:
        raise ValueError(
            f"shapes do not line up: y {y.shape}, x {x.shape}, A_t {A_t.shape}, Bs_t {[B.shape for B in Bs_t]}"
        )
    cd = A_t.dtype if x.dtype == A_t.dtype else ACC_DTYPE
    xc = x.astype(cd)

    def heavy_slot(u, delta):  # delta [d_out, T] += this slot's LoRA for its rows
        s = plan.heavy[u]
        mine = plan.slots == s  # [T]
        xs = jnp.where(mine[:, None], xc, 0)
        a = jax.lax.dynamic_index_in_dim(A_t, s, 0, keepdims=False).astype(cd)  # [n*R, in]
        h = jax.lax.dot_general(a, xs, _CONTRACT_MINOR, preferred_element_type=ACC_DTYPE)  # [n*R, T]
        bs = [jax.lax.dynamic_index_in_dim(B, s, 0, keepdims=False) for B in Bs_t]
        # other rows' columns are A @ 0: NaN where this slot holds one; selected out, never multiplied
        return delta + jnp.where(mine[None, :], _expand_t(bs, h, batch=False), 0.0)

    if plan.single:
        delta_t = heavy_slot(0, jnp.zeros((d_out, T), ACC_DTYPE))
    else:
        delta_t = jax.lax.fori_loop(0, plan.n_heavy, heavy_slot, jnp.zeros((d_out, T), ACC_DTYPE))
    # The barrier keeps XLA from turning the transposed products back into the slower x-first form.
    delta = jax.lax.optimization_barrier(delta_t).T  # [T, d_out]
    J = plan.light
    if J:
        xg = jnp.concatenate([xc, jnp.zeros((1, d_in), cd)])[plan.rows]  # [S, J, in]
        h = jax.lax.dot_general(
            A_t.astype(cd), xg, (((2,), (2,)), ((0,), (0,))), preferred_element_type=ACC_DTYPE
        )
        d = jax.lax.optimization_barrier(_expand_t(Bs_t, h, batch=True))  # [S, d_out, J]
        d = jnp.swapaxes(d, 1, 2).reshape(S * J, d_out)
        delta = delta + jnp.where((plan.flat >= 0)[:, None], d[jnp.maximum(plan.flat, 0)], 0.0)
    out = (y.astype(ACC_DTYPE) + delta).astype(y.dtype)
    return jnp.where((plan.slots >= 0)[:, None], out, y)


def add_lora_slices_one_slot(y, x, A_t, Bs_t: Sequence, slot):  # [T, sum(out_i)]
    """Every token of one prompt with the adapter in ``slot`` (prefill of one request), weights-first pools.

    Args:
      y: ``[T, sum(out_i)]``; x: ``[T, in]``; A_t: ``[S, n*R, in]``; Bs_t: n × ``[S, out_i, R]``;
      slot: ``[]`` int, −1 = no adapter.

    *Semantics:* ``y + (x @ A_t[slot, i*R:(i+1)*R].T) @ Bs_t[i][slot].T`` per slice i (f32 math);
    ``y`` exactly when slot is −1.
    """
    take = jnp.maximum(slot, 0)
    a_s = jax.lax.dynamic_index_in_dim(A_t, take, axis=0, keepdims=False)  # [n*R, in]
    h = linear(x, a_s)  # [T, n*R] f32
    r = Bs_t[0].shape[2]
    parts = [
        linear(h[:, i * r : (i + 1) * r].astype(B.dtype), jax.lax.dynamic_index_in_dim(B, take, 0, False))
        for i, B in enumerate(Bs_t)
    ]
    delta = parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)
    return jnp.where(slot >= 0, (y.astype(ACC_DTYPE) + delta).astype(y.dtype), y)
