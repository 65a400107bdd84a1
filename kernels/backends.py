"""LoRA backend objects: each owns its slot-pool layout, the host→pool conversion, the per-batch plan and the ops.

The model (``models/decoder.py``) calls one of these and never branches on a backend name; the worker
picks one with ``--kernel-backend`` through :func:`resolve_backend`. The shape follows vLLM's
``PunicaWrapperBase``: per-batch metadata is prepared once on the host (:meth:`LoraBackend.plan`), then
every projection of the step calls the op with it (:meth:`LoraBackend.add_decode`).

* ``reference``   — docs/design.md §6 pools (``A [in, n*R]``, ``B [R, out]`` per slot); decode: per-token
  gather (the truth); prefill: the one slot's SGMV.
* ``xla-onehot``  — docs/design.md §6 pools; decode: one-hot einsum over all S slots (what TPU servers
  use); prefill: SGMV.
* ``xla-grouped`` — weights-first pools (``A [n*R, in]``, ``B [out, R]``); decode: rows grouped by
  slot on the host (:mod:`kernels.grouped`); prefill: the one slot's matrices multiplied directly.
* ``cpu``         — docs/design.md §6 pools, float32 or bfloat16; C++ custom calls (:mod:`kernels.cpu`).
* ``pallas``      — docs/design.md §6 pools; decode: TPU kernels (:mod:`kernels.pallas`); prefill: SGMV.

Names ``--kernel-backend`` accepts: the five above, ``auto`` (``cpu`` where its C++ kernels build on
a CPU, else ``xla-grouped``) and ``xla``, which means ``xla-grouped``: the worker's ``xla`` has always
been the grouped decode, and users who pass it keep that code path. The function-level ops
(``kernels.add_lora`` etc.) name their one-hot einsum ``backend="xla-onehot"`` as well.

Backends are frozen, field-less dataclasses: equal and hashable by class, so they are static
arguments of ``jax.jit`` (one compilation per backend, none per call).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np

from loraserve.kernels import cpu, grouped, pallas_decode, reference, sgmv, xla

Array = jax.Array
Pools = list[dict[str, Array]]  # per layer: pool name -> [S, *slot layout]
Plan = Any  # a pytree the backend's add_decode reads; None = no row has an adapter

# How the layer a LoRA call adapts is split under tensor parallelism (Megatron): ``COLUMN`` = by output
# features (q/k/v, gate/up), ``ROW`` = by input features with one reduction (o, down). A single-device
# backend ignores it; :class:`kernels.sharded.ShardedBackend` picks its ``shard_map`` specs by it.
COLUMN, ROW = "column", "row"
PARALLEL_KINDS = (COLUMN, ROW)


def pool_kind(name: str) -> str:
    """``"A"`` for a shrink pool (``A_qkv``, ``A_o``, ...), ``"B"`` for an expand pool (``B_q``, ...)."""
    if name[:2] not in ("A_", "B_"):
        raise ValueError(f"{name!r} is not a LoRA matrix pool (A_<group> or B_<module>)")
    return name[0]


@dataclass(frozen=True)
class LoraBackend(ABC):
    """One multi-LoRA strategy: pool layout, host→pool conversion, per-batch plan, shrink/expand ops.

    Slot values are given in the canonical layout of docs/design.md §6 without the slot axis: ``A [in, n*R]``
    (the n modules of a fused projection side by side on the rank axis) and ``B [R, out]``.
    """

    name: ClassVar[str]
    pool_dtypes: ClassVar[tuple[Any, ...] | None] = None  # dtypes the pools may have; None = any

    def __str__(self) -> str:
        return self.name

    # ------------------------------------------------------------------ layout
    def slot_shape(self, shape: tuple[int, int], kind: str) -> tuple[int, int]:
        """Canonical shape of one slot's matrix of ``kind`` (``"A"`` or ``"B"``: :func:`pool_kind`) -> its shape
        in this backend's pools."""
        return shape

    def to_pool_layout(self, value, kind: str):  # traceable; numpy or jax
        """One slot's matrix of ``kind``, canonical layout -> pool layout (``SlotPools.write`` runs this under
        jit)."""
        return value

    def from_pool_layout(self, value, kind: str):
        """Inverse of :meth:`to_pool_layout` (on finite values): one slot of a pool -> the canonical layout."""
        return value

    def init_pools(
        self, slot_shapes: Mapping[str, tuple[int, int]], num_layers: int, num_slots: int, dtype: Any
    ) -> Pools:
        """Zeroed pools: per layer, ``name -> [num_slots, *slot_shape(slot_shapes[name])]`` of ``dtype``.

        *Semantics:* every slot holds an adapter that adds exactly 0.
        """
        if self.pool_dtypes is not None and jnp.dtype(dtype) not in self.pool_dtypes:
            allowed = ", ".join(str(jnp.dtype(d)) for d in self.pool_dtypes)
            raise ValueError(f"the {self.name} backend takes {allowed} pools, got {jnp.dtype(dtype)}")
        return [
            {
                k: jnp.zeros((num_slots, *self.slot_shape(tuple(s), pool_kind(k))), dtype)
                for k, s in slot_shapes.items()
            }
            for _ in range(num_layers)
        ]

    # ------------------------------------------------------------------ plan (host side)
    def plan(self, slots: np.ndarray, num_slots: int) -> Plan | None:
        """Per decode batch: slots ``[B]`` int (−1 or anything outside ``[0, S)`` = none) -> plan or None.

        The default plan is the slot ids themselves, ``[B]`` int32 with −1 for rows without an adapter.
        *Semantics:* ``None`` exactly when no row has an adapter (the step then compiles no LoRA code).
        """
        slots = np.asarray(slots, np.int32)
        valid = (slots >= 0) & (slots < num_slots)
        if not valid.any():
            return None
        return np.where(valid, slots, -1).astype(np.int32)

    def warmup_plans(self, rows: int, num_slots: int) -> list[Plan | None]:
        """One plan per compiled decode variant (no adapter rows in any): after these, serving compiles nothing."""
        return [None, np.full(rows, -1, np.int32)]

    def row_slots(self, plan: Plan) -> Array:
        """The slot of every row of a (non-None) plan, ``[B]`` int32, −1 = none (traceable).

        *Semantics:* the ``slots`` :meth:`plan` was made from; the default plan is exactly that.
        """
        return plan

    # ------------------------------------------------------------------ tensor parallelism
    @property
    def shards(self) -> int:
        """Devices the model's layers are split over (1 here; :class:`kernels.sharded.ShardedBackend`: N)."""
        return 1

    def feature_axis(self, kind: str) -> int:
        """Pool axis of the features a slot's matrix is split by under tensor parallelism: the input
        features of ``"A"`` pools (row-parallel layers), the output features of ``"B"`` pools
        (column-parallel layers). Canonical layout: ``A [S, in, n*R]`` -> 1, ``B [S, R, out]`` -> 2."""
        return 1 if kind == "A" else 2

    def apply_decode(
        self, y: Array, x: Array, a: Array, bs: Sequence[Array], plan: Plan, parallel: str
    ) -> Array:
        """What the model calls: :meth:`add_decode` for the layer split as ``parallel`` (``COLUMN``/``ROW``).

        *Semantics:* :meth:`add_decode`; a single-device backend ignores ``parallel``.
        """
        return self.add_decode(y, x, a, bs, plan)

    def apply_one_slot(
        self, y: Array, x: Array, a: Array, bs: Sequence[Array], slot: Array, parallel: str
    ) -> Array:
        """What the model's prefill calls: :meth:`add_one_slot`; ``parallel`` as in :meth:`apply_decode`."""
        return self.add_one_slot(y, x, a, bs, slot)

    def apply_segments(
        self, y: Array, x: Array, a: Array, bs: Sequence[Array], seg_slots: Array, parallel: str
    ) -> Array:
        """What the model's packed prefill calls: :meth:`add_segments`; ``parallel`` as in :meth:`apply_decode`."""
        return self.add_segments(y, x, a, bs, seg_slots)

    def add_segments(self, y: Array, x: Array, a: Array, bs: Sequence[Array], seg_slots: Array) -> Array:
        """y ``[G*L, sum(out_i)]``, x ``[G*L, in]``, seg_slots ``[G]`` int: G prompts packed back to back in
        equal segments of L tokens, segment g on slot ``seg_slots[g]`` (−1 = none). SGMV-style prefill.

        *Semantics:* :meth:`add_one_slot` on each segment. The default maps it over the segments
        (``jax.vmap``: each segment gathers its own slot's matrices once, ``1/S`` of a one-hot's work).
        """
        g = seg_slots.shape[0]
        t = x.shape[0]

        def one(yy: Array, xx: Array, slot: Array) -> Array:
            return self.add_one_slot(yy, xx, a, bs, slot)

        out = jax.vmap(one)(y.reshape(g, t // g, -1), x.reshape(g, t // g, -1), seg_slots)
        return out.reshape(y.shape)

    def check(self) -> None:
        """Make the backend usable here now (build, register); raises with the reason when it cannot be.

        Pure-JAX backends need nothing: they trace wherever JAX runs.
        """
        return None

    # ------------------------------------------------------------------ ops (traced)
    @abstractmethod
    def add_decode(self, y: Array, x: Array, a: Array, bs: Sequence[Array], plan: Plan) -> Array:
        """y ``[B, sum(out_i)]``, x ``[B, in]``, a: one A pool, bs: the n B pools, plan from :meth:`plan`.

        *Semantics:* row b gets ``x[b] @ A[s][:, i*R:(i+1)*R] @ B_i[s]`` added to slice i, s = its slot;
        rows without one return ``y[b]`` unchanged.
        """

    @abstractmethod
    def add_one_slot(self, y: Array, x: Array, a: Array, bs: Sequence[Array], slot: Array) -> Array:
        """y ``[T, sum(out_i)]``, x ``[T, in]``, slot ``[]`` int (−1 = none): every token on one slot (prefill).

        *Semantics:* ``add_decode`` with every row on ``slot``; ``y`` when slot is −1.
        """


class _SgmvPrefill:
    """Prefill on docs/design.md §6 pools: the one slot gathered, then the masked SGMV over one segment."""

    def add_one_slot(self, y, x, a, bs, slot):  # [T, sum(out_i)]
        return sgmv.xla_add_lora_slices_one_slot(y, x, a, tuple(bs), slot)


@dataclass(frozen=True)
class ReferenceBackend(_SgmvPrefill, LoraBackend):
    """Per-token gather + matmul at highest precision (:mod:`kernels.reference`): the truth, not fast."""

    name: ClassVar[str] = "reference"

    def add_decode(self, y, x, a, bs, plan):  # [B, sum(out_i)]
        return reference.add_lora_slices(y, x, a, tuple(bs), plan)


@dataclass(frozen=True)
class XlaOneHotBackend(_SgmvPrefill, LoraBackend):
    """One-hot masked matmuls over every slot (:mod:`kernels.xla`, docs/design.md §6): what TPU servers use."""

    name: ClassVar[str] = "xla-onehot"

    def add_decode(self, y, x, a, bs, plan):  # [B, sum(out_i)]
        return xla.add_lora_slices(y, x, a, tuple(bs), plan)


@dataclass(frozen=True)
class PallasBackend(LoraBackend):
    """TPU kernels on rank-major pools, ``A [S, n*R, in]`` and ``B [S, R, out]`` (the rank on the sublanes of
    both: nothing padded to 128 lanes): decode reads each slot in use once, by DMA, in one call per projection,
    the slots in groups that fill the MXU's 128 rows (:mod:`kernels.pallas_decode`); shapes it does not take
    run the one-hot XLA product, prefill the gathered slot's. B pools hold finite values only (the write
    zeroes the rest: row isolation, :mod:`kernels.pallas_decode`). Interpreted off-TPU."""

    name: ClassVar[str] = "pallas"

    def slot_shape(self, shape, kind):  # A [in, n*R] -> [n*R, in]; B [R, out] as it is
        return (shape[1], shape[0]) if kind == "A" else shape

    def feature_axis(self, kind):  # A [S, n*R, in] -> 2; B [S, R, out] -> 2
        return 2

    def to_pool_layout(self, value, kind):
        if kind == "A":
            return value.T
        return jnp.where(jnp.isfinite(value), value, jnp.zeros((), value.dtype))

    def from_pool_layout(self, value, kind):
        return value.T if kind == "A" else value

    def plan(self, slots, num_slots):  # DecodePlan, or None (the default plan's rule)
        ids = super().plan(slots, num_slots)
        return None if ids is None else pallas_decode.plan_decode(ids, num_slots)

    def warmup_plans(self, rows, num_slots):
        return [None, pallas_decode.plan_decode(np.full(rows, -1, np.int32), num_slots)]

    def row_slots(self, plan):  # [B] int32
        return plan.idx

    def add_decode(self, y, x, a, bs, plan):  # [B, sum(out_i)]
        outs = [b.shape[2] for b in bs]
        rows, rank_cols, d_in = x.shape[0], a.shape[1], a.shape[2]
        if pallas_decode.fits(rows, d_in, rank_cols, outs, x.dtype, a.dtype, bs[0].dtype, y.dtype):
            return pallas_decode.add_lora_slices_decode(y, x, a, tuple(bs), plan)
        # shapes the kernel does not take (test models' widths, rank 8 in bf16, too much VMEM): the one-hot
        # product on the transposed view (whether XLA copies the pool for it is not measured)
        return xla.add_lora_slices(y, x, jnp.swapaxes(a, 1, 2), tuple(bs), plan.idx)

    def add_one_slot(self, y, x, a, bs, slot):  # [T, sum(out_i)]: the one slot gathered, then transposed
        a_one = jax.lax.dynamic_index_in_dim(a, jnp.maximum(slot, 0), axis=0, keepdims=True)  # [1, n*R, in]
        bs_one = tuple(jax.lax.dynamic_index_in_dim(b, jnp.maximum(slot, 0), 0, keepdims=True) for b in bs)
        one = jnp.where(slot >= 0, 0, -1)
        return sgmv.xla_add_lora_slices_one_slot(y, x, jnp.swapaxes(a_one, 1, 2), bs_one, one)


@dataclass(frozen=True)
class CpuBackend(LoraBackend):
    """C++ custom calls through XLA's FFI (:mod:`kernels.cpu`): rows grouped by slot inside the call,
    float32 or bfloat16 pools; the worker's default on a CPU."""

    name: ClassVar[str] = "cpu"
    pool_dtypes: ClassVar[tuple[Any, ...] | None] = cpu.POOL_DTYPES

    def check(self) -> None:
        cpu.ensure_registered()  # CpuKernelUnavailable says why (no compiler, build error)

    def add_decode(self, y, x, a, bs, plan):  # [B, sum(out_i)]
        return cpu.add_lora_slices(y, x, a, tuple(bs), plan)

    def add_one_slot(self, y, x, a, bs, slot):  # [T, sum(out_i)]: the kernel groups all T rows into one
        return cpu.add_lora_slices(y, x, a, tuple(bs), jnp.full(x.shape[:1], slot, jnp.int32))

    def add_segments(self, y, x, a, bs, seg_slots):  # [G*L, sum(out_i)]: per-token slots, grouped in C++
        return cpu.add_lora_slices(
            y, x, a, tuple(bs), jnp.repeat(seg_slots, x.shape[0] // seg_slots.shape[0])
        )


@dataclass(frozen=True)
class XlaGroupedBackend(LoraBackend):
    """Weights-first pools, decode rows grouped by slot on the host (:mod:`kernels.grouped`): no one-hot
    over slots, so no ``S×`` flops on a CPU. What the worker's ``--kernel-backend xla`` serves with."""

    name: ClassVar[str] = "xla-grouped"

    def slot_shape(self, shape, kind):
        return shape[1], shape[0]

    def feature_axis(self, kind):  # A [S, n*R, in] -> 2; B [S, out, R] -> 1
        return 2 if kind == "A" else 1

    def to_pool_layout(self, value, kind):  # A [in, n*R] -> [n*R, in]; B [R, out] -> [out, R]
        return value.T

    def from_pool_layout(self, value, kind):
        return value.T

    def plan(self, slots, num_slots):  # GroupPlan of one of grouped.VARIANTS, or None
        return grouped.plan_groups(slots, num_slots)

    def warmup_plans(self, rows, num_slots):
        return [None] + [grouped.empty_plan(rows, num_slots, j, single) for j, single in grouped.VARIANTS]

    def row_slots(self, plan):  # [B] int32
        return plan.slots

    def add_decode(self, y, x, a, bs, plan):  # [B, sum(out_i)]
        return grouped.add_lora_slices_grouped(y, x, a, tuple(bs), plan)

    def add_one_slot(self, y, x, a, bs, slot):  # [T, sum(out_i)]
        return grouped.add_lora_slices_one_slot(y, x, a, tuple(bs), slot)


LORA_BACKENDS: dict[str, type[LoraBackend]] = {
    cls.name: cls
    for cls in (ReferenceBackend, XlaOneHotBackend, XlaGroupedBackend, CpuBackend, PallasBackend)
}
# The worker's ``xla`` before backend objects existed was the grouped decode; it keeps meaning that.
ALIASES: dict[str, str] = {"xla": "xla-grouped"}
# Every value ``--kernel-backend`` accepts.
KERNEL_BACKENDS: tuple[str, ...] = ("auto", *sorted({*ALIASES, *LORA_BACKENDS}))


def get_backend(name: str) -> LoraBackend:
    """The backend object ``name`` (a ``--kernel-backend`` value other than ``auto``) stands for.

    Builds nothing; ``ValueError`` naming every accepted value for anything else.
    """
    cls = LORA_BACKENDS.get(ALIASES.get(name, name)) if isinstance(name, str) else None
    if cls is None:
        hint = " ('auto' depends on the machine: use resolve_backend)" if name == "auto" else ""
        raise ValueError(
            f"unknown kernel backend {name!r}{hint}; expected one of {', '.join(KERNEL_BACKENDS)}"
        )
    return cls()


def resolve_backend(name: str) -> LoraBackend:
    """``auto`` -> ``cpu`` on a CPU where its C++ kernels build, ``pallas`` on a TPU (its decode kernel was the
    fastest backend there, measured in the engine: docs/kernels.md), else ``xla-grouped``; any other name ->
    :func:`get_backend`, checked usable now (``cpu``: built and registered, or
    :class:`kernels.cpu.CpuKernelUnavailable` saying why)."""
    if name == "auto":
        if cpu.available():
            return CpuBackend()
        return PallasBackend() if jax.default_backend() == "tpu" else XlaGroupedBackend()
    backend = get_backend(name)
    backend.check()
    return backend
