"""Row isolation through the whole model: whatever one slot holds, even NaN and inf written straight into its
pools (past every validation), every other row's logits are bit for bit those of a run where that slot holds
a healthy adapter — in packed prefill, in decode, through DoRA scales, LoRA biases and the embed_tokens /
lm_head pools, and afterwards for requests whose pages the poisoned rows used (stale keys/values) or that
read the null page the poisoned prompts' padding wrote.

Every LoRA backend runs, each with a decode attention implementation (xla, cpu, pallas interpreted; on a
TPU the ``pallas`` case falls back to xla: the chip's kernel does not take the test model's head size 16).
The comparison is exact (``assert_array_equal``): the two runs differ only in the poisoned slot's contents.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loraserve.kernels import get_backend
from loraserve.kernels.attention import DecodeAttention
from loraserve.models import decoder
from loraserve.models.checkpoint import load_checkpoint
from loraserve.models.lora.dora_bias import bias_name, magnitude_name, mask_name
from loraserve.models.lora.embedding import vocab_slot_shapes
from loraserve.models.lora.layout import lora_slot_shapes, lora_vector_sizes
from loraserve.models.lora.pools import SlotPools, base_weights
from loraserve.models.step import PrefillBatch
from tests.platform import cpp_only
from tests.worker.model_steps import ModelSteps

SLOTS, RANK, PAGE, PAGES_PER_ROW, SEG = 4, 8, 8, 4, 16
POISONED = 2
ROW_SLOTS = np.array([0, POISONED, 1, -1, POISONED, 0], np.int32)  # victims on slots 0 and 1, base rows
LENGTHS = np.array([5, 13, 9, 3, 16, 7], np.int32)  # the poisoned prompts leave padding (null-page writes)
DECODE_STEPS = 2
# what the poisoned slot holds in every pool: NaN, both infinities and a finite value that overflows a product
POISON = np.array([np.nan, np.inf, -np.inf, 3e38], np.float32)

# (LoRA backend, decode attention): every backend once, every attention implementation at least once
CASES = [
    pytest.param("reference", "xla", id="reference"),
    pytest.param("xla-onehot", "xla", id="xla-onehot"),
    pytest.param("xla-grouped", "xla", id="xla-grouped"),
    pytest.param("cpu", "cpu", id="cpu", marks=cpp_only),
    pytest.param("pallas", "pallas", id="pallas"),
]


@pytest.fixture(scope="module")
def checkpoint(llama_dir):
    return load_checkpoint(str(llama_dir))


def _healthy_values(cfg, seed: int) -> list[dict[str, np.ndarray]]:
    """Random slot values in the canonical layout: every matrix, DoRA on every group, a LoRA bias on every
    group, and embed_tokens / lm_head LoRA (layer 0); sized so that the adapter visibly moves the logits."""
    rng = np.random.default_rng(seed)
    layers = []
    for layer in range(cfg.num_layers):
        values = {
            k: (rng.standard_normal(shape) * 0.5 / np.sqrt(shape[0])).astype(np.float32)
            for k, shape in lora_slot_shapes(cfg, RANK).items()
        }
        for group, size in lora_vector_sizes(cfg).items():
            values[magnitude_name(group)] = rng.uniform(0.5, 1.5, size).astype(np.float32)
            values[mask_name(group)] = np.ones(size, np.float32)
            values[bias_name(group)] = (0.05 * rng.standard_normal(size)).astype(np.float32)
        if layer == 0:
            values.update(
                {
                    k: (rng.standard_normal(shape) * 0.1).astype(np.float32)
                    for k, shape in vocab_slot_shapes(cfg, RANK).items()
                }
            )
        layers.append(values)
    return layers


def _pools(checkpoint, backend, poison: bool) -> SlotPools:
    cfg = checkpoint.config
    pools = SlotPools(cfg, SLOTS, RANK, jnp.dtype(jnp.float32), backend, base=base_weights(checkpoint.params))
    for slot in range(SLOTS - 1):  # the last slot stays empty
        pools.write(slot, _healthy_values(cfg, seed=10 + slot))
    if poison:  # straight into the device pools, every pool of the slot: no validation on this path
        pools.pools = jax.tree.map(
            lambda pool: pool.at[POISONED].set(
                jnp.asarray(np.resize(POISON, pool.shape[1:])).astype(pool.dtype)
            ),
            pools.pools,
        )
    return pools


def _serve(checkpoint, backend, attention: str, pools: SlotPools) -> dict[str, np.ndarray]:
    """Packed prefill of six prompts (two on the poisoned slot), decode steps of all six rows, then the
    poisoned rows' pages handed to two new requests (a healthy adapter and the base) that prefill shorter
    prompts into them and decode with the rest. Returns each phase's logits."""
    cfg = checkpoint.config
    rows = len(ROW_SLOTS)
    cache = decoder.init_cache(cfg, 1 + rows * PAGES_PER_ROW, PAGE, jnp.dtype(jnp.float32))
    steps = ModelSteps(cfg, backend, checkpoint.params, pools, cache, attention=DecodeAttention(attention))
    tables = decoder.contiguous_page_tables(rows, PAGES_PER_ROW)
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, cfg.vocab_size, (rows, SEG)).astype(np.int32)
    out: dict[str, np.ndarray] = {}

    def prefill_rows(slots, lengths, starts):
        blocks = np.int32(
            -(-int((starts + lengths).max()) // (decoder.key_block_pages(PAGE, PAGES_PER_ROW) * PAGE))
        )
        return steps.prefill(PrefillBatch(tokens, lengths, starts, slots, tables, blocks))

    def decode_rows(slots, positions, count, key):
        for step in range(count):
            toks = rng.integers(3, cfg.vocab_size, rows).astype(np.int32)
            logits = steps.decode(toks, positions + step, tables, backend.plan(slots, SLOTS))
            out[f"{key}{step}"] = np.asarray(logits)

    out["prefill"] = np.asarray(prefill_rows(ROW_SLOTS, LENGTHS, np.zeros(rows, np.int32)))
    decode_rows(ROW_SLOTS, LENGTHS, DECODE_STEPS, "decode")
    # the poisoned rows finish; their pages go to two new requests with shorter prompts (positions past
    # their lengths still hold what the poisoned rows wrote), the other rows go on
    reused = ROW_SLOTS == POISONED
    slots2 = np.where(reused, np.array([0, 0, 0, 0, -1, 0], np.int32), ROW_SLOTS)
    lengths2 = np.where(reused, 4, 0).astype(np.int32)
    logits = prefill_rows(np.where(reused, slots2, -1), lengths2, np.zeros(rows, np.int32))
    out["reused-prefill"] = np.asarray(logits)[reused]
    positions2 = np.where(reused, lengths2, LENGTHS + DECODE_STEPS).astype(np.int32)
    decode_rows(slots2, positions2, DECODE_STEPS, "reused-decode")
    return out


@pytest.mark.parametrize(("backend_name", "attention"), CASES)
def test_a_poisoned_slot_leaves_every_other_row_bit_identical(checkpoint, backend_name, attention) -> None:
    backend = get_backend(backend_name)
    healthy = _serve(checkpoint, backend, attention, _pools(checkpoint, backend, poison=False))
    poisoned = _serve(checkpoint, backend, attention, _pools(checkpoint, backend, poison=True))
    victims = ROW_SLOTS != POISONED
    for key, want in healthy.items():
        rows = slice(None) if key.startswith("reused") else victims
        assert np.isfinite(want).all(), key
        np.testing.assert_array_equal(poisoned[key][rows], want[rows], err_msg=f"{backend_name}: {key}")
    # the poison did reach its own rows (the test would prove nothing if it had been filtered out)
    assert not np.array_equal(poisoned["decode0"][~victims], healthy["decode0"][~victims])
