"""The device-step contract: what the compiled prefill and decode steps read, take and return.

Every step input is a registered pytree dataclass, so a step's signature names what it gets:

* :class:`DeviceState` — what lives on the device between steps: the base model's ``params``, the adapter
  slot ``pools`` (:class:`LoraPools`: per-layer pools and the vocabulary pools apart), the paged KV
  ``cache``, the ``rope`` frequency table(s) and the decode rows' sampling ``history``
  (``models.sampling.RowHistory``, for the logits controls). A step reads all of it and returns a new
  ``cache`` (and, when it samples, a new ``history`` in ``Sampled.history``).
* :class:`PrefillBatch` — G prompts (or prompt chunks) packed into one call, each with its adapter slot.
* :class:`DecodeBatch` — one token for each of B rows, with the LoRA backend's plan for their slots.
* ``models.sampling.SamplingArrays`` — each row's sampling parameters.

``engine.jax_runner.jit_steps`` compiles the two steps with the KV cache and the history donated **by
name** (``donate_argnames``): their buffers are updated in place, nothing else is given up. The jitted
functions take keyword arguments only, so a caller cannot pass the cache where the pools belong::

    steps = jit_steps(cfg, backend, attention)
    sampled, cache = steps.decode(**state.fields(), batch=batch, sampling=sampling)

Semantics of the model functions behind the steps: ``models.decoder.prefill_packed`` and
``models.decoder.decode``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from loraserve.kernels.backends import Plan
from loraserve.models.sampling import RowHistory

Array = jax.Array
Params = dict[str, Any]  # embed, final_norm, lm_head?, layers: list of per-layer dicts
Cache = list[tuple[Array, Array]]  # per layer: k_pages, v_pages [kv_heads, pages, page_size, D]

# the keyword names of a step's device state; "cache" and "history" are donated
STATE_FIELDS = ("params", "pools", "cache", "rope", "history")
DONATED = ("cache", "history")


def _pytree(cls: type) -> type:
    """A frozen dataclass whose every field is a pytree child (traced; no static fields)."""
    return jax.tree_util.register_dataclass(
        cls, data_fields=[f.name for f in dataclasses.fields(cls)], meta_fields=[]
    )


@_pytree
@dataclass(frozen=True)
class LoraPools:
    """Every adapter slot pool on the device, ``S`` slots each.

    ``layers``: per layer, pool name -> array: ``A_<group>`` and ``B_<module>`` in the LoRA backend's layout
    (``kernels.backends``), the DoRA-scale and LoRA-bias vectors of ``models.lora.dora_bias``. ``vocab``: the
    embed_tokens / lm_head pools of ``models.lora.embedding`` (``A_embed``, ``B_embed``, ``A_lm_head``,
    ``B_lm_head``), the same layout for every backend."""

    layers: list[dict[str, Array]]
    vocab: dict[str, Array]


@_pytree
@dataclass(frozen=True)
class DeviceState:
    """What a step reads from the device; it returns a new ``cache`` and ``history`` (donated: updated in
    place). ``history`` None: a step whose rows use no logits controls (tests, ``plan --verify``)."""

    params: Params
    pools: LoraPools
    cache: Cache
    rope: Array  # [D/2] f32, or [2, D/2] (global, local): ModelConfig.inv_freq()
    history: RowHistory | None = None  # [max_batch_size] rows (models.sampling)

    def fields(self) -> dict[str, Any]:
        """The state as the jitted steps' keyword arguments (:data:`STATE_FIELDS`)."""
        return {name: getattr(self, name) for name in STATE_FIELDS}


@_pytree
@dataclass(frozen=True)
class PrefillBatch:
    """G sequences' new tokens packed into one prefill call (``models.decoder.prefill_packed``)."""

    tokens: Array  # [G, L] int32: each sequence's new tokens, padded to L
    lengths: Array  # [G] int32: real new tokens per sequence (0 = an unused segment)
    starts: Array  # [G] int32: position of each sequence's first new token (a cached prefix before it)
    slots: Array  # [G] int32: adapter slot per sequence, -1 = base
    page_tables: Array  # [G, R] int32: each sequence's pages (0 = the null page)
    key_blocks: Array  # [] int32: ceil(max(starts + lengths) / (block pages * page size))
    # [G, L] int32: per new token, the prompt token after it, whose log-probability the prefill reports
    # (-1: none); None: a prefill that scores nothing (``models.decoder.prefill_scored``)
    targets: Array | None = None

    @classmethod
    def single(
        cls, tokens: Any, length: Any, start: Any, slot: Any, page_table: Any, key_blocks: Any
    ) -> PrefillBatch:
        """One sequence (G = 1): ``tokens`` [T], ``page_table`` [R], scalars for the rest (host arrays)."""

        def vector1(x: Any) -> np.ndarray:
            return np.reshape(np.asarray(x, np.int32), (1,))

        return cls(
            np.asarray(tokens, np.int32)[None],
            vector1(length),
            vector1(start),
            vector1(slot),
            np.asarray(page_table, np.int32)[None],
            np.int32(key_blocks),
        )


@_pytree
@dataclass(frozen=True)
class DecodeBatch:
    """One decode step of B rows (``models.decoder.decode``)."""

    tokens: Array  # [B] int32: the last token of each row
    positions: Array  # [B] int32: the position of that token
    page_tables: Array  # [B, W] int32: each row's first W pages (W * page_size > every position)
    plan: Plan | None  # the LoRA backend's plan of the rows' slots (backend.plan); None = no row has one
