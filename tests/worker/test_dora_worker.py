"""DoRA and LoRA-bias adapters through the whole worker (#16 items 1-2): the engine gives PEFT's greedy
tokens with DoRA, bias, plain and base requests mixed and nothing compiled after start; malformed ones are
INVALID_ARGUMENT; N = 2 and 4 tensor parallelism serves what N = 1 serves. Model-level parity:
``test_dora.py``.
"""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest

from loraserve.adapters.errors import AdapterError
from loraserve.adapters.files import read_adapter_files
from loraserve.adapters.peft import load_tensors, parse_adapter
from loraserve.kernels.testing import count_compilations
from loraserve.models.checkpoint import load_checkpoint
from loraserve.testing import make_adapter
from tests.conftest import DORA_ADAPTERS
from tests.platform import SUBPROCESS_JAX
from tests.worker.test_dora import NAMES, RANK, _weights
from tests.worker.test_lora_parity import _reference_logits


def _peft_greedy(model_dir, adapter_dir, prompt: list[int], n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(_reference_logits(model_dir, adapter_dir, seq)[-1].argmax()))
    return seq[len(prompt) :]


def test_engine_serves_dora_and_bias_with_peft_s_greedy_tokens(model_dirs, dora_dirs) -> None:
    """The whole worker path (residency: fetch, validate, prepare; slot writes with the scale computed on
    the device; packed prefill; decode): DoRA, bias and plain adapters and the base model, concurrently,
    through 2 slots (so loads evict and reload), give PEFT's greedy tokens; nothing compiles after start."""
    import uuid

    from loraserve.engine.config import EngineConfig
    from loraserve.engine.request import EngineRequest, Sampling
    from tests.engines import started_engine
    from tests.worker.fake_engine import Collector

    model_dir, dirs = model_dirs["llama"], dora_dirs("llama")
    config = EngineConfig(
        max_batch_size=4,
        max_seq_len=64,
        max_loras=2,
        max_lora_rank=RANK,
        max_cpu_loras=1,
        min_prefill_bucket=64,
    )  # one prefill bucket: a shorter warm-up (bucketing itself: test_engine.py)
    prompts = {name: [5, 17, 33 + i, 100, 7] for i, name in enumerate(["", *NAMES])}
    with started_engine(model_dir, config, dirs) as engine:
        with count_compilations() as count:
            collectors = {}
            for round_ in range(2):  # the second round reloads what the first evicted
                for name, prompt in prompts.items():
                    c = Collector()
                    req = EngineRequest(
                        uuid.uuid4().hex, name, prompt, Sampling(max_tokens=8, ignore_eos=True), c
                    )
                    engine.submit(req)
                    collectors[name, round_] = c
            for c in collectors.values():
                assert c.done.wait(120), "request did not finish"
        assert count.compilations == 0, count.names
    for (name, _), c in collectors.items():
        want = _peft_greedy(model_dir, dirs[name] if name else None, prompts[name], 8)
        assert c.tokens == want, name
        if name:  # the adapter changes the text: base tokens on its prompt would have failed
            assert want != _peft_greedy(model_dir, None, prompts[name], 8), name


def test_runner_computes_dora_scales_on_prepare(model_dirs, dora_dirs) -> None:
    """``JaxRunner.prepare`` (the loader thread) hands over values that already carry each group's DoRA
    scale (no magnitudes left), so the engine thread's write only sets the slot; neither compiles."""
    from loraserve.engine.config import EngineConfig
    from loraserve.engine.jax_runner import JaxRunner

    ck = load_checkpoint(str(model_dirs["llama"]))
    config = EngineConfig(max_batch_size=2, max_seq_len=32, max_loras=2, max_lora_rank=RANK)
    runner = JaxRunner(ck, config)
    runner.warmup()
    weights = _weights(ck.config, dora_dirs("llama")["dora-all-r4"])
    with count_compilations() as count:
        values = runner.prepare(weights)
        runner.write_slot(1, values)
    assert count.compilations == 0, count.names
    assert {"dora_scale_qkv", "lora_bias_qkv"} <= set(values[0]) and "magnitude_qkv" not in values[0]
    assert isinstance(values[0]["dora_scale_qkv"], np.ndarray)  # host arrays: the host tier keeps them
    stored = np.asarray(runner.pools.pools.layers[0]["dora_scale_qkv"][1])
    np.testing.assert_array_equal(stored, values[0]["dora_scale_qkv"])
    assert np.abs(stored - 1).max() > 0.1


def _save_tensors(tensors: dict) -> bytes:
    from safetensors.numpy import save

    return save({k: np.ascontiguousarray(v) for k, v in tensors.items()})


def _edit(path, config=None, tensors=None) -> tuple[bytes, bytes]:
    cfg_bytes, weights = read_adapter_files(str(path))
    cfg = json.loads(cfg_bytes)
    cfg.update(config or {})
    t = load_tensors(weights)
    if tensors is not None:
        tensors(t)
    return json.dumps(cfg).encode(), _save_tensors(t)


def _first(t: dict, needle: str) -> str:
    return next(k for k in sorted(t) if needle in k)


def _drop_magnitude(t: dict) -> None:
    del t[_first(t, "lora_magnitude_vector")]


def _shorten(needle: str):
    def fn(t: dict) -> None:
        k = _first(t, needle)
        t[k] = t[k][:-1]

    return fn


# (adapter, config changes, tensor edit, message): each refused with INVALID_ARGUMENT, at the worker and
# at the registry alike (one parser)
REFUSED = [
    ("dora-all-r4", None, _drop_magnitude, "lora_magnitude_vector is missing"),
    ("dora-all-r4", None, _shorten("lora_magnitude_vector"), "does not match lora_B's"),
    ("bias-r4", None, _shorten("lora_B.bias"), "does not match lora_B's"),
    ("bias-r4", None, lambda t: t.update({_first(t, "lora_B.bias"): np.zeros((2, 2), np.float32)}), "1-D"),
    ("dora-all-r4", {"use_dora": False}, None, "use_dora is not set"),
    ("bias-r4", {"lora_bias": False}, None, "lora_bias is not set"),
    ("dora-all-r4", {"lora_bias": True}, None, "DoRA does not support a LoRA bias"),
    ("plain-r4", {"modules_to_save": ["lm_head"]}, None, "modules_to_save"),
    ("plain-r4", {"bias": "all"}, None, "bias 'all' is not supported"),
    ("plain-r4", {"bias": "lora_only"}, None, "bias 'lora_only' is not supported"),
]


@pytest.mark.parametrize(("name", "config", "edit", "needle"), REFUSED)
def test_malformed_dora_and_bias_adapters_are_refused(
    model_dirs, dora_dirs, name, config, edit, needle
) -> None:
    cfg = load_checkpoint(str(model_dirs["llama"])).config
    config_bytes, weights = _edit(dora_dirs("llama")[name], config, edit)
    with pytest.raises(AdapterError, match=needle) as info:
        parse_adapter(config_bytes, weights, module_shapes=cfg.module_shapes(), num_layers=cfg.num_layers)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    # the untouched adapter parses, with its magnitudes / biases
    weights = _weights(cfg, dora_dirs("llama")[name])
    assert weights.use_dora == name.startswith("dora") and bool(weights.biases) == name.startswith("bias")


@pytest.mark.cpu_only(SUBPROCESS_JAX)
def test_tensor_parallel_dora_matches_one_device(model_dirs, dora_dirs, tmp_path_factory) -> None:
    """N = 2 and 4 (KV heads repeated) serve the DoRA, bias and plain adapters with N = 1's logits and
    greedy tokens; 200 slot swaps of them after warm-up compile nothing (tests/worker/tp_child.py)."""
    from transformers import AutoModelForCausalLM

    from loraserve.testing import save_model
    from tests.worker.test_tensor_parallel import ATOL as TP_ATOL
    from tests.worker.test_tensor_parallel import TP_MODEL, run_child

    root = tmp_path_factory.mktemp("tp-dora")
    model = save_model(root / "qwen2", "qwen2", seed=7, **TP_MODEL)
    adapters = []
    for name, kw in DORA_ADAPTERS.items():
        make_adapter(AutoModelForCausalLM.from_pretrained(str(model)), root / name, **kw)
        adapters.append(str(root / name))
    out = run_child(
        "--model", str(model), "--adapters", ",".join(adapters), "--backend", "cpu",
        "--sizes", "1,2,4", "--steps", "4", "--swaps", "200",
    )  # fmt: skip
    ref = np.array(out["1"]["logits"])
    moved = np.abs(ref[0] - np.array(out["1"]["base_logits"])).max(axis=-1)
    assert moved[4] < 1e-5 and (moved[[0, 1, 2, 3, 5]] > 0.1).all(), moved
    assert out["1"]["compilations"] == 0, out["1"]["compiled"]  # the runner's swaps of them on one device
    for n in ("2", "4"):
        got = out[n]
        assert got["tokens"] == out["1"]["tokens"], n
        np.testing.assert_allclose(np.array(got["logits"]), ref, atol=TP_ATOL, rtol=0, err_msg=f"N={n}")
        assert got["compilations"] == 0, (n, got["compiled"])
        assert got["abstract_matches"] == {"params": True, "cache": True, "pools": True}


def test_the_worker_checks_what_a_slot_will_hold(model_dirs, dora_dirs) -> None:
    """The worker never trusts the registry: ``JaxRunner.prepare`` refuses values that are not finite or over
    ``MAX_SLOT_VALUE`` once everything is folded in — here weights that skipped the parser's checks, and a
    DoRA adapter whose magnitudes pass the parser (<= 1e4) but whose computed scales ``m / ||W + sBA||`` do
    not — with INVALID_ARGUMENT naming the layer and pool; nothing is written."""
    import dataclasses

    from loraserve.adapters.peft import MAX_SLOT_VALUE
    from loraserve.engine.config import EngineConfig
    from loraserve.engine.jax_runner import JaxRunner

    ck = load_checkpoint(str(model_dirs["llama"]))
    runner = JaxRunner(ck, EngineConfig(max_batch_size=2, max_seq_len=32, max_loras=2, max_lora_rank=RANK))
    weights = _weights(ck.config, dora_dirs("llama")["dora-all-r4"])
    runner.prepare(weights)  # healthy: accepted
    a, b = weights.modules["v_proj"]
    b = b.copy()
    b[1, 0, 0] = np.inf
    poisoned = dataclasses.replace(weights, modules={**weights.modules, "v_proj": (a, b)})
    with pytest.raises(AdapterError) as exc:
        runner.prepare(poisoned)
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "slot value B_v of layer 1 is not finite" in str(exc.value)
    m, mask = weights.magnitudes["q_proj"]
    big = dataclasses.replace(
        weights, magnitudes={**weights.magnitudes, "q_proj": (m * 0 + MAX_SLOT_VALUE, mask)}
    )
    with pytest.raises(AdapterError) as exc:
        runner.prepare(big)
    assert "slot value dora_scale_qkv of layer 0" in str(exc.value) and "over the bound" in str(exc.value)
    assert not any(np.asarray(pool).any() for pool in runner.pools.pools.layers[1].values() if pool.ndim == 3)


def test_a_multi_host_runner_checks_dora_scales_as_it_writes_them(model_dirs, dora_dirs) -> None:
    """Across processes ``prepare`` cannot compute DoRA's scales (every device call keeps one order on every
    process), so ``write_slot`` computes and checks them: the same refusal as on one host, raised when the slot
    is written, and the slot left empty; a healthy DoRA adapter is written with the one-host values."""
    import dataclasses

    from loraserve.adapters.peft import MAX_SLOT_VALUE
    from loraserve.engine.config import EngineConfig
    from loraserve.engine.jax_runner import JaxRunner

    ck = load_checkpoint(str(model_dirs["llama"]))
    runner = JaxRunner(ck, EngineConfig(max_batch_size=2, max_seq_len=32, max_loras=2, max_lora_rank=RANK))
    weights = _weights(ck.config, dora_dirs("llama")["dora-all-r4"])
    one_host = runner.prepare(weights)
    runner.multiprocess = True  # what jax.process_count() > 1 sets
    m, mask = weights.magnitudes["q_proj"]
    big = dataclasses.replace(
        weights, magnitudes={**weights.magnitudes, "q_proj": (m * 0 + MAX_SLOT_VALUE, mask)}
    )
    values = runner.prepare(big)  # the magnitudes pass; their scales are not computed yet
    with pytest.raises(AdapterError) as exc:
        runner.write_slot(1, values)
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "slot value dora_scale_qkv of layer 0" in str(exc.value) and "over the bound" in str(exc.value)
    assert not any(
        np.asarray(pool[1]).any() for pool in runner.pools.pools.layers[0].values() if pool.ndim == 3
    )
    runner.write_slot(1, runner.prepare(weights))
    for name, want in one_host[0].items():
        np.testing.assert_allclose(runner.pools.read(1)[0][name], want, rtol=1e-6, atol=1e-7, err_msg=name)
