"""Adapters served together in ONE batch each match peft; the row without an adapter matches the base model.

Four PEFT adapters differ in rank (2..16, incl. rank_pattern), alpha (incl. alpha_pattern), rsLoRA and
target modules. Tolerance: f32 logits within 2e-4 absolute.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from loraserve.adapters.files import read_adapter_files
from loraserve.adapters.peft import parse_adapter
from loraserve.kernels import XlaGroupedBackend, get_backend, grouped
from loraserve.worker import model as M
from loraserve.worker.checkpoint import load_checkpoint
from loraserve.worker.slots import SlotPools, slot_arrays
from tests.conftest import ADAPTERS

ATOL = 2e-4
PROMPT = [5, 17, 33, 100, 7, 9]
STEPS = 6


def _reference_logits(llama_dir, adapter_dir, seq):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(llama_dir)).eval()
    model = base if adapter_dir is None else PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0].numpy()


# The xla-grouped backend (weights-first pools) under each grouping of kernels.grouped — every row
# through the heavy-slot loop (J=0), one row per slot in place plus heavy slots 2 and 0 (J=1), all in
# place (J=4), one adapter on every adapter row (single) — and every backend with DESIGN.md §6 pools:
# reference, xla-onehot, pallas (interpreted off-TPU) and cpu (C++ kernels) with f32 pools and with
# bf16 pools. bf16 pools round every adapter weight to 8 mantissa bits (relative 2^-9); on these
# adapters that moves the logits by up to 2.0e-3 (measured), so those rows get ATOL_BF16_POOLS instead.
ATOL_BF16_POOLS = 4e-3


@pytest.mark.parametrize(
    ("backend", "light", "single", "pool_dtype"),
    [
        ("xla-grouped", 0, False, "float32"),
        ("xla-grouped", 1, False, "float32"),
        ("xla-grouped", 4, False, "float32"),
        ("xla-grouped", 0, True, "float32"),
        ("reference", 0, False, "float32"),
        ("xla-onehot", 0, False, "float32"),
        ("pallas", 0, False, "float32"),
        ("cpu", 0, False, "float32"),
        ("cpu", 0, False, "bfloat16"),
    ],
)
def test_mixed_adapter_batch_matches_peft(
    llama_dir, adapter_dirs, backend: str, light: int, single: bool, pool_dtype: str
) -> None:
    ck = load_checkpoint(str(llama_dir))
    cfg = ck.config
    names = list(ADAPTERS)
    atol = ATOL if pool_dtype == "float32" else ATOL_BF16_POOLS
    lora = get_backend(backend)
    pools = SlotPools(cfg, max_loras=len(names), max_rank=16, dtype=jnp.dtype(pool_dtype), backend=lora)
    for slot, name in enumerate(names):
        weights = parse_adapter(
            *read_adapter_files(str(adapter_dirs[name])),
            module_shapes=cfg.module_shapes(),
            num_layers=cfg.num_layers,
            max_rank=16,
        )
        values = slot_arrays(cfg, weights, 16)
        pools.write(slot, values)
        for got, want in zip(pools.read(slot), values, strict=True):  # the backend's layout round-trips
            for k, v in want.items():
                np.testing.assert_array_equal(
                    got[k].astype(np.float32), np.asarray(jnp.asarray(v).astype(pool_dtype), np.float32)
                )
    # every slot in a shuffled order, a row with no adapter, slot 2 on three rows and slot 0 on two
    row_slots = np.array([2, 0, 3, 1, -1, 2, 0, 2], np.int32)
    if single:  # ... or the third adapter on every row but one
        row_slots = np.array([2, 2, -1, 2, 2], np.int32)
    if isinstance(lora, XlaGroupedBackend):  # force the variant under test
        plan = grouped.plan_groups(row_slots, len(names), lights=(light,), single=single)
        assert plan is not None and plan.variant == (light, single)
    else:
        plan = lora.plan(row_slots, len(names))
        np.testing.assert_array_equal(plan, row_slots)  # the slot ids themselves
    rng = np.random.default_rng(0)
    seq = PROMPT + rng.integers(3, cfg.vocab_size, STEPS).tolist()  # teacher-forced continuation
    by_slot = {
        s: _reference_logits(llama_dir, None if s < 0 else adapter_dirs[names[s]], seq)
        for s in set(row_slots.tolist())
    }
    refs = [by_slot[s] for s in row_slots]
    rows = len(row_slots)
    cache = M.init_cache(cfg, rows, 32, jnp.float32)
    inv = jnp.asarray(cfg.inv_freq(), jnp.float32)
    prefill = jax.jit(partial(M.prefill, cfg, backend=lora))
    decode = jax.jit(partial(M.decode, cfg, backend=lora))
    tokens = np.zeros(16, np.int32)
    tokens[: len(PROMPT)] = PROMPT
    for row, slot in enumerate(row_slots):
        got, cache = prefill(
            ck.params, pools.pools, tokens, np.int32(len(PROMPT)), np.int32(slot), np.int32(row), cache, inv
        )
        np.testing.assert_allclose(
            np.asarray(got), refs[row][len(PROMPT) - 1], atol=atol, err_msg=f"prefill row {row}"
        )
    for step in range(STEPS):
        pos = len(PROMPT) + step
        toks = np.full(rows, seq[pos], np.int32)
        got, cache = decode(ck.params, pools.pools, toks, np.full(rows, pos, np.int32), plan, cache, inv)
        for row in range(rows):
            np.testing.assert_allclose(
                np.asarray(got[row]), refs[row][pos], atol=atol, err_msg=f"row {row} step {step}"
            )
    # the adapters really change the output (otherwise the comparison above proves nothing)
    for slot in set(row_slots.tolist()) - {-1}:
        assert np.abs(by_slot[slot][-1] - by_slot[-1][-1]).max() > 1e-2


def test_pattern_ranks_and_scaling_are_folded(llama_dir, adapter_dirs) -> None:
    cfg = load_checkpoint(str(llama_dir)).config
    w = parse_adapter(
        *read_adapter_files(str(adapter_dirs["attn-pattern"])),
        module_shapes=cfg.module_shapes(),
        num_layers=cfg.num_layers,
    )
    assert w.target_modules == ("q_proj", "k_proj", "o_proj")
    assert w.modules["k_proj"][0].shape == (cfg.num_layers, cfg.hidden_size, 2)  # rank_pattern k_proj: 2
    assert w.modules["q_proj"][0].shape == (cfg.num_layers, cfg.hidden_size, 8)
    from safetensors.numpy import load_file

    raw = load_file(str(adapter_dirs["attn-pattern"] / "adapter_model.safetensors"))
    b_o = next(v for k, v in raw.items() if "layers.0.self_attn.o_proj.lora_B" in k)
    np.testing.assert_allclose(
        w.modules["o_proj"][1][0], b_o.T * (3.0 / 8), rtol=1e-6
    )  # alpha_pattern o_proj: 3
    b_k = next(v for k, v in raw.items() if "layers.0.self_attn.k_proj.lora_B" in k)
    np.testing.assert_allclose(w.modules["k_proj"][1][0], b_k.T * (8.0 / 2), rtol=1e-6)
    rs = parse_adapter(*read_adapter_files(str(adapter_dirs["qv-r8-rslora"])))
    raw = load_file(str(adapter_dirs["qv-r8-rslora"] / "adapter_model.safetensors"))
    b_q = next(v for k, v in raw.items() if "layers.1.self_attn.q_proj.lora_B" in k)
    np.testing.assert_allclose(rs.modules["q_proj"][1][1], b_q.T * (4.0 / np.sqrt(8)), rtol=1e-6)
