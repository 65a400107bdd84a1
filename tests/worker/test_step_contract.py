"""The device-step contract (models/step.py): typed inputs, the KV cache donated by name and nothing else."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loraserve.engine.jax_runner import jit_steps
from loraserve.kernels import get_backend
from loraserve.models import decoder
from loraserve.models.checkpoint import load_checkpoint
from loraserve.models.lora import layout
from loraserve.models.sampling import SamplingArrays
from loraserve.models.step import DecodeBatch, DeviceState, LoraPools, PrefillBatch


@pytest.fixture(scope="module")
def state(llama_dir):
    ck = load_checkpoint(str(llama_dir))
    cfg, backend = ck.config, get_backend("xla-grouped")
    pools = layout.empty_lora(cfg, 2, 4, jnp.float32, backend)
    rope = jnp.asarray(cfg.inv_freq(), jnp.float32)
    return cfg, backend, DeviceState(ck.params, pools, decoder.init_cache(cfg, 5, 16, jnp.float32), rope)


def test_the_vocabulary_pools_are_their_own_field(state) -> None:
    cfg, _, st = state
    assert isinstance(st.pools, LoraPools) and len(st.pools.layers) == cfg.num_layers
    assert set(st.pools.vocab) == {"A_embed", "B_embed", "A_lm_head", "B_lm_head"}
    assert not any(name in layer for layer in st.pools.layers for name in st.pools.vocab)
    # a pytree: its leaves are every pool, the vocabulary's included
    assert len(jax.tree.leaves(st.pools)) == sum(map(len, st.pools.layers)) + 4


def test_a_step_donates_the_cache_by_name_and_nothing_else(state) -> None:
    cfg, backend, st = state
    steps = jit_steps(cfg, backend)
    tables = decoder.contiguous_page_tables(2, 2)
    tokens = np.zeros((2, 16), np.int32)
    tokens[:, :3] = [[5, 6, 7], [8, 9, 10]]
    batch = PrefillBatch(tokens, np.array([3, 3], np.int32), np.zeros(2, np.int32), np.array([-1, 0], np.int32),
                         tables, np.int32(1))  # fmt: skip
    old = st.cache
    sampled, cache = steps.prefill(**st.fields(), batch=batch, sampling=SamplingArrays.empty(2))
    assert sampled.tokens.shape == (2,)
    assert all(k.is_deleted() and v.is_deleted() for k, v in old)  # donated: updated in place
    kept = (st.params, st.pools, st.rope)
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(kept))
    st = DeviceState(st.params, st.pools, cache, st.rope)
    # without sampling the step gives the logits; keywords only: positions cannot be mixed up
    logits, cache = steps.decode(**st.fields(), batch=DecodeBatch(np.array([1, 2], np.int32),
                                                                   np.array([3, 3], np.int32), tables, None))  # fmt: skip
    assert logits.shape == (2, cfg.vocab_size) and logits.dtype == jnp.float32
    with pytest.raises(TypeError):
        steps.decode(st.params, st.pools, cache, st.rope)


def test_steps_are_shared_by_equal_arguments_and_only_by_them(state) -> None:
    """jit_steps is memoized by value: an equal (not identical) model config, backend and attention give
    the same jitted functions, so a second runner of one model compiles nothing; any difference (a rope
    scaling dict, the linear backend, the LoRA backend) gives new ones."""
    import dataclasses

    from loraserve.engine import jax_runner
    from loraserve.kernels.attention import DecodeAttention

    cfg, backend, _ = state
    steps = jit_steps(cfg, backend, DecodeAttention("xla"))
    twin = dataclasses.replace(cfg)  # a new object, equal to cfg
    assert twin is not cfg and jit_steps(twin, get_backend("xla-grouped"), DecodeAttention("xla")) is steps
    scaled = dataclasses.replace(cfg, rope_scaling={"rope_type": "linear", "factor": 2.0})  # a dict field
    other = jit_steps(scaled, backend, DecodeAttention("xla"))
    assert other is not steps
    reordered = dataclasses.replace(cfg, rope_scaling={"factor": 2.0, "rope_type": "linear"})
    assert jit_steps(reordered, backend, DecodeAttention("xla")) is other
    assert jit_steps(cfg, backend, DecodeAttention("xla"), "xla") is not steps
    assert jit_steps(cfg, get_backend("xla-onehot"), DecodeAttention("xla")) is not steps
    # bounded: the least recently used arguments are forgotten, the process keeps at most STEPS_KEPT
    for theta in range(jax_runner.STEPS_KEPT + 1):
        jit_steps(dataclasses.replace(cfg, rope_theta=1000.0 + theta), backend)
    assert len(jax_runner._steps_memo) == jax_runner.STEPS_KEPT
    assert jit_steps(cfg, backend, DecodeAttention("xla")) is not steps


def test_the_matmul_precision_is_traced_into_the_steps(state) -> None:
    """``jit_steps(..., precision)`` traces the steps under ``jax.default_matmul_precision``: at ``highest`` the
    float32 products of the decode step carry it in the lowered program (a TPU then multiplies float32 in ~6
    bf16 passes instead of one); ``default`` adds nothing; the two are different memo entries."""
    from loraserve.kernels.attention import DecodeAttention

    cfg, backend, st = state
    tables = decoder.contiguous_page_tables(2, 2)
    batch = DecodeBatch(np.array([1, 2], np.int32), np.array([3, 3], np.int32), tables, None)
    text = {}
    # lowered with the process's own setting cleared: on a TPU the test process runs at highest
    # (tests/conftest.py), which a step traced at `default` (adding nothing) would otherwise carry
    with jax.default_matmul_precision(None):
        for precision in ("default", "highest"):
            steps = jit_steps(cfg, backend, DecodeAttention("xla"), "xla", None, precision)
            text[precision] = steps.decode.lower(**st.fields(), batch=batch).as_text()
    assert "HIGHEST" in text["highest"] and "HIGHEST" not in text["default"]
    assert jit_steps(cfg, backend, DecodeAttention("xla"), "xla", None, "highest") is not jit_steps(
        cfg, backend, DecodeAttention("xla"), "xla", None, "default"
    )
