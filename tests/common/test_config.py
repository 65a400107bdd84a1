"""common.config: one flag-from-dataclass helper for the three CLIs (bools parse like env values), one shared
security base whose fields keep each server's ``LORASERVE_<SERVER>_<FIELD>`` names, refusals as
INVALID_ARGUMENT, and WorkerConfig inheriting (not re-declaring) EngineConfig."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

import grpc
import pytest

from loraserve.common.config import (
    ConfigError,
    InferenceSecurityConfig,
    ServerSecurityConfig,
    add_config_flags,
    config_from_args,
    config_from_env,
)
from loraserve.registry.config import RegistryConfig
from loraserve.router.config import RouterConfig
from loraserve.worker.config import EngineConfig, WorkerConfig


@dataclass(frozen=True)
class Toy(ServerSecurityConfig):
    port: int = 7
    ratio: float = 0.5
    name: str = "toy"
    migrate: bool = True


HELP = {"port": "p", "ratio": "r", "name": "n", "migrate": "m", "admin_tokens": "a", "tls_cert": "c"}
HELP |= {"tls_key": "k", "tls_client_ca": "ca", "worker_tokens": "w", "router_tokens": "r"}


def _parse(argv: list[str], only=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_config_flags(parser, Toy, "TOY_", HELP, only=only)
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    ("raw", "want"), [("false", False), ("0", False), ("no", False), ("on", True), ("YES", True)]
)
def test_bool_flags_parse_like_env_values(raw: str, want: bool, monkeypatch) -> None:
    monkeypatch.delenv("TOY_MIGRATE", raising=False)
    assert config_from_args(Toy, "TOY_", _parse(["--migrate", raw])).migrate is want
    assert config_from_env(Toy, "TOY_", {"TOY_MIGRATE": raw}, {}).migrate is want


def test_flags_beat_env_beat_defaults_and_only_limits_the_flags(monkeypatch) -> None:
    monkeypatch.setenv("TOY_PORT", "9")
    monkeypatch.setenv("TOY_NAME", "from-env")
    cfg = config_from_args(Toy, "TOY_", _parse(["--port", "11", "--ratio", "0.25", "--admin-tokens", "a,b"]))
    assert (cfg.port, cfg.ratio, cfg.name, cfg.migrate, cfg.admin_tokens) == (
        11,
        0.25,
        "from-env",
        True,
        "a,b",
    )
    assert cfg.security().admin_tokens == ("a", "b") and cfg.security().inference_tokens == ()
    with pytest.raises(SystemExit):
        _parse(["--ratio", "1"], only=("port",))
    assert config_from_args(Toy, "TOY_", _parse(["--port", "3"], only=("port",))).ratio == 0.5


def test_refused_values_are_invalid_argument_and_still_value_errors() -> None:
    with pytest.raises(ConfigError, match=r"TOY_PORT='x'") as exc:
        config_from_env(Toy, "TOY_", {"TOY_PORT": "x"}, {})
    assert exc.value.code is grpc.StatusCode.INVALID_ARGUMENT and isinstance(exc.value, ValueError)
    with pytest.raises(ConfigError, match="max_loras must be >= 1") as exc:
        WorkerConfig.from_env({"LORASERVE_WORKER_MAX_LORAS": "0"})
    assert exc.value.code is grpc.StatusCode.INVALID_ARGUMENT


def test_security_fields_are_declared_once_and_keep_their_env_names() -> None:
    security = {f.name for f in fields(ServerSecurityConfig)}
    assert security == {
        "admin_tokens",
        "worker_tokens",
        "router_tokens",
        "tls_cert",
        "tls_key",
        "tls_client_ca",
    }
    assert {f.name for f in fields(InferenceSecurityConfig)} == security | {"auth_tokens"}
    assert issubclass(RegistryConfig, ServerSecurityConfig) and not issubclass(
        RegistryConfig, InferenceSecurityConfig
    )
    assert issubclass(RouterConfig, InferenceSecurityConfig) and issubclass(
        WorkerConfig, InferenceSecurityConfig
    )
    env = {"LORASERVE_WORKER_AUTH_TOKENS": "i1,i2", "LORASERVE_WORKER_ADMIN_TOKENS": "adm"}
    sec = WorkerConfig.from_env(env).security()
    assert (sec.inference_tokens, sec.admin_tokens) == (("i1", "i2"), ("adm",))
    router = RouterConfig.from_env(
        {"LORASERVE_ROUTER_AUTH_TOKENS": "r", "LORASERVE_ROUTER_TLS_CERT": "/c.pem"}
    )
    assert (router.security().inference_tokens, router.security().tls_cert) == (("r",), "/c.pem")
    registry = RegistryConfig.from_env(
        {"LORASERVE_REGISTRY_ADMIN_TOKENS": "x", "LORASERVE_REGISTRY_TLS_KEY": "/k"}
    )
    assert (registry.security().admin_tokens, registry.security().tls_key) == (("x",), "/k")


@pytest.mark.parametrize(
    ("config", "prefix"),
    [
        (RegistryConfig, "LORASERVE_REGISTRY_"),
        (WorkerConfig, "LORASERVE_WORKER_"),
        (RouterConfig, "LORASERVE_ROUTER_"),
    ],
)
def test_worker_and_router_token_lists_reach_every_server(config, prefix) -> None:
    """Every role reads ``<PREFIX>WORKER_TOKENS`` and ``<PREFIX>ROUTER_TOKENS`` (and the flags), each list
    becoming its scope's tokens; the older lists keep their meaning (auth_tokens = inference)."""
    env = {prefix + "WORKER_TOKENS": "w1, w2", prefix + "ROUTER_TOKENS": "r1", prefix + "ADMIN_TOKENS": "a"}
    sec = config.from_env(env).security()
    assert (sec.worker_tokens, sec.router_tokens, sec.admin_tokens) == (("w1", "w2"), ("r1",), ("a",))
    assert sec.scopes_of("w2") == {"worker"} and sec.scopes_of("r1") == {"router"} and not sec.scopes_of("x")
    assert config.from_env({}, worker_tokens="flag").security().worker_tokens == ("flag",)


def test_worker_config_inherits_every_engine_field() -> None:
    engine_fields = {f.name: f.default for f in fields(EngineConfig)}
    worker_fields = {f.name: f.default for f in fields(WorkerConfig)}
    assert engine_fields.items() <= worker_fields.items()  # same names, same defaults
    declared_here = set(WorkerConfig.__annotations__)  # what WorkerConfig's own body declares
    assert not declared_here & set(engine_fields) and not declared_here & {"auth_tokens", "tls_cert"}
    overrides = {"max_batch_size": 3, "prefill_per_step": 1, "min_prefill_bucket": 8, "kernel_backend": "xla"}
    cfg = WorkerConfig.from_env({"LORASERVE_WORKER_DEFAULT_MAX_TOKENS": "5"}, **overrides)
    assert cfg.engine_config() == EngineConfig(default_max_tokens=5, **overrides)


def test_every_worker_field_has_a_flag_with_help_naming_its_env_twin() -> None:
    from loraserve.worker.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    helps = {a.dest: a.help for a in parser._actions}
    for f in fields(WorkerConfig):
        assert f"env LORASERVE_WORKER_{f.name.upper()};" in helps[f.name], f.name
