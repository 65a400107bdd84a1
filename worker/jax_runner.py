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
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from loraserve import kernels
from loraserve.adapters.peft import LoraWeights
from loraserve.kernels.sharded import ShardedBackend
from loraserve.worker import model as M
from loraserve.worker import sharding
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
    """The real device side (``worker.runner.Runner``) over one checkpoint and ``max_loras`` slot pools.

    With ``tensor_parallel_size`` N > 1 the params, KV cache and slot pools live on a 1-D ``model`` mesh of
    N devices (``worker.sharding``), the LoRA backend runs per shard (``kernels.sharded``) and the jitted
    steps pin their outputs' shardings, so donated buffers keep one layout and nothing recompiles.
    """

    def __init__(self, checkpoint: Checkpoint, config: EngineConfig) -> None:
        self.config, self.checkpoint_config = config, checkpoint.config
        backend = kernels.resolve_backend(config.kernel_backend)
        n = config.tensor_parallel_size
        self.mesh = None
        if n == 1:
            self.model_config, self.params, self.backend = checkpoint.config, checkpoint.params, backend
            jit_out: dict[str, object] = {}
        else:
            sharding.check_tensor_parallel(checkpoint.config, n, len(jax.devices()))
            self.mesh = sharding.make_mesh(n)
            self.model_config = sharding.tp_model_config(checkpoint.config, n)
            self.params = sharding.shard_params(checkpoint.config, checkpoint.params, self.mesh)
            self.backend = ShardedBackend(backend, self.mesh)
            cache = NamedSharding(self.mesh, sharding.CACHE_SPEC)
            self._cache_shardings = [(cache, cache)] * self.model_config.num_layers
            jit_out = {"out_shardings": (NamedSharding(self.mesh, P()), self._cache_shardings)}
        log.info(
            "multi-LoRA kernels: %s (%s), slot pools %s, tensor parallel %d",
            self.backend,
            config.kernel_backend,
            config.pool_dtype,
            n,
        )
        self.inv_freq = jnp.asarray(self.model_config.inv_freq(), jnp.float32)
        self.buckets = config.prefill_buckets()
        cfg, backend = self.model_config, self.backend
        self._prefill = jax.jit(partial(_prefill_sample, cfg, backend), donate_argnums=(6,), **jit_out)
        self._decode = jax.jit(partial(_decode_sample, cfg, backend), donate_argnums=(5,), **jit_out)
        self.init_state()

    def init_state(self) -> None:
        cfg, config = self.model_config, self.config
        shardings = None if self.mesh is None else sharding.pool_shardings(cfg, self.backend)
        self.pools = SlotPools(
            cfg, config.max_loras, config.max_lora_rank, jnp.dtype(config.pool_dtype), self.backend, shardings
        )
        self.cache = M.init_cache(cfg, config.max_batch_size, config.max_seq_len, jnp.dtype(config.dtype))
        if self.mesh is not None:
            self.cache = jax.device_put(self.cache, self._cache_shardings)

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
        values = slot_arrays(self.checkpoint_config, weights, self.config.max_lora_rank)
        return sharding.expand_slot_values(self.checkpoint_config, values, self.config.tensor_parallel_size)

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
