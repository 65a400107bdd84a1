"""Run docker-compose.yml's loraserve services as local processes: same commands, same variables.

Only addresses change: service hostnames become 127.0.0.1 with free ports, the database URL points at
the test's PostgreSQL database, the GCS emulator runs in-process, and the /assets and /cache volumes
become test folders.
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import yaml

from loraserve.common.processes import ServerProcess, loraserve_argv, start_server

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]
# the stack's bearer tokens by hop (admin, worker-admin, inference, router, router-generate, worker)
TOKENS = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["x-tokens"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalCompose:
    def __init__(
        self,
        *,
        db_url: str,
        gcs_endpoint: str,
        model_dir: Path,
        workdir: Path,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        """``extra_env``: variables every service gets on top of compose's (the tests' XLA flags)."""
        self.ports = {name: free_port() for name in ("registry", "worker-1", "worker-2", "router")}
        self.replace = {
            "postgresql+psycopg://postgres:postgres@postgres:5432/loraserve": db_url,
            "http://gcs:4443": gcs_endpoint,
            "/assets/model": str(model_dir),
            **{
                f"{name}:{port}": f"127.0.0.1:{self.ports[name]}"
                for name, port in (
                    ("registry", 50051),
                    ("worker-1", 50061),
                    ("worker-2", 50061),
                    ("router", 50071),
                )
            },
        }
        self.workdir = workdir
        self.extra_env = dict(extra_env or {})
        self.http_ports: dict[str, int] = {}  # services with an HTTP port -> this machine's

    def _value(self, service: str, value: str) -> str:
        value = str(value)
        for old, new in self.replace.items():
            value = value.replace(old, new)
        if value == "/cache":
            value = str(self.workdir / f"cache-{service}")
        return value

    def args(self, service: str) -> list[str]:
        """The service's ``loraserve`` arguments, with this machine's addresses and folders."""
        cmd = list(COMPOSE[service]["command"])
        assert cmd[0] == "loraserve"
        out: list[str] = []
        i = 1
        while i < len(cmd):
            if cmd[i] == "--host":
                out += ["--host", "127.0.0.1"]
                i += 2
            elif cmd[i] == "--port":
                out += ["--port", str(self.ports[service])]
                i += 2
            else:
                out.append(self._value(service, cmd[i]))
                i += 1
        return out

    def env(self, service: str) -> dict[str, str]:
        env = {k: self._value(service, v) for k, v in (COMPOSE[service].get("environment") or {}).items()}
        env.update(self.extra_env)
        for key in [k for k in env if k.endswith("_METRICS_PORT")]:
            env[key] = str(free_port())  # one host here, not one per container
        for key in [k for k in env if k.endswith("_HTTP_PORT")]:
            env[key] = str(self.http_ports.setdefault(service, free_port()))
        return env

    def run_job(self, service: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            loraserve_argv(self.args(service)),
            env={**os.environ, **self.env(service)},
            capture_output=True,
            text=True,
            timeout=300,
        )

    def start(self, service: str) -> ServerProcess:
        """Launch a long-running service (not waiting for it; its output also goes to ``<service>.log``)."""
        return start_server(
            self.args(service), self.env(service), timeout=None, log_file=self.workdir / f"{service}.log"
        )

    def address(self, service: str) -> str:
        return f"127.0.0.1:{self.ports[service]}"

    def http_url(self, service: str) -> str:
        """Base URL of the service's OpenAI-compatible HTTP API (set once ``env``/``start`` ran)."""
        return f"http://127.0.0.1:{self.http_ports[service]}"
