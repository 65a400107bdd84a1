"""The model's compiled steps driven directly, without the runner's scheduler: for tests that compare logits.

The steps are ``engine.jax_runner.jit_steps`` (the worker's own, KV cache donated by name) called without
sampling, so they return logits. ``pools`` may be a ``SlotPools`` (its latest writes are read at every
call) or a ``LoraPools``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from loraserve.engine.jax_runner import jit_steps
from loraserve.models import decoder
from loraserve.models.lora.pools import SlotPools
from loraserve.models.step import DecodeBatch, DeviceState, LoraPools, PrefillBatch


class ModelSteps:
    def __init__(
        self,
        cfg: Any,
        backend: Any,
        params: Any,
        pools: SlotPools | LoraPools,
        cache: Any,
        attention: Any = "xla",
        linear: str = "auto",
    ) -> None:
        self.cfg, self.backend, self.params, self.pools, self.cache = cfg, backend, params, pools, cache
        self.rope = jnp.asarray(cfg.inv_freq(), jnp.float32)
        self.steps = jit_steps(cfg, backend, attention, linear)

    def state(self) -> DeviceState:
        pools = self.pools.pools if isinstance(self.pools, SlotPools) else self.pools
        return DeviceState(self.params, pools, self.cache, self.rope)

    def prefill(self, batch: PrefillBatch) -> jax.Array:
        """Logits ``[G, V]`` of each sequence's last token; the cache keeps their keys and values."""
        logits, self.cache = self.steps.prefill(**self.state().fields(), batch=batch)
        return logits

    def prefill_one(self, tokens: Any, length: Any, start: Any, slot: Any, page_table: Any) -> jax.Array:
        """One sequence over every key block of its row: logits ``[V]``."""
        page = self.cache[0][0].shape[2]
        blocks = decoder.whole_row_key_blocks(page, len(page_table))
        return self.prefill(PrefillBatch.single(tokens, length, start, slot, page_table, blocks))[0]

    def decode(self, tokens: Any, positions: Any, page_tables: Any, plan: Any = None) -> jax.Array:
        """One decode step of every row: logits ``[B, V]``."""
        batch = DecodeBatch(np.asarray(tokens, np.int32), np.asarray(positions, np.int32), page_tables, plan)
        logits, self.cache = self.steps.decode(**self.state().fields(), batch=batch)
        return logits
