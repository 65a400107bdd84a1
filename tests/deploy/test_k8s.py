"""deploy/k8s is checked without a cluster: every kustomization renders (`kubectl kustomize`), every object
validates against the Kubernetes JSON schemas (kubernetes-validate, offline), and the objects agree with each
other and with the servers: selectors select real pods, ports are ones the servers bind, every LORASERVE_*
variable is a field of its role's config dataclass, every referenced Secret/ConfigMap key exists.

The gateway example uses CRDs the schema package does not know (InferencePool, Gateway, HTTPRoute): their
required fields are checked here by hand, after the extension's and Gateway API's CRDs. So is the multi-host
overlay's LeaderWorkerSet, whose two pod templates are validated as core PodTemplates.
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from dataclasses import fields
from functools import cache
from pathlib import Path

import pytest
import yaml

from loraserve.cli import build_parser
from loraserve.registry.config import RegistryConfig
from loraserve.router.config import RouterConfig
from loraserve.worker.config import WorkerConfig
from tests.deploy.exported_metrics import exported_families

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
KUBERNETES_VERSION = "1.32.0"  # schemas validated against (native sidecars need >= 1.29)

# kustomization -> what it is applied with (the gateway goes on top of an overlay)
RENDERS = {
    "base": ["base"],
    "local": ["overlays/local"],
    "gke-tpu": ["overlays/gke-tpu"],
    "gke-tpu+gateway": ["overlays/gke-tpu", "gateway"],
    "gke-tpu-multihost": ["overlays/gke-tpu-multihost"],
}
CRDS = {"InferencePool", "Gateway", "HTTPRoute", "LeaderWorkerSet"}
# GKE's cloud.google.com/gke-tpu-accelerator values -> `loraserve plan --chip`
GKE_TPU_CHIPS = {"tpu-v5-lite-podslice": "v5e", "tpu-v5p-slice": "v5p", "tpu-v6e-slice": "v6e"}

ROLES = {  # role -> (config dataclass, env prefix, Dockerfile image, argv)
    "registry": (
        RegistryConfig,
        "LORASERVE_REGISTRY_",
        "loraserve-registry",
        ["loraserve", "registry", "serve"],
    ),
    "worker": (WorkerConfig, "LORASERVE_WORKER_", "loraserve-worker", ["loraserve", "worker"]),
    "router": (RouterConfig, "LORASERVE_ROUTER_", "loraserve-router", ["loraserve", "router", "serve"]),
}
# Variables a loraserve container may set besides its role's LORASERVE_<ROLE>_<FIELD> twins.
OTHER_ENV = {
    "LORASERVE_LOG_FORMAT",  # common.observability.setup_logging
    "LORASERVE_KERNEL_CACHE_DIR",  # kernels/cpu.py
    "STORAGE_EMULATOR_HOST",  # gcsfs (docs/design.md §3)
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT",  # gcsfs
    "HOME",
    "POD_NAME",  # downward API, used in the worker's advertise address
    "TPU_PROCESS_PORT",  # libtpu's slice-builder port (overlays/gke-tpu-multihost)
}
HELPER_ENV = re.compile(r"TOKEN_[A-Z_]+")  # Secret values composed into token lists by $(TOKEN_X)
# Pod labels that policies admit but that pods outside these manifests carry (operators, Prometheus).
EXTERNAL_LABELS = {"loraserve.dev/admin", "loraserve.dev/metrics-scraper"}


def role_env_names(role: str) -> set[str]:
    cls, prefix, _, _ = ROLES[role]
    return {prefix + f.name.upper() for f in fields(cls)}


# ---------------------------------------------------------------- rendering


@cache
def render(name: str) -> tuple[dict, ...]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed: cannot render the kustomizations (`kubectl kustomize`)")
    objects: list[dict] = []
    for path in RENDERS[name]:
        out = subprocess.run(
            ["kubectl", "kustomize", str(K8S / path)], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, f"kubectl kustomize {path} failed:\n{out.stderr}"
        objects += [o for o in yaml.safe_load_all(out.stdout) if o]
    return tuple(objects)


@pytest.fixture(params=sorted(RENDERS))
def objects(request) -> tuple[dict, ...]:
    return render(request.param)


def of_kind(objects, kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def named(objects, kind: str, name: str) -> dict:
    found = [o for o in of_kind(objects, kind) if o["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} found"
    return found[0]


WORKLOADS = ("Deployment", "StatefulSet", "Job", "DaemonSet")


def pod_templates(objects) -> list[tuple[dict, dict]]:
    """(workload, its pod template) for every workload; a LeaderWorkerSet's leader and worker templates are
    two entries of the same workload."""
    out = [(o, o["spec"]["template"]) for o in objects if o["kind"] in WORKLOADS]
    for lws in of_kind(objects, "LeaderWorkerSet"):
        lwt = lws["spec"]["leaderWorkerTemplate"]
        out += [(lws, lwt[key]) for key in ("leaderTemplate", "workerTemplate") if key in lwt]
    return out


def is_follower(workload: dict, template: dict) -> bool:
    """A multi-host worker's non-leader pods (a LeaderWorkerSet's workerTemplate beside a leaderTemplate):
    they run the same command, but serve nothing."""
    lwt = workload["spec"].get("leaderWorkerTemplate", {})
    return "leaderTemplate" in lwt and template is lwt["workerTemplate"]


def serving_worker(objects) -> tuple[dict, dict]:
    """The worker workload and the template of its pods that serve: the StatefulSet's, or a LeaderWorkerSet's
    leader template."""
    (found,) = [
        (w, t)
        for w, t in pod_templates(objects)
        if w["metadata"]["name"] == "loraserve-worker" and not is_follower(w, t)
    ]
    return found


def worker_subdomain(workload: dict) -> str:
    """The headless Service whose name is the worker pods' subdomain: a StatefulSet's serviceName; a
    LeaderWorkerSet's own name (subdomainPolicy Shared)."""
    if workload["kind"] == "StatefulSet":
        return workload["spec"]["serviceName"]
    assert workload["spec"].get("networkConfig", {}).get("subdomainPolicy", "Shared") == "Shared"
    return workload["metadata"]["name"]


def matches(selector: dict, labels: dict) -> bool:
    """A label selector (matchLabels / matchExpressions, or a plain map) against a label map."""
    plain = {k: v for k, v in selector.items() if k not in ("matchLabels", "matchExpressions")}
    wanted = {**plain, **selector.get("matchLabels", {})}
    if any(labels.get(k) != v for k, v in wanted.items()):
        return False
    for expr in selector.get("matchExpressions", []):
        value, op = labels.get(expr["key"]), expr["operator"]
        if (op == "In" and value not in expr["values"]) or (op == "NotIn" and value in expr["values"]):
            return False
        if (op == "Exists" and value is None) or (op == "DoesNotExist" and value is not None):
            return False
    return True


def selected_pods(objects, selector: dict) -> list[tuple[dict, dict]]:
    return [(w, t) for w, t in pod_templates(objects) if matches(selector, t["metadata"].get("labels", {}))]


def containers(template: dict, init: bool = True) -> list[dict]:
    spec = template["spec"]
    return spec["containers"] + (spec.get("initContainers", []) if init else [])


def role_of(container: dict) -> str | None:
    """The loraserve role a container runs, from its image (overlays rename the registry, keep the role)."""
    image = container["image"].rsplit("/", 1)[-1].split(":")[0]
    for role, (_, _, base_image, _) in ROLES.items():
        if image in (base_image, f"{role}", f"{role}-tpu"):
            return role
    return None


def loraserve_containers(objects) -> list[tuple[dict, dict, dict, str]]:
    """(workload, template, container, role) for every container that runs a loraserve server."""
    out = []
    for w, t in pod_templates(objects):
        for c in containers(t, init=False):
            role = role_of(c)
            if role and c.get("command", [])[:3] == ROLES[role][3][:3]:
                out.append((w, t, c, role))
    return out


def container_env(objects, container: dict) -> dict[str, str | None]:
    """Every variable the container gets: envFrom ConfigMaps (values) and env entries (values, or None
    when from a Secret or the downward API). Later entries win, as in Kubernetes."""
    env: dict[str, str | None] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(named(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
        if "secretRef" in source:
            secret = named(objects, "Secret", source["secretRef"]["name"])
            env.update(dict.fromkeys({**secret.get("data", {}), **secret.get("stringData", {})}))
    for e in container.get("env", []):
        env[e["name"]] = e.get("value")
    return env


def bound_ports(objects, container: dict, role: str) -> dict[str, int]:
    """``field -> port`` the server binds: config defaults < the container's environment < its flags."""
    cls, prefix, _, _ = ROLES[role]
    env = {
        k: v for k, v in container_env(objects, container).items() if v is not None and k.startswith(prefix)
    }
    config = cls.from_env(env)
    args = build_parser().parse_args(container["command"][1:] + container.get("args", []))
    ports = {}
    for name in ("port", "http_port", "metrics_port"):
        value = getattr(args, name, None) or getattr(config, name, 0)
        if value:
            ports[name] = int(value)
    return ports


def worker_config(objects, container: dict) -> WorkerConfig:
    """The WorkerConfig a worker container starts with (its ConfigMap and literal variables)."""
    env = container_env(objects, container)
    prefix = ROLES["worker"][1]
    return WorkerConfig.from_env(
        {k: v for k, v in env.items() if k.startswith(prefix) and v is not None and "$(" not in v}
    )


def planned(objects, template: dict):
    """`loraserve plan` (in process) for a TPU worker pod: the model, slots, batch, context and dtypes of its
    configuration, the tensor parallel size read from LORASERVE_WORKER_TENSOR_PARALLEL_SIZE and the chip from
    the pod's cloud.google.com/gke-tpu-accelerator label."""
    from loraserve.models import planner

    container = template["spec"]["containers"][0]
    env = container_env(objects, container)
    tp = int(env["LORASERVE_WORKER_TENSOR_PARALLEL_SIZE"])
    chip = GKE_TPU_CHIPS[template["spec"]["nodeSelector"]["cloud.google.com/gke-tpu-accelerator"]]
    config = worker_config(objects, container)
    assert config.tensor_parallel_size == tp and isinstance(config.max_seq_len, int)
    # the checkpoint is the preset the planner counts
    assert env["LORASERVE_WORKER_MODEL"].rstrip("/").rsplit("/", 1)[1] == config.model_id
    name, model = planner.load_model_config(config.model_id)
    return planner.plan(
        name,
        model,
        chip,
        tp,
        max_loras=config.max_loras,
        max_lora_rank=config.max_lora_rank,
        batch=config.max_batch_size,
        context=config.max_seq_len,
        dtype=config.dtype,
        lora_dtype=config.lora_dtype,
        quantization=config.quantization,
    )


# ---------------------------------------------------------------- schemas


def test_every_kustomization_renders_and_validates_against_the_kubernetes_schemas(objects) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    kinds = {o["kind"] for o in objects}
    checked = [o for o in objects if o["kind"] not in CRDS]
    for lws in of_kind(objects, "LeaderWorkerSet"):  # its templates are core PodTemplateSpecs
        for key, template in lws["spec"]["leaderWorkerTemplate"].items():
            if key in ("leaderTemplate", "workerTemplate"):
                name = f"{lws['metadata']['name']}.{key}"
                checked.append(
                    {
                        "apiVersion": "v1",
                        "kind": "PodTemplate",
                        "metadata": {"name": name},
                        "template": template,
                    }
                )
    for obj in checked:
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = "/".join(str(p) for p in exc.path)
            pytest.fail(f"{obj['kind']}/{obj['metadata']['name']}: {where}: {exc.message}")
    assert kinds & {"Deployment", "StatefulSet", "Service"}


def test_the_schema_check_catches_a_mistake() -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    deployment = named(render("base"), "Deployment", "loraserve-router")
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["port"] = "grpc"  # int only
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)
    broken = yaml.safe_load(yaml.safe_dump(deployment))
    broken["spec"]["template"]["spec"]["containers"][0]["envFromm"] = []  # unknown field (strict)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_the_gateway_crds_have_their_required_fields() -> None:
    objects = render("gke-tpu+gateway")
    pool = named(objects, "InferencePool", "loraserve-workers")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    spec = pool["spec"]
    assert {"selector", "targetPorts", "endpointPickerRef"} <= set(spec)  # the v1 CRD's required
    assert spec["selector"]["matchLabels"]
    assert 1 <= len(spec["targetPorts"]) <= 8 and all(
        isinstance(p["number"], int) for p in spec["targetPorts"]
    )
    ref = spec["endpointPickerRef"]
    assert ref["name"] and ref.get("kind", "Service") == "Service" and isinstance(ref["port"]["number"], int)

    gateway = named(objects, "Gateway", "loraserve-gateway")
    assert gateway["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert gateway["spec"]["gatewayClassName"]
    for listener in gateway["spec"]["listeners"]:
        assert {"name", "port", "protocol"} <= set(listener)

    route = named(objects, "HTTPRoute", "loraserve")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    for parent in route["spec"]["parentRefs"]:
        assert parent.get("kind", "Gateway") == "Gateway"
        named(objects, "Gateway", parent["name"])
    for rule in route["spec"]["rules"]:
        for backend in rule["backendRefs"]:
            assert (backend["group"], backend["kind"]) == ("inference.networking.k8s.io", "InferencePool")
            named(objects, "InferencePool", backend["name"])


# ---------------------------------------------------------------- cross-references


def test_labels_are_consistent(objects) -> None:
    for obj in objects:
        labels = obj["metadata"].get("labels", {})
        assert labels.get("app.kubernetes.io/part-of") == "loraserve", (
            f"{obj['kind']}/{obj['metadata']['name']}"
        )
    for w, t, _, role in loraserve_containers(objects):
        labels = t["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "loraserve"
        assert labels["app.kubernetes.io/component"] == role, w["metadata"]["name"]
        assert w["metadata"]["labels"]["app.kubernetes.io/component"] == role


def test_workers_carry_llm_d_s_engine_type_and_export_its_metric_names(objects) -> None:
    """llm-d's routers read a pod's metrics by the names its ``llm-d.ai/engine-type`` label says: every worker
    pod that serves says vllm and its configuration turns on vLLM's names (``--metrics-compat vllm``);
    multi-host followers export no metrics and carry no such label."""
    workers = []
    for w, t, c, role in loraserve_containers(objects):
        if role == "worker" and is_follower(w, t):
            assert "llm-d.ai/engine-type" not in t["metadata"]["labels"]
        elif role == "worker":
            workers.append((w, t, c))
    assert workers
    for _, template, container in workers:
        assert template["metadata"]["labels"]["llm-d.ai/engine-type"] == "vllm"
        assert container_env(objects, container)["LORASERVE_WORKER_METRICS_COMPAT"] == "vllm"


def test_every_server_role_runs_from_its_image_with_our_cli(objects) -> None:
    found = {role for _, _, _, role in loraserve_containers(objects)}
    assert found == set(ROLES)
    for _w, t in pod_templates(objects):
        for c in containers(t):
            argv = c.get("command", []) + c.get("args", [])
            if argv[:1] == ["loraserve"]:
                build_parser().parse_args(argv[1:])  # argparse exits 2 on an unknown flag or command
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                command = c.get(probe, {}).get("exec", {}).get("command", [])
                if command[:1] == ["loraserve"]:
                    build_parser().parse_args(command[1:])


def test_every_loraserve_variable_is_a_field_of_its_roles_config(objects) -> None:
    migrate = named(objects, "Job", "loraserve-migrate")["spec"]["template"]
    checked = [(t, c, role) for _, t, c, role in loraserve_containers(objects)]
    checked.append((migrate, migrate["spec"]["containers"][0], "registry"))
    for _t, c, role in checked:
        known = role_env_names(role) | OTHER_ENV
        env = container_env(objects, c)
        for name in env:
            assert name in known or HELPER_ENV.fullmatch(name), f"{role} sets {name}, which nothing reads"
        # $(VAR) in a value must name a variable defined before it in the same container
        defined: set[str] = {
            k for s in c.get("envFrom", []) for k in container_env(objects, {"envFrom": [s]})
        }
        for e in c.get("env", []):
            for ref in re.findall(r"\$\((\w+)\)", e.get("value", "")):
                assert ref in defined, f"{role}: {e['name']} uses $({ref}) before it is defined"
            defined.add(e["name"])


def test_client_containers_set_only_variables_the_cli_reads(objects) -> None:
    """Jobs and init containers that run client commands (`adapters push`, `demo --build-only`)."""
    from loraserve.client.connection_flags import FLAGS

    client_env = {env for _, env, _ in FLAGS.values()} | {"LORASERVE_REGISTRY_ADDRESS", "LORASERVE_TARGET"}
    servers = {id(c) for _, _, c, _ in loraserve_containers(objects)}
    for w, t in pod_templates(objects):
        for c in containers(t):
            if id(c) in servers or w["metadata"]["name"] == "loraserve-migrate":
                continue
            for name in container_env(objects, c):
                if name.startswith("LORASERVE_"):
                    assert name in client_env, f"{w['metadata']['name']}/{c['name']} sets {name}"


def test_config_maps_parse_with_the_server_configs(objects) -> None:
    """Every value a role's container sees builds its config (a bad number or bool would stop the server)."""
    for _, _, c, role in loraserve_containers(objects):
        cls, prefix, _, _ = ROLES[role]
        env = {k: v for k, v in container_env(objects, c).items() if k.startswith(prefix)}
        env = {k: (v if v is not None and "$(" not in v else "x") for k, v in env.items()}
        cls.from_env(env)


def test_every_referenced_secret_and_config_map_key_exists(objects) -> None:
    def keys(kind: str, name: str) -> set[str]:
        obj = named(objects, kind, name)
        return set(obj.get("data", {})) | set(obj.get("stringData", {}))

    for w, t in pod_templates(objects):
        spec = t["spec"]
        for c in containers(t):
            for source in c.get("envFrom", []):
                for kind, ref in (("ConfigMap", "configMapRef"), ("Secret", "secretRef")):
                    if ref in source:
                        keys(kind, source[ref]["name"])
            for e in c.get("env", []):
                src = e.get("valueFrom", {})
                if "secretKeyRef" in src:
                    assert src["secretKeyRef"]["key"] in keys("Secret", src["secretKeyRef"]["name"]), e
                if "configMapKeyRef" in src:
                    assert src["configMapKeyRef"]["key"] in keys(
                        "ConfigMap", src["configMapKeyRef"]["name"]
                    ), e
            mounted = {v["name"] for v in spec.get("volumes", [])}
            mounted |= {v["metadata"]["name"] for v in w["spec"].get("volumeClaimTemplates", [])}
            for m in c.get("volumeMounts", []):
                assert m["name"] in mounted, f"{w['metadata']['name']}: volume {m['name']} is not declared"
        for v in spec.get("volumes", []):
            if "secret" in v:
                keys("Secret", v["secret"]["secretName"])
            if "configMap" in v:
                keys("ConfigMap", v["configMap"]["name"])
        if "serviceAccountName" in spec:
            named(objects, "ServiceAccount", spec["serviceAccountName"])


def test_tls_material_is_a_read_only_secret_mount_the_tls_paths_point_into(objects) -> None:
    for _, t, c, role in loraserve_containers(objects):
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        tls = mounts["/etc/loraserve/tls"]
        assert tls.get("readOnly") is True
        volume = next(v for v in t["spec"]["volumes"] if v["name"] == tls["name"])
        secret = named(objects, "Secret", volume["secret"]["secretName"])
        files = set(secret.get("data", {})) | set(secret.get("stringData", {}))
        for name, value in container_env(objects, c).items():
            if re.search(r"TLS_(CERT|KEY|CA|CLIENT_CA)$", name) and value:
                directory, _, file = value.rpartition("/")
                assert directory == "/etc/loraserve/tls" and file in files, (role, name, value)


def test_container_and_probe_ports_are_the_ones_the_servers_bind(objects) -> None:
    from loraserve.engine import multihost

    for w, t, c, role in loraserve_containers(objects):
        if is_follower(w, t):  # serves nothing: nothing to declare, nothing to probe
            assert "ports" not in c and not {"startupProbe", "readinessProbe", "livenessProbe"} & set(c)
            continue
        bound = bound_ports(objects, c, role)
        assert set(bound) == {"port", "http_port", "metrics_port"} - (
            {"http_port"} if role == "registry" else set()
        )
        if w["kind"] == "LeaderWorkerSet":  # the leader also listens for its group (engine.multihost)
            coordinator = multihost.DEFAULT_COORDINATOR_PORT
            bound |= {"coordinator": coordinator, "step": coordinator + 1}
        declared = {p["containerPort"] for p in c["ports"]}
        assert declared == set(bound.values()), (w["metadata"]["name"], declared, bound)
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if probe not in c:
                continue
            spec = c[probe]
            if "grpc" in spec:  # grpc.health.v1 lives on the gRPC port
                assert spec["grpc"]["port"] == bound["port"], (role, probe)
            elif "exec" in spec:
                address = spec["exec"]["command"][2]
                assert int(address.rsplit(":", 1)[1]) == bound["port"], (role, probe)
            else:
                pytest.fail(f"{role} {probe}: neither grpc nor exec")
        assert "readinessProbe" in c and "livenessProbe" in c, role
    worker = serving_worker(objects)[1]["spec"]["containers"][0]
    startup = worker["startupProbe"]  # warm-up compiles for minutes on a TPU
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


def test_every_service_selects_pods_and_targets_ports_they_declare(objects) -> None:
    for svc in of_kind(objects, "Service"):
        pods = selected_pods(objects, svc["spec"]["selector"])
        assert pods, f"Service {svc['metadata']['name']} selects no pod"
        if "ports" not in svc["spec"]:  # only a headless Service gives pods DNS names without ports
            assert svc["spec"]["clusterIP"] == "None", svc["metadata"]["name"]
        for port in svc["spec"].get("ports", []):
            target = port.get("targetPort", port["port"])
            for w, t in pods:
                declared = [p for c in containers(t, init=False) for p in c.get("ports", [])]
                names = {p.get("name") for p in declared}
                numbers = {p["containerPort"] for p in declared}
                assert target in (names if isinstance(target, str) else numbers), (
                    f"Service {svc['metadata']['name']} port {port['name']} -> {target!r}, "
                    f"which {w['metadata']['name']} does not declare"
                )


def test_servers_reach_each_other_by_service_names_that_exist(objects) -> None:
    def service_port(address: str) -> None:
        host, port = address.rsplit(":", 1)
        svc = named(objects, "Service", host)
        assert int(port) in {p["port"] for p in svc["spec"]["ports"]}, address

    for _, _, c, role in loraserve_containers(objects):
        env = container_env(objects, c)
        if role in ("worker", "router"):
            service_port(env[f"LORASERVE_{role.upper()}_REGISTRY"])
    workload, template = serving_worker(objects)
    worker = template["spec"]["containers"][0]
    env = container_env(objects, worker)
    headless = named(objects, "Service", worker_subdomain(workload))
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    for w, _ in selected_pods(objects, headless["spec"]["selector"]):
        assert w is workload, f"{headless['metadata']['name']} also selects {w['metadata']['name']}"
    assert env["LORASERVE_WORKER_ADVERTISE_ADDRESS"] == (
        f"$(POD_NAME).{headless['metadata']['name']}:{bound_ports(objects, worker, 'worker')['port']}"
    )
    pod_name = next(e for e in worker["env"] if e["name"] == "POD_NAME")
    assert pod_name["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_hpa_targets_the_router_deployment(objects) -> None:
    (hpa,) = of_kind(objects, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    ref = hpa["spec"]["scaleTargetRef"]
    target = named(objects, ref["kind"], ref["name"])
    assert target["kind"] == "Deployment" and ref["apiVersion"] == "apps/v1"
    assert target["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"] == "router"
    assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    c = target["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"]["requests"]["cpu"]  # a CPU utilisation target needs a CPU request


def test_disruption_budgets_select_exactly_one_workload_each(objects) -> None:
    covered = set()
    for pdb in of_kind(objects, "PodDisruptionBudget"):
        workloads = {id(w): w for w, _ in selected_pods(objects, pdb["spec"]["selector"])}
        assert len(workloads) == 1, f"PDB {pdb['metadata']['name']} selects {len(workloads)} workloads"
        (workload,) = workloads.values()
        covered.add(workload["metadata"]["name"])
        for w, t in pod_templates(objects):  # a multi-host group's followers too: losing one stops the group
            if w is workload:
                assert matches(pdb["spec"]["selector"], t["metadata"]["labels"])
    assert covered == {"loraserve-registry", "loraserve-router", "loraserve-worker"}


def test_network_policies_select_real_pods_and_let_only_the_router_reach_workers(objects) -> None:
    for policy in of_kind(objects, "NetworkPolicy"):
        assert selected_pods(objects, policy["spec"]["podSelector"]), policy["metadata"]["name"]
        for rule in policy["spec"].get("ingress", []):
            for peer in rule.get("from", []):
                if "podSelector" not in peer:
                    continue
                labels = set(peer["podSelector"].get("matchLabels", {}))
                if labels <= EXTERNAL_LABELS:
                    continue  # operators' and Prometheus's pods live outside these manifests
                assert "namespaceSelector" not in peer, policy["metadata"]["name"]
                assert selected_pods(objects, peer["podSelector"]), f"{policy['metadata']['name']}: {peer}"

    def sources(component: str, port: int) -> list[dict]:
        """The peers that policies admit to ``port`` of pods of ``component`` (``{}`` = anyone)."""
        out = []
        for policy in of_kind(objects, "NetworkPolicy"):
            labels = {"app.kubernetes.io/name": "loraserve", "app.kubernetes.io/component": component}
            if not matches(policy["spec"]["podSelector"], labels):
                continue
            for rule in policy["spec"].get("ingress", []):
                if not rule.get("ports") or any(p["port"] == port for p in rule["ports"]):
                    out += rule.get("from") or [{}]
        return out

    default_deny = named(objects, "NetworkPolicy", "loraserve-default-deny")
    assert default_deny["spec"]["policyTypes"] == ["Ingress"] and "ingress" not in default_deny["spec"]
    router_only = [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "loraserve"} | {
        "app.kubernetes.io/component": "router"}}}]  # fmt: skip
    assert sources("worker", 50061) == router_only
    gateway = any(o["kind"] == "InferencePool" for o in objects)
    http = sources("worker", 8000)
    assert http[:1] == router_only
    scrapers = [
        {"namespaceSelector": {}, "podSelector": {"matchLabels": {"loraserve.dev/metrics-scraper": "true"}}}
    ]
    epp = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "loraserve-epp"}}}
    if gateway:  # the gateway's proxies send requests to the HTTP port; the EPP scrapes the metrics port
        assert http[1:] and all("ipBlock" in p for p in http[1:])
        assert sources("worker", 9100) == [*scrapers, epp]
    else:
        assert http == router_only
        assert sources("worker", 9100) == scrapers
    assert sources("router", 50071) == [{}]  # the front door
    for component in ("registry", "router"):
        assert sources(component, 9100) == scrapers
    registry = sources("registry", 50051)
    components = {p["podSelector"]["matchLabels"].get("app.kubernetes.io/component") for p in registry}
    assert components == {"worker", "router", None}
    assert {"podSelector": {"matchLabels": {"loraserve.dev/admin": "true"}}} in registry


def test_pods_run_as_non_root_with_a_read_only_root(objects) -> None:
    for w, t in pod_templates(objects):
        if not w["metadata"]["name"].startswith("loraserve"):
            continue
        assert t["spec"]["securityContext"]["runAsNonRoot"] is True, w["metadata"]["name"]
        for c in containers(t):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, c["name"]
            assert c["resources"]["requests"] and c["resources"]["limits"], c["name"]


def test_placeholders_are_marked() -> None:
    for secret in of_kind(render("base"), "Secret"):
        for value in secret.get("stringData", {}).values():
            assert "CHANGE-ME" in value, secret["metadata"]["name"]


# ---------------------------------------------------------------- overlays


def test_local_overlay_runs_postgres_fake_gcs_and_small_cpu_workers() -> None:
    objects = render("local")
    named(objects, "StatefulSet", "postgres")
    named(objects, "Service", "postgres")
    gcs = named(objects, "Deployment", "gcs")
    assert gcs["spec"]["template"]["spec"]["containers"][0]["image"].startswith("fsouza/fake-gcs-server")
    gcs_port = named(objects, "Service", "gcs")["spec"]["ports"][0]["port"]
    db_url = named(objects, "Secret", "loraserve-registry-db")["stringData"]["url"]
    host_port = db_url.split("@", 1)[1].split("/", 1)[0]
    assert host_port == f"postgres:{named(objects, 'Service', 'postgres')['spec']['ports'][0]['port']}"
    for _, _, c, role in loraserve_containers(objects):
        env = container_env(objects, c)
        if role in ("registry", "worker"):
            assert env["STORAGE_EMULATOR_HOST"] == f"http://gcs:{gcs_port}", role
        assert "google.com/tpu" not in c["resources"]["limits"]
    registry_env = container_env(objects, named(objects, "Deployment", "loraserve-registry")["spec"]["template"]["spec"]["containers"][0])  # fmt: skip
    assert registry_env["LORASERVE_REGISTRY_STORAGE"].startswith("gs://loraserve/")
    worker = named(objects, "StatefulSet", "loraserve-worker")["spec"]["template"]["spec"]
    env = container_env(objects, worker["containers"][0])
    assert env["LORASERVE_WORKER_MODEL"] == "/assets/model"
    assert [c["name"] for c in worker["initContainers"]] == ["assets"]
    # the seed Job is the admin pod the registry's policy admits
    seed = named(objects, "Job", "loraserve-seed")["spec"]["template"]
    assert seed["metadata"]["labels"]["loraserve.dev/admin"] == "true"
    script = seed["spec"]["containers"][0]["args"][0]
    for line in re.split(r"&&|;", script):
        line = line.strip().removeprefix("do ").strip()
        if line.startswith("loraserve"):
            build_parser().parse_args(shlex.split(line.split("||")[0].replace("$a", "demo-x"))[1:])


def test_gke_tpu_overlay_requests_tpus_matching_the_tensor_parallel_size() -> None:
    objects = render("gke-tpu")
    worker = named(objects, "StatefulSet", "loraserve-worker")["spec"]["template"]["spec"]
    selector = worker["nodeSelector"]
    assert selector["cloud.google.com/gke-tpu-accelerator"] and selector["cloud.google.com/gke-tpu-topology"]
    c = worker["containers"][0]
    chips = int(c["resources"]["limits"]["google.com/tpu"])
    assert int(c["resources"]["requests"]["google.com/tpu"]) == chips
    x, y = (int(n) for n in selector["cloud.google.com/gke-tpu-topology"].split("x"))
    assert chips == x * y  # one pod holds the whole single-host slice
    env = container_env(objects, c)
    assert int(env["LORASERVE_WORKER_TENSOR_PARALLEL_SIZE"]) == chips
    plan = planned(objects, named(objects, "StatefulSet", "loraserve-worker")["spec"]["template"])
    assert plan.hosts == 1 and plan.fits  # one host: no LeaderWorkerSet needed (overlays/gke-tpu-multihost)
    assert "STORAGE_EMULATOR_HOST" not in env
    for name in ("loraserve-registry", "loraserve-worker"):
        sa = named(objects, "ServiceAccount", name)
        assert sa["metadata"]["annotations"]["iam.gke.io/gcp-service-account"].endswith(
            ".iam.gserviceaccount.com"
        )
    # Cloud SQL Auth Proxy as a native sidecar next to whatever reaches the database
    db_url = named(objects, "Secret", "loraserve-registry-db")["stringData"]["url"]
    assert "@127.0.0.1:5432/" in db_url
    for kind, name in (("Deployment", "loraserve-registry"), ("Job", "loraserve-migrate")):
        (proxy,) = named(objects, kind, name)["spec"]["template"]["spec"]["initContainers"]
        assert "cloud-sql-proxy" in proxy["image"] and proxy["restartPolicy"] == "Always"
        assert "--port=5432" in proxy["args"]
    # TLS on: every server reads its certificate, probes dial TLS
    for _, _, c, role in loraserve_containers(objects):
        env = container_env(objects, c)
        assert env[f"LORASERVE_{role.upper()}_TLS_CERT"] and env[f"LORASERVE_{role.upper()}_TLS_KEY"]
        assert "--tls-ca" in c["readinessProbe"]["exec"]["command"]


def multihost_group(objects) -> tuple[dict, dict, dict]:
    """The multi-host overlay's LeaderWorkerSet, its leader template and its worker (follower) template."""
    lws = named(objects, "LeaderWorkerSet", "loraserve-worker")
    lwt = lws["spec"]["leaderWorkerTemplate"]
    return lws, lwt["leaderTemplate"], lwt["workerTemplate"]


def test_gke_tpu_multihost_group_spans_the_hosts_the_planner_counts() -> None:
    """One pod per host: the group's size is the hosts `loraserve plan` counts for the manifest's own model,
    chip (its accelerator label) and tensor parallel size (its LORASERVE_WORKER_TENSOR_PARALLEL_SIZE), and
    the chips of all pods together are that tensor parallel size and the slice's topology."""
    objects = render("gke-tpu-multihost")
    lws, leader, follower = multihost_group(objects)
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    assert isinstance(size, int) and size > 1
    assert leader["spec"]["nodeSelector"] == follower["spec"]["nodeSelector"]
    selector = leader["spec"]["nodeSelector"]
    assert selector["cloud.google.com/gke-tpu-accelerator"] == "tpu-v5-lite-podslice"
    plan = planned(objects, leader)
    assert (plan.model, plan.chip, plan.tp, plan.dtype) == ("llama-3-70b", "v5e", 16, "bfloat16")
    assert plan.hosts == size == 4
    assert plan.fits, f"{plan.total / 2**30:.2f} GiB a chip over {plan.hbm / 2**30:.0f}"
    for template in (leader, follower):
        resources = template["spec"]["containers"][0]["resources"]
        chips = int(resources["limits"]["google.com/tpu"])
        assert int(resources["requests"]["google.com/tpu"]) == chips == 4
        assert chips * size == plan.tp
        env = container_env(objects, template["spec"]["containers"][0])
        assert int(env["LORASERVE_WORKER_TENSOR_PARALLEL_SIZE"]) == chips * size
    x, y = (int(n) for n in selector["cloud.google.com/gke-tpu-topology"].split("x"))
    assert x * y == plan.tp  # the slice's chips are the group's: one slice a group


def test_gke_tpu_multihost_leader_and_followers_run_the_gke_tpu_worker() -> None:
    """Both templates are the single-host worker's pod (image, command, env, volumes, security, TPUs), with
    the leader's advertised name moved into the LeaderWorkerSet's subdomain and libtpu kept off the
    coordinator's port; the leader keeps the probes and adds its group's ports, followers have neither. Their
    environment makes the worker take the cluster from the LeaderWorkerSet's variables."""
    from loraserve.engine import multihost

    base = named(render("gke-tpu"), "StatefulSet", "loraserve-worker")["spec"]["template"]
    base_c = base["spec"]["containers"][0]
    objects = render("gke-tpu-multihost")
    lws, leader, follower = multihost_group(objects)
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    grpc = bound_ports(objects, leader["spec"]["containers"][0], "worker")["port"]
    subdomain = worker_subdomain(lws)
    assert subdomain == "loraserve-worker"
    env = []
    for e in base_c["env"]:
        if e["name"] == "LORASERVE_WORKER_ADVERTISE_ADDRESS":
            assert e["value"] == "$(POD_NAME).loraserve-worker-headless:50061"
            e = {"name": e["name"], "value": f"$(POD_NAME).{subdomain}:{grpc}"}
        env.append(e)
    env.append({"name": "TPU_PROCESS_PORT", "value": "8471"})
    topology = {"cloud.google.com/gke-tpu-topology": "4x4"}
    pod_fields = (
        "serviceAccountName",
        "securityContext",
        "volumes",
        "tolerations",
        "terminationGracePeriodSeconds",
    )
    container_fields = ("name", "image", "command", "args", "envFrom", "resources", "securityContext")
    for role, template in (("leader", leader), ("follower", follower)):
        spec, c = template["spec"], template["spec"]["containers"][0]
        for key in pod_fields:
            assert spec.get(key) == base["spec"].get(key), (role, key)
        assert spec["nodeSelector"] == base["spec"]["nodeSelector"] | topology
        assert spec.get("restartPolicy", "Always") == "Always"  # exit 3 restarts it: the group is recreated
        for key in (*container_fields, "volumeMounts"):
            assert c.get(key) == base_c.get(key), (role, key)
        assert c["env"] == env, role
        labels = base["metadata"]["labels"] | {"loraserve.dev/worker-role": role}
        if role == "follower":  # exports no metrics: nothing for llm-d to read
            del labels["llm-d.ai/engine-type"]
        assert template["metadata"]["labels"] == labels, role
    leader_c, follower_c = leader["spec"]["containers"][0], follower["spec"]["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert leader_c[probe] == base_c[probe]
        assert probe not in follower_c
    coordinator = multihost.DEFAULT_COORDINATOR_PORT
    ports = {p["name"]: p["containerPort"] for p in leader_c["ports"]}
    assert ports == {p["name"]: p["containerPort"] for p in base_c["ports"]} | {
        "coordinator": coordinator,
        "step": coordinator + 1,
    }
    assert "ports" not in follower_c
    # the worker's cluster comes from the LeaderWorkerSet's variables (no --coordinator in the manifests)
    config = worker_config(objects, leader_c)
    assert worker_config(objects, follower_c) == config
    assert (config.coordinator, config.num_processes, config.process_id) == ("", 1, 0)
    leader_address = f"{lws['metadata']['name']}-0.{subdomain}.{lws['metadata']['namespace']}"  # the LWS's
    for index in range(size):
        lws_env = {"LWS_LEADER_ADDRESS": leader_address, "LWS_GROUP_SIZE": str(size)}
        lws_env["LWS_WORKER_INDEX"] = str(index)
        cluster = multihost.cluster_from(
            config.coordinator, config.num_processes, config.process_id, config.multihost_timeout, env=lws_env
        )
        assert (cluster.num_processes, cluster.process_id, cluster.leader) == (size, index, index == 0)
        assert cluster.coordinator == f"{leader_address}:{ports['coordinator']}"
        assert cluster.step_address == (leader_address, ports["step"])
    # the leader waits up to --multihost-timeout for its followers before it can report SERVING
    startup = leader_c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] > 2 * config.multihost_timeout
    # the leaders' Service: leaders only (followers declare no port it could target)
    leaders = named(objects, "Service", "loraserve-worker-leaders")
    assert [t for _, t in selected_pods(objects, leaders["spec"]["selector"])] == [leader]


def test_gke_tpu_multihost_restarts_a_group_whole_and_starts_followers_after_their_leader() -> None:
    """The StatefulSet is gone; the LeaderWorkerSet recreates a group when any of its processes restarts (a
    lost peer exits 3), starts followers once the leader exists, and keeps a group on one slice."""
    from loraserve.engine import multihost

    objects = render("gke-tpu-multihost")
    assert not of_kind(objects, "StatefulSet")
    named(render("gke-tpu"), "StatefulSet", "loraserve-worker")
    lws, _, _ = multihost_group(objects)
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    spec = lws["spec"]
    assert set(spec["leaderWorkerTemplate"]) >= {"leaderTemplate", "workerTemplate", "size", "restartPolicy"}
    assert spec["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    assert multihost.EXIT_PEER_LOST == 3  # a lost process exits non-zero: the group is recreated
    assert spec["startupPolicy"] == "LeaderCreated"
    assert spec["replicas"] == 2
    assert spec["rolloutStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdateConfiguration": {"maxUnavailable": 1},
    }
    assert spec["networkConfig"] == {"subdomainPolicy": "Shared"}
    # a group's pods on one slice (a node pool), one pod a node
    annotations = lws["metadata"]["annotations"]
    assert annotations["leaderworkerset.sigs.k8s.io/exclusive-topology"] == "cloud.google.com/gke-nodepool"
    config = worker_config(objects, multihost_group(objects)[1]["spec"]["containers"][0])
    assert config.multihost_timeout == 300


def test_gke_tpu_multihost_group_pods_reach_the_leader_on_the_coordinator_and_step_ports() -> None:
    """Followers reach the leader's jax.distributed coordinator and step channel, every pod of the group
    reaches every other's libtpu slice builder, and nothing else changes: gRPC and HTTP stay router-only."""
    from loraserve.engine import multihost

    objects = render("gke-tpu-multihost")
    _, leader, follower = multihost_group(objects)
    leader_l, follower_l = leader["metadata"]["labels"], follower["metadata"]["labels"]
    router_l = named(objects, "Deployment", "loraserve-router")["spec"]["template"]["metadata"]["labels"]
    registry_l = named(objects, "Deployment", "loraserve-registry")["spec"]["template"]["metadata"]["labels"]

    def admitted(source: dict, destination: dict, port: int) -> bool:
        """Whether some NetworkPolicy lets a pod labelled ``source`` (this namespace) connect to ``port``
        of a pod labelled ``destination``."""
        for policy in of_kind(objects, "NetworkPolicy"):
            if not matches(policy["spec"]["podSelector"], destination):
                continue
            for rule in policy["spec"].get("ingress", []):
                if rule.get("ports") and all(p["port"] != port for p in rule["ports"]):
                    continue
                for peer in rule.get("from") or [{"podSelector": {}}]:
                    same_namespace = peer.get("namespaceSelector", {}) == {} and "podSelector" in peer
                    if same_namespace and matches(peer["podSelector"], source):
                        return True
        return False

    coordinator = multihost.DEFAULT_COORDINATOR_PORT
    step = multihost.Cluster(f"leader:{coordinator}", 2, 1, 1.0).step_address[1]
    assert step == coordinator + 1 == 8477
    slice_builder = int(container_env(objects, follower["spec"]["containers"][0])["TPU_PROCESS_PORT"])
    for port in (coordinator, step, slice_builder):
        assert admitted(follower_l, leader_l, port), port
    for a, b in ((leader_l, follower_l), (follower_l, follower_l)):
        assert admitted(a, b, slice_builder)
    for port in (50061, 8000, 9100):  # the group's rule opens no server port
        assert not admitted(follower_l, leader_l, port), port
    assert admitted(router_l, leader_l, 50061) and admitted(router_l, leader_l, 8000)
    assert admitted(leader_l, registry_l, 50051)  # the leader registers
    deny = named(objects, "NetworkPolicy", "loraserve-default-deny")["spec"]["podSelector"]
    assert matches(deny, leader_l) and matches(deny, follower_l)


def test_the_endpoint_picker_reads_the_metrics_workers_export() -> None:
    objects = render("gke-tpu+gateway")
    families = exported_families()
    pool = named(objects, "InferencePool", "loraserve-workers")
    workers = selected_pods(objects, pool["spec"]["selector"])
    assert [w["metadata"]["name"] for w, _ in workers] == ["loraserve-worker"]
    worker = workers[0][1]["spec"]["containers"][0]
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [
        bound_ports(objects, worker, "worker")["http_port"]
    ]
    epp_ref = pool["spec"]["endpointPickerRef"]
    epp_svc = named(objects, "Service", epp_ref["name"])
    assert epp_ref["port"]["number"] in {p["port"] for p in epp_svc["spec"]["ports"]}
    (epp,) = [t for _, t in selected_pods(objects, epp_svc["spec"]["selector"])]
    args = dict(a.removeprefix("--").split("=", 1) for a in epp["spec"]["containers"][0]["args"])
    assert args["pool-name"] == pool["metadata"]["name"]
    want = {
        "total-queued-requests-metric": ("loraserve_requests_waiting", "gauge"),
        "total-running-requests-metric": ("loraserve_requests_running", "gauge"),
        "kv-cache-usage-percentage-metric": ("loraserve_kv_cache_utilisation", "gauge"),
        "lora-info-metric": ("loraserve_lora_requests_info", "gauge"),
    }
    for flag, (metric, kind) in want.items():
        assert args[flag] == metric
        assert families[metric].type == kind
    assert families["loraserve_lora_requests_info"].labels == {
        "running_lora_adapters",
        "waiting_lora_adapters",
        "max_lora",
    }
    assert args["cache-info-metric"] == ""  # loraserve exports no vLLM cache_config_info: switched off
    assert args["model-server-metrics-path"] == "/metrics"
    # the workers serve /metrics on their metrics port only (a metrics port set: not on the HTTP port)
    assert int(args["model-server-metrics-port"]) == bound_ports(objects, worker, "worker")["metrics_port"]
    config = named(objects, "ConfigMap", epp["spec"]["volumes"][0]["configMap"]["name"])
    assert args["config-file"].rsplit("/", 1)[1] in config["data"]
