"""Fully sharded LoRA: any backend's ops run per shard (``jax.shard_map``) over a 1-D ``model`` mesh.

The slot pools are split like the layer they adapt (vLLM's ``fully_sharded_loras``, docs/design.md §10.2):

* column-parallel layers (q/k/v, gate/up; base weight split by output features): ``x`` replicated,
  ``A`` whole, ``B`` and ``y`` split by output. Each shard adds its own output columns: no communication.
  A fused projection's ``y`` holds, on every shard, that shard's part of each module side by side
  (``[q_s | k_s | v_s]``, the order ``models.sharding`` gives the fused base weights), so the inner
  backend's slice op works on the local arrays unchanged.
* row-parallel layers (o, down; base weight split by input features, then one reduction): ``x`` and
  ``A`` split by input, the ``[tokens, n*R]`` shrink result summed over the devices (``psum``: the
  only collective LoRA adds, ``tokens x rank`` elements), then the whole ``B`` adds to the already
  reduced ``y`` on every shard.

The row-parallel shrink and expand are the inner backend's own fused op run twice with an identity
in the other place: ``shrink(x) = add(0, x, A, I)`` and ``expand(y, h) = add(y, h, I, B)``, exact
(multiplying by an identity in f32 changes nothing) and the same for every backend and its plan.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from loraserve.kernels.backends import COLUMN, PARALLEL_KINDS, ROW, LoraBackend, Plan

Array = jax.Array
AXIS = "model"  # the mesh axis tensor parallelism splits over


def _spec(rank: int, axis: int | None) -> P:
    """A PartitionSpec of ``rank`` dims split over ``AXIS`` along ``axis`` (None = replicated)."""
    return P(*(AXIS if d == axis else None for d in range(rank)))


@dataclass(frozen=True)
class ShardedBackend(LoraBackend):
    """``inner``'s pool layout, plan and ops, run per shard of ``mesh`` (1-D, axis ``model``).

    Hashable (a frozen dataclass of a backend and a ``Mesh``), so it is a static ``jax.jit`` argument.
    """

    inner: LoraBackend
    mesh: Mesh

    name = "sharded"

    def __str__(self) -> str:
        return f"{self.inner.name} x{self.shards} shards"

    @property
    def shards(self) -> int:
        return int(self.mesh.shape[AXIS])

    @property
    def pool_dtypes(self) -> Any:  # type: ignore[override]
        return self.inner.pool_dtypes

    # ------------------------------------------------------------------ layout: the inner backend's
    def slot_shape(self, shape, kind):
        return self.inner.slot_shape(shape, kind)

    def to_pool_layout(self, value, kind):
        return self.inner.to_pool_layout(value, kind)

    def from_pool_layout(self, value, kind):
        return self.inner.from_pool_layout(value, kind)

    def feature_axis(self, kind):
        return self.inner.feature_axis(kind)

    def plan(self, slots, num_slots):
        return self.inner.plan(slots, num_slots)

    def warmup_plans(self, rows, num_slots):
        return self.inner.warmup_plans(rows, num_slots)

    def row_slots(self, plan):
        return self.inner.row_slots(plan)

    def check(self) -> None:
        self.inner.check()

    def pool_spec(self, kind: str, parallel: str) -> P:
        """PartitionSpec of an ``"A"`` or ``"B"`` pool adapting a ``parallel`` layer: ``B`` split by
        output for column-parallel layers, ``A`` split by input for row-parallel ones, else whole."""
        if parallel not in PARALLEL_KINDS:
            raise ValueError(f"parallel must be one of {PARALLEL_KINDS}, got {parallel!r}")
        split = (kind == "B") == (parallel == COLUMN)
        return _spec(3, self.feature_axis(kind) if split else None)

    # ------------------------------------------------------------------ ops: shard_map over the inner ones
    def _run(self, op, y, x, a, bs, extra, parallel):
        """``op(y, x, a, bs, extra)`` per shard with the specs of a ``parallel`` layer."""
        col = parallel == COLUMN
        y_spec = _spec(y.ndim, y.ndim - 1 if col else None)
        x_spec = _spec(x.ndim, None if col else x.ndim - 1)
        specs = (
            y_spec,
            x_spec,
            self.pool_spec("A", parallel),
            tuple(self.pool_spec("B", parallel) for _ in bs),
        )
        fn = op if col else self._row(op, a.shape[3 - self.feature_axis("A")])
        return jax.shard_map(fn, mesh=self.mesh, in_specs=(*specs, P()), out_specs=y_spec, check_vma=False)(
            y, x, a, tuple(bs), extra
        )

    @staticmethod
    def _row(op, n_r: int):
        """Row-parallel ``op`` (A pools of ``n_r = n*R`` ranks): partial shrink on this shard's input
        features, ``psum`` of the ``[T, n*R]`` result, then the expand on every shard."""

        def fn(y, x, a, bs, extra):
            eye = jnp.broadcast_to(jnp.eye(n_r, dtype=a.dtype), (a.shape[0], n_r, n_r))
            r = n_r // len(bs)
            eyes = tuple(eye[:, :r, :r] for _ in bs)  # each module's [R, R] identity (both layouts)
            h = op(jnp.zeros((*x.shape[:-1], n_r), jnp.float32), x, a, eyes, extra)  # [T, n*R] partial
            h = jax.lax.psum(h, AXIS)
            return op(y, h, eye, bs, extra)

        return fn

    def add_decode(self, y, x, a, bs, plan: Plan):  # [B, sum(out_i)]; as a column-parallel layer
        return self.apply_decode(y, x, a, bs, plan, COLUMN)

    def add_one_slot(self, y, x, a, bs, slot):  # [T, sum(out_i)]; as a column-parallel layer
        return self.apply_one_slot(y, x, a, bs, slot, COLUMN)

    def add_segments(self, y, x, a, bs, seg_slots):  # [G*L, sum(out_i)]; as a column-parallel layer
        return self.apply_segments(y, x, a, bs, seg_slots, COLUMN)

    def apply_decode(self, y, x, a, bs: Sequence[Array], plan, parallel):  # [B, sum(out_i)]
        return self._run(self.inner.add_decode, y, x, a, bs, plan, parallel)

    def apply_one_slot(self, y, x, a, bs: Sequence[Array], slot, parallel):  # [T, sum(out_i)]
        return self._run(self.inner.add_one_slot, y, x, a, bs, slot, parallel)

    def apply_segments(self, y, x, a, bs: Sequence[Array], seg_slots, parallel):  # [G*L, sum(out_i)]
        return self._run(self.inner.add_segments, y, x, a, bs, seg_slots, parallel)


__all__ = ["AXIS", "COLUMN", "ROW", "ShardedBackend"]
