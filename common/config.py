"""Configuration from flags and environment, one source of truth per option.

Every server's config is a frozen dataclass. Each field is declared with ``opt(default, help, group)``:
its default, its help text and its ``--help`` group live on the field (in its metadata) and nowhere else;
the field's type says how a value parses. From each field come

- a flag ``--field-name`` (``add_config_flags``; in the ``--help`` section of its group, the class's
  ``GROUPS`` giving the order and a line about each group), and
- an environment twin ``<PREFIX><FIELD>``: ``LORASERVE_WORKER_MAX_SEQ_LEN``, ``LORASERVE_REGISTRY_DB``,
  ``LORASERVE_ROUTER_PORT``.

Flags win over the environment, the environment over the defaults. A flag and its twin parse the same way:

- ``int``, ``float``, ``str``: as written;
- ``bool``: ``1/true/yes/on`` or ``0/false/no/off`` (any case); anything else is refused, never read as false;
- ``Literal[...]``: one of the listed values (any case; ``--help`` lists them as the flag's choices);
- ``int | Literal["auto"]``: a number or the word (``auto`` resolves later, e.g. from the checkpoint).

A refused value is a ``ConfigError`` (INVALID_ARGUMENT) naming the variable (or the flag) and what it
accepts.

Logging is the process's, not the server's: every server takes ``--log-level`` and ``--log-format``
(``LoggingConfig``) with the twins ``LORASERVE_LOG_LEVEL`` and ``LORASERVE_LOG_FORMAT``, the same names
whichever server reads them.
"""

from __future__ import annotations

import argparse
import os
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import Field, dataclass, field, fields, is_dataclass
from typing import Any, ClassVar, Literal, TypeVar

from loraserve.common.errors import InvalidArgument
from loraserve.common.security import ServerSecurity

T = TypeVar("T")

AUTO = "auto"


class ConfigError(InvalidArgument, ValueError):
    """A flag or environment value the config refuses (INVALID_ARGUMENT)."""


def opt(default: Any, help: str, group: str) -> Any:
    """A config field: its default, its ``--help`` text and the ``--help`` group it is listed under."""
    return field(default=default, metadata={"help": help, "group": group})


def field_help(cls: type, name: str) -> str:
    """The help text the field ``name`` of ``cls`` was declared with."""
    return next(f for f in fields(cls) if f.name == name).metadata["help"]


TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")


def parse_bool(value: str) -> bool:
    """``1/true/yes/on`` -> True, ``0/false/no/off`` -> False (any case); anything else is refused."""
    word = value.strip().lower()
    if word in TRUE:
        return True
    if word in FALSE:
        return False
    raise ConfigError(f"{value!r} is not a boolean: use {'/'.join(TRUE)} or {'/'.join(FALSE)}")


def _choice_parser(choices: tuple[str, ...]) -> Callable[[str], str]:
    def parse(value: str) -> str:
        for choice in choices:
            if value.strip().lower() == choice.lower():
                return choice
        shown = ", ".join(c or "''" for c in choices)
        raise ConfigError(f"{value!r} is not one of {shown}")

    return parse


def _number_parser(kind: type) -> Callable[[str], object]:
    noun = "an integer" if kind is int else "a number"

    def parse(value: str) -> object:
        try:
            return kind(value)
        except ValueError:
            raise ConfigError(f"{value!r} is not {noun}") from None

    return parse


@dataclass(frozen=True)
class Kind:
    """How one field's values parse: ``parse`` (str -> value, ``ConfigError`` when refused), the
    ``choices`` when the type lists them, the flag's ``metavar``."""

    parse: Callable[[str], object]
    choices: tuple[str, ...] = ()
    metavar: str = ""
    only_choices: bool = False  # a Literal: nothing but the choices (argparse's choices=)


def kind_of(annotation: Any, name: str) -> Kind:
    """The ``Kind`` of a field annotated ``annotation`` (see the module docstring for the types)."""
    if annotation is bool:
        return Kind(parse_bool, metavar="{true,false}")
    if annotation in (int, float):
        return Kind(_number_parser(annotation), metavar=name.upper())
    if annotation is str:
        return Kind(str, metavar=name.upper())
    origin = typing.get_origin(annotation)
    if origin is Literal:
        choices = typing.get_args(annotation)
        metavar = "{" + ",".join(c or "''" for c in choices) + "}"
        return Kind(_choice_parser(choices), choices, metavar, only_choices=True)
    if origin in (typing.Union, types.UnionType):  # int | Literal["auto"]: a number or one of the words
        words = tuple(
            w for a in typing.get_args(annotation) if typing.get_origin(a) is Literal for w in a.__args__
        )
        numbers = [a for a in typing.get_args(annotation) if a in (int, float)]
        if len(numbers) == 1 and words:
            number, word = _number_parser(numbers[0]), _choice_parser(words)

            def parse(value: str) -> object:
                try:
                    return word(value)
                except ConfigError:
                    pass
                try:
                    return number(value)
                except ConfigError:
                    noun = "an integer" if numbers[0] is int else "a number"
                    raise ConfigError(f"{value!r} is neither {noun} nor one of {', '.join(words)}") from None

            return Kind(parse, words, "{" + ",".join(words) + "," + numbers[0].__name__.upper() + "}")
    raise TypeError(f"config field {name}: no parser for {annotation!r}")


def config_fields(cls: type) -> list[tuple[Field, Kind]]:
    """Every field of the config dataclass ``cls`` with its ``Kind``."""
    hints = typing.get_type_hints(cls)
    return [(f, kind_of(hints[f.name], f.name)) for f in fields(cls)]


def _check_choice(f: Field, kind: Kind, value: object, what: str) -> None:
    if kind.choices and isinstance(value, str) and value not in kind.choices:
        shown = ", ".join(c or "''" for c in kind.choices)
        raise ConfigError(f"{what}={value!r}: {value!r} is not one of {shown}")


def config_from_env(
    cls: type[T], prefix: str, env: Mapping[str, str] | None, overrides: dict[str, object]
) -> T:
    """Build the frozen dataclass ``cls``: field defaults < ``<prefix><FIELD>`` variables < non-None overrides.

    Shared by the worker, registry and router configs (and ``LoggingConfig``). A value the field's type
    refuses raises ``ConfigError`` naming the variable; so does the dataclass's own validation.
    """
    env = dict(os.environ if env is None else env)
    values: dict[str, object] = {}
    for f, kind in config_fields(cls):
        name = prefix + f.name.upper()
        raw = env.get(name)
        if raw is not None:
            try:
                values[f.name] = kind.parse(raw)
            except ConfigError as exc:
                raise ConfigError(f"{name}={raw!r}: {exc.message}") from exc
        override = overrides.get(f.name)
        if override is not None:
            _check_choice(f, kind, override, f.name)
            values[f.name] = override
    try:
        return cls(**values)
    except ValueError as exc:  # the dataclass's own validation
        raise ConfigError(str(exc)) from exc


def _flag_type(kind: Kind) -> Callable[[str], object]:
    """``kind.parse`` for argparse: a refusal becomes its usage error (exit 2) with our message."""

    def parse(value: str) -> object:
        try:
            return kind.parse(value)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(exc.message) from None

    return parse


def add_config_flags(
    parser: argparse.ArgumentParser, cls: type, prefix: str, only: Iterable[str] | None = None
) -> None:
    """One ``--field-name`` flag per field of ``cls`` (or of ``only``), default None so the environment and the
    field default apply; the help is the field's, naming the environment twin and the default.

    Flags are listed by group, in the order of ``cls.GROUPS`` (group -> one line about it); within a group,
    the fields ``cls`` declares itself come first, inherited ones follow.
    """
    wanted = None if only is None else set(only)
    inherited = {f.name for base in cls.__mro__[1:] if is_dataclass(base) for f in fields(base)}
    own = {f.name for f in fields(cls)} - inherited  # declared first by cls (a re-declared default is not)
    specs = [(f, k) for f, k in config_fields(cls) if wanted is None or f.name in wanted]
    groups: Mapping[str, str] = getattr(cls, "GROUPS", {})
    order = {g: i for i, g in enumerate(groups)}
    missing = {f.metadata.get("group") for f, _ in specs} - set(groups)
    if missing:
        raise TypeError(f"{cls.__name__}: fields in groups missing from GROUPS: {sorted(map(str, missing))}")
    sections: dict[str, argparse._ArgumentGroup] = {}
    for f, kind in sorted(specs, key=lambda s: (order[s[0].metadata["group"]], s[0].name not in own)):
        group = f.metadata["group"]
        if group not in sections:
            sections[group] = parser.add_argument_group(group, groups[group])
        default = str(f.default).lower() if isinstance(f.default, bool) else f.default
        default = "''" if default == "" else default
        text = f"{f.metadata['help']} (env {prefix + f.name.upper()}; default {default})"
        sections[group].add_argument(
            "--" + f.name.replace("_", "-"),
            type=_flag_type(kind),
            choices=kind.choices if kind.only_choices else None,
            default=None,
            metavar=kind.metavar,
            help=text.replace("%", "%%"),
        )


def config_from_args(cls: type[T], prefix: str, args: argparse.Namespace) -> T:
    """The config the flags in ``args`` (those ``add_config_flags`` added) and the environment describe."""
    overrides = {f.name: getattr(args, f.name, None) for f in fields(cls)}
    return config_from_env(cls, prefix, None, overrides)


# ---------------------------------------------------------------- logging: the same for every server

LOG_ENV_PREFIX = "LORASERVE_"


@dataclass(frozen=True)
class LoggingConfig:
    """``--log-level`` / ``LORASERVE_LOG_LEVEL`` and ``--log-format`` / ``LORASERVE_LOG_FORMAT``: the
    process's logging, the same variables whichever server runs (common.observability.setup_logging)."""

    GROUPS: ClassVar[dict[str, str]] = {"logging": "the process's logs (the same variables for every server)"}

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"] = opt(
        "INFO", "least severe level logged", "logging"
    )
    log_format: Literal["text", "json"] = opt(
        "text",
        "text: one line per record; json: one JSON object per line with request_id and adapter (log collectors)",
        "logging",
    )


def add_logging_flags(parser: argparse.ArgumentParser) -> None:
    add_config_flags(parser, LoggingConfig, LOG_ENV_PREFIX)


def setup_logging_from_args(args: argparse.Namespace) -> LoggingConfig:
    """Configure the root logger from ``--log-level``/``--log-format`` and their environment twins."""
    from loraserve.common.observability import setup_logging

    config = config_from_args(LoggingConfig, LOG_ENV_PREFIX, args)
    setup_logging(config.log_level, config.log_format)
    return config


# ---------------------------------------------------------------- TLS and tokens: every server's

SECURITY = "security"


@dataclass(frozen=True)
class ServerSecurityConfig:
    """The TLS and token fields every server reads (``LORASERVE_<SERVER>_ADMIN_TOKENS`` …). Each token list
    is a scope (common/security.py, docs/security.md); any token configured turns auth on."""

    admin_tokens: str = opt(
        "", "comma-separated bearer tokens accepted for every RPC (empty: no auth)", SECURITY
    )
    worker_tokens: str = opt(
        "",
        "comma-separated bearer tokens of workers: RegisterWorker, Heartbeat, GetAdapter, DownloadAdapter"
        " (docs/security.md)",
        SECURITY,
    )
    router_tokens: str = opt(
        "",
        "comma-separated bearer tokens of routers: Generate, LocateAdapter, ListWorkers, ListAdapters"
        " (docs/security.md)",
        SECURITY,
    )
    tls_cert: str = opt("", "PEM certificate: serve TLS", SECURITY)
    tls_key: str = opt("", "PEM key of --tls-cert", SECURITY)
    tls_client_ca: str = opt("", "PEM CA: require client certificates (mTLS)", SECURITY)

    def security(self) -> ServerSecurity:
        return ServerSecurity.from_strings(
            getattr(self, "auth_tokens", ""),
            self.admin_tokens,
            self.tls_cert,
            self.tls_key,
            self.tls_client_ca,
            self.worker_tokens,
            self.router_tokens,
        )


@dataclass(frozen=True)
class InferenceSecurityConfig(ServerSecurityConfig):
    """Servers that serve ``Inference.Generate`` (worker, router) also accept inference-only tokens."""

    auth_tokens: str = opt(
        "", "comma-separated bearer tokens accepted for Inference.Generate (empty: no auth)", SECURITY
    )
