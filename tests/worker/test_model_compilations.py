"""Every LoRA backend object, through the model: after warm-up (each prefill bucket, each of the backend's
warm-up plans, one slot write), slot swaps, prefills on any slot and decode steps over any slot mix
compile nothing (docs/design.md §5); on Llama for every backend and on Gemma 3 for the CPU default. The
engine's own count over 200 requests is in test_engine.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loraserve.adapters.files import read_adapter_files
from loraserve.adapters.peft import parse_adapter
from loraserve.kernels import LORA_BACKENDS, get_backend
from loraserve.kernels.testing import count_compilations
from loraserve.models import decoder
from loraserve.models.checkpoint import load_checkpoint
from loraserve.models.lora.pools import SlotPools, slot_arrays
from tests.platform import NATIVE_BACKEND, cpp_only
from tests.worker.model_steps import ModelSteps

PROMPT = [5, 17, 33, 100, 7, 9]
ROWS, SLOTS, RANK, BUCKET = 4, 3, 16, 16


# every backend on Llama; Gemma 3 (sliding and full layers, two RoPE tables, q/k norm) on the CPU default
CASES = [("llama", name) for name in LORA_BACKENDS] + [("gemma3_text", NATIVE_BACKEND)]
PARAMS = [pytest.param(f, n, marks=cpp_only if n == "cpu" else ()) for f, n in CASES]


@pytest.mark.parametrize(("family", "name"), PARAMS)
def test_serving_after_warmup_compiles_nothing(
    model_dirs, adapter_dirs, family_adapter_dirs, family: str, name: str
) -> None:
    ck = load_checkpoint(str(model_dirs[family]))
    cfg = ck.config
    backend = get_backend(name)
    if family != "llama":
        adapter_dirs = family_adapter_dirs(family)
    values = [
        slot_arrays(
            cfg,
            parse_adapter(
                *read_adapter_files(str(path)),
                module_shapes=cfg.module_shapes(),
                num_layers=cfg.num_layers,
                max_rank=RANK,
            ),
            RANK,
        )
        for path in adapter_dirs.values()
    ]
    pools = SlotPools(cfg, SLOTS, RANK, jnp.dtype(jnp.float32), backend)
    cache = decoder.init_cache(cfg, ROWS * 2 + 1, 16, jnp.float32)  # two pages of 16 per row
    tables = decoder.contiguous_page_tables(ROWS, 2)
    steps = ModelSteps(cfg, backend, ck.params, pools, cache)
    tokens = np.zeros(BUCKET, np.int32)
    tokens[: len(PROMPT)] = PROMPT
    n, same, nines = len(PROMPT), np.full(ROWS, len(PROMPT), np.int32), np.full(ROWS, 9, np.int32)
    # warm-up, as the engine does it
    pools.zero(0)
    steps.prefill_one(tokens, n, 0, 0, tables[0])
    for plan in backend.warmup_plans(ROWS, SLOTS):
        steps.decode(nines, same, tables, plan)
    jax.block_until_ready(steps.cache)

    mixes = [[0, 1, 2, -1], [1, 1, 1, 1], [-1, -1, -1, -1], [2, 2, 0, -1], [0, 1, 1, 2]]
    with count_compilations() as count:
        for i, v in enumerate(values):  # more adapters than slots: swaps
            pools.write(i % SLOTS, v)
        for row, slot in enumerate(mixes[0]):
            steps.prefill_one(tokens, n, 0, slot, tables[row])
        for row in range(ROWS):  # one history for every row (slot 1's prompt): rows then differ by slot only
            steps.prefill_one(tokens, n, 0, 1, tables[row])
        logits = []
        for mix in mixes:
            out = steps.decode(nines, same, tables, backend.plan(np.array(mix, np.int32), SLOTS))
            logits.append(np.asarray(out))
    assert count.compilations == 0, count.names
    # each step used its own mix: every step rewrites the same position, so a row's logits depend on its
    # slot in that step only — equal for equal slots across rows and steps, different for another slot
    np.testing.assert_allclose(logits[1][0], logits[1][3], atol=1e-5)
    np.testing.assert_allclose(logits[0][1], logits[1][2], atol=1e-5)  # slot 1 in both
    np.testing.assert_allclose(logits[0][2], logits[3][1], atol=1e-5)  # slot 2 in both
    np.testing.assert_allclose(logits[0][3], logits[2][0], atol=1e-5)  # no adapter in both
    assert np.abs(logits[0][2] - logits[0][1]).max() > 1e-2
    assert np.abs(logits[0][3] - logits[0][1]).max() > 1e-2
