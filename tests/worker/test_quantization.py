"""Weight-only int8 and int4 bases (``--quantization int8|int4``, models.quantization): the quantized linear is
"dequantize, then the same-dtype matmul"; adapters compute on ``x`` (their delta is the float base's);
quality against the unquantized model is reported and bounded; the engine serves a quantized base token for
token as the model computes it; checkpoints written by ``loraserve quantize`` load bit for bit, broken ones
are refused with the tensor named.

Quality (``bench/quality.py``'s comparison: 4 random prompts, 24 greedy steps, 100 next-token distributions,
f32) on the tiny random families: int8 top-1 agreement 0.95 (Llama) and mean KL 5e-5; int4 0.76 / 0.66
(Llama / Qwen3), KL 6e-3 / 1.1e-2 (its groups are 8 inputs wide on these 64-wide models). Tiny random
models have small top-2 margins (a flip needs ~0.05), so the bounds are 90 % (int8) and 60 % (int4).
"""

from __future__ import annotations

import dataclasses
import re
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loraserve.engine.config import EngineConfig
from loraserve.engine.request import EngineRequest, Finished, Sampling
from loraserve.models import decoder
from loraserve.models.checkpoint import load_checkpoint
from loraserve.models.quantization import (
    Int4Weight,
    Int8Weight,
    Quantized,
    int4_group,
    pack_int4,
    qlinear,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)
from loraserve.testing import save_model
from tests.engines import started_engine
from tests.platform import SUBPROCESS_JAX
from tests.worker.fake_engine import Collector
from tests.worker.test_model_parity import PROMPTS, STEPS, _hf, _reference, run_model


def test_int8_values_and_scales() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((48, 40)).astype(np.float32) * rng.uniform(0.01, 3, (48, 1)).astype(np.float32)
    w[5] = 0.0  # an all-zero row
    q, s = quantize_int8(w)
    assert q.dtype == np.int8 and s.dtype == np.float32 and np.abs(q).max() == 127
    np.testing.assert_allclose(s[:5], np.abs(w[:5]).max(axis=1) / 127, rtol=1e-7)
    assert s[5] == 1.0 and not q[5].any()
    assert (np.abs(q * s[:, None] - w) <= s[:, None] / 2 + 1e-7).all()  # rounding: half a step at most


@pytest.mark.parametrize(("dtype", "rtol"), [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_the_quantized_linear_is_dequantize_then_matmul(dtype, rtol) -> None:
    rng = np.random.default_rng(1)
    q, s = quantize_int8(rng.standard_normal((96, 64)).astype(np.float32))
    w = Int8Weight(jnp.asarray(q), jnp.asarray(s))
    x = jnp.asarray(rng.standard_normal((5, 64)), jnp.float32).astype(dtype)
    want = jnp.dot(x, w.dequantize(dtype).T, preferred_element_type=jnp.float32)
    got = qlinear(x, w)
    assert got.dtype == jnp.float32 and got.shape == (5, 96)
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(want), rtol=rtol, atol=rtol * float(jnp.abs(want).max())
    )


def test_int4_groups_values_scales_and_packing() -> None:
    """Group-wise symmetric int4: a scale per group of inputs, values in [-7, 7] within half a step of the
    weight, two a byte (element 2j in byte j's low nibble, 2j + 1 in its high one, each as q + 8)."""
    assert [int4_group(n) for n in (4096, 14336, 11008, 256, 64, 6)] == [128, 128, 32, 32, 8, 2]
    from loraserve.common.errors import FailedPrecondition

    with pytest.raises(FailedPrecondition, match="a projection with 63 inputs cannot"):
        int4_group(63)
    assert pack_int4(np.array([[-8, 7, 0, -1]])).tolist() == [[0xF0, 0x78]]
    rng = np.random.default_rng(0)
    w = rng.standard_normal((24, 256)).astype(np.float32) * rng.uniform(0.01, 3, (24, 1)).astype(np.float32)
    w[3, 32:64] = 0.0  # an all-zero group
    q, s = quantize_int4(w)
    assert q.dtype == np.uint8 and q.shape == (24, 128) and s.dtype == np.float32 and s.shape == (24, 8)
    values = unpack_int4(q)
    assert values.dtype == np.int8 and np.abs(values).max() == 7 and values.min() >= -7
    assert np.array_equal(pack_int4(values), q)  # the packing round-trips
    groups = w.reshape(24, 8, 32)
    np.testing.assert_allclose(s[0], np.abs(groups[0]).max(axis=1) / 7, rtol=1e-7)
    assert s[3, 1] == 1.0 and not values[3, 32:64].any()
    deq = np.asarray(Int4Weight(jnp.asarray(q), jnp.asarray(s)).dequantize())
    assert (np.abs(deq - w).reshape(24, 8, 32) <= s[:, :, None] / 2 + 1e-6).all()
    np.testing.assert_array_equal(np.asarray(unpack_int4(jnp.asarray(q))), values)  # jax unpacks the same


@pytest.mark.parametrize(("dtype", "rtol"), [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("rows", [5, 70])  # a decode step's rows (C++ kernel on a CPU), a prefill's (XLA)
def test_the_int4_linear_is_dequantize_then_matmul(dtype, rtol, rows) -> None:
    rng = np.random.default_rng(1)
    q, s = quantize_int4(rng.standard_normal((96, 256)).astype(np.float32))
    w = Int4Weight(jnp.asarray(q), jnp.asarray(s))
    assert w.shape == (96, 256) and w.group == 32
    x = jnp.asarray(rng.standard_normal((rows, 256)), jnp.float32).astype(dtype)
    want = jnp.dot(x, w.dequantize(dtype).T, preferred_element_type=jnp.float32)
    got = jax.jit(qlinear)(x, w)
    assert got.dtype == jnp.float32 and got.shape == (rows, 96)
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(want), rtol=rtol, atol=rtol * float(jnp.abs(want).max())
    )


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    return {name: save_model(root / name, name, seed=3) for name in ("llama", "qwen3")}


QUALITY = {  # quantization -> (least top-1 agreement, largest mean KL, largest |logit diff|)
    "int8": (0.9, 1e-3, 0.2),
    "int4": (0.6, 2e-2, 1.5),
}


def _bench_quality():
    """bench/quality.py's functions (the script the quality numbers in docs/worker.md come from)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "quality.py"
    spec = importlib.util.spec_from_file_location("bench_quality", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_quality_against_the_unquantized_model(tiny, family) -> None:
    """4 random prompts, 24 greedy steps of the unquantized model, each quantized model teacher-forced on
    them (``bench/quality.py``): 100 next-token distributions compared, the numbers printed."""
    quality = _bench_quality()
    prompts = np.random.default_rng(1).integers(3, 256, (4, 8)).astype(np.int32)
    full, fed = quality.run(load_checkpoint(str(tiny[family])), prompts, None, 24)
    for quantization, (least, most_kl, most_diff) in QUALITY.items():
        ck = load_checkpoint(str(tiny[family]), quantization=quantization)
        kind, stored = (Int8Weight, jnp.int8) if quantization == "int8" else (Int4Weight, jnp.uint8)
        assert ck.quantization == quantization and isinstance(ck.params["layers"][0]["wqkv"], kind)
        assert ck.params["layers"][0]["wqkv"].q.dtype == stored and ck.params["embed"].dtype == jnp.float32
        got = quality.compare(full, fed, quality.run(ck, prompts, fed, 24)[0])
        print(family, quantization, got)
        assert got["positions"] == 100
        assert got["top1_agreement"] >= least and got["mean_kl"] <= most_kl, got
        assert 1e-4 < got["max_abs_logit_diff"] < most_diff  # quantized (the logits moved), and not by much


def test_the_trained_quality_model_learns_the_repository_text(tmp_path) -> None:
    """``bench/quality.py --trained``'s pieces at a toy size: the corpus is this repository's own text, a
    byte-level Llama trained on its first 90 % for 40 steps learns something (its held-out loss well under
    a uniform guess's ln 256 = 5.55 nats), saves a checkpoint the worker's loader reads, and the held-out
    prompts are the text's own bytes; the comparison runs on it (the int8 model agrees on most positions)."""
    from pathlib import Path

    quality = _bench_quality()
    root = Path(__file__).resolve().parents[2]
    text = quality.corpus(root)
    assert len(text) > 1_000_000 and (root / "models" / "quantization.py").read_bytes() in text
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2)
    out = tmp_path / "trained"
    got = quality.train_byte_model(out, text, steps=40, batch=8, seq=64, **shape)
    assert got["held_out_loss"] < 4.0 and got["train_loss"] < 4.0, got
    ck = load_checkpoint(str(out))
    assert ck.config.vocab_size == 256 and ck.config.hidden_size == 64
    prompts = quality.held_out_prompts(text, 3, 16)
    held = text[len(text) * 9 // 10 :]
    assert prompts.shape == (3, 16) and bytes(prompts[1].astype(np.uint8)) in held
    full, fed = quality.run(ck, prompts, None, 8)
    result = quality.compare(
        full, fed, quality.run(load_checkpoint(str(out), quantization="int8"), prompts, fed, 8)[0]
    )
    assert result["positions"] == 27 and result["top1_agreement"] >= 0.8, result


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("family", ["llama", "gemma2"])  # gemma2 ties its head to the embedding
def test_a_quantized_head_is_its_dequantized_matrix(tiny, tmp_path, family, quantization) -> None:
    """``--quantize-lm-head``: the head is quantized as the projections are (int8 a scale per vocab row, int4
    per group of hidden inputs), the embedding stays float for the lookup (a tied model's too), and the
    model's logits are those of the same model with the head replaced by its dequantized matrix (f32, within
    1e-5 of the logits' scale: the head's product and its scaling round differently)."""
    path = tiny.get(family) or save_model(tmp_path / family, family, seed=3)
    ck = load_checkpoint(str(path), quantization=quantization, quantize_lm_head=True)
    head = ck.params["lm_head"]
    assert isinstance(head, Int8Weight if quantization == "int8" else Int4Weight)
    assert (
        head.shape == (ck.config.vocab_size, ck.config.hidden_size)
        and ck.params["embed"].dtype == jnp.float32
    )
    fp = load_checkpoint(str(path), quantization=quantization)
    np.testing.assert_array_equal(np.asarray(ck.params["embed"]), np.asarray(fp.params["embed"]))
    deq = dataclasses.replace(ck, params={**ck.params, "lm_head": head.dequantize(jnp.float32)})
    refs = [(list(p) + [5 + i for i in range(STEPS)], None) for p in PROMPTS]
    got, want = np.asarray(run_model(ck, refs, "float32")), np.asarray(run_model(deq, refs, "float32"))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    unquantized_head = np.asarray(run_model(fp, refs, "float32"))
    assert np.abs(unquantized_head - got).max() > 1e-4  # the head's quantization moved the logits


@pytest.mark.cpu_only(SUBPROCESS_JAX)
@pytest.mark.slow
def test_the_quality_script_compares_a_checkpoint_folder(tiny) -> None:
    """``bench/quality.py --model DIR`` (a user's trained checkpoint): the numbers its functions give in this
    process for the same prompts (random ids of ``--prompt-len``, seed 0), and the folder's own sizes."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from tests.conftest import with_test_xla_flags

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "bench/quality.py", "--model", str(tiny["llama"]), "--quantization", "int8",
         "--prompts", "3", "--prompt-len", "6", "--steps", "5"],
        cwd=root, env=with_test_xla_flags(), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    quality = _bench_quality()
    ck = load_checkpoint(str(tiny["llama"]))
    prompts = np.random.default_rng(0).integers(3, ck.config.vocab_size, (3, 6)).astype(np.int32)
    full, fed = quality.run(ck, prompts, None, 5)
    int8 = load_checkpoint(str(tiny["llama"]), quantization="int8")
    want = quality.compare(full, fed, quality.run(int8, prompts, fed, 5)[0])
    assert report["quality"] == {"int8": want} and want["positions"] == 18
    assert report["shape"] == str(tiny["llama"])
    assert report["model"] == {
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "vocab_size": 384,
    }


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_an_adapter_computes_on_x_whatever_the_base_weight(tiny, quantization) -> None:
    """A layer's q/k/v with a LoRA delta D(x) added: the delta a quantized base gets is the float base's (the
    adapter never sees the weight), up to the rounding of the add."""
    fp = load_checkpoint(str(tiny["llama"]))
    q8 = load_checkpoint(str(tiny["llama"]), quantization=quantization)
    cfg = fp.config
    rng = np.random.default_rng(2)
    h = jnp.asarray(rng.standard_normal((4, cfg.hidden_size)), jnp.float32)
    d = jnp.asarray(rng.standard_normal((cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size)) * 0.1, jnp.float32)

    def with_delta(y, x, ll, group, parallel, bias):
        return y + x @ d if group == "qkv" else y

    def plain(y, x, ll, group, parallel, bias):
        return y

    deltas = []
    for ck in (fp, q8):
        lp = ck.params["layers"][0]
        got = [
            jnp.concatenate([t.reshape(4, -1) for t in decoder._qkv(cfg, lp, {}, h, fn)], -1)
            for fn in (with_delta, plain)
        ]
        deltas.append(np.asarray(got[0] - got[1]))
    np.testing.assert_allclose(deltas[1], deltas[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("quantization", "head"), [("int8", False), ("int4", False), ("int8", True)])
def test_the_engine_serves_a_quantized_base_as_the_model_computes_it(tiny, quantization, head) -> None:
    path = tiny["llama"]
    config = EngineConfig(max_batch_size=4, max_seq_len=32, max_loras=1, max_lora_rank=8, prefill_chunk=4)
    ck = load_checkpoint(str(path), quantization=quantization, quantize_lm_head=head)
    assert ck.quantized_head is head
    with started_engine(ck, config, warmup=False) as engine:
        collectors = [Collector() for _ in PROMPTS]
        for p, c in zip(PROMPTS, collectors, strict=True):
            engine.submit(
                EngineRequest(uuid.uuid4().hex, "", list(p), Sampling(max_tokens=STEPS, ignore_eos=True), c)
            )
        for c in collectors:
            assert c.done.wait(120) and isinstance(c.end, Finished), c.end
    # the model run teacher-forced with the engine's own tokens picks each of them (f32: exact greedy)
    refs = [(list(p) + c.tokens, None) for p, c in zip(PROMPTS, collectors, strict=True)]
    got = run_model(ck, refs, "float32")
    for row, c in enumerate(collectors):
        assert np.argmax(got[row][:STEPS], axis=-1).tolist() == c.tokens


def test_an_unknown_quantization_is_refused(tiny) -> None:
    from loraserve.common.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="quantization must be one of"):
        load_checkpoint(str(tiny["llama"]), quantization="int3")


def test_the_planner_counts_int8_weights_as_loaded(tiny) -> None:
    """``loraserve plan --quantization int8``: the weights are the int8 checkpoint's bytes (projections at one
    byte, an f32 scale per channel, the rest in --dtype): about a quarter of f32's projections."""
    from loraserve.models import planner

    for family in ("llama", "qwen3"):
        ck = load_checkpoint(str(tiny[family]), quantization="int8")
        loaded = sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(ck.params))
        assert planner.weight_bytes(ck.config, 1, "float32", "int8") == loaded
    for family in ("llama", "gemma2"):  # --quantize-lm-head; gemma2 ties the head: its embedding stays beside
        root = tiny["llama"].parent
        path = tiny.get(family) or save_model(root / family, family, seed=3)
        ck = load_checkpoint(str(path), quantization="int8", quantize_lm_head=True)
        loaded = sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(ck.params))
        assert ck.quantized_head and planner.weight_bytes(ck.config, 1, "float32", "int8", True) == loaded
    _, cfg = planner.load_model_config("llama-3-8b")
    bf16, int8 = planner.weight_bytes(cfg, 1, "bfloat16"), planner.weight_bytes(cfg, 1, "bfloat16", "int8")
    head = planner.weight_bytes(cfg, 1, "bfloat16", "int8", quantize_lm_head=True)
    assert int8 - head == 128256 * 4096 - 4 * 128256  # its head: 2 bytes a value -> 1, plus a scale a row
    assert 0.55 < int8 / bf16 < 0.6  # 6.98B projection parameters at 1 byte, 1.05B embedding/head at 2
    # split over 2 devices (tests/worker/test_tensor_parallel.py serves it): each holds half the int8 values,
    # its column-parallel scales' half, the row-parallel scales whole
    split = planner.plan(
        "x", cfg, "v5e", 2, max_loras=4, max_lora_rank=8, batch=4, context=256, quantization="int8"
    )
    assert split.weights == planner.weight_bytes(cfg, 2, "bfloat16", "int8")
    assert 0.5 < split.weights / int8 < 0.501


def test_the_planner_counts_int4_weights_as_loaded(tiny) -> None:
    """``loraserve plan --quantization int4``: packed values at half a byte and an f32 scale per group of
    inputs (128 for Llama-3-8B: 1/32 byte a weight more), the rest in --dtype; a split that would cut a
    group is refused by name."""
    from loraserve.common.errors import FailedPrecondition
    from loraserve.models import planner

    for family in ("llama", "qwen3"):
        ck = load_checkpoint(str(tiny[family]), quantization="int4")
        loaded = sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(ck.params))
        assert planner.weight_bytes(ck.config, 1, "float32", "int4") == loaded
    _, cfg = planner.load_model_config("llama-3-8b")
    bf16 = planner.weight_bytes(cfg, 1, "bfloat16")
    int4 = planner.weight_bytes(cfg, 1, "bfloat16", "int4")
    projections = 6_979_321_856  # Llama-3-8B's q/k/v/o/gate/up/down parameters, 32 layers
    assert bf16 - int4 == projections * 2 - (projections // 2 + projections * 4 // 128)
    for tp in (2, 8):
        split = planner.plan(
            "x", cfg, "v5e", tp, max_loras=4, max_lora_rank=8, batch=4, context=256, quantization="int4"
        )
        assert split.weights == planner.weight_bytes(cfg, tp, "bfloat16", "int4")
    odd = dataclasses.replace(cfg, intermediate_size=384)  # groups of 16 (384 / 8 = 48 = 3 x 16)
    with pytest.raises(FailedPrecondition, match="down_proj's 384 inputs split into 24 per device"):
        planner.plan(
            "x", odd, "v5e", 16, max_loras=4, max_lora_rank=8, batch=4, context=256, quantization="int4"
        )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_cpu_int8_kernel_equals_xla_and_is_batch_invariant(dtype) -> None:
    """``kernels.cpu.linear_int8`` (a decode step's rows on a CPU) against XLA's int8 dot, over odd sizes that
    reach every tile and tail; a row's result is the same bits in a batch of 1, 3, 5 or 16 rows (bf16 on AMX
    tiles: of 1-2 rows, kept in registers, and of 3-16 on the tiles; ``cpu.quant_register_rows()``)."""
    from loraserve.kernels import cpu
    from loraserve.models import quantization as quant

    if not cpu.available():
        pytest.skip("the C++ kernels do not build here")
    rng = np.random.default_rng(3)
    for n, k in ((517, 1027), (8, 64), (3, 9)):
        q, s = quantize_int8(rng.standard_normal((n, k)).astype(np.float32))
        q, s = jnp.asarray(q), jnp.asarray(s)
        x = jnp.asarray(rng.standard_normal((16, k)), jnp.float32).astype(dtype)
        rows = {}
        for m in (1, 3, 5, 16):
            got = np.asarray(jax.jit(quant._kernel)(x[:m], q, s))
            want = np.asarray(quant._xla(x[:m], q, s))
            np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
            rows[m] = got[0]
        split = cpu.quant_register_rows() if dtype == jnp.bfloat16 else 0
        for m in (3, 5, 16):
            np.testing.assert_array_equal(rows[m], rows[1 if m <= split else 3])


@pytest.mark.parametrize(
    ("quantization", "tp", "head"),
    [("int8", 1, False), ("int8", 2, True), ("int4", 2, False), ("int4", 1, True)],
)
def test_plan_verify_compiles_a_quantized_decode_step_to_the_byte(
    quantization, tp, head, tmp_path, capsys
) -> None:
    """``plan --quantization int8|int4 --verify``: the compiled decode step's arguments are the estimate's
    quantized weights (and scales) + KV + pools + history + the step's small inputs, exactly; split over
    devices too (the values split like the weights, the scales with their rows or groups); with
    ``--quantize-lm-head`` the head at its quantized size."""
    import json

    from loraserve.cli import main

    small = {
        "model_type": "llama", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512,
        "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
    }  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(small))
    args = [
        "plan",
        "--model",
        str(path),
        "--chip",
        "v5e",
        "--batch",
        "8",
        "--context",
        "256",
        "--tp",
        str(tp),
    ]
    args += ["--max-loras", "4", "--max-lora-rank", "8", "--dtype", "float32", "--quantization", quantization]
    args += ["--quantize-lm-head"] if head else []
    assert main([*args, "--json", "--verify"]) == 0
    out = json.loads(capsys.readouterr().out)
    from loraserve.models import planner

    cfg = planner.load_model_config(str(path))[1]
    rows = 4096 // tp  # the head's vocab rows a device holds, f32 -> quantized (int4: groups of 32 here)
    saved = rows * 256 * 4 - planner.quantized_matrix_bytes(rows, 256, quantization)
    assert planner.weight_bytes(cfg, tp, "float32", quantization) - out["weights"] == (saved if head else 0)
    estimate = out["weights"] + out["kv_cache"] + out["lora_pools"] + out["sampling_history"]
    assert out["compiled"]["argument_bytes"] == estimate + out["compiled"]["small_input_bytes"]


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_dora_scales_on_a_quantized_base_use_its_dequantized_weight(tiny, quantization) -> None:
    """DoRA's norm is of the weight the model multiplies: on a quantized base, its dequantized values (inside
    the scale computation only: the base weights kept for DoRA stay quantized, which saves their memory)."""
    from loraserve.models.lora.dora_bias import magnitude_name, mask_name, scale_name
    from loraserve.models.lora.pools import _dora_scales_jit, base_weights

    ck = load_checkpoint(str(tiny["llama"]), quantization=quantization)
    base = base_weights(ck.params)
    assert isinstance(base[0]["qkv"], Int8Weight if quantization == "int8" else Int4Weight)  # no float copy
    cfg, r = ck.config, 4
    rng = np.random.default_rng(5)
    out = cfg.q_size + 2 * cfg.kv_size
    vals = {
        "A_qkv": rng.standard_normal((cfg.hidden_size, 3 * r)).astype(np.float32) * 0.1,
        "B_q": rng.standard_normal((r, cfg.q_size)).astype(np.float32) * 0.1,
        "B_k": rng.standard_normal((r, cfg.kv_size)).astype(np.float32) * 0.1,
        "B_v": rng.standard_normal((r, cfg.kv_size)).astype(np.float32) * 0.1,
        magnitude_name("qkv"): rng.uniform(0.5, 2.0, out).astype(np.float32),
        mask_name("qkv"): np.ones(out, np.float32),
    }
    got = _dora_scales_jit([vals], [{"qkv": base[0]["qkv"]}], shards=1)[0][scale_name("qkv")]
    dense = [{"qkv": base[0]["qkv"].dequantize()}]
    want = _dora_scales_jit([vals], dense, shards=1)[0][scale_name("qkv")]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not np.allclose(np.asarray(got), 1.0)  # a real scale


@pytest.mark.parametrize(
    ("family", "quantization", "head"),
    [
        ("llama", "int8", False),
        ("qwen3_moe", "int8", False),
        ("llama", "int4", False),
        ("llama", "int4", True),
        ("gemma2", "int8", True),  # ties its head to the embedding
    ],
)
def test_a_quantized_checkpoint_loads_the_same_weights_without_quantizing(
    tmp_path, family, quantization, head
) -> None:
    """``loraserve quantize SRC DST`` writes I8 projections with F32 ``_scale`` vectors (int8), or U8 packed
    int4 projections with F32 ``_scale [out, in / group]`` (int4) — attention's only on a mixture of experts
    — copies the rest in the checkpoint's dtype and the tokenizer; loading DST gives bit for bit the values
    and scales ``--quantization`` computes from SRC at start-up, and the same logits. ``--lm-head``: the head
    too (a tied model's written as ``lm_head.weight`` beside its float embedding), as ``--quantize-lm-head``
    quantizes it."""
    import json

    from safetensors import safe_open

    from loraserve.cli import main

    src = save_model(tmp_path / "src", family, seed=1)
    flags = ["--lm-head"] if head else []
    assert main(["quantize", str(src), str(tmp_path / "dst"), "--quantization", quantization, *flags]) == 0
    dst = tmp_path / "dst"
    written = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert written["quant_method"] == f"loraserve-{quantization}" and written["lm_head"] is head
    assert (dst / "tokenizer.json").exists()
    hidden = json.loads((src / "config.json").read_text())["hidden_size"]
    with safe_open(str(dst / "model.safetensors"), "np") as f:
        keys = set(f.keys())
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        scale = f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale")
    assert scale.dtype == np.float32
    if quantization == "int8":
        assert q.dtype == np.int8 and scale.shape == (q.shape[0],)
    else:
        assert q.dtype == np.uint8 and q.shape[1] == hidden // 2
        assert scale.shape == (q.shape[0], hidden // int4_group(hidden)) and written["bits"] == 4
    assert "model.layers.1.self_attn.o_proj.weight_scale" in keys
    assert ("model.layers.0.mlp.down_proj.weight_scale" in keys) == (family != "qwen3_moe")
    assert ("lm_head.weight_scale" in keys) is head and "model.embed_tokens.weight_scale" not in keys
    made = load_checkpoint(str(src), quantization=quantization, quantize_lm_head=head)
    loaded = load_checkpoint(str(dst))  # quantized whatever --quantization says: the checkpoint is
    assert loaded.quantization == quantization and loaded.quantized_head is made.quantized_head is head
    if head:
        for part in ("q", "scale"):
            want, got = (np.asarray(getattr(c.params["lm_head"], part)) for c in (made, loaded))
            np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(np.asarray(loaded.params["embed"]), np.asarray(made.params["embed"]))
    for a, b in zip(made.params["layers"], loaded.params["layers"], strict=True):
        assert a.keys() == b.keys()
        for key in a:
            if isinstance(a[key], Quantized):
                assert type(a[key]) is type(b[key])
                np.testing.assert_array_equal(np.asarray(a[key].q), np.asarray(b[key].q))
                np.testing.assert_array_equal(np.asarray(a[key].scale), np.asarray(b[key].scale))
            else:
                np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]))
    refs = _reference(_hf(src))
    np.testing.assert_array_equal(run_model(loaded, refs, "float32"), run_model(made, refs, "float32"))


def _edit(folder, fn) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(folder / "model.safetensors"))


SCALE = "model.layers.1.self_attn.k_proj.weight_scale"
UP = "model.layers.0.mlp.up_proj.weight"
BAD_CHECKPOINTS = {  # name -> (edit, the message's start; {q}: the quantization, {stored}: its values' dtype)
    "a-missing-scale": (lambda t: t.pop(SCALE), f"checkpoint lacks tensor {SCALE}"),
    "a-mis-shaped-scale": (lambda t: t.update({SCALE: t[SCALE][:-1]}), f"tensor {SCALE} has shape"),
    "a-nan-scale": (lambda t: t[SCALE].__setitem__(0, np.nan), f"tensor {SCALE} holds a scale that is not finite"),
    "a-zero-scale": (lambda t: t[SCALE].__setitem__(0, 0.0), f"tensor {SCALE} holds a scale that is not finite"),
    "a-float-projection": (
        lambda t: t.update({UP: t[UP].astype(np.float32)}),
        "tensor " + UP + " is float32 of shape ({rows}, {cols}); an {q} checkpoint stores it as a 2-d {stored} matrix",
    ),
    "a-mis-packed-projection": (
        lambda t: t.update({UP: t[UP][:, :-2]}), "tensor " + UP + "_scale has shape ({rows}, ",
    ),
    "a-stray-scale": (
        lambda t: t.update({"model.norm.weight_scale": np.ones(1, np.float32)}),
        "tensor model.norm.weight_scale scales no {q} projection",
    ),
}  # fmt: skip


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("name", list(BAD_CHECKPOINTS))
def test_a_broken_quantized_checkpoint_is_refused_naming_the_tensor(
    tiny, tmp_path, name, quantization
) -> None:
    from loraserve.models.checkpoint import CheckpointError
    from loraserve.worker.quantize_cmd import quantize_checkpoint

    quantize_checkpoint(str(tiny["llama"]), str(tmp_path / "q"), quantization)
    edit, message = BAD_CHECKPOINTS[name]
    shapes = {}
    _edit(tmp_path / "q", lambda t: shapes.update(up=t[UP].shape) or edit(t))
    stored = "int8" if quantization == "int8" else "uint8"
    rows, cols = shapes["up"]
    if name == "a-mis-packed-projection" and quantization == "int8":
        message = "tensor " + UP + " has shape"  # int8: the values' shape is the weight's
    message = message.format(q=quantization, stored=stored, rows=rows, cols=cols)
    with pytest.raises(CheckpointError, match="^" + re.escape(message)) as err:
        load_checkpoint(str(tmp_path / "q"))
    assert err.value.code.name == "INVALID_ARGUMENT"


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda t: t.pop("lm_head.weight_scale"), "checkpoint lacks tensor lm_head.weight_scale"),
        (
            lambda t: t["lm_head.weight_scale"].__setitem__(3, np.inf),
            "tensor lm_head.weight_scale holds a scale",
        ),
        (lambda t: t.pop("lm_head.weight"), "checkpoint lacks tensor lm_head.weight (its config says"),
    ],
)
def test_a_broken_quantized_head_is_refused_naming_the_tensor(tiny, tmp_path, edit, message) -> None:
    """A ``--lm-head`` checkpoint whose head lacks its scales, holds a non-finite one, or lacks the head."""
    from loraserve.models.checkpoint import CheckpointError
    from loraserve.worker.quantize_cmd import quantize_checkpoint

    quantize_checkpoint(str(tiny["llama"]), str(tmp_path / "q"), "int8", lm_head=True)
    _edit(tmp_path / "q", edit)
    with pytest.raises(CheckpointError, match="^" + re.escape(message)):
        load_checkpoint(str(tmp_path / "q"))


def test_quantize_lm_head_needs_a_quantization(tiny) -> None:
    from loraserve.common.errors import FailedPrecondition
    from loraserve.models import planner

    with pytest.raises(FailedPrecondition, match="--quantize-lm-head needs --quantization int8 or int4"):
        load_checkpoint(str(tiny["llama"]), quantize_lm_head=True)
    cfg = load_checkpoint(str(tiny["llama"])).config
    with pytest.raises(FailedPrecondition, match="--quantize-lm-head needs --quantization int8 or int4"):
        planner.plan(
            "x", cfg, "v5e", 1, max_loras=1, max_lora_rank=8, batch=1, context=64, quantize_lm_head=True
        )


def test_quantize_refuses_what_it_cannot_write(tiny, tmp_path) -> None:
    from loraserve.cli import main

    assert main(["quantize", str(tiny["llama"]), str(tmp_path / "q")]) == 0
    assert main(["quantize", str(tmp_path / "q"), str(tmp_path / "again")]) == 1  # already quantized
    assert main(["quantize", str(tiny["llama"]), str(tmp_path / "q")]) == 1  # DST holds a checkpoint


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_quantized_decode_step_lowers_for_tpu(monkeypatch, quantization) -> None:
    """Llama-3-8B's decode step (2 layers, bf16 activations, abstract: nothing allocated) over int8 or int4
    projections with the pallas LoRA backend, exported for TPU from this CPU: the projections are XLA's dot
    (int8: on the int8 values; int4: on the weight dequantized from its nibbles), never the CPU kernels."""

    from loraserve.kernels import pallas
    from loraserve.kernels.backends import get_backend
    from loraserve.models import planner
    from tests.worker.test_adapter_ops import _abstract, export_decode_for_tpu

    monkeypatch.setattr(pallas, "default_interpret", lambda: False)
    _, full = planner.load_model_config("llama-3-8b")
    cfg = dataclasses.replace(full, num_layers=2)
    backend = get_backend("pallas")
    params, pools = _abstract(cfg, backend)
    sds = jax.ShapeDtypeStruct
    for layer in params["layers"]:
        for key in ("wqkv", "wo", "w_gate_up", "w_down"):
            out, inputs = layer[key].shape
            if quantization == "int8":
                layer[key] = Int8Weight(sds((out, inputs), jnp.int8), sds((out,), jnp.float32))
            else:
                groups = inputs // int4_group(inputs)
                layer[key] = Int4Weight(sds((out, inputs // 2), jnp.uint8), sds((out, groups), jnp.float32))
    exported, _ = export_decode_for_tpu(cfg, backend, params, pools)
    mlir = exported.mlir_module()
    assert exported.platforms == ("tpu",) and "loraserve_linear" not in mlir
    assert mlir.count("tpu_custom_call") >= 4 * cfg.num_layers  # the LoRA kernels
    if quantization == "int8":
        assert "tensor<4096x4096xi8>" in mlir  # wo's int8 values reach the dot as they are
    else:
        assert "tensor<4096x2048xui8>" in mlir and "tensor<4096x32xf32>" in mlir  # wo's nibbles and scales
