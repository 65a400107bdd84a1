"""The base install is the SDK, the CLI's client side and the router (docs/design.md §10.1): `loraserve adapters
push`, `adapters ls`, `generate` and `health` run with JAX, torch, SQLAlchemy, numpy (and everything else that
only the server extras bring) made unimportable, against a real registry and worker (full installs) and a
router that runs with the same packages unimportable, and stream exactly the tokens that a full install gets,
a weighted mix included (the router parses and validates it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import with_test_xla_flags
from tests.e2e.procs import COMPOSE_SHAPES, loraserve_process, wait_for_workers, worker_args

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# What the base install does not bring: the worker, registry, http, demo and dev extras' packages.
HEAVY = ("jax", "jaxlib", "torch", "sqlalchemy", "alembic", "transformers", "peft", "tokenizers")
HEAVY += ("safetensors", "numpy", "psycopg", "gcsfs", "fastapi", "uvicorn")

BLOCKER = f"""
import importlib.abc, sys

class _Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {HEAVY!r}:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked: not in the base install)", name=name)
        return None

sys.meta_path.insert(0, _Blocked())
"""
MODEL_ID = "base-install-tiny"


@pytest.fixture
def blocked_env(tmp_path: Path) -> dict[str, str]:
    site = tmp_path / "blocker"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)
    return env


def _cli(args: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "loraserve", *args], capture_output=True, text=True, timeout=120, env=env
    )


def test_the_blocker_blocks(blocked_env: dict[str, str]) -> None:
    for module in ("jax", "torch", "sqlalchemy", "numpy"):
        out = subprocess.run(
            [sys.executable, "-c", f"import {module}"], capture_output=True, text=True, env=blocked_env
        )
        assert out.returncode == 1
        assert "blocked: not in the base install" in out.stderr


def test_client_commands_run_without_server_packages(
    blocked_env: dict[str, str], llama_dir: Path, adapter_dirs: dict[str, Path], tmp_path: Path
) -> None:
    registry_args = ["registry", "serve", "--db", f"sqlite:///{tmp_path / 'r.db'}"]
    registry_args += ["--storage", str(tmp_path / "store"), "--port", "0", "--lease-seconds", "5"]
    with loraserve_process(registry_args) as registry:
        push_args = ["adapters", "push", str(adapter_dirs["all-r4"]), "--name", "blocked-push"]
        push_args += ["--base-model", MODEL_ID, "--registry", registry.address, "--json"]
        push = _cli(push_args, env=blocked_env)
        assert push.returncode == 0, push.stderr
        pushed = json.loads(push.stdout)
        assert (pushed["name"], pushed["version"], pushed["rank"]) == ("blocked-push", 1, 4)
        stored = (adapter_dirs["all-r4"] / "adapter_model.safetensors").read_bytes()
        assert int(pushed["size_bytes"]) == len(stored)

        listed = _cli(["adapters", "ls", "--registry", registry.address, "--json"], env=blocked_env)
        assert listed.returncode == 0, listed.stderr
        assert [(a["name"], a["version"]) for a in json.loads(listed.stdout)] == [("blocked-push", 1)]

        args = worker_args(llama_dir, registry.address, *COMPOSE_SHAPES, model_id=MODEL_ID, warmup=False)
        with loraserve_process(args, env=with_test_xla_flags()) as worker:  # compile-bound
            from loraserve.client.registry_client import RegistryClient

            with RegistryClient(registry.address) as reg:
                assert len(wait_for_workers(reg, 1)) == 1
            router_args = ["router", "serve", "--registry", registry.address, "--port", "0"]
            with loraserve_process(router_args, env=blocked_env) as router:
                health = _cli(["health", router.address], env=blocked_env)
                assert health.returncode == 0, health.stderr
                for adapter in ("", "blocked-push"):
                    args = ["generate", "--target", router.address, "--max-tokens", "6", "--json"]
                    args += ["--adapter", adapter, "What is the capital of France?"]
                    full = _cli(args)
                    base_only = _cli(args, env=blocked_env)
                    assert full.returncode == 0, full.stderr
                    assert base_only.returncode == 0, base_only.stderr
                    chunks = [json.loads(line) for line in base_only.stdout.splitlines()]
                    reference = [json.loads(line) for line in full.stdout.splitlines()]
                    for chunk in (*chunks, *reference):
                        assert chunk.pop("request_id")  # each call gets its own
                    tokens = [t for c in chunks for t in c["token_ids"]]
                    assert len(tokens) == 6 or chunks[-1]["finish_reason"] == "eos"
                    assert chunks[-1]["adapter"] == ("blocked-push@1" if adapter else "")
                    assert chunks == reference  # same tokens, same text, same usage
                # a mix goes through the router's mix parsing and validation (adapters.mixes)
                args = ["generate", "--target", router.address, "--max-tokens", "4", "--json"]
                mixed = _cli([*args, "--mix", "blocked-push=0.5", "hi"], env=blocked_env)
                assert mixed.returncode == 0, mixed.stderr
                assert json.loads(mixed.stdout.splitlines()[-1])["adapter"] == "blocked-push@1*0.5"
                too_big = _cli([*args, "--mix", "blocked-push=1e+16", "hi"], env=blocked_env)
                assert too_big.returncode == 1, too_big.stderr
                assert (
                    "INVALID_ARGUMENT: mix weight of 'blocked-push' must be finite and within ±100"
                    in too_big.stderr
                )
                assert router.popen.poll() is None
            assert worker.popen.poll() is None
