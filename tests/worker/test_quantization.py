"""Weight-only int8 bases (``--quantization int8``, worker.quant): the quantized linear is "dequantize, then the
same-dtype matmul"; adapters compute on ``x`` (their delta is the float base's); quality against the
unquantized model is reported and bounded; the engine serves an int8 base token for token as the model
computes it; what int8 cannot do yet is refused by name.

Measured on the tiny families (prefill + 20 greedy steps of 3 prompts, 63 next-token distributions): top-1
agreement with the unquantized model 62/63 (Llama), 60/63 (Qwen3), 63/63 (Gemma 2) in f32; mean KL
5.5e-5, 6.7e-5, 4.1e-5; max |logit diff| <= 0.064. Tiny random models have small top-2 margins (a flip
needs only ~0.05), so the bound here is 90 % and KL <= 1e-3.
"""

from __future__ import annotations

import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loraserve.testing import save_model
from loraserve.worker import model as M
from loraserve.worker.checkpoint import load_checkpoint
from loraserve.worker.config import EngineConfig
from loraserve.worker.quant import Int8Weight, qlinear, quantize_int8
from loraserve.worker.requests import EngineRequest, Finished, Sampling
from tests.engines import started_engine
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


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    return {name: save_model(root / name, name, seed=3) for name in ("llama", "qwen3")}


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_quality_against_the_unquantized_model(tiny, family) -> None:
    refs = _reference(_hf(tiny[family]))
    full = run_model(load_checkpoint(str(tiny[family])), refs, "float32")
    ck = load_checkpoint(str(tiny[family]), quantization="int8")
    assert ck.quantization == "int8" and isinstance(ck.params["layers"][0]["wqkv"], Int8Weight)
    assert ck.params["layers"][0]["wqkv"].q.dtype == jnp.int8 and ck.params["embed"].dtype == jnp.float32
    int8 = run_model(ck, refs, "float32")
    agree = sum(int((np.argmax(a, -1) == np.argmax(b, -1)).sum()) for a, b in zip(full, int8, strict=True))
    total = sum(a.shape[0] for a in full)
    kl = np.mean(
        [
            np.sum(np.exp(la) * (la - lb), axis=-1).mean()
            for la, lb in (
                (jax.nn.log_softmax(a, -1), jax.nn.log_softmax(b, -1))
                for a, b in zip(full, int8, strict=True)
            )
        ]
    )
    diff = max(float(np.abs(a - b).max()) for a, b in zip(full, int8, strict=True))
    assert agree >= 0.9 * total and kl <= 1e-3, (agree, total, kl)
    assert 1e-4 < diff < 0.2  # quantized (the logits moved), and not by much


def test_an_adapter_computes_on_x_whatever_the_base_weight(tiny) -> None:
    """A layer's q/k/v with a LoRA delta D(x) added: the delta the int8 base gets is the float base's (the
    adapter never sees the weight), up to the rounding of the add."""
    fp, q8 = load_checkpoint(str(tiny["llama"])), load_checkpoint(str(tiny["llama"]), quantization="int8")
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
            jnp.concatenate([t.reshape(4, -1) for t in M._qkv(cfg, lp, {}, h, fn)], -1)
            for fn in (with_delta, plain)
        ]
        deltas.append(np.asarray(got[0] - got[1]))
    np.testing.assert_allclose(deltas[1], deltas[0], atol=1e-5, rtol=1e-5)


def test_the_engine_serves_an_int8_base_as_the_model_computes_it(tiny) -> None:
    path = tiny["llama"]
    config = EngineConfig(max_batch_size=4, max_seq_len=32, max_loras=1, max_lora_rank=8, prefill_chunk=4)
    ck = load_checkpoint(str(path), quantization="int8")
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
    from loraserve.worker import planner

    for family in ("llama", "qwen3"):
        ck = load_checkpoint(str(tiny[family]), quantization="int8")
        loaded = sum(np.asarray(leaf).nbytes for leaf in jax.tree.leaves(ck.params))
        assert planner.weight_bytes(ck.config, 1, "float32", "int8") == loaded
    _, cfg = planner.load_model_config("llama-3-8b")
    bf16, int8 = planner.weight_bytes(cfg, 1, "bfloat16"), planner.weight_bytes(cfg, 1, "bfloat16", "int8")
    assert 0.55 < int8 / bf16 < 0.6  # 6.98B projection parameters at 1 byte, 1.05B embedding/head at 2
    # split over 2 devices (tests/worker/test_tensor_parallel.py serves it): each holds half the int8 values,
    # its column-parallel scales' half, the row-parallel scales whole
    split = planner.plan(
        "x", cfg, "v5e", 2, max_loras=4, max_lora_rank=8, batch=4, context=256, quantization="int8"
    )
    assert split.weights == planner.weight_bytes(cfg, 2, "bfloat16", "int8")
    assert 0.5 < split.weights / int8 < 0.501


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_the_cpu_int8_kernel_equals_xla_and_is_batch_invariant(dtype) -> None:
    """``kernels.cpu.linear_int8`` (a decode step's rows on a CPU) against XLA's int8 dot, over odd sizes that
    reach every tile and tail; a row's result is the same bits in a batch of 1, 3, 5 or 16 rows."""
    from loraserve.kernels import cpu
    from loraserve.worker import quant

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
        for m in (3, 5, 16):
            np.testing.assert_array_equal(rows[m], rows[1])


@pytest.mark.parametrize("tp", [1, 2])
def test_plan_verify_compiles_an_int8_decode_step_to_the_byte(tp, tmp_path, capsys) -> None:
    """``plan --quantization int8 --verify``: the compiled decode step's arguments are the estimate's int8
    weights (and scales) + KV + pools + history + the step's small inputs, exactly; split over devices too
    (the int8 values split like the weights, the scales with their rows)."""
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
    args += ["--max-loras", "4", "--max-lora-rank", "8", "--dtype", "float32", "--quantization", "int8"]
    assert main([*args, "--json", "--verify"]) == 0
    out = json.loads(capsys.readouterr().out)
    estimate = out["weights"] + out["kv_cache"] + out["lora_pools"] + out["sampling_history"]
    assert out["compiled"]["argument_bytes"] == estimate + out["compiled"]["small_input_bytes"]


def test_dora_scales_on_an_int8_base_use_its_dequantized_weight(tiny) -> None:
    """DoRA's norm is of the weight the model multiplies: on an int8 base, ``q * s`` (dequantized inside the
    scale computation only: the base weights kept for DoRA stay int8, so int8 still saves their memory)."""
    from loraserve.worker.dora import magnitude_name, mask_name, scale_name
    from loraserve.worker.slot_pools import _dora_scales_jit, base_weights

    ck = load_checkpoint(str(tiny["llama"]), quantization="int8")
    base = base_weights(ck.params)
    assert isinstance(base[0]["qkv"], Int8Weight)  # no float copy held
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


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_a_quantized_checkpoint_loads_the_same_int8_weights_without_quantizing(tmp_path, family) -> None:
    """``loraserve quantize SRC DST`` writes I8 projections with F32 ``_scale`` vectors (attention's only on a
    mixture of experts), copies the rest in the checkpoint's dtype and the tokenizer; loading DST gives
    bit for bit the int8 values and scales ``--quantization int8`` computes from SRC at start-up, and the
    same logits."""
    import json

    from safetensors import safe_open

    from loraserve.cli import main

    src = save_model(tmp_path / "src", family, seed=1)
    assert main(["quantize", str(src), str(tmp_path / "dst")]) == 0
    dst = tmp_path / "dst"
    assert (
        json.loads((dst / "config.json").read_text())["quantization_config"]["quant_method"]
        == "loraserve-int8"
    )
    assert (dst / "tokenizer.json").exists()
    with safe_open(str(dst / "model.safetensors"), "np") as f:
        keys = set(f.keys())
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight").dtype == np.int8
        assert f.get_tensor("model.layers.0.self_attn.q_proj.weight_scale").dtype == np.float32
    assert "model.layers.1.self_attn.o_proj.weight_scale" in keys
    assert ("model.layers.0.mlp.down_proj.weight_scale" in keys) == (family == "llama")
    made = load_checkpoint(str(src), quantization="int8")
    loaded = load_checkpoint(str(dst))  # int8 whatever --quantization says: the checkpoint is
    assert loaded.quantization == "int8"
    for a, b in zip(made.params["layers"], loaded.params["layers"], strict=True):
        assert a.keys() == b.keys()
        for key in a:
            if isinstance(a[key], Int8Weight):
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
BAD_CHECKPOINTS = {
    "a-missing-scale": (lambda t: t.pop(SCALE), f"lacks tensor {SCALE}"),
    "a-mis-shaped-scale": (lambda t: t.update({SCALE: t[SCALE][:-1]}), f"tensor {SCALE} has shape"),
    "a-nan-scale": (lambda t: t[SCALE].__setitem__(0, np.nan), f"tensor {SCALE} holds a scale that is not finite"),
    "a-zero-scale": (lambda t: t[SCALE].__setitem__(0, 0.0), f"tensor {SCALE} holds a scale that is not finite"),
    "a-float-projection": (
        lambda t: t.update({"model.layers.0.mlp.up_proj.weight": t["model.layers.0.mlp.up_proj.weight"].astype(np.float32)}),
        "model.layers.0.mlp.up_proj.weight is float32; a quantized checkpoint stores it as int8",
    ),
    "a-stray-scale": (
        lambda t: t.update({"model.norm.weight_scale": np.ones(1, np.float32)}), "model.norm.weight_scale scales no"
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BAD_CHECKPOINTS))
def test_a_broken_quantized_checkpoint_is_refused_naming_the_tensor(tiny, tmp_path, name) -> None:
    from loraserve.worker.checkpoint import CheckpointError
    from loraserve.worker.quantize_cmd import quantize_checkpoint

    quantize_checkpoint(str(tiny["llama"]), str(tmp_path / "q"))
    edit, message = BAD_CHECKPOINTS[name]
    _edit(tmp_path / "q", edit)
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(")) as err:
        load_checkpoint(str(tmp_path / "q"))
    assert err.value.code.name == "INVALID_ARGUMENT"


def test_quantize_refuses_what_it_cannot_write(tiny, tmp_path) -> None:
    from loraserve.cli import main

    assert main(["quantize", str(tiny["llama"]), str(tmp_path / "q")]) == 0
    assert main(["quantize", str(tmp_path / "q"), str(tmp_path / "again")]) == 1  # already quantized
    assert main(["quantize", str(tiny["llama"]), str(tmp_path / "q")]) == 1  # DST holds a checkpoint
