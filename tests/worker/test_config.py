"""Frozen configs read defaults < environment < flags, for the worker, registry and router alike; the
worker's ``auto`` dtype and context resolve against the checkpoint's config.json."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import typing
from dataclasses import replace

import pytest

from loraserve.common.config import ConfigError
from loraserve.engine.config import (
    AUTO_MAX_SEQ_LEN,
    DTYPES,
    MATMUL_PRECISIONS,
    EngineConfig,
    resolve_engine_config,
)
from loraserve.models.checkpoint import read_config
from loraserve.registry.config import RegistryConfig
from loraserve.router.config import RouterConfig
from loraserve.worker.config import WorkerConfig


def test_precedence_and_types() -> None:
    env = {"LORASERVE_WORKER_PORT": "7001", "LORASERVE_WORKER_MAX_LORAS": "9", "LORASERVE_WORKER_MODEL": "/m"}
    cfg = WorkerConfig.from_env(env, max_loras=3, model=None)
    assert (cfg.port, cfg.max_loras, cfg.model) == (7001, 3, "/m")  # flag beats env, None means "not given"
    assert cfg.engine_config().max_loras == 3
    assert (
        RegistryConfig.from_env(
            {"LORASERVE_REGISTRY_MIGRATE": "false", "LORASERVE_REGISTRY_LEASE_SECONDS": "4"}
        ).migrate
        is False
    )
    assert RegistryConfig.from_env({"LORASERVE_REGISTRY_LEASE_SECONDS": "4"}).lease_seconds == 4
    assert RouterConfig.from_env({"LORASERVE_ROUTER_LOCATE_TTL": "0.25"}).locate_ttl == 0.25
    with pytest.raises(ValueError):
        WorkerConfig.from_env({"LORASERVE_WORKER_PORT": "not-a-number"})


def test_the_worker_process_prefills_in_chunks_by_default() -> None:
    """`loraserve worker` turns chunked prefill on (64 tokens a step: bench/serve.py showed it does not lose
    at low load); the engine's own config, which tests and benchmarks build, keeps whole prompts."""
    from loraserve.engine.config import EngineConfig

    assert WorkerConfig.from_env({}).engine_config().prefill_chunk == 64
    assert WorkerConfig.from_env({"LORASERVE_WORKER_PREFILL_CHUNK": "0"}).engine_config().prefill_chunk == 0
    assert EngineConfig().prefill_chunk == 0


def test_engine_config_validation_and_buckets() -> None:
    assert EngineConfig(max_seq_len=100, min_prefill_bucket=16).prefill_buckets() == (16, 32, 64, 100)
    assert EngineConfig(max_seq_len=64).prefill_buckets() == (16, 32, 64)
    with pytest.raises(ValueError):
        EngineConfig(max_loras=0)
    with pytest.raises(ValueError, match="kernel_backend must be auto or one of"):
        EngineConfig(kernel_backend="cuda")
    with pytest.raises(
        ValueError, match="one of cpu, pallas, reference, xla, xla-grouped, xla-onehot, got 'cuda'"
    ):
        EngineConfig(kernel_backend="cuda")
    for name in ("auto", "cpu", "xla", "xla-grouped", "xla-onehot", "pallas", "reference"):
        assert EngineConfig(kernel_backend=name).kernel_backend == name  # every --kernel-backend value
    with pytest.raises(ValueError, match="lora_dtype must be float32 or bfloat16"):
        EngineConfig(lora_dtype="float16")
    assert EngineConfig().pool_dtype == "float32"  # pools follow the model dtype unless told
    assert EngineConfig(dtype="bfloat16").pool_dtype == "bfloat16"
    cfg = WorkerConfig.from_env({"LORASERVE_WORKER_LORA_DTYPE": "bfloat16"})
    assert cfg.engine_config().pool_dtype == "bfloat16"


def test_compilation_cache_dir_flag_stores_compiled_programs(tmp_path) -> None:
    """--compilation-cache-dir / LORASERVE_WORKER_COMPILATION_CACHE_DIR puts every compiled program on
    disk (a fresh process, so the test run's own cache setting does not interfere)."""
    cache = tmp_path / "xla"
    cfg = WorkerConfig.from_env({"LORASERVE_WORKER_COMPILATION_CACHE_DIR": str(cache)})
    assert cfg.compilation_cache_dir == str(cache)
    code = (
        "import sys, jax, jax.numpy as jnp\n"
        "from loraserve.engine.engine import enable_compilation_cache\n"
        "enable_compilation_cache(sys.argv[1])\n"
        "jax.jit(lambda x: x * 2 + 1)(jnp.ones(3)).block_until_ready()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    subprocess.run([sys.executable, "-c", code, str(cache)], check=True, env=env, timeout=120)
    assert any(p.name.startswith("jit__lambda") for p in cache.iterdir())


def test_the_backend_choices_are_the_kernel_registries() -> None:
    """The flags' choices are spelled out in engine/config.py (no JAX for `loraserve --help`): the same
    values as the registries the backends are resolved from."""
    from loraserve.kernels import KERNEL_BACKENDS
    from loraserve.kernels.attention import ATTENTION_BACKENDS
    from loraserve.kernels.linear import LINEAR_BACKENDS

    hints = typing.get_type_hints(EngineConfig)
    assert set(typing.get_args(hints["kernel_backend"])) == set(KERNEL_BACKENDS)
    assert set(typing.get_args(hints["attention_backend"])) == set(ATTENTION_BACKENDS)
    assert set(typing.get_args(hints["linear_backend"])) == set(LINEAR_BACKENDS)
    assert typing.get_args(hints["dtype"]) == ("auto", *DTYPES)


def test_matmul_precision_auto_follows_the_dtype() -> None:
    """``--matmul-precision auto``: float32 models trace their steps at ``highest`` (a TPU would otherwise
    multiply float32 in one bf16 pass), bfloat16 ones at ``default``; a stated value is kept; others refused."""
    assert EngineConfig(dtype="float32").traced_matmul_precision == "highest"
    assert EngineConfig(dtype="bfloat16").traced_matmul_precision == "default"
    assert EngineConfig(dtype="float32", matmul_precision="high").traced_matmul_precision == "high"
    assert EngineConfig(dtype="bfloat16", matmul_precision="highest").traced_matmul_precision == "highest"
    with pytest.raises(ValueError, match="matmul_precision must be one of auto, default, high, highest"):
        EngineConfig(matmul_precision="bf16_3x")
    hints = typing.get_type_hints(EngineConfig)
    assert set(typing.get_args(hints["matmul_precision"])) == set(MATMUL_PRECISIONS)
    config = WorkerConfig.from_env({"LORASERVE_WORKER_MATMUL_PRECISION": "high"})
    assert config.engine_config().matmul_precision == "high"


def _resolve(hf: dict, **fields: object) -> EngineConfig:
    return resolve_engine_config(WorkerConfig.from_env({}, **fields).engine_config(), hf)


def test_auto_dtype_and_context_resolve_from_the_checkpoint(llama_dir, caplog) -> None:
    """The tiny llama's config.json says float32 and 512 positions; a page of 16 tokens of its KV cache
    (2 layers x 2 KV heads x head_dim 16, keys and values) is 2 * 2 * 2 * 16 * 16 * 4 = 8192 bytes at f32."""
    hf = read_config(str(llama_dir))
    assert (hf["dtype"], hf["max_position_embeddings"]) == ("float32", 512)
    worker = WorkerConfig.from_env({}, model=str(llama_dir))
    assert (worker.dtype, worker.max_seq_len) == ("auto", "auto") and not worker.engine_config().resolved
    with caplog.at_level(logging.INFO, logger="loraserve.engine.config"):
        engine = resolve_engine_config(worker.engine_config(), hf)
    assert engine == replace(worker.engine_config(), dtype="float32", max_seq_len=512) and engine.resolved
    assert type(engine) is EngineConfig
    assert "dtype auto: float32 (the checkpoint's torch_dtype: float32)" in caplog.messages
    assert "max_seq_len auto: 512 (the model's max_position_embeddings 512)" in caplog.messages
    # a KV budget smaller than the context caps it: one full context plus the null page
    assert _resolve(hf, kv_pages=20).max_seq_len == 19 * 16
    assert _resolve(hf, kv_pages=20, kv_page_size=8).max_seq_len == 19 * 8
    assert _resolve(hf, kv_cache_bytes=11 * 8192 + 100).max_seq_len == 10 * 16
    assert _resolve(hf, kv_cache_bytes=11 * 8192, dtype="bfloat16").max_seq_len == 21 * 16  # 4096 B pages
    assert _resolve(hf, kv_pages=1000).max_seq_len == 512  # a larger budget: the model's context
    with pytest.raises(ConfigError, match=r"^max_seq_len auto: --kv-pages 1 holds no context"):
        _resolve(hf, kv_pages=1)
    # a long-context bf16 checkpoint with no budget: capped at AUTO_MAX_SEQ_LEN (the pool is then
    # max_batch_size contexts of it)
    long = dict(hf, dtype="bfloat16", max_position_embeddings=131072)
    with caplog.at_level(logging.INFO, logger="loraserve.engine.config"):
        assert (
            (_resolve(long).dtype, _resolve(long).max_seq_len)
            == ("bfloat16", AUTO_MAX_SEQ_LEN)
            == (
                "bfloat16",
                4096,
            )
        )
    assert (
        "max_seq_len auto: 4096 (the model's max_position_embeddings 131072, capped at 4096 without a KV"
        " budget (--kv-cache-bytes or --kv-pages allow more))" in caplog.messages
    )
    assert _resolve(long, kv_cache_bytes=1 << 30).max_seq_len == 131072  # 262144 pages of 4096 B hold it
    # float16 is served as bfloat16; the older torch_dtype key; nothing said: float32
    old = {k: v for k, v in hf.items() if k != "dtype"}
    assert _resolve(dict(hf, dtype="float16")).dtype == "bfloat16"
    assert _resolve(dict(old, torch_dtype="bfloat16")).dtype == "bfloat16"
    assert _resolve(old).dtype == "float32"
    # explicit values pass through untouched; an EngineConfig built in code has no auto at all
    explicit = _resolve(long, dtype="float32", max_seq_len=64)
    assert (explicit.dtype, explicit.max_seq_len) == ("float32", 64)
    assert resolve_engine_config(EngineConfig(), long) == EngineConfig()
    assert (EngineConfig().dtype, EngineConfig().max_seq_len) == ("float32", 256)


def test_an_engine_refuses_a_config_that_still_says_auto() -> None:
    from loraserve.engine.engine import Engine

    for config in (EngineConfig(dtype="auto"), EngineConfig(max_seq_len="auto")):
        with pytest.raises(ValueError, match="resolve auto against the checkpoint first"):
            Engine(None, config)
    with pytest.raises(ValueError, match="resolve auto"):
        _ = EngineConfig(max_seq_len="auto").pages_per_row
    with pytest.raises(ValueError, match="max_seq_len must be an integer or auto, got 'long'"):
        EngineConfig(max_seq_len="long")
