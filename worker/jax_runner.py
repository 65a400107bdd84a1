"""The JAX runner: parameters, KV cache and slot pools on the device, jitted prefill/decode with donation.

The only module that calls ``worker.model`` and ``SlotPools``/``slot_arrays``. Prompts are padded to
bucketed lengths and decode picks one of the LoRA backend's ``warmup_plans`` variants, so after ``warmup``
nothing compiles while serving.
"""

from __future__ import annotations

import logging
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from loraserve import kernels
from loraserve.adapters.peft import LoraWeights
from loraserve.worker import model as M
from loraserve.worker.checkpoint import Checkpoint
from loraserve.worker.config import EngineConfig
from loraserve.worker.requests import SamplingRow
from loraserve.worker.sampling import SamplingArrays, sample
from loraserve.worker.slots import SlotPools, SlotValues, slot_arrays

log = logging.getLogger("loraserve.worker.runner")


def _prefill_sample(cfg, backend, params, pools, tokens, length, slot, row, cache, inv_freq, samp):
    logits, cache = M.prefill(cfg, params, pools, tokens, length, slot, row, cache, inv_freq, backend)
    token = sample(logits[None], *samp)[0]  # samp arrays are [1]
    return token, cache


def _decode_sample(cfg, backend, params, pools, tokens, positions, plan, cache, inv_freq, samp):
    logits, cache = M.decode(cfg, params, pools, tokens, positions, plan, cache, inv_freq, backend)
    return sample(logits, *samp), cache


def _sampling_arrays(rows: list[SamplingRow | None]) -> SamplingArrays:
    arrays = SamplingArrays.empty(len(rows))
    for i, r in enumerate(rows):
        if r is None:
            continue
        arrays.temperature[i], arrays.top_k[i], arrays.top_p[i] = r.temperature, r.top_k, r.top_p
        arrays.seed_lo[i], arrays.seed_hi[i] = r.seed & 0xFFFFFFFF, r.seed >> 32
        arrays.step[i] = r.step
    return arrays


class JaxRunner:
    """The real device side (``worker.runner.Runner``) over one checkpoint and ``max_loras`` slot pools."""

    def __init__(self, checkpoint: Checkpoint, config: EngineConfig) -> None:
        self.config, self.model_config = config, checkpoint.config
        self.params = checkpoint.params
        self.backend = kernels.resolve_backend(config.kernel_backend)
        log.info(
            "multi-LoRA kernels: %s (%s), slot pools %s",
            self.backend,
            config.kernel_backend,
            config.pool_dtype,
        )
        self.inv_freq = jnp.asarray(self.model_config.inv_freq(), jnp.float32)
        self.buckets = config.prefill_buckets()
        cfg, backend = self.model_config, self.backend
        self._prefill = jax.jit(partial(_prefill_sample, cfg, backend), donate_argnums=(6,))
        self._decode = jax.jit(partial(_decode_sample, cfg, backend), donate_argnums=(5,))
        self.init_state()

    def init_state(self) -> None:
        cfg, config = self.model_config, self.config
        self.pools = SlotPools(
            cfg, config.max_loras, config.max_lora_rank, jnp.dtype(config.pool_dtype), self.backend
        )
        self.cache = M.init_cache(cfg, config.max_batch_size, config.max_seq_len, jnp.dtype(config.dtype))

    def warmup(self) -> None:
        samp = SamplingArrays.empty(1).as_tuple()
        for bucket in self.buckets:
            tokens = jnp.zeros((bucket,), jnp.int32)
            _, self.cache = self._prefill(
                self.params,
                self.pools.pools,
                tokens,
                jnp.int32(1),
                jnp.int32(0),
                jnp.int32(0),
                self.cache,
                self.inv_freq,
                samp,
            )
        b = self.config.max_batch_size
        zeros = np.zeros(b, np.int32)
        # one decode compilation per plan variant of the LoRA backend (backend.plan picks one per step)
        for plan in self.backend.warmup_plans(b, self.config.max_loras):
            out, self.cache = self._decode(
                self.params,
                self.pools.pools,
                zeros,
                zeros,
                plan,
                self.cache,
                self.inv_freq,
                SamplingArrays.empty(b).as_tuple(),
            )
        self.pools.zero(0)
        jax.block_until_ready(out)

    def prepare(self, weights: LoraWeights) -> SlotValues:
        return slot_arrays(self.model_config, weights, self.config.max_lora_rank)

    def write_slot(self, index: int, values: SlotValues) -> None:
        self.pools.write(index, values)

    def zero_slot(self, index: int) -> None:
        self.pools.zero(index)

    def prefill(self, prompt: list[int], slot: int, row: int, sampling: SamplingRow) -> int:
        n = len(prompt)
        tokens = np.zeros(next(b for b in self.buckets if b >= n), np.int32)
        tokens[:n] = prompt
        token, self.cache = self._prefill(
            self.params,
            self.pools.pools,
            tokens,
            np.int32(n),
            np.int32(slot),
            np.int32(row),
            self.cache,
            self.inv_freq,
            _sampling_arrays([sampling]).as_tuple(),
        )
        return int(token)

    def decode(
        self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, sampling: list[SamplingRow | None]
    ) -> np.ndarray:
        out, self.cache = self._decode(
            self.params,
            self.pools.pools,
            tokens,
            positions,
            self.backend.plan(slots, self.config.max_loras),
            self.cache,
            self.inv_freq,
            _sampling_arrays(sampling).as_tuple(),
        )
        return np.asarray(out)
