"""On a TPU: every family's base-model logits, computed by the same program on the chip and on XLA:CPU (the
CPU backend every JAX process also has), agree with each other and with transformers (f32, matmuls at
``highest``). Tolerance: 2e-4 absolute, the f32 parity bound of tests/worker/test_lora_parity.py.

When a parity test fails on the chip only, this one says on which side the difference lies. It first ran for
Gemma 2, 0.03-0.11 off PEFT on the chip: the chip and XLA:CPU agreed to 5e-5 and both were 0.13 off
transformers, whose 5.17 (the chip host's) computed Gemma 2's attention with sdpa, dropping the soft-cap; the
test models now ask for eager attention (loraserve.testing, tests/worker/test_families.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loraserve.kernels import get_backend
from loraserve.models import decoder
from loraserve.models.checkpoint import load_checkpoint
from loraserve.models.lora.pools import SlotPools
from loraserve.testing import save_model
from tests.conftest import FAMILIES
from tests.platform import ON_TPU
from tests.worker.model_steps import ModelSteps
from tests.worker.test_lora_parity import ATOL, PROMPT, STEPS, _reference_logits

pytestmark = pytest.mark.skipif(not ON_TPU, reason="compares the chip's results with XLA:CPU's: needs a TPU")

VARIANTS = {name: (name, kw) for name, kw in FAMILIES.items()}


def _base_logits(ck, seq, device) -> np.ndarray:
    """The base model (no adapter) over PROMPT, then ``seq``'s continuation teacher-forced: ``[1 + STEPS, V]``."""
    with jax.default_device(device):
        params = jax.device_put(ck.params, device)
        backend = get_backend("reference")
        pools = SlotPools(ck.config, max_loras=1, max_rank=8, dtype=jnp.dtype("float32"), backend=backend)
        cache = decoder.init_cache(ck.config, 3, 16, jnp.dtype("float32"))
        tables = decoder.contiguous_page_tables(1, 2)
        steps = ModelSteps(ck.config, backend, params, pools, cache)
        tokens = np.zeros(16, np.int32)
        tokens[: len(PROMPT)] = PROMPT
        out = [np.asarray(steps.prefill_one(tokens, len(PROMPT), 0, -1, tables[0]), np.float32)]
        for step in range(STEPS):
            pos = len(PROMPT) + step
            got = steps.decode(np.array([seq[pos]], np.int32), np.array([pos], np.int32), tables)
            out.append(np.asarray(got[0], np.float32))
    return np.stack(out)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_chip_and_xla_cpu_agree_with_transformers(variant: str, tmp_path) -> None:
    family, overrides = VARIANTS[variant]
    path = save_model(tmp_path / variant, family, seed=7, **overrides)
    ck = load_checkpoint(str(path), dtype="float32")
    rng = np.random.default_rng(1)
    seq = PROMPT + rng.integers(3, ck.config.vocab_size, STEPS).tolist()
    want = _reference_logits(path, None, seq)[len(PROMPT) - 1 :]
    chip = _base_logits(ck, seq, jax.devices()[0])
    errors = {"chip vs transformers": float(np.abs(chip - want).max())}
    try:
        host_device = jax.devices("cpu")[0]
    except RuntimeError:  # a process started with JAX_PLATFORMS=tpu has no CPU backend: transformers only
        host_device = None
    if host_device is not None:
        host = _base_logits(ck, seq, host_device)
        errors["xla:cpu vs transformers"] = float(np.abs(host - want).max())
        errors["chip vs xla:cpu"] = float(np.abs(chip - host).max())
    assert max(errors.values()) <= ATOL, f"{variant}: max |diff| {errors}"
