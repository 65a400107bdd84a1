"""Qwen3, Gemma 2 and Gemma 3 text: the config fields read from ``config.json`` (5.x and 4.x layouts), a
family as a module of its own (``models.families``), the refusals naming what is not served, and that every
family feature really shapes the logits.

The parity itself (logits and greedy tokens vs transformers, f32 and bf16; PEFT with mixed adapters) is
in test_model_parity.py and test_lora_parity.py; the last test here shows each feature the families
add moves the logits far beyond those tests' f32 tolerance (2e-4) when switched off, so the parity
tests would catch it missing or wrong.
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from loraserve.cli import main as cli_main
from loraserve.kernels import XlaGroupedBackend
from loraserve.models import decoder
from loraserve.models.checkpoint import load_checkpoint
from loraserve.models.config import (
    FULL,
    SLIDING,
    SUPPORTED_MODEL_TYPES,
    ModelConfig,
    UnsupportedModelError,
)
from loraserve.models.lora import layout
from tests.worker.model_steps import ModelSteps

PROMPT = [300, 200, 100, 50, 25, 12, 6, 3, 9, 11, 40]  # longer than every sliding window (4, 5)


def test_saved_configs_are_read(model_dirs) -> None:
    q3 = load_checkpoint(str(model_dirs["qwen3"]))
    c = q3.config
    assert (c.head_dim, c.q_size, c.qk_norm, c.qkv_bias, c.gemma_norm, c.embed_scale) == (
        24,
        96,
        True,
        False,
        False,
        None,
    )
    assert (c.sliding_window, c.layer_types) == (5, (FULL, SLIDING, SLIDING))  # max_window_layers=1
    assert q3.params["layers"][0]["q_norm"].shape == (24,) and "post_attn_norm" not in q3.params["layers"][0]
    g2 = load_checkpoint(str(model_dirs["gemma2"]))
    c = g2.config
    assert (c.hidden_act, c.gemma_norm, c.sandwich_norms, c.qk_norm) == (
        "gelu_pytorch_tanh",
        True,
        True,
        False,
    )
    assert (c.attn_logit_softcap, c.final_logit_softcap, c.embed_scale) == (1.0, 2.5, 8.0)
    assert c.attn_scale == 24**-0.5 and c.tie_word_embeddings and "lm_head" not in g2.params
    assert (c.sliding_window, c.layer_types) == (4, (SLIDING, FULL, SLIDING))  # transformers' default rule
    assert set(g2.params["layers"][1]) >= {"attn_norm", "post_attn_norm", "mlp_norm", "post_mlp_norm"}
    g3 = load_checkpoint(str(model_dirs["gemma3_text"]))
    c = g3.config
    assert (c.qk_norm, c.sandwich_norms, c.attn_logit_softcap, c.final_logit_softcap) == (
        True,
        True,
        None,
        None,
    )
    assert (c.num_kv_heads, c.head_dim, c.attn_scale) == (1, 32, 48**-0.5)
    assert (c.rope_theta, c.rope_scaling["rope_type"], c.rope_scaling["factor"]) == (1000.0, "linear", 4.0)
    assert (c.local_rope_theta, c.local_rope_scaling) == (50.0, None)
    inv = c.inv_freq()  # two tables: global (linear-scaled, base 1000) and local (base 50)
    assert inv.shape == (2, 16)
    np.testing.assert_allclose(inv[0], 1000.0 ** -(np.arange(0, 32, 2) / 32) / 4.0, rtol=1e-12)
    np.testing.assert_allclose(inv[1], 50.0 ** -(np.arange(0, 32, 2) / 32), rtol=1e-12)
    assert [c.is_sliding(n) for n in range(3)] == [True, False, True]
    llama = load_checkpoint(str(model_dirs["llama"])).config  # the defaults keep Llama as it was
    assert (llama.sliding_window, llama.layer_types, llama.inv_freq().shape) == (None, (), (8,))
    mistral = load_checkpoint(str(model_dirs["mistral"])).config  # its 4096 window, on every layer
    assert (mistral.sliding_window, mistral.layer_types) == (4096, (SLIDING, SLIDING))


BASE = dict(vocab_size=384, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_hidden_layers=6)


def test_soft_capped_test_models_are_references_in_every_transformers(model_dirs) -> None:
    """transformers before 5.2x loads Gemma 2 with sdpa by default, which drops the attention soft-cap without
    a word (the chip's host had 5.17: every Gemma 2 parity test 0.03-0.28 off while the chip and XLA:CPU
    agreed to 5e-5). A soft-capped test model says ``attn_implementation: eager`` in its config.json, so the
    reference is the soft-capped maths whatever version computes it; the others leave the default."""
    from transformers import AutoModelForCausalLM

    for family, path in model_dirs.items():
        saved = json.loads((path / "config.json").read_text())
        soft_capped = bool(saved.get("attn_logit_softcapping"))
        assert saved.get("attn_implementation") == ("eager" if soft_capped else None), family
    reference = AutoModelForCausalLM.from_pretrained(str(model_dirs["gemma2"]))
    assert reference.config._attn_implementation == "eager"


def test_transformers_4x_configs() -> None:
    """Configs saved by transformers 4.x: no layer_types, rope_theta/rope_scaling at the top, Gemma 3's
    sliding_window_pattern and rope_local_base_freq, Qwen's use_sliding_window flag."""
    g3 = ModelConfig.from_hf(
        dict(
            BASE,
            model_type="gemma3_text",
            hidden_activation="gelu_pytorch_tanh",
            sliding_window=512,
            sliding_window_pattern=3,
            rope_theta=1e6,
            rope_local_base_freq=1e4,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
        )
    )
    assert g3.layer_types == (SLIDING, SLIDING, FULL) * 2 and g3.sliding_window == 512
    assert (g3.rope_theta, g3.rope_scaling, g3.local_rope_theta, g3.local_rope_scaling) == (
        1e6,
        {"rope_type": "linear", "factor": 8.0},
        1e4,
        None,
    )
    assert g3.query_pre_attn_scalar == 256 and g3.embed_scale == math.sqrt(64) and g3.tie_word_embeddings
    g2 = ModelConfig.from_hf(
        dict(BASE, model_type="gemma2", hidden_act="gelu_pytorch_tanh", sliding_window=4096)
    )
    assert g2.layer_types == (SLIDING, FULL) * 3 and g2.attn_logit_softcap is None  # absent: not capped
    assert g2.inv_freq().shape == (8,)  # one RoPE table
    off = ModelConfig.from_hf(dict(BASE, model_type="qwen3", sliding_window=4096, use_sliding_window=False))
    assert (off.sliding_window, off.layer_types) == (None, ())
    on = ModelConfig.from_hf(
        dict(BASE, model_type="qwen2", sliding_window=64, use_sliding_window=True, max_window_layers=4)
    )
    assert on.layer_types == (FULL,) * 4 + (SLIDING,) * 2 and on.qkv_bias


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        (dict(model_type="gemma"), ["'gemma'", "supported: " + ", ".join(SUPPORTED_MODEL_TYPES)]),
        (dict(model_type="phi3"), ["'phi3'", "gemma2", "gemma3_text", "qwen3"]),
        (dict(model_type="gemma2", hidden_activation="gelu"), ["gemma2", "'gelu'", "gelu_pytorch_tanh"]),
        (dict(model_type="qwen3", hidden_act="relu"), ["qwen3", "'relu'", "silu"]),
        (
            dict(model_type="qwen3", rope_parameters={"rope_type": "yarn", "factor": 4.0}),
            ["'yarn'", "llama3"],
        ),
        (
            dict(model_type="gemma3_text", rope_parameters={"full_attention": {"rope_type": "dynamic"}}),
            ["'dynamic'"],
        ),
        (dict(model_type="gemma3_text", use_bidirectional_attention=True), ["gemma3_text", "bidirectional"]),
        (
            dict(model_type="gemma2", sliding_window=8, layer_types=["chunked_attention"] * 6),
            ["chunked_attention"],
        ),
    ],
)
def test_unsupported_is_refused_naming_it(overrides, words) -> None:
    with pytest.raises(UnsupportedModelError) as err:
        ModelConfig.from_hf(dict(BASE, **overrides))
    for w in words:
        assert w in str(err.value)
    assert err.value.code_name == "FAILED_PRECONDITION"


def test_worker_refuses_an_unsupported_architecture_at_start(tmp_path, capsys) -> None:
    (tmp_path / "config.json").write_text(json.dumps(dict(BASE, model_type="phi3")))
    assert cli_main(["worker", "--model", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert (
        err
        == f"error: FAILED_PRECONDITION: model_type 'phi3' is not served; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
    )


def _prefill_last_logits(ck, cfg: ModelConfig) -> np.ndarray:
    backend = XlaGroupedBackend()
    cache = decoder.init_cache(cfg, 2, 16, jnp.float32)  # the null page and one page of 16
    tokens = np.zeros(16, np.int32)
    tokens[: len(PROMPT)] = PROMPT
    steps = ModelSteps(cfg, backend, ck.params, layout.empty_lora(cfg, 1, 4, jnp.float32, backend), cache)
    return np.asarray(steps.prefill_one(tokens, len(PROMPT), 0, -1, np.array([1], np.int32)))


OFF = {  # family -> feature switched off in our config only (the weights stay)
    "qwen3": dict(qk_norm=False, sliding_window=None),
    "gemma2": dict(
        gemma_norm=False,
        sandwich_norms=False,
        embed_scale=None,
        hidden_act="silu",
        query_pre_attn_scalar=None,
        attn_logit_softcap=None,
        final_logit_softcap=None,
        sliding_window=None,
    ),
    "gemma3_text": dict(qk_norm=False, local_rope_theta=None, rope_scaling=None, sliding_window=None),
}


@pytest.mark.parametrize(("family", "feature"), [(f, k) for f, kw in OFF.items() for k in kw])
def test_each_feature_moves_the_logits(model_dirs, family: str, feature: str) -> None:
    from transformers import AutoModelForCausalLM

    ck = load_checkpoint(str(model_dirs[family]))
    hf = AutoModelForCausalLM.from_pretrained(str(model_dirs[family])).eval()
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0, -1].numpy()
    np.testing.assert_allclose(_prefill_last_logits(ck, ck.config), want, atol=2e-4)
    wrong = _prefill_last_logits(ck, dataclasses.replace(ck.config, **{feature: OFF[family][feature]}))
    assert np.abs(wrong - want).max() > 1e-2, feature


def test_engine_serves_gemma3_like_transformers_generates(model_dirs, family_adapter_dirs) -> None:
    """The whole worker path (runner, its two RoPE tables, slots, scheduler) on Gemma 3: greedy tokens of
    the base model and of an adapter, served concurrently, equal transformers' / peft's own greedy generate."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from loraserve.engine.config import EngineConfig
    from loraserve.engine.request import EngineRequest, Sampling
    from tests.engines import started_engine
    from tests.worker.fake_engine import Collector

    path, adapter = model_dirs["gemma3_text"], family_adapter_dirs("gemma3_text")["all-r4"]
    steps = 16
    want = {}
    for name in ("", "all-r4"):
        hf = AutoModelForCausalLM.from_pretrained(str(path)).eval()
        hf = hf if not name else PeftModel.from_pretrained(hf, str(adapter)).eval()
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([PROMPT]), max_new_tokens=steps, min_new_tokens=steps, do_sample=False
            )
        want[name] = out[0, len(PROMPT) :].tolist()
    assert want[""] != want["all-r4"]
    config = EngineConfig(max_batch_size=2, max_seq_len=64, max_loras=1, max_lora_rank=16)
    with started_engine(path, config, {"all-r4": adapter}, warmup=False) as engine:
        got = {}
        for name in want:
            got[name] = Collector()
            sampling = Sampling(max_tokens=steps, ignore_eos=True)
            engine.submit(EngineRequest(f"r{len(got)}", name, list(PROMPT), sampling, got[name]))
        for c in got.values():
            assert c.done.wait(120), "request did not finish"
    assert {name: c.tokens for name, c in got.items()} == want


def test_every_family_is_a_module_of_its_own_and_a_new_one_is_a_new_module(monkeypatch) -> None:
    """models/families holds one module per family, each listed once under its model_type; a new architecture
    is one more module (here a made-up one: Llama's reading plus a q/k norm), with nothing else to edit."""
    import importlib
    import pkgutil
    import types

    from loraserve.models import families
    from loraserve.models.families import rules

    modules = {m.name for m in pkgutil.iter_modules(families.__path__)} - {"rules"}
    assert {f.__name__.rsplit(".", 1)[1] for f in families.FAMILIES.values()} == modules
    assert tuple(families.FAMILIES) == SUPPORTED_MODEL_TYPES
    for name in modules:
        module = importlib.import_module(f"loraserve.models.families.{name}")
        assert name == module.MODEL_TYPE and module.__doc__ and callable(module.fields)

    newcomer = types.ModuleType("newcomer", "A made-up family: Llama with a q/k norm.")
    newcomer.MODEL_TYPE = "newcomer"
    newcomer.fields = lambda cfg, layers: {"qk_norm": True, **rules.sliding(cfg, layers, rules.every_layer)}
    monkeypatch.setitem(families.FAMILIES, "newcomer", newcomer)
    cfg = dict(
        model_type="newcomer",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
    )
    got = ModelConfig.from_hf(cfg)
    llama = ModelConfig.from_hf({**cfg, "model_type": "llama"})
    assert got == dataclasses.replace(llama, model_type="newcomer", qk_norm=True)
