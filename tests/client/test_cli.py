"""The ``loraserve`` console script: help lists the subcommands that exist, each parses --help."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from loraserve.cli import COMMANDS, main


def _loraserve() -> list[str]:
    exe = shutil.which("loraserve", path=str(__import__("pathlib").Path(sys.executable).parent))
    return [exe] if exe else [sys.executable, "-m", "loraserve"]


def test_console_script_help_lists_every_subcommand() -> None:
    out = subprocess.run([*_loraserve(), "--help"], capture_output=True, text=True, check=True).stdout
    for name in COMMANDS:
        assert name in out


@pytest.mark.parametrize("name", list(COMMANDS))
def test_each_subcommand_has_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([name, "--help"])
    assert exc.value.code == 0
    assert "usage: loraserve " + name in capsys.readouterr().out


def test_unknown_subcommand_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["no-such-command"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_version_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["version", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert found["loraserve"] == "0.1.0"
    assert found["jax"] != "not installed"
