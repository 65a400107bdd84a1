"""Run ``loraserve`` servers as child processes and wait for their ready line (the demo and the process tests).

A server prints ``loraserve <role> serving on ADDRESS`` once it is SERVING (``common.server.run_server``;
``HOST:PORT``, or ``unix:/absolute/path`` with ``--listen unix:PATH``: one word either way, the line's last);
``start_server`` launches ``python -m loraserve ARGS``, reads its output on a thread (so the pipe never fills),
and ``ServerProcess.wait_ready`` returns the address from that line.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from loraserve.common.errors import Unavailable

READY = " serving on "


def loraserve_argv(args: Sequence[str]) -> list[str]:
    """The argv that runs ``loraserve ARGS`` with this interpreter."""
    return [sys.executable, "-m", "loraserve", *args]


class ServerProcess:
    """One ``loraserve`` child process: its output lines in ``log`` (stdout and stderr, in order) and the
    address from its ready line."""

    def __init__(self, popen: subprocess.Popen, log_file: Path | None = None) -> None:
        self.popen, self.log, self.address = popen, [], ""
        self._ready = threading.Event()
        self._log_file = log_file
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.popen.stdout is not None
        out = open(self._log_file, "a") if self._log_file else None  # noqa: SIM115 - closed below
        try:
            for line in self.popen.stdout:
                self.log.append(line)
                if out is not None:
                    out.write(line)
                    out.flush()
                if not self.address and line.startswith("loraserve ") and READY in line:
                    self.address = line.strip().rsplit(" ", 1)[-1]
                    self._ready.set()
        finally:
            if out is not None:
                out.close()
            self._ready.set()  # the process ended: wake up a waiter

    def wait_ready(self, timeout: float = 120.0) -> str:
        """The address (``HOST:PORT`` or ``unix:PATH``) once the server says it serves; kills it and raises
        UNAVAILABLE if it exits or stays silent for ``timeout`` seconds."""
        self._ready.wait(timeout)
        if not self.address:
            self.popen.kill()
            self.popen.wait(30)
            self._reader.join(5)
            tail = "".join(self.log[-40:])
            raise Unavailable(f"`loraserve {' '.join(self.popen.args[3:])}` did not come up:\n{tail}")
        return self.address

    def stop(self, kill: bool = False, timeout: float = 30.0) -> int:
        """SIGTERM (drain) or SIGKILL; returns the exit status."""
        if self.popen.poll() is None:
            (self.popen.kill if kill else self.popen.terminate)()
        return self.popen.wait(timeout)

    # Popen's own verbs, for callers that treat this as the process
    def terminate(self) -> None:
        self.popen.terminate()

    def kill(self) -> None:
        self.popen.kill()

    def wait(self, timeout: float | None = None) -> int:
        return self.popen.wait(timeout)

    def poll(self) -> int | None:
        return self.popen.poll()


def start_server(
    args: Sequence[str],
    env: Mapping[str, str] | None = None,
    *,
    timeout: float | None = 120.0,
    log_file: Path | None = None,
    preexec_fn: Callable[[], None] | None = None,
) -> ServerProcess:
    """Launch ``loraserve ARGS`` (``env`` on top of this process's environment); with a ``timeout``, wait for
    its ready line (``None``: return at once and call ``wait_ready`` later). ``preexec_fn`` runs in the child
    before the exec (e.g. a parent-death signal)."""
    popen = subprocess.Popen(
        loraserve_argv(args),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"},
        preexec_fn=preexec_fn,
    )
    proc = ServerProcess(popen, log_file)
    if timeout is not None:
        proc.wait_ready(timeout)
    return proc


def die_with_parent() -> None:
    """A ``preexec_fn`` for :func:`start_server`: SIGTERM the child when its parent dies (Linux prctl
    PR_SET_PDEATHSIG), so a benchmark killed by Ctrl-C or a crash leaves no server behind."""
    import ctypes
    import signal

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
