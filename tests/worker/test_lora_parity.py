"""Adapters served together in ONE batch each match peft; the row without an adapter matches the base model.

Four PEFT adapters differ in rank (2..16, incl. rank_pattern), alpha (incl. alpha_pattern), rsLoRA and
target modules; on Llama through every backend, on every family (Llama, Mistral, Qwen2, Qwen3, Gemma 2,
Gemma 3) through the default CPU backend in f32 and bf16. Tolerance: f32 logits within 2e-4 absolute; bf16 see ATOL_BF16.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from loraserve.adapters.files import read_adapter_files
from loraserve.adapters.peft import parse_adapter
from loraserve.kernels import XlaGroupedBackend, get_backend, grouped
from loraserve.models import decoder
from loraserve.models.checkpoint import load_checkpoint
from loraserve.models.lora.pools import SlotPools, slot_arrays
from tests.conftest import ADAPTERS, FAMILIES
from tests.platform import NATIVE_BACKEND, cpp_only
from tests.worker.model_steps import ModelSteps

ATOL = 2e-4
PROMPT = [5, 17, 33, 100, 7, 9]
STEPS = 6


def _reference_logits(base_dir, adapter_dir, seq, dtype: str = "float32"):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=getattr(torch, dtype)).eval()
    model = base if adapter_dir is None else PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0].float().numpy()


def _load_pools(cfg, dirs, backend, pool_dtype: str) -> SlotPools:
    """One slot per adapter of ``dirs`` (in order), rank up to 16; checks the layout round-trips."""
    pools = SlotPools(cfg, max_loras=len(dirs), max_rank=16, dtype=jnp.dtype(pool_dtype), backend=backend)
    for slot, path in enumerate(dirs):
        weights = parse_adapter(
            *read_adapter_files(str(path)),
            module_shapes=cfg.module_shapes(),
            num_layers=cfg.num_layers,
            max_rank=16,
        )
        values = slot_arrays(cfg, weights, 16)
        pools.write(slot, values)
        for got, want in zip(pools.read(slot), values, strict=True):  # the backend's layout round-trips
            for k, v in want.items():
                if k not in got:  # DoRA's magnitude and mask: inputs of the scale pool, not pools
                    continue
                np.testing.assert_array_equal(
                    got[k].astype(np.float32), np.asarray(jnp.asarray(v).astype(pool_dtype), np.float32)
                )
    return pools


def _serve_mixed(ck, backend, pools, row_slots, plan, seq, dtype: str) -> np.ndarray:
    """Prefill PROMPT into one row per entry of ``row_slots`` (with that slot), then decode ``seq``'s
    continuation teacher-forced over all rows in one batch; returns logits [rows, 1 + STEPS, V] (f32)."""
    cfg = ck.config
    rows = len(row_slots)
    cache = decoder.init_cache(cfg, rows * 2 + 1, 16, jnp.dtype(dtype))  # two pages of 16 per row
    tables = decoder.contiguous_page_tables(rows, 2)
    steps = ModelSteps(cfg, backend, ck.params, pools, cache)
    tokens = np.zeros(16, np.int32)
    tokens[: len(PROMPT)] = PROMPT
    out: list[list[np.ndarray]] = [[] for _ in range(rows)]
    for row, slot in enumerate(row_slots):
        got = steps.prefill_one(tokens, len(PROMPT), 0, slot, tables[row])
        out[row].append(np.asarray(got, np.float32))
    for step in range(STEPS):
        pos = len(PROMPT) + step
        got = steps.decode(np.full(rows, seq[pos], np.int32), np.full(rows, pos, np.int32), tables, plan)
        for row in range(rows):
            out[row].append(np.asarray(got[row], np.float32))
    return np.stack([np.stack(o) for o in out])


# The xla-grouped backend (weights-first pools) under each grouping of kernels.grouped — every row
# through the heavy-slot loop (J=0), one row per slot in place plus heavy slots 2 and 0 (J=1), all in
# place (J=4), one adapter on every adapter row (single) — and every backend with docs/design.md §6 pools:
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
        pytest.param("cpu", 0, False, "float32", marks=cpp_only),
        pytest.param("cpu", 0, False, "bfloat16", marks=cpp_only),
        (NATIVE_BACKEND, 0, False, "bfloat16"),
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
    pools = _load_pools(cfg, [adapter_dirs[n] for n in names], lora, pool_dtype)
    # every slot in a shuffled order, a row with no adapter, slot 2 on three rows and slot 0 on two
    row_slots = np.array([2, 0, 3, 1, -1, 2, 0, 2], np.int32)
    if single:  # ... or the third adapter on every row but one
        row_slots = np.array([2, 2, -1, 2, 2], np.int32)
    if isinstance(lora, XlaGroupedBackend):  # force the variant under test
        plan = grouped.plan_groups(row_slots, len(names), lights=(light,), single=single)
        assert plan is not None and plan.variant == (light, single)
    else:
        plan = lora.plan(row_slots, len(names))
        np.testing.assert_array_equal(lora.row_slots(plan), row_slots)
    rng = np.random.default_rng(0)
    seq = PROMPT + rng.integers(3, cfg.vocab_size, STEPS).tolist()  # teacher-forced continuation
    by_slot = {
        s: _reference_logits(llama_dir, None if s < 0 else adapter_dirs[names[s]], seq)
        for s in set(row_slots.tolist())
    }
    got = _serve_mixed(ck, lora, pools, row_slots, plan, seq, "float32")
    for row, slot in enumerate(row_slots):
        want = by_slot[slot][len(PROMPT) - 1 :]
        for step in range(STEPS + 1):
            np.testing.assert_allclose(
                got[row, step], want[step], atol=atol, err_msg=f"row {row} step {step}"
            )
    # the adapters really change the output (otherwise the comparison above proves nothing)
    for slot in set(row_slots.tolist()) - {-1}:
        assert np.abs(by_slot[slot][-1] - by_slot[-1][-1]).max() > 1e-2


# Every family with the default CPU backend: the four adapters (made on each family's base) and a
# base-model row mixed in one batch, f32 model with f32 pools, and bf16 model with bf16 pools against
# peft on the bf16 base (peft keeps its LoRA weights and math in f32: autocast_adapter_dtype). bf16
# tolerance as for the base model (test_model_parity): 0.08; measured max |diff| 0.025 (Llama), 0.028
# (Mistral), 0.025 (Qwen2), 0.034 (Qwen3), 0.033 (Gemma 2), 0.044 (Gemma 3). f32: ATOL (measured
# <= 3.4e-6).
ATOL_BF16 = 0.08


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_mixed_adapter_batch_matches_peft_per_family(
    model_dirs, family_adapter_dirs, family: str, dtype: str
):
    dirs = family_adapter_dirs(family)
    names = list(ADAPTERS)
    ck = load_checkpoint(str(model_dirs[family]), dtype=dtype)
    cfg = ck.config
    lora = get_backend(NATIVE_BACKEND)
    pools = _load_pools(cfg, [dirs[n] for n in names], lora, dtype)
    row_slots = np.array([3, -1, 0, 2, 1, 0], np.int32)
    rng = np.random.default_rng(1)
    seq = PROMPT + rng.integers(3, cfg.vocab_size, STEPS).tolist()
    by_slot = {
        s: _reference_logits(model_dirs[family], None if s < 0 else dirs[names[s]], seq, dtype)
        for s in set(row_slots.tolist())
    }
    got = _serve_mixed(ck, lora, pools, row_slots, lora.plan(row_slots, len(names)), seq, dtype)
    atol = ATOL if dtype == "float32" else ATOL_BF16
    worst: dict[int, float] = {}
    for row, slot in enumerate(row_slots):
        err = np.abs(got[row] - by_slot[slot][len(PROMPT) - 1 :]).max(axis=-1)
        assert err.max() <= atol, f"row {row} (slot {slot}): max |diff| per step {np.round(err, 5).tolist()}"
        worst[slot] = max(worst.get(slot, 0.0), float(err.max()))
    # every adapter moves peft's logits by > 0.1 (measured >= 0.13) and by more than twice our largest
    # deviation on its rows: serving another adapter or none would have failed the check above
    for slot in set(row_slots.tolist()) - {-1}:
        effect = np.abs(by_slot[slot][len(PROMPT) - 1 :] - by_slot[-1][len(PROMPT) - 1 :]).max()
        assert effect > max(0.1, 2 * worst[slot]), (slot, effect, worst[slot])


# The pallas backend's decode kernel (kernels.pallas_decode) takes projections whose slices are multiples of
# 128 lanes; the test models' are not (the tiled kernels serve them). A Llama of hidden 128, intermediate 256
# and two heads of 64 runs it on every projection: the four adapters and a base row in one batch, f32 model
# with f32 pools (ATOL) and with bf16 pools: those round every weight (ATOL_BF16_POOLS' 2.0e-3) and the kernel
# rounds h = x @ A to bf16 before the expand as xla-grouped does (relative 2^-9 more): 4.8e-3 measured, 1e-2.
WIDE = dict(
    hidden_size=128, intermediate_size=256, num_attention_heads=2, num_key_value_heads=2, num_hidden_layers=2
)


@pytest.mark.parametrize("pool_dtype", ["float32", "bfloat16"])
def test_pallas_decode_kernel_matches_peft_on_lane_wide_projections(
    tmp_path_factory, monkeypatch, pool_dtype: str
) -> None:
    from transformers import AutoModelForCausalLM

    from loraserve.kernels import pallas, pallas_decode
    from loraserve.testing import make_adapter, save_model

    traced = {"decode kernel": 0, "tiled kernels": 0}

    def counted(fn, key):
        def wrapper(*args, **kwargs):
            traced[key] += 1
            return fn(*args, **kwargs)

        return wrapper

    kernel = pallas_decode.add_lora_slices_decode
    monkeypatch.setattr(pallas_decode, "add_lora_slices_decode", counted(kernel, "decode kernel"))
    monkeypatch.setattr(pallas, "add_lora_slices", counted(pallas.add_lora_slices, "tiled kernels"))

    root = tmp_path_factory.mktemp("wide")
    base_dir = save_model(root / "llama", "llama", seed=11, **WIDE)
    dirs = []
    for name, kw in ADAPTERS.items():
        make_adapter(AutoModelForCausalLM.from_pretrained(str(base_dir)), root / name, **kw)
        dirs.append(root / name)
    ck = load_checkpoint(str(base_dir))
    cfg = ck.config
    lora = get_backend("pallas")
    pools = _load_pools(cfg, dirs, lora, pool_dtype)
    row_slots = np.array([1, 3, -1, 0, 2, 3], np.int32)
    rng = np.random.default_rng(5)
    seq = PROMPT + rng.integers(3, cfg.vocab_size, STEPS).tolist()
    by_slot = {
        s: _reference_logits(base_dir, None if s < 0 else dirs[s], seq) for s in set(row_slots.tolist())
    }
    got = _serve_mixed(ck, lora, pools, row_slots, lora.plan(row_slots, len(dirs)), seq, "float32")
    atol = ATOL if pool_dtype == "float32" else 1e-2
    for row, slot in enumerate(row_slots):
        err = np.abs(got[row] - by_slot[slot][len(PROMPT) - 1 :]).max()
        assert err <= atol, f"row {row} (slot {slot}): max |diff| {err}"
    for slot in set(row_slots.tolist()) - {-1}:
        assert np.abs(by_slot[slot][-1] - by_slot[-1][-1]).max() > 1e-2
    # every projection of both layers (qkv, o, gate_up, down) was traced through the decode kernel, once
    assert traced == {"decode kernel": 4 * cfg.num_layers, "tiled kernels": 0}
