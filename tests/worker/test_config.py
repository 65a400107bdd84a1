"""Frozen configs read defaults < environment < flags, for the worker, registry and router alike."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from loraserve.registry.config import RegistryConfig
from loraserve.router.config import RouterConfig
from loraserve.worker.config import EngineConfig, WorkerConfig


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
        "from worker.engine import enable_compilation_cache\n"
        "enable_compilation_cache(sys.argv[1])\n"
        "jax.jit(lambda x: x * 2 + 1)(jnp.ones(3)).block_until_ready()\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    subprocess.run([sys.executable, "-c", code, str(cache)], check=True, env=env, timeout=120)
    assert any(p.name.startswith("jit__lambda") for p in cache.iterdir())
