"""common.config: one flag-from-dataclass helper for the three CLIs (bools parse like env values), one shared
security base whose fields keep each server's ``LORASERVE_<SERVER>_<FIELD>`` names, refusals as
INVALID_ARGUMENT, and WorkerConfig inheriting (not re-declaring) EngineConfig."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import ClassVar, Literal

import grpc
import pytest

from loraserve.common.config import (
    ConfigError,
    InferenceSecurityConfig,
    LoggingConfig,
    ServerSecurityConfig,
    add_config_flags,
    config_from_args,
    config_from_env,
    opt,
    setup_logging_from_args,
)
from loraserve.engine.config import EngineConfig
from loraserve.registry.config import RegistryConfig
from loraserve.router.config import RouterConfig
from loraserve.worker.config import WorkerConfig


@dataclass(frozen=True)
class Toy(ServerSecurityConfig):
    GROUPS: ClassVar[dict[str, str]] = {"toy": "the toy's own", "security": "tokens and TLS"}

    port: int = opt(7, "p", "toy")
    ratio: float = opt(0.5, "r", "toy")
    name: str = opt("toy", "n", "toy")
    migrate: bool = opt(True, "m", "toy")
    colour: Literal["red", "green"] = opt("red", "c", "toy")
    width: int | Literal["auto"] = opt("auto", "w", "toy")


def _parse(argv: list[str], only=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_config_flags(parser, Toy, "TOY_", only=only)
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
    engine_fields = {f.name: f for f in fields(EngineConfig)}
    worker_fields = {f.name: f for f in fields(WorkerConfig)}
    assert engine_fields.keys() <= worker_fields.keys()
    # the same defaults and the same help, but for `loraserve worker` dtype and max_seq_len are auto and
    # chunked prefill and async decode are on
    other = {
        n: worker_fields[n].default for n, f in engine_fields.items() if worker_fields[n].default != f.default
    }
    assert other == {"dtype": "auto", "max_seq_len": "auto", "prefill_chunk": 64, "async_decode": True}
    assert all(worker_fields[n].metadata == f.metadata for n, f in engine_fields.items())
    declared_here = set(WorkerConfig.__annotations__)  # what WorkerConfig's own body declares
    assert declared_here & set(engine_fields) == set(other) and not declared_here & {
        "auth_tokens",
        "tls_cert",
    }
    overrides = {"max_batch_size": 3, "prefill_per_step": 1, "min_prefill_bucket": 8, "kernel_backend": "xla"}
    cfg = WorkerConfig.from_env({"LORASERVE_WORKER_DEFAULT_MAX_TOKENS": "5"}, **overrides)
    assert cfg.engine_config() == EngineConfig(
        default_max_tokens=5,
        dtype="auto",
        max_seq_len="auto",
        prefill_chunk=64,
        async_decode=True,
        **overrides,
    )


def test_every_worker_field_has_a_flag_with_help_naming_its_env_twin() -> None:
    from loraserve.worker.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    helps = {a.dest: a.help for a in parser._actions}
    for f in fields(WorkerConfig):
        assert f"env LORASERVE_WORKER_{f.name.upper()};" in helps[f.name], f.name


def test_a_typo_in_a_boolean_is_refused_naming_the_variable_or_flag(monkeypatch, capsys) -> None:
    with pytest.raises(ConfigError) as exc:
        config_from_env(Toy, "TOY_", {"TOY_MIGRATE": "ture"}, {})
    assert (
        exc.value.message
        == "TOY_MIGRATE='ture': 'ture' is not a boolean: use 1/true/yes/on or 0/false/no/off"
    )
    assert exc.value.code is grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(ConfigError, match=r"^LORASERVE_REGISTRY_MIGRATE='flase': 'flase' is not a boolean"):
        RegistryConfig.from_env({"LORASERVE_REGISTRY_MIGRATE": "flase"})
    with pytest.raises(
        ConfigError, match=r"^LORASERVE_WORKER_ENABLE_PREFIX_CACHING='2': '2' is not a boolean"
    ):
        WorkerConfig.from_env({"LORASERVE_WORKER_ENABLE_PREFIX_CACHING": "2"})
    with pytest.raises(SystemExit) as exit_:
        _parse(["--migrate", "nope"])
    assert exit_.value.code == 2
    assert (
        "argument --migrate: 'nope' is not a boolean: use 1/true/yes/on or 0/false/no/off"
        in capsys.readouterr().err
    )


def test_a_value_outside_the_choices_is_refused_listing_them(capsys) -> None:
    with pytest.raises(ConfigError) as exc:
        WorkerConfig.from_env({"LORASERVE_WORKER_KERNEL_BACKEND": "cuda"})
    assert exc.value.message == (
        "LORASERVE_WORKER_KERNEL_BACKEND='cuda': 'cuda' is not one of auto, cpu, pallas, reference, xla,"
        " xla-grouped, xla-onehot"
    )
    with pytest.raises(ConfigError) as exc:
        WorkerConfig.from_env({"LORASERVE_WORKER_DTYPE": "float16"})
    assert (
        exc.value.message
        == "LORASERVE_WORKER_DTYPE='float16': 'float16' is not one of auto, float32, bfloat16"
    )
    with pytest.raises(ConfigError) as exc:
        WorkerConfig.from_env({"LORASERVE_WORKER_MAX_SEQ_LEN": "long"})
    assert (
        exc.value.message
        == "LORASERVE_WORKER_MAX_SEQ_LEN='long': 'long' is neither an integer nor one of auto"
    )
    with pytest.raises(ConfigError, match=r"^colour='blue': 'blue' is not one of red, green$"):
        config_from_env(Toy, "TOY_", {}, {"colour": "blue"})  # values given in code are checked too
    # any case, stored as declared; numbers or the word for int | Literal["auto"]
    env = {"LORASERVE_WORKER_DTYPE": "BFloat16", "LORASERVE_WORKER_LORA_DTYPE": "FLOAT32"}
    env |= {"LORASERVE_WORKER_MAX_SEQ_LEN": "2048"}
    cfg = WorkerConfig.from_env(env)
    assert (cfg.dtype, cfg.lora_dtype, cfg.max_seq_len) == ("bfloat16", "float32", 2048)
    assert WorkerConfig.from_env({"LORASERVE_WORKER_MAX_SEQ_LEN": "AUTO"}).max_seq_len == "auto"
    assert config_from_args(Toy, "TOY_", _parse(["--colour", "GREEN", "--width", "12"])).colour == "green"
    assert config_from_args(Toy, "TOY_", _parse(["--width", "12"])).width == 12
    with pytest.raises(SystemExit):
        _parse(["--colour", "blue"])
    assert "argument --colour: 'blue' is not one of red, green" in capsys.readouterr().err
    from loraserve.worker.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(["--attention-backend", "flash"])
    assert (
        "argument --attention-backend: 'flash' is not one of auto, xla, pallas, cpu"
        in capsys.readouterr().err
    )
    choices = {a.dest: a.choices for a in parser._actions}
    assert choices["linear_backend"] == ("auto", "xla", "cpu") and choices["log_format"] == ("text", "json")
    assert choices["max_seq_len"] is None  # auto or any integer


CONFIGS = [
    (WorkerConfig, "LORASERVE_WORKER_"),
    (RegistryConfig, "LORASERVE_REGISTRY_"),
    (RouterConfig, "LORASERVE_ROUTER_"),
    (LoggingConfig, "LORASERVE_"),
]


@pytest.mark.parametrize(("config", "prefix"), CONFIGS)
def test_every_field_has_its_help_and_a_group(config, prefix) -> None:
    for f in fields(config):
        assert len(f.metadata.get("help", "")) > 8, f.name
        assert f.metadata["group"] in config.GROUPS, f.name
    parser = argparse.ArgumentParser()
    add_config_flags(parser, config, prefix)
    helps = {a.dest: a.help for a in parser._actions}
    for f in fields(config):
        assert helps[f.name].startswith(f.metadata["help"]), f.name
        assert f"(env {prefix}{f.name.upper()}; default " in helps[f.name], f.name


def _help(argv: list[str], capsys) -> str:
    from loraserve.cli import main

    with pytest.raises(SystemExit) as exit_:
        main([*argv, "--help"])
    assert exit_.value.code == 0
    return capsys.readouterr().out


def test_help_lists_the_options_by_group(capsys) -> None:
    def titles(text: str) -> list[str]:
        return [line[:-1] for line in text.splitlines() if line.endswith(":") and not line.startswith(" ")]

    worker = _help(["worker"], capsys)
    groups = [
        "model",
        "cache",
        "adapters",
        "scheduling",
        "kernels",
        "serving",
        "multi-host",
        "security",
        "logging",
    ]
    assert titles(worker) == ["options", *groups]
    sections = worker.split("\n\n")
    model = next(s for s in sections if s.lstrip().startswith("--model MODEL"))
    assert model.index("--model MODEL") < model.index("--max-seq-len {auto,INT}") < model.index("--dtype")
    assert "--kernel-backend {auto,cpu,pallas,reference,xla,xla-grouped,xla-onehot}" in worker
    assert "least severe level logged (env LORASERVE_LOG_LEVEL; default INFO)" in " ".join(worker.split())
    assert titles(_help(["registry", "serve"], capsys)) == [
        "options",
        "storage",
        "uploads",
        "serving",
        "security",
        "logging",
    ]
    assert titles(_help(["registry", "migrate"], capsys)) == ["options", "storage"]
    assert titles(_help(["router", "serve"], capsys)) == [
        "options",
        "serving",
        "upstream",
        "security",
        "logging",
    ]


@pytest.fixture
def root_logger():
    import logging

    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)


def test_log_level_and_format_have_one_env_twin_for_every_server(root_logger, monkeypatch) -> None:
    import logging

    from loraserve.common.observability import JsonFormatter
    from loraserve.worker.cli import add_arguments

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    monkeypatch.setenv("LORASERVE_LOG_LEVEL", "warning")
    monkeypatch.setenv("LORASERVE_LOG_FORMAT", "json")
    config = setup_logging_from_args(parser.parse_args([]))
    assert config == LoggingConfig(log_level="WARNING", log_format="json")
    assert root_logger.level == logging.WARNING and isinstance(
        root_logger.handlers[0].formatter, JsonFormatter
    )
    setup_logging_from_args(parser.parse_args(["--log-level", "DEBUG", "--log-format", "text"]))  # flags win
    assert root_logger.level == logging.DEBUG and not isinstance(
        root_logger.handlers[0].formatter, JsonFormatter
    )
    for argv in (["registry", "serve"], ["router", "serve"]):
        from loraserve.cli import build_parser

        args = build_parser().parse_args([*argv, "--log-level", "ERROR"])
        assert config_from_args(LoggingConfig, "LORASERVE_", args).log_level == "ERROR"
    monkeypatch.setenv("LORASERVE_LOG_LEVEL", "loud")
    with pytest.raises(ConfigError) as exc:
        setup_logging_from_args(parser.parse_args([]))
    assert (
        exc.value.message
        == "LORASERVE_LOG_LEVEL='loud': 'loud' is not one of DEBUG, INFO, WARNING, ERROR, CRITICAL"
    )
