"""docker-compose.yml is checked without Docker: it parses, every loraserve command parses with our CLI and
its subcommand runs --help, every variable it sets is one our configs read, depends_on is acyclic with the
right conditions, and every healthcheck runs a command that exists."""

from __future__ import annotations

import shlex
import tomllib
from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from loraserve.cli import build_parser, main
from loraserve.registry.config import RegistryConfig
from loraserve.router.config import RouterConfig
from loraserve.worker.config import WorkerConfig

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]
OURS = {name: svc for name, svc in SERVICES.items() if str(svc.get("image", "")).startswith("loraserve-")}

KNOWN_ENV = (
    {f"LORASERVE_WORKER_{f.name.upper()}" for f in fields(WorkerConfig)}
    | {f"LORASERVE_REGISTRY_{f.name.upper()}" for f in fields(RegistryConfig)}
    | {f"LORASERVE_ROUTER_{f.name.upper()}" for f in fields(RouterConfig)}
    | {"LORASERVE_REGISTRY_ADDRESS", "LORASERVE_TARGET"}  # the admin CLI and SDK's defaults
    | {"LORASERVE_TOKEN"}  # the CLI's and SDK's bearer token (client.connection_flags)
    | {"LORASERVE_LOG_FORMAT"}  # common.observability.setup_logging
    | {"STORAGE_EMULATOR_HOST", "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"}  # read by gcsfs (docs/design.md §3)
)
THIRD_PARTY_PROBES = {"pg_isready", "wget"}  # shipped in the postgres and fake-gcs-server images


# The Dockerfile target each service must run from: the image of its role and nothing heavier.
ROLE_OF = {"migrate": "registry", "registry": "registry", "worker-1": "worker", "worker-2": "worker"}
ROLE_OF |= {"router": "router", "seed": "client", "assets": "demo"}
# target -> the extras its `pip install` names (docs/design.md §10.1: a role's image installs that role only)
# (the router and the workers serve the OpenAI-compatible HTTP API too: the `http` extra)
EXTRAS_OF = {"client": set(), "router": {"http"}, "registry": {"registry", "postgres", "gcs"}}
EXTRAS_OF |= {"worker": {"worker", "gcs", "http"}, "demo": {"worker", "gcs", "http", "demo"}}


def dockerfile_stages() -> dict[str, dict]:
    """``FROM … AS name`` stages of the Dockerfile: their parent and the extras their pip installs name."""
    stages: dict[str, dict] = {}
    current = None
    for line in (ROOT / "Dockerfile").read_text().splitlines():
        if line.startswith("FROM "):
            parent, _, name = line.removeprefix("FROM ").partition(" AS ")
            current = stages[name.strip()] = {"parent": parent.strip(), "extras": set()}
        elif current is not None and line.startswith("RUN pip install") and "/wheels/loraserve" in line:
            extras = line.split("]")[0].split("[")[1] if "[" in line else ""
            current["extras"] |= {e for e in extras.split(",") if e}
    return stages


def stage_extras(stages: dict[str, dict], name: str) -> set[str]:
    stage = stages[name]
    inherited = stage_extras(stages, stage["parent"]) if stage["parent"] in stages else set()
    return stage["extras"] | inherited


def test_each_service_runs_the_image_of_its_role() -> None:
    stages = dockerfile_stages()
    assert set(ROLE_OF) == set(OURS)
    for name, svc in OURS.items():
        role = ROLE_OF[name]
        assert svc["build"] == {"context": ".", "target": role}, name
        assert svc["image"] == f"loraserve-{role}:dev", name
        assert stage_extras(stages, role) == EXTRAS_OF[role], role
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for role in EXTRAS_OF.values():
        assert role <= set(extras)


def loraserve_commands(svc: dict) -> list[list[str]]:
    """Every ``loraserve …`` argv a service runs (also inside ``sh -c`` scripts)."""
    cmd = svc.get("command") or []
    if cmd[:2] == ["sh", "-c"]:
        script = cmd[2].replace("$$a", "demo-x").replace("$$", "$")
        parts = [p.strip().removeprefix("do ").strip() for p in script.replace(";", "\n").splitlines()]
        return [shlex.split(p.split("||")[0]) for p in parts if p.startswith("loraserve")]
    return [cmd] if cmd and cmd[0] == "loraserve" else []


def test_every_loraserve_service_runs_our_cli() -> None:
    assert set(OURS) == {"migrate", "assets", "registry", "worker-1", "worker-2", "router", "seed"}
    for name, svc in OURS.items():
        commands = loraserve_commands(svc)
        assert commands, f"{name} runs no loraserve command"
        for argv in commands:
            build_parser().parse_args(argv[1:])  # every flag exists (argparse exits 2 otherwise)


@pytest.mark.parametrize("name", sorted(OURS))
def test_each_command_answers_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    for argv in loraserve_commands(OURS[name]):
        path = [a for a in argv[1:] if not a.startswith("-")][:2]
        subcommand = path[:2] if path[0] in ("registry", "router", "adapters", "workers") else path[:1]
        with pytest.raises(SystemExit) as exc:
            main([*subcommand, "--help"])
        assert exc.value.code == 0
        assert "usage: loraserve" in capsys.readouterr().out


def test_every_variable_is_one_our_config_reads() -> None:
    for name, svc in OURS.items():
        for var in svc.get("environment", {}):
            assert var in KNOWN_ENV, f"{name} sets {var}, which nothing reads"


def test_dependency_graph_is_acyclic_with_health_conditions() -> None:
    graph = {name: dict(svc.get("depends_on") or {}) for name, svc in SERVICES.items()}
    jobs = {"migrate", "assets", "seed"}
    for name, deps in graph.items():
        for dep, spec in deps.items():
            assert dep in SERVICES, f"{name} depends on unknown {dep}"
            want = "service_completed_successfully" if dep in jobs else "service_healthy"
            assert spec["condition"] == want, (name, dep)
    order: list[str] = []
    pending = dict(graph)
    while pending:
        ready = [n for n, deps in pending.items() if all(d in order for d in deps)]
        assert ready, f"dependency cycle among {sorted(pending)}"
        order += sorted(ready)
        for n in ready:
            del pending[n]
    assert order.index("router") > order.index("worker-1") > order.index("registry") > order.index("migrate")


def test_every_long_running_service_has_a_real_healthcheck(capsys: pytest.CaptureFixture[str]) -> None:
    jobs = {"migrate", "assets", "seed"}
    for name, svc in SERVICES.items():
        if name in jobs:
            continue
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD"
        if test[1] == "loraserve":
            assert test[2] == "health"
            with pytest.raises(SystemExit) as exc:
                main(["health", "--help"])
            assert exc.value.code == 0
            port = test[3].rsplit(":", 1)[1]
            assert any(f"--port {port}" in " ".join(c) for c in loraserve_commands(svc)), name
        else:
            assert test[1] in THIRD_PARTY_PROBES, name


def test_health_probe_against_a_live_and_a_dead_server(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from loraserve.registry.config import RegistryConfig
    from tests.registry.conftest import start_registry

    config = RegistryConfig(db=f"sqlite:///{tmp_path / 'r.db'}", storage=str(tmp_path / "s"))
    with start_registry(config, str(tmp_path / "s")) as env:
        assert main(["health", env.address]) == 0
        assert capsys.readouterr().out.strip() == f"{env.address}: SERVING"
    assert main(["health", "127.0.0.1:1", "--timeout", "0.5"]) == 1
    assert "UNAVAILABLE" in capsys.readouterr().err


def test_the_image_build_copies_every_room() -> None:
    """The wheel is built inside the Dockerfile from COPYed folders: a room missing there is missing from
    every image (the wheel test in tests/test_packaging.py builds from the checkout, which has them all)."""
    import tomllib

    rooms = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    )
    copied = {
        line.split()[1]
        for line in (ROOT / "Dockerfile").read_text().splitlines()
        if line.startswith("COPY ") and "--from" not in line
    }
    assert rooms <= copied, f"not copied into the build stage: {sorted(rooms - copied)}"
