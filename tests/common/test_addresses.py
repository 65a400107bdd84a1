"""common.addresses: HOST:PORT and unix:PATH, as servers bind them and as workers register them; the flags
each server's config checks at start."""

from __future__ import annotations

import os

import grpc
import pytest

from loraserve.common.addresses import (
    Address,
    AddressError,
    check_listen_flags,
    join_host_port,
    parse_address,
    serve_address,
)
from loraserve.common.config import ConfigError
from loraserve.registry.config import RegistryConfig
from loraserve.router.config import RouterConfig
from loraserve.worker.config import WorkerConfig


@pytest.mark.parametrize(
    ("text", "parsed", "canonical"),
    [
        ("10.0.0.5:50061", Address("10.0.0.5", 50061), "10.0.0.5:50061"),
        ("worker-0.loraserve-worker-headless:1", Address("worker-0.loraserve-worker-headless", 1), None),
        ("localhost:1", Address("localhost", 1), None),
        ("[::1]:50061", Address("::1", 50061), "[::1]:50061"),
        ("unix:/run/loraserve/worker.sock", Address(path="/run/loraserve/worker.sock"), None),
        ("unix:///run/loraserve/w.sock", Address(path="/run/loraserve/w.sock"), "unix:/run/loraserve/w.sock"),
    ],
)  # fmt: skip
def test_dial_addresses_parse_to_their_canonical_form(text, parsed, canonical) -> None:
    assert parse_address(text) == parsed
    assert str(parsed) == (canonical or text)


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("", "is neither HOST:PORT"),
        ("10.0.0.5", "is neither HOST:PORT"),
        ("10.0.0.5:0", "the port must be a number from 1 to 65535"),
        ("10.0.0.5:65536", "the port must be a number from 1 to 65535"),
        ("10.0.0.5:+80", "the port must be a number from 1 to 65535"),
        ("10.0.0.5:８０", "the port must be a number from 1 to 65535"),  # fullwidth digits are no port
        (":50061", "'' is no host name or IP address"),
        ("a b:50061", "'a b' is no host name or IP address"),
        ("-bad-:50061", "is no host name or IP address"),
        ("::1:50061", "an IPv6 address goes in brackets"),
        ("[not-v6]:50061", "in brackets is no IPv6 address"),
        ("[::1]50061", "is neither HOST:PORT"),
        ("dns:///worker:50061", "is neither HOST:PORT"),
        ("x" * 300 + ":1", "302 characters long: at most 256"),
        ("unix:", "names no socket path"),
        ("unix:worker.sock", "the socket path must be absolute"),
        ("unix://host/worker.sock", "unix:// is followed by an absolute path"),
        ("unix:/run/my worker.sock", "no whitespace or control character"),
        ("unix:/run/\x00.sock", "no whitespace or control character"),
        ("unix:/" + "s" * 107, "the socket path is 108 bytes long; a unix socket's holds at most 107"),
    ],
)
def test_malformed_dial_addresses_are_invalid_argument(text, why) -> None:
    with pytest.raises(AddressError) as exc:
        parse_address(text, what="worker address")
    assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert exc.value.message.startswith("worker address") and why in exc.value.message


def test_listen_addresses_take_port_0_and_relative_socket_paths(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert parse_address("127.0.0.1:0", listen=True) == Address("127.0.0.1", 0)
    assert parse_address("[::]:0", listen=True) == Address("::", 0)
    assert parse_address(":50061", listen=True) == Address("", 50061)  # gRPC's every interface
    assert parse_address("unix:w.sock", listen=True) == Address(path=str(tmp_path / "w.sock"))
    assert parse_address("unix:../w.sock", listen=True) == Address(path=os.path.dirname(tmp_path) + "/w.sock")
    with pytest.raises(AddressError, match="from 0 to 65535"):
        parse_address("127.0.0.1:99999", listen=True)


def test_serve_address_is_listen_else_host_and_port() -> None:
    assert serve_address("", "127.0.0.1", 50061) == "127.0.0.1:50061"
    assert serve_address("", "::", 50061) == "[::]:50061" == join_host_port("::", 50061)
    assert serve_address("unix:/run/w.sock", "127.0.0.1", 50061) == "unix:/run/w.sock"
    check_listen_flags("", "0.0.0.0")
    with pytest.raises(AddressError) as exc:
        check_listen_flags("", "unix:/run/w.sock")
    assert "--host names a TCP interface; a unix socket is --listen unix:/run/w.sock" in exc.value.message


@pytest.mark.parametrize("config", [RegistryConfig, RouterConfig, WorkerConfig])
def test_every_server_checks_its_listen_flag_at_start(config) -> None:
    prefix = {RegistryConfig: "REGISTRY", RouterConfig: "ROUTER", WorkerConfig: "WORKER"}[config]
    assert config.from_env({f"LORASERVE_{prefix}_LISTEN": "unix:/run/x.sock"}).listen == "unix:/run/x.sock"
    with pytest.raises(ConfigError, match=r"listen '/run/x.sock' is neither HOST:PORT .* nor unix:PATH"):
        config.from_env({f"LORASERVE_{prefix}_LISTEN": "/run/x.sock"})
    with pytest.raises(ConfigError, match="--host names a TCP interface"):
        config.from_env({}, host="unix:/run/x.sock")
