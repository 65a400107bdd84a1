"""DoRA and LoRA-bias adapters served in ONE batch with plain LoRA and base rows, against PEFT (#16 items 1-2).

Real PEFT adapters made on the tiny random models (``tests.conftest.DORA_ADAPTERS``): DoRA on every module
(rank 4), DoRA with rsLoRA, ``rank_pattern`` and ``alpha_pattern`` on a target subset, a ``lora_bias``
adapter and a plain one. Their logits (a prefill and STEPS teacher-forced decode steps) are compared with
PEFT's in f32 within ATOL through every LoRA backend on Llama, and on every other family (Qwen2's q/k/v
bias: PEFT's DoRA scales only the non-bias part) with the CPU default, and in bf16; the stored per-slot
scales with PEFT's ``m / ||W + s·B·A||``; the packed prefill; nothing compiles after warm-up while
DoRA/bias adapters are swapped in and served. The engine, tensor parallelism and the refusals:
``test_dora_worker.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from loraserve.adapters.files import read_adapter_files
from loraserve.adapters.peft import parse_adapter
from loraserve.kernels import get_backend
from loraserve.kernels.testing import count_compilations
from loraserve.models import decoder
from loraserve.models.checkpoint import load_checkpoint
from loraserve.models.lora.pools import SlotPools, base_weights, slot_arrays
from loraserve.models.step import PrefillBatch
from tests.conftest import DORA_ADAPTERS
from tests.platform import NATIVE_BACKEND, backends
from tests.worker.model_steps import ModelSteps
from tests.worker.test_lora_parity import PROMPT, STEPS, _reference_logits, _serve_mixed

ATOL = 2e-4
# bf16 model and pools against peft on the bf16 base, as in test_lora_parity (its ATOL_BF16)
ATOL_BF16 = 0.08
RANK = 16
NAMES = list(DORA_ADAPTERS)
# every slot, DoRA slot 0 on three rows, a base row; then teacher-forced decode of one sequence
ROW_SLOTS = np.array([0, 2, -1, 1, 3, 0, 1, 0], np.int32)


def _weights(cfg, path):
    return parse_adapter(
        *read_adapter_files(str(path)),
        module_shapes=cfg.module_shapes(),
        num_layers=cfg.num_layers,
        max_rank=RANK,
    )


def _pools(ck, dirs, backend, dtype: str = "float32") -> SlotPools:
    cfg = ck.config
    pools = SlotPools(cfg, len(dirs), RANK, jnp.dtype(dtype), backend, base=base_weights(ck.params))
    for slot, path in enumerate(dirs):
        pools.write(slot, slot_arrays(cfg, _weights(cfg, path), RANK))
    return pools


def _check_against_peft(model_dir, dirs, backend_name: str, dtype: str = "float32") -> float:
    """Serve ROW_SLOTS in one batch; every row within ATOL (bf16: ATOL_BF16) of PEFT with its adapter,
    in f32 the same greedy tokens at every step; returns the largest |diff|."""
    ck = load_checkpoint(str(model_dir), dtype=dtype)
    backend = get_backend(backend_name)
    pools = _pools(ck, [dirs[n] for n in NAMES], backend, dtype)
    atol = ATOL if dtype == "float32" else ATOL_BF16
    rng = np.random.default_rng(3)
    seq = PROMPT + rng.integers(3, ck.config.vocab_size, STEPS).tolist()
    want = {
        s: _reference_logits(model_dir, None if s < 0 else dirs[NAMES[s]], seq, dtype)[len(PROMPT) - 1 :]
        for s in set(ROW_SLOTS.tolist())
    }
    got = _serve_mixed(ck, backend, pools, ROW_SLOTS, backend.plan(ROW_SLOTS, len(NAMES)), seq, dtype)
    worst = 0.0
    for row, slot in enumerate(ROW_SLOTS):
        err = np.abs(got[row] - want[slot]).max(axis=-1)
        assert err.max() <= atol, f"row {row} (slot {slot}): max |diff| per step {err.tolist()}"
        if dtype == "float32":
            np.testing.assert_array_equal(got[row].argmax(-1), want[slot].argmax(-1), err_msg=f"row {row}")
        worst = max(worst, float(err.max()))
    for slot in range(len(NAMES)):  # every adapter moves PEFT's logits far more than our deviation
        assert np.abs(want[slot] - want[-1]).max() > max(0.1, (100 if dtype == "float32" else 2) * worst), (
            slot
        )
    return worst


# measured max |diff| on Llama (f32): 1.6e-6 .. 1.9e-6 for every backend
@pytest.mark.parametrize("backend", backends("reference", "xla-onehot", "xla-grouped", "cpu", "pallas"))
def test_dora_and_bias_mixed_batch_match_peft(model_dirs, dora_dirs, backend: str) -> None:
    assert _check_against_peft(model_dirs["llama"], dora_dirs("llama"), backend) <= ATOL


# Qwen2 has a q/k/v bias: PEFT's DoRA scales W x + s·B A x and adds the bias unscaled; Gemma's sandwich
# norms act on the scaled o/down outputs (measured: see docs/worker.md)
@pytest.mark.parametrize("family", ["mistral", "qwen2", "qwen3", "gemma2", "gemma3_text"])
def test_dora_and_bias_on_other_families_match_peft(model_dirs, dora_dirs, family: str) -> None:
    assert _check_against_peft(model_dirs[family], dora_dirs(family), NATIVE_BACKEND) <= ATOL


# bf16 model with bf16 pools (the scales and biases stay f32): measured 0.037
def test_dora_and_bias_in_bfloat16_match_peft(model_dirs, dora_dirs) -> None:
    assert (
        _check_against_peft(model_dirs["llama"], dora_dirs("llama"), NATIVE_BACKEND, "bfloat16") <= ATOL_BF16
    )


def test_stored_scales_and_biases_are_peft_s(model_dirs, dora_dirs) -> None:
    """The slot's ``dora_scale_<group>`` is PEFT's ``m / ||W + s·B·A||`` of each module side by side
    (q|k|v, gate|up); ``lora_bias_<group>`` is ``lora_B.bias · s``; plain slots hold ones and zeros."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ck = load_checkpoint(str(model_dirs["llama"]))
    dirs = dora_dirs("llama")
    pools = _pools(ck, [dirs[n] for n in NAMES], get_backend(NATIVE_BACKEND))
    groups = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj")}
    groups["down"] = ("down_proj",)
    for slot, name in enumerate(NAMES):
        base = AutoModelForCausalLM.from_pretrained(str(model_dirs["llama"]))
        peft = PeftModel.from_pretrained(base, str(dirs[name])).eval()
        stored = pools.read(slot)
        for layer in range(ck.config.num_layers):
            attn = peft.base_model.model.model.layers[layer].self_attn
            mlp = peft.base_model.model.model.layers[layer].mlp
            for group, modules in groups.items():
                scales, biases = [], []
                for module in modules:
                    mod = getattr(attn if module in ("q_proj", "k_proj", "v_proj", "o_proj") else mlp, module)
                    linear = mod.get_base_layer() if hasattr(mod, "get_base_layer") else mod  # untargeted
                    scales.append(np.ones(linear.weight.shape[0], np.float32))
                    biases.append(np.zeros(linear.weight.shape[0], np.float32))
                    if linear is mod or "default" not in mod.lora_A:
                        continue
                    s = mod.scaling["default"]
                    with torch.no_grad():
                        if mod.lora_magnitude_vector and "default" in mod.lora_magnitude_vector:
                            dora = mod.lora_magnitude_vector["default"]
                            delta = mod.lora_B["default"].weight @ mod.lora_A["default"].weight
                            norm = dora.get_weight_norm(linear.weight, delta, s)
                            scales[-1] = (dora.weight / norm).numpy()
                        if mod.lora_B["default"].bias is not None:
                            biases[-1] = (mod.lora_B["default"].bias * s).numpy()
                np.testing.assert_allclose(
                    stored[layer][f"dora_scale_{group}"], np.concatenate(scales), rtol=1e-5
                )
                np.testing.assert_allclose(
                    stored[layer][f"lora_bias_{group}"], np.concatenate(biases), rtol=1e-6
                )
        if name.startswith("dora"):  # the scales really differ from 1
            assert np.abs(stored[0]["dora_scale_qkv"] - 1).max() > 0.1
        else:  # exactly ones: plain-LoRA rows are untouched bit for bit
            assert all((layer[f"dora_scale_{g}"] == 1).all() for layer in stored for g in groups)


@pytest.mark.parametrize("backend", [NATIVE_BACKEND, "xla-grouped"])
def test_loading_and_serving_dora_compiles_nothing_after_warmup(model_dirs, dora_dirs, backend: str) -> None:
    ck = load_checkpoint(str(model_dirs["llama"]))
    cfg, lora = ck.config, get_backend(backend)
    dirs = dora_dirs("llama")
    values = [slot_arrays(cfg, _weights(cfg, dirs[n]), RANK) for n in NAMES]
    rows, slots = 4, 3
    pools = SlotPools(cfg, slots, RANK, jnp.dtype(jnp.float32), lora, base=base_weights(ck.params))
    tables = decoder.contiguous_page_tables(rows, 2)
    steps = ModelSteps(cfg, lora, ck.params, pools, decoder.init_cache(cfg, rows * 2 + 1, 16, jnp.float32))
    tokens = np.zeros(16, np.int32)
    tokens[: len(PROMPT)] = PROMPT
    n, same, nines = len(PROMPT), np.full(rows, len(PROMPT), np.int32), np.full(rows, 9, np.int32)
    pools.zero(0)  # warm-up, as the runner does it
    steps.prefill_one(tokens, n, 0, 0, tables[0])
    for plan in lora.warmup_plans(rows, slots):
        steps.decode(nines, same, tables, plan)
    jax.block_until_ready(steps.cache)
    with count_compilations() as count:
        for i, v in enumerate(values * 2):  # DoRA, bias and plain adapters swapped through 3 slots
            pools.write(i % slots, v)
        for row, slot in enumerate([0, 1, 2, -1]):
            steps.prefill_one(tokens, n, 0, slot, tables[row])
        for mix in ([0, 1, 2, -1], [0, 0, 0, 0], [2, -1, 1, 1]):
            out = steps.decode(nines, same, tables, lora.plan(np.array(mix, np.int32), slots))
        jax.block_until_ready(out)
    assert count.compilations == 0, count.names
    # the last writes left bias-r4, plain-r4 and dora-pattern-rslora in slots 0, 1, 2
    assert np.abs(np.asarray(pools.pools.layers[0]["dora_scale_qkv"][2]) - 1).max() > 0.1
    assert np.abs(np.asarray(pools.pools.layers[0]["lora_bias_qkv"][0])).max() > 0


@pytest.mark.parametrize("backend", [NATIVE_BACKEND, "xla-grouped"])
def test_packed_prefill_of_dora_and_bias_prompts_matches_peft(model_dirs, dora_dirs, backend: str) -> None:
    """The runner's prefill: prompts of different lengths on DoRA, bias, plain and no adapter packed into
    one call of G segments; each segment's last-token logits are PEFT's (f32, ATOL)."""
    model_dir, dirs = model_dirs["llama"], dora_dirs("llama")
    ck = load_checkpoint(str(model_dir))
    cfg, lora = ck.config, get_backend(backend)
    pools = _pools(ck, [dirs[n] for n in NAMES], lora)
    prompts = [
        [5, 17, 33, 100, 7, 9],
        [3, 4],
        [250, 11, 12, 13, 14, 15, 16, 2, 8],
        [60, 61, 62],
        [8, 8, 8, 1],
    ]
    seg_slots = np.array([0, 2, 1, -1, 3], np.int32)
    g, t = len(prompts), 16
    tokens = np.zeros((g, t), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    lengths = np.array([len(p) for p in prompts], np.int32)
    steps = ModelSteps(cfg, lora, ck.params, pools, decoder.init_cache(cfg, g + 1, 16, jnp.float32))
    tables = decoder.contiguous_page_tables(g, 1)
    zeros = np.zeros(g, np.int32)
    logits = steps.prefill(PrefillBatch(tokens, lengths, zeros, seg_slots, tables, np.int32(1)))
    for i, (p, slot) in enumerate(zip(prompts, seg_slots, strict=True)):
        want = _reference_logits(model_dir, None if slot < 0 else dirs[NAMES[slot]], p)[-1]
        np.testing.assert_allclose(
            np.asarray(logits[i]), want, atol=ATOL, err_msg=f"segment {i} (slot {slot})"
        )
