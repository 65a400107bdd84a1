"""The per-slot ops #16 added beside the LoRA kernels, as properties against numpy (#16 item 5): DoRA's scale and
the LoRA bias (``models.lora.dora_bias.apply_vectors``), embed_tokens LoRA (``models.lora.embedding.apply_embed``) and
lm_head LoRA (``apply_lm_head``), over random slot counts, shapes, groupings and slot ids (−1 and out of
range = none); and the whole decode step and packed prefill with the ``pallas`` LoRA backend and every
adapter pool (DoRA vectors, vocab pools) exported for TPU (``jax.export`` runs the Mosaic lowering here).

These ops are plain jnp, the same for every backend (the model applies them after the backend's LoRA), so
every backend serves DoRA, bias, embed/lm_head LoRA and mixes (a mix is a slot: ``adapters.mixes``); no
backend refuses an adapter type.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from loraserve.kernels import get_backend
from loraserve.models import decoder
from loraserve.models.config import ModelConfig
from loraserve.models.lora import layout
from loraserve.models.lora.dora_bias import apply_vectors, bias_name, scale_name
from loraserve.models.lora.embedding import apply_embed, apply_lm_head
from loraserve.models.sharding import param_shapes
from loraserve.models.step import DecodeBatch, DeviceState, PrefillBatch

EXAMPLES = settings(max_examples=25, deadline=None)


@st.composite
def slot_rows(draw, max_slots: int = 6, max_groups: int = 5, max_k: int = 4):
    """(S, k, slots [G]) with ids in [-2, S+1]: −1 and out-of-range ids mean "no adapter"."""
    s = draw(st.integers(1, max_slots))
    g = draw(st.integers(1, max_groups))
    k = draw(st.integers(1, max_k))
    slots = np.array(draw(st.lists(st.integers(-2, s + 1), min_size=g, max_size=g)), np.int32)
    return s, k, slots


def _valid(slots: np.ndarray, s: int) -> np.ndarray:
    return (slots >= 0) & (slots < s)


# jitted as the steps run them: every example has new shapes, and run eagerly each of their ops compiled
_apply_vectors = jax.jit(apply_vectors, static_argnums=2)
_apply_embed = jax.jit(apply_embed)
_apply_lm_head = jax.jit(apply_lm_head)


@EXAMPLES
@given(slot_rows(), st.integers(1, 24), st.booleans(), st.integers(0, 2**31 - 1))
def test_dora_scale_and_lora_bias_rows(case, out: int, with_bias: bool, seed: int) -> None:
    s, k, slots = case
    rng = np.random.default_rng(seed)
    scales = rng.uniform(0.5, 1.5, (s, out)).astype(np.float32)
    biases = rng.standard_normal((s, out)).astype(np.float32)
    y = rng.standard_normal((len(slots) * k, out)).astype(np.float32)
    bias = rng.standard_normal(out).astype(np.float32) if with_bias else None
    pools = {scale_name("o"): jnp.asarray(scales), bias_name("o"): jnp.asarray(biases)}
    got = np.asarray(_apply_vectors(jnp.asarray(y), pools, "o", jnp.asarray(slots), bias))
    b = np.zeros(out, np.float32) if bias is None else bias
    for row in range(len(y)):
        slot = slots[row // k]
        if not _valid(slots, s)[row // k]:
            np.testing.assert_array_equal(got[row], y[row])  # no adapter: y exactly
            continue
        want = scales[slot] * (y[row] - b) + b + biases[slot]  # PEFT: DoRA scales the non-bias part
        np.testing.assert_allclose(got[row], want, rtol=1e-5, atol=1e-5)


@EXAMPLES
@given(slot_rows(), st.integers(2, 40), st.integers(1, 16), st.integers(1, 8), st.integers(0, 2**31 - 1))
def test_embed_lora_rows(case, vocab: int, hidden: int, rank: int, seed: int) -> None:
    s, k, slots = case
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((s, vocab, rank)).astype(np.float32)
    b = rng.standard_normal((s, rank, hidden)).astype(np.float32)
    tokens = rng.integers(0, vocab, len(slots) * k).astype(np.int32)
    h = rng.standard_normal((len(tokens), hidden)).astype(np.float32)
    pools = {"A_embed": jnp.asarray(a), "B_embed": jnp.asarray(b)}
    got = np.asarray(_apply_embed(jnp.asarray(h), jnp.asarray(tokens), pools, jnp.asarray(slots)))
    for row, token in enumerate(tokens):
        slot = slots[row // k]
        if not _valid(slots, s)[row // k]:
            np.testing.assert_array_equal(got[row], h[row])
        else:
            np.testing.assert_allclose(got[row], h[row] + a[slot, token] @ b[slot], rtol=1e-5, atol=1e-5)


@EXAMPLES
@given(
    slot_rows(max_k=1),
    st.integers(2, 40),
    st.integers(1, 16),
    st.integers(1, 8),
    st.booleans(),
    st.integers(0, 2**31 - 1),
)
def test_lm_head_lora_rows(case, vocab: int, hidden: int, rank: int, zero_a: bool, seed: int) -> None:
    """Also with every A zero (slots without an lm_head LoRA): the logits come back exactly."""
    s, _, slots = case
    rng = np.random.default_rng(seed)
    a = (
        np.zeros((s, hidden, rank), np.float32)
        if zero_a
        else rng.standard_normal((s, hidden, rank)).astype(np.float32)
    )
    b = rng.standard_normal((s, rank, vocab)).astype(np.float32)
    x = rng.standard_normal((len(slots), hidden)).astype(np.float32)
    logits = rng.standard_normal((len(slots), vocab)).astype(np.float32)
    pools = {"A_lm_head": jnp.asarray(a), "B_lm_head": jnp.asarray(b)}
    got = np.asarray(_apply_lm_head(jnp.asarray(logits), jnp.asarray(x), pools, jnp.asarray(slots)))
    for row, slot in enumerate(slots):
        if not _valid(slots, s)[row] or zero_a:
            np.testing.assert_array_equal(got[row], logits[row])
        else:
            want = logits[row] + (x[row] @ a[slot]) @ b[slot]
            np.testing.assert_allclose(got[row], want, rtol=1e-4, atol=1e-4)


# A Llama-3-8B layer's widths (3 layers), a Gemma-sized vocabulary: the TPU block rules bite at real sizes.
LLAMA = dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_layers=2,
             num_heads=32, num_kv_heads=8, head_dim=128)  # fmt: skip


def _abstract(cfg: ModelConfig, backend, dtype=jnp.bfloat16):
    sds = jax.ShapeDtypeStruct
    params = jax.tree.map(lambda s: sds(s, dtype), param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))
    pools = jax.eval_shape(lambda: layout.empty_lora(cfg, 4, 16, dtype, backend))
    return params, pools


def export_decode_for_tpu(cfg: ModelConfig, backend, params, pools, rows: int = 16):
    """``decoder.decode`` over abstract ``params``/``pools`` and a bf16 paged cache, exported for TPU from this CPU:
    -> (the exported program, its DeviceState)."""
    sds = jax.ShapeDtypeStruct
    page, pages = 16, 65
    cache = [
        (sds((cfg.num_kv_heads, pages, page, cfg.head_dim), jnp.bfloat16),) * 2 for _ in range(cfg.num_layers)
    ]
    ints = sds((rows,), jnp.int32)
    state = DeviceState(params, pools, cache, sds((cfg.head_dim // 2,), jnp.float32))
    slots = jax.tree.leaves(pools.layers[0])[0].shape[0]
    plan = jax.tree.map(
        lambda v: sds(v.shape, v.dtype), backend.warmup_plans(rows, slots)[-1]
    )  # adapter rows
    exported = jax.export.export(jax.jit(partial(decoder.decode, cfg, backend)), platforms=["tpu"])(
        state, DecodeBatch(ints, ints, sds((rows, 4), jnp.int32), plan)
    )
    return exported, state


def test_decode_and_packed_prefill_with_every_adapter_pool_lower_for_tpu(monkeypatch) -> None:
    """The pallas backend's decode step (LoRA kernels + DoRA vectors + embed/lm_head LoRA) and packed
    prefill, exported for TPU on abstract bf16 shapes: Mosaic accepts every kernel, and the vector and vocab
    pools are inputs of the compiled step (so the step applies them)."""
    from loraserve.kernels import pallas

    monkeypatch.setattr(
        pallas, "default_interpret", lambda: False
    )  # lower the real kernels, not the interpreter
    cfg = ModelConfig(**LLAMA)
    backend = get_backend("pallas")
    params, pools = _abstract(cfg, backend)
    assert {"dora_scale_qkv", "lora_bias_down"} <= set(pools.layers[0])
    assert {"A_embed", "B_embed", "A_lm_head", "B_lm_head"} == set(pools.vocab)
    sds = jax.ShapeDtypeStruct
    exported, state = export_decode_for_tpu(cfg, backend, params, pools)
    # a decode kernel per LoRA call (kernels.pallas_decode): 4 groups a layer
    assert (
        exported.platforms == ("tpu",)
        and exported.mlir_module().count("tpu_custom_call") >= 4 * cfg.num_layers
    )

    g, t = 2, 64
    gs = sds((g,), jnp.int32)
    batch = PrefillBatch(sds((g, t), jnp.int32), gs, gs, gs, sds((g, 4), jnp.int32), sds((), jnp.int32))
    exported = jax.export.export(jax.jit(partial(decoder.prefill_packed, cfg, backend)), platforms=["tpu"])(
        state, batch
    )
    assert exported.platforms == ("tpu",)
