"""The JAX runner: parameters, paged KV cache and slot pools on the device, jitted prefill/decode with donation.

The only module that calls ``worker.model`` and ``SlotPools``/``slot_arrays``. Prompts are padded to
bucketed lengths; decode gathers a bucketed width of page-table columns (``decode_page_buckets``) and picks
one of the LoRA backend's ``warmup_plans`` variants, so after ``warmup`` nothing compiles while serving.
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
from loraserve.kernels.attention import DecodeAttention, resolve_attention
from loraserve.kernels.sharded import ShardedBackend
from loraserve.worker import model as M
from loraserve.worker import sharding
from loraserve.worker.checkpoint import Checkpoint
from loraserve.worker.config import EngineConfig
from loraserve.worker.requests import SamplingRow
from loraserve.worker.sampling import SamplingArrays, sample
from loraserve.worker.slots import SlotPools, SlotValues, slot_arrays

log = logging.getLogger("loraserve.worker.runner")


def _prefill_sample(cfg, backend, params, pools, tokens, length, start, slot, table, cache, inv_freq, samp):
    logits, cache = M.prefill(
        cfg, params, pools, tokens, length, start, slot, table, cache, inv_freq, backend
    )
    token = sample(logits[None], *samp)[0]  # samp arrays are [1]
    return token, cache


def _decode_sample(
    cfg, backend, params, pools, tokens, positions, tables, plan, cache, inv_freq, samp, attention="xla"
):
    logits, cache = M.decode(
        cfg, params, pools, tokens, positions, tables, plan, cache, inv_freq, backend, attention
    )
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
        # decode attention over the pages: the TPU kernel runs per device of the mesh (kernels.attention)
        self.attention = DecodeAttention(resolve_attention(config.attention_backend), self.mesh)
        log.info(
            "multi-LoRA kernels: %s (%s), slot pools %s, tensor parallel %d, decode attention %s (%s)",
            self.backend,
            config.kernel_backend,
            config.pool_dtype,
            n,
            self.attention.impl,
            config.attention_backend,
        )
        self.inv_freq = jnp.asarray(self.model_config.inv_freq(), jnp.float32)
        self.buckets = config.prefill_buckets()
        self.page_buckets = config.decode_page_buckets()
        self.page_size = config.kv_page_size
        page_bytes = M.kv_page_bytes(checkpoint.config, self.page_size, config.dtype)
        self.num_pages = config.num_kv_pages(page_bytes)
        log.info(
            "paged KV cache: %d pages of %d tokens (%.1f MiB), context %d",
            self.num_pages,
            self.page_size,
            self.num_pages * page_bytes / 2**20,
            config.max_seq_len,
        )
        cfg, backend = self.model_config, self.backend
        self._prefill = jax.jit(partial(_prefill_sample, cfg, backend), donate_argnums=(7,), **jit_out)
        decode = partial(_decode_sample, cfg, backend, attention=self.attention)
        self._decode = jax.jit(decode, donate_argnums=(6,), **jit_out)
        self.init_state()

    def init_state(self) -> None:
        cfg, config = self.model_config, self.config
        shardings = None if self.mesh is None else sharding.pool_shardings(cfg, self.backend)
        self.pools = SlotPools(
            cfg, config.max_loras, config.max_lora_rank, jnp.dtype(config.pool_dtype), self.backend, shardings
        )
        self.cache = M.init_cache(cfg, self.num_pages, self.page_size, jnp.dtype(config.dtype))
        if self.mesh is not None:
            self.cache = jax.device_put(self.cache, self._cache_shardings)

    def warmup(self) -> None:
        """Compile every prefill bucket and every (page width, LoRA plan) decode variant; the null page
        takes every write, so the cache holds nothing afterwards."""
        samp = SamplingArrays.empty(1).as_tuple()
        null_table = np.zeros(self.config.pages_per_row, np.int32)
        for bucket in self.buckets:
            tokens = np.zeros(bucket, np.int32)
            one, zero = np.int32(1), np.int32(0)
            args = (tokens, one, zero, zero, null_table, self.cache, self.inv_freq, samp)
            _, self.cache = self._prefill(self.params, self.pools.pools, *args)
        b = self.config.max_batch_size
        zeros = np.zeros(b, np.int32)
        # one decode compilation per page width times plan variant of the LoRA backend (backend.plan picks
        # one per step)
        for width in self.page_buckets:
            tables = np.zeros((b, width), np.int32)
            for plan in self.backend.warmup_plans(b, self.config.max_loras):
                out, self.cache = self._decode(
                    self.params,
                    self.pools.pools,
                    zeros,
                    zeros,
                    tables,
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

    def prefill(
        self, tokens: list[int], start: int, slot: int, page_table: np.ndarray, sampling: SamplingRow
    ) -> int:
        n = len(tokens)
        padded = np.zeros(next(b for b in self.buckets if b >= n), np.int32)
        padded[:n] = tokens
        token, self.cache = self._prefill(
            self.params,
            self.pools.pools,
            padded,
            np.int32(n),
            np.int32(start),
            np.int32(slot),
            np.asarray(page_table, np.int32),
            self.cache,
            self.inv_freq,
            _sampling_arrays([sampling]).as_tuple(),
        )
        return int(token)

    def decode(
        self,
        tokens: np.ndarray,
        positions: np.ndarray,
        slots: np.ndarray,
        page_tables: np.ndarray,
        sampling: list[SamplingRow | None],
    ) -> np.ndarray:
        needed = int(np.max(positions)) // self.page_size + 1  # pages of the longest row
        width = next(w for w in self.page_buckets if w >= needed)
        out, self.cache = self._decode(
            self.params,
            self.pools.pools,
            tokens,
            positions,
            np.ascontiguousarray(page_tables[:, :width], np.int32),
            self.backend.plan(slots, self.config.max_loras),
            self.cache,
            self.inv_freq,
            _sampling_arrays(sampling).as_tuple(),
        )
        return np.asarray(out)
