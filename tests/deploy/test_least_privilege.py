"""Least privilege in docker-compose.yml and deploy/k8s (docs/security.md, "Deployments"): auth is on in every
server, each component presents on each hop a token of the one scope that hop needs (workers -> registry:
worker; router -> registry: router; router -> workers: Generate only), and no pod but the registry (which
checks it) and admin jobs reads the registry's admin token. Token values are resolved as the pods get them
(ConfigMaps, Secret keys, $(VAR) references) and fed to the servers' own config classes."""

from __future__ import annotations

import re

import pytest

from loraserve.common.security import ADMIN, GENERATE, INFERENCE, ROUTER, WORKER, ServerSecurity
from tests.deploy.test_compose import OURS
from tests.deploy.test_k8s import (
    RENDERS,
    ROLES,
    containers,
    loraserve_containers,
    named,
    pod_templates,
    render,
    role_of,
)


def security_of(role: str, env: dict[str, str]) -> ServerSecurity:
    cls, prefix, _, _ = ROLES[role]
    return cls.from_env({k: v for k, v in env.items() if k.startswith(prefix)}).security()


def check_hops(env: dict[str, dict[str, str]], admin_holders: set[str]) -> None:
    """``env``: role -> its variables' values (one registry, one worker, one router)."""
    registry, worker = security_of("registry", env["registry"]), security_of("worker", env["worker"])
    router = security_of("router", env["router"])
    assert registry.auth_on and worker.auth_on and router.auth_on
    assert registry.scopes_of(env["worker"]["LORASERVE_WORKER_REGISTRY_TOKEN"]) == {WORKER}
    assert registry.scopes_of(env["router"]["LORASERVE_ROUTER_REGISTRY_TOKEN"]) == {ROUTER}
    to_workers = env["router"]["LORASERVE_ROUTER_WORKER_TOKEN"]
    assert worker.scopes_of(to_workers) and worker.scopes_of(to_workers) <= {INFERENCE, ROUTER}
    assert worker.refusal(to_workers, GENERATE) is None
    assert router.scopes_of(to_workers) == set()  # a hop's token opens that hop only
    # the registry's admin token: checked by the registry, held by operators and admin jobs, no other pod
    (admin,) = registry.tokens(ADMIN)
    holders = {name for name, values in env.items() if any(admin in v.split(",") for v in values.values())}
    assert holders <= {"registry"} | admin_holders, holders
    assert not router.admin_tokens or set(router.admin_tokens).isdisjoint(registry.admin_tokens)
    assert set(worker.admin_tokens).isdisjoint(registry.admin_tokens)


def test_compose_gives_each_service_the_scope_of_its_hops() -> None:
    env = {name: {k: str(v) for k, v in (svc.get("environment") or {}).items()} for name, svc in OURS.items()}
    assert env["worker-1"] == {**env["worker-2"], "LORASERVE_WORKER_ADVERTISE_ADDRESS": "worker-1:50061"}
    hops = {"registry": env["registry"], "worker": env["worker-1"], "router": env["router"]}
    check_hops({**env, **hops}, admin_holders={"seed"})
    assert security_of("registry", env["registry"]).scopes_of(env["seed"]["LORASERVE_TOKEN"]) == {ADMIN}


def k8s_env(objects, container: dict) -> dict[str, str]:
    """The container's variables as the kubelet sets them: ConfigMap values, Secret keys' values,
    ``$(VAR)`` references expanded (the downward API as a placeholder)."""

    def secret_value(ref: dict) -> str:
        secret = named(objects, "Secret", ref["name"])
        assert "data" not in secret or ref["key"] not in secret["data"], "placeholders are stringData"
        return secret["stringData"][ref["key"]]

    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        assert "secretRef" not in source, "a whole Secret in a pod's environment: name the keys it needs"
        env.update(named(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], e["value"])
        elif "secretKeyRef" in e["valueFrom"]:
            env[e["name"]] = secret_value(e["valueFrom"]["secretKeyRef"])
        else:
            env[e["name"]] = "from-the-downward-api"
    return env


def token_keys(objects, container: dict) -> set[str]:
    """The keys of the loraserve-tokens Secret a container reads."""
    return {
        e["valueFrom"]["secretKeyRef"]["key"]
        for e in container.get("env", [])
        if e.get("valueFrom", {}).get("secretKeyRef", {}).get("name") == "loraserve-tokens"
    }


@pytest.mark.parametrize("name", sorted(RENDERS))
def test_k8s_gives_each_pod_the_scope_of_its_hops(name: str) -> None:
    objects = render(name)
    servers = {role: k8s_env(objects, c) for _, _, c, role in loraserve_containers(objects)}
    assert set(servers) == {"registry", "worker", "router"}
    admin_jobs = set()
    for workload, template in pod_templates(objects):
        admin_pod = template["metadata"].get("labels", {}).get("loraserve.dev/admin") == "true"
        for c in containers(template):
            if "admin" in token_keys(objects, c) and not admin_pod:
                assert role_of(c) == "registry", (workload["metadata"]["name"], c["name"])
            if admin_pod:
                admin_jobs.add(workload["metadata"]["name"])
                servers[workload["metadata"]["name"]] = k8s_env(objects, c)
    check_hops(servers, admin_holders=admin_jobs)
    keys = {role: token_keys(objects, c) for _, _, c, role in loraserve_containers(objects)}
    assert keys == {
        "registry": {"admin", "router", "worker"},
        "worker": {"worker-admin", "inference", "router-generate", "worker"},
        "router": {"inference", "router", "router-generate"},
    }
