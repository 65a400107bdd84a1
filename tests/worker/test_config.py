"""Frozen configs read defaults < environment < flags, for the worker, registry and router alike."""

from __future__ import annotations

import pytest

from registry.config import RegistryConfig
from router.config import RouterConfig
from worker.config import EngineConfig, WorkerConfig


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
