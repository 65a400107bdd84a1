"""Every refusal of the ``loraserve`` CLI, local or remote, is one line ``error: CODE: message`` on stderr and
exit status 1, never a traceback (loraserve.cli documents the exit statuses)."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from loraserve.cli import EXIT_REFUSED, main
from loraserve.common.addresses import NEITHER
from tests.e2e.procs import unix_socket_dir

DEAD = "127.0.0.1:1"  # nothing listens on port 1: the connection is refused at once


def _folder(root: Path, **files: bytes) -> Path:
    root.mkdir(parents=True)
    for name, data in files.items():
        (root / name).write_bytes(data)
    return root


def _push(folder: Path, registry: str = DEAD) -> list[str]:
    return ["adapters", "push", str(folder), "--name", "a", "--base-model", "m", "--registry", registry]


def _refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one line a refused command prints (servers may log before it: the line is the last one)."""
    assert main(argv) == EXIT_REFUSED
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.endswith("\n"), err
    lines = err.splitlines()
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:], err
    if argv[0] not in ("worker", "registry", "router"):  # clients print nothing else
        assert len(lines) == 1, err
    return lines[-1]


def test_pickle_only_folder_is_invalid_argument(tmp_path, capsys) -> None:
    folder = _folder(
        tmp_path / "pickled", **{"adapter_config.json": b"{}", "adapter_model.bin": b"\x80\x04."}
    )
    assert _refusal(_push(folder), capsys) == (
        "error: INVALID_ARGUMENT: adapter_model.bin is a pickle file, which is refused (loading it can run code)"
    )


def test_missing_folder_is_invalid_argument(tmp_path, capsys) -> None:
    missing = tmp_path / "does-not-exist"
    assert (
        _refusal(_push(missing), capsys)
        == f"error: INVALID_ARGUMENT: no adapter_model.safetensors in {missing}"
    )


def test_unreadable_weights_are_invalid_argument(tmp_path, capsys) -> None:
    folder = _folder(tmp_path / "unreadable", **{"adapter_config.json": b"{}"})
    (folder / "adapter_model.safetensors").mkdir()  # exists, but no read can succeed (even as root)
    line = _refusal(_push(folder), capsys)
    assert line.startswith(f"error: INVALID_ARGUMENT: cannot read the adapter folder {folder}: "), line


def test_dead_registry_is_unavailable(tmp_path, capsys) -> None:
    folder = _folder(
        tmp_path / "ok", **{"adapter_config.json": b"{}", "adapter_model.safetensors": b"\x08" + b"\0" * 15}
    )
    assert _refusal(_push(folder), capsys).startswith("error: UNAVAILABLE: ")
    for argv in (["adapters", "ls"], ["adapters", "show", "x@1"], ["workers", "ls"]):
        assert _refusal([*argv, "--registry", DEAD], capsys).startswith("error: UNAVAILABLE: "), argv


def test_generate_against_a_dead_address_is_unavailable(capsys) -> None:
    assert _refusal(["generate", "hello", "--target", DEAD], capsys).startswith("error: UNAVAILABLE: ")
    assert capsys.readouterr().out == ""  # nothing was streamed, no stray newline


def test_server_commands_refuse_bad_configuration(monkeypatch, capsys) -> None:
    monkeypatch.delenv("LORASERVE_WORKER_MODEL", raising=False)
    assert _refusal(["worker"], capsys) == (
        "error: INVALID_ARGUMENT: loraserve worker: --model (or LORASERVE_WORKER_MODEL) is required"
    )
    monkeypatch.setenv("LORASERVE_ROUTER_MAX_CANDIDATES", "three")
    line = _refusal(["router", "serve"], capsys)
    assert line.startswith("error: INVALID_ARGUMENT: LORASERVE_ROUTER_MAX_CANDIDATES='three': "), line
    assert _refusal(["worker", "--model", "/m", "--max-loras", "0"], capsys) == (
        "error: INVALID_ARGUMENT: max_loras must be >= 1"
    )


def test_the_console_script_prints_one_line_and_exits_1(tmp_path) -> None:
    folder = _folder(tmp_path / "pickled", **{"adapter_model.pt": b"\x80\x04."})
    out = subprocess.run(
        [sys.executable, "-m", "loraserve", *_push(folder)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 1 and out.stdout == ""
    assert out.stderr == (
        "error: INVALID_ARGUMENT: adapter_model.pt is a pickle file, which is refused (loading it can run code)\n"
    )


def test_servers_refuse_what_they_cannot_start_with(tmp_path, monkeypatch, capsys) -> None:
    missing = tmp_path / "no-model"
    assert (
        _refusal(["worker", "--model", str(missing)], capsys)
        == f"error: INVALID_ARGUMENT: no config.json in {missing}"
    )
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        db = ["--db", f"sqlite:///{tmp_path / 'r.db'}", "--storage", str(tmp_path / "s")]
        line = _refusal(["registry", "serve", "--port", str(port), *db], capsys)
        assert line.startswith(f"error: UNAVAILABLE: cannot bind 127.0.0.1:{port}: "), line
        line = _refusal(["router", "serve", "--port", "0", "--metrics-port", str(port)], capsys)
        assert line.startswith(f"error: UNAVAILABLE: cannot serve /metrics on port {port}: "), line
    line = _refusal(["router", "serve", "--port", "0", "--tls-cert", str(tmp_path / "c.pem")], capsys)
    assert line == "error: INVALID_ARGUMENT: a TLS certificate needs its key (--tls-key)"
    line = _refusal(
        [
            "router",
            "serve",
            "--port",
            "0",
            "--tls-cert",
            str(tmp_path / "c.pem"),
            "--tls-key",
            str(tmp_path / "k"),
        ],
        capsys,
    )
    assert line.startswith("error: INVALID_ARGUMENT: cannot read a TLS file: "), line


def test_servers_refuse_addresses_they_cannot_listen_on_or_advertise(tmp_path, capsys) -> None:
    """--listen and --advertise-address are checked before anything loads; a unix socket a live process serves
    on is not taken over (no TCP socket in this test: it runs where there is none)."""
    assert _refusal(["router", "serve", "--listen", "/run/r.sock"], capsys) == (
        f"error: INVALID_ARGUMENT: listen '/run/r.sock' {NEITHER}"
    )
    assert _refusal(["registry", "serve", "--host", "unix:/run/r.sock"], capsys) == (
        "error: INVALID_ARGUMENT: host 'unix:/run/r.sock': --host names a TCP interface; a unix socket is"
        " --listen unix:/run/r.sock"
    )
    model = ["worker", "--model", str(tmp_path / "no-model")]
    assert _refusal([*model, "--advertise-address", "unix:w.sock"], capsys).startswith(
        "error: INVALID_ARGUMENT: --advertise-address 'unix:w.sock': the socket path must be absolute"
    )
    assert _refusal([*model, "--advertise-address", "10.0.0.5"], capsys) == (
        f"error: INVALID_ARGUMENT: --advertise-address '10.0.0.5' {NEITHER}"
    )
    with unix_socket_dir() as folder, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as live:
        live.bind(str(folder / "live.sock"))
        live.listen()
        assert _refusal(["router", "serve", "--listen", f"unix:{folder / 'live.sock'}"], capsys) == (
            f"error: UNAVAILABLE: cannot bind unix:{folder / 'live.sock'}: another process is serving on it"
        )
