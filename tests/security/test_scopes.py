"""Token scopes (docs/security.md): every RPC of every server against every kind of token, over real servers on
loopback (registry, worker, router), driven by one table, ``common.security.RPC_SCOPES``.

The RPCs are enumerated twice: from the contract's descriptors (every RPC must have a row) and from each live
server's reflection (what it really serves), so a new RPC without a row fails here. A token whose scope covers
the RPC gets past auth (the method runs and answers whatever it answers to an empty request); a known token
without the scope gets PERMISSION_DENIED; a missing or unknown token UNAUTHENTICATED. Health and reflection
need no token."""

from __future__ import annotations

import itertools
from contextlib import ExitStack
from pathlib import Path

import grpc
import pytest
from google.protobuf import descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from loraserve.client.registry_client import RegistryClient
from loraserve.common.errors import LoraserveError
from loraserve.common.security import ADMIN, INFERENCE, ROUTER, RPC_SCOPES, SCOPES, WORKER, ServerSecurity
from loraserve.protos.v1 import inference_pb2, placement_pb2, registry_pb2, worker_admin_pb2
from loraserve.registry.app import open_registry
from loraserve.registry.config import RegistryConfig
from loraserve.registry.server import build_server as build_registry
from loraserve.router.routing import Locator, WorkerPool
from loraserve.router.server import build_server as build_router
from loraserve.worker.server import build_server as build_worker
from tests.aio_thread import aio_server_thread

TOKENS = {INFERENCE: "inference-t", ROUTER: "router-t", WORKER: "worker-t", ADMIN: "admin-t"}
SECURITY = ServerSecurity(
    inference_tokens=(TOKENS[INFERENCE],),
    router_tokens=(TOKENS[ROUTER],),
    worker_tokens=(TOKENS[WORKER],),
    admin_tokens=(TOKENS[ADMIN],),
)
SERVES = {  # what each server must serve (its reflection is checked against this)
    "registry": {"loraserve.v1.AdapterRegistry", "loraserve.v1.Placement"},
    "worker": {"loraserve.v1.Inference", "loraserve.v1.WorkerAdmin"},
    "router": {"loraserve.v1.Inference"},
}
MODEL = "scopes-tiny"


def contract_methods() -> set[str]:
    """Every RPC of every service of the loraserve.v1 contract, as full method names."""
    out = set()
    for module in (inference_pb2, placement_pb2, registry_pb2, worker_admin_pb2):
        for service in module.DESCRIPTOR.services_by_name.values():
            out |= {f"/{service.full_name}/{m.name}" for m in service.methods}
    return out


def test_the_table_has_a_row_for_every_rpc_of_the_contract() -> None:
    assert set(RPC_SCOPES) == contract_methods()
    assert all(ADMIN in scopes and scopes <= set(SCOPES) for scopes in RPC_SCOPES.values())


def test_docs_print_the_same_table() -> None:
    """docs/security.md's RPC table is ``RPC_SCOPES``, row for row, with the servers that serve each RPC."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    header = "| RPC | served by | " + " | ".join(SCOPES) + " |"
    assert header in doc
    rows = {}
    for line in doc.split(header, 1)[1].splitlines()[2:]:
        if not line.startswith("| `"):
            break
        rpc, served_by, *cells = (c.strip() for c in line.strip("|").split("|"))
        service, method = rpc.strip("`").split(".")
        servers = {name for name, services in SERVES.items() if f"loraserve.v1.{service}" in services}
        assert set(served_by.split(", ")) == servers, line
        assert all(cell in ("✓", "—") for cell in cells), line
        rows[f"/loraserve.v1.{service}/{method}"] = {
            s for s, cell in zip(SCOPES, cells, strict=True) if cell == "✓"
        }
    assert rows == RPC_SCOPES


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    from loraserve.engine.config import EngineConfig
    from loraserve.engine.engine import Engine
    from loraserve.engine.fake_runner import FakeRunner
    from tests.worker.fake_engine import TINY

    tmp = tmp_path_factory.mktemp("scopes")
    with ExitStack() as es:
        registry = open_registry(RegistryConfig(db=f"sqlite:///{tmp / 'r.db'}", storage=str(tmp / "store")))
        es.callback(registry.close)

        async def registry_server():
            server, port, _ = build_registry(registry.catalog, registry.placement, "127.0.0.1:0", SECURITY)
            return server, port

        registry_address = f"127.0.0.1:{es.enter_context(aio_server_thread(registry_server))}"
        cfg = EngineConfig(max_batch_size=2, max_seq_len=32, max_loras=2, max_lora_rank=4)
        engine = Engine(
            None, cfg, None, runner=FakeRunner.for_config(TINY.vocab_size, cfg), model_config=TINY
        )
        engine.start()
        es.callback(engine.stop)

        async def worker_server():
            server, port, _ = build_worker(engine, None, MODEL, "127.0.0.1:0", SECURITY)
            return server, port

        async def router_server():  # the router presents its router token upstream, as deployed
            locator = Locator(registry_address, 0.2, 3, token=TOKENS[ROUTER])
            server, port, _ = build_router(locator, WorkerPool(token=TOKENS[ROUTER]), "127.0.0.1:0", SECURITY)
            return server, port

        yield {
            "registry": registry_address,
            "worker": f"127.0.0.1:{es.enter_context(aio_server_thread(worker_server))}",
            "router": f"127.0.0.1:{es.enter_context(aio_server_thread(router_server))}",
        }


def served_methods(address: str) -> dict[str, object]:
    """The loraserve.v1 RPCs the server at ``address`` serves, by full name -> method descriptor, read through
    its reflection service (which needs no token)."""
    with grpc.insecure_channel(address) as ch:
        database = ProtoReflectionDescriptorDatabase(ch)
        pool = descriptor_pool.DescriptorPool(database)
        out = {}
        for name in database.get_services():
            if name.startswith("loraserve.v1."):
                service = pool.FindServiceByName(name)
                out |= {f"/{name}/{m.name}": m for m in service.methods}
        return out


def call(address: str, method: str, descriptor, token: str) -> tuple[grpc.StatusCode, str]:
    """``method`` with an empty request (streamed when the RPC takes a stream) and ``token``."""
    request_class = message_factory.GetMessageClass(descriptor.input_type)
    kind = ("stream" if descriptor.client_streaming else "unary") + "_"
    kind += "stream" if descriptor.server_streaming else "unary"
    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(address) as ch:
        stub = getattr(ch, kind)(
            method, request_serializer=request_class.SerializeToString, response_deserializer=bytes
        )
        request = iter([request_class()]) if descriptor.client_streaming else request_class()
        try:
            result = stub(request, timeout=15, metadata=metadata)
            if descriptor.server_streaming:
                list(result)
        except grpc.RpcError as exc:
            return exc.code(), exc.details() or ""
    return grpc.StatusCode.OK, ""


def refused_by_auth(code: grpc.StatusCode, details: str) -> bool:
    """Whether the auth interceptor refused the call (a method may answer PERMISSION_DENIED itself: an
    ImportAdapter outside --import-allow)."""
    return code == grpc.StatusCode.UNAUTHENTICATED or (
        code == grpc.StatusCode.PERMISSION_DENIED and details.startswith("token scope ")
    )


@pytest.mark.parametrize("server", sorted(SERVES))
def test_every_rpc_against_every_kind_of_token(servers, server: str) -> None:
    address = servers[server]
    methods = served_methods(address)
    assert {m.split("/")[1] for m in methods} == SERVES[server]
    assert set(methods) <= set(RPC_SCOPES), "an RPC without a row in common.security.RPC_SCOPES"
    for method, descriptor in methods.items():
        for token in ("", "not-a-token"):
            code, details = call(address, method, descriptor, token)
            assert code == grpc.StatusCode.UNAUTHENTICATED, (server, method, token, details)
        for scope in SCOPES:
            code, details = call(address, method, descriptor, TOKENS[scope])
            if scope in RPC_SCOPES[method]:
                assert not refused_by_auth(code, details), (server, method, scope, code, details)
            else:
                assert code == grpc.StatusCode.PERMISSION_DENIED, (server, method, scope, code)
                assert details.startswith(f"token scope {scope} may not call {method[1:]}"), details
    with grpc.insecure_channel(address) as ch:  # health stays open for probes
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1


def test_a_token_in_several_lists_holds_each_scope() -> None:
    both = ServerSecurity(worker_tokens=("t",), router_tokens=("t",))
    assert both.scopes_of("t") == {WORKER, ROUTER}
    assert both.refusal("t", "/loraserve.v1.Placement/LocateAdapter") is None
    assert both.refusal("t", "/loraserve.v1.Placement/Heartbeat") is None
    code, message = both.refusal("t", "/loraserve.v1.AdapterRegistry/DeleteAdapter")
    assert code == grpc.StatusCode.PERMISSION_DENIED and message.startswith("token scope router/worker ")
    assert ServerSecurity().refusal("", "/loraserve.v1.AdapterRegistry/DeleteAdapter") is None  # auth off
    # an RPC the table does not know is admin-only
    assert ServerSecurity(admin_tokens=("a",), router_tokens=("r",)).refusal("r", "/x.Y/Z")[0] == (
        grpc.StatusCode.PERMISSION_DENIED
    )


def _adapter_folder(path: Path) -> Path:
    from tests.worker.fake_engine import adapter_files

    config, weights = adapter_files()
    path.mkdir(parents=True, exist_ok=True)
    (path / "adapter_config.json").write_bytes(config)
    (path / "adapter_model.safetensors").write_bytes(weights)
    return path


def test_worker_and_router_tokens_cannot_change_the_catalog(servers, tmp_path) -> None:
    """A worker's or a router's token (what a compromised worker or router pod holds) cannot push, import,
    delete or alias adapters, nor name base models: PERMISSION_DENIED, and the catalog is as it was."""
    address = servers["registry"]
    folder = _adapter_folder(tmp_path / "a")
    with RegistryClient(address, token=TOKENS[ADMIN]) as admin:
        admin.push(folder, "kept", MODEL)
        before = [(a.name, a.version, a.sha256) for a in admin.list()]
    for scope, action in itertools.product(
        (WORKER, ROUTER, INFERENCE),
        (
            lambda c: c.push(folder, "kept", MODEL),
            lambda c: c.push(folder, "new-one", MODEL),
            lambda c: c.delete("kept"),
            lambda c: c.set_alias("kept", "prod", [(1, 1.0)], "thief"),
        ),
    ):
        with RegistryClient(address, token=TOKENS[scope]) as client, pytest.raises(LoraserveError) as exc:
            action(client)
        assert exc.value.code_name == "PERMISSION_DENIED", scope
    with RegistryClient(address, token=TOKENS[ADMIN]) as admin:
        assert [(a.name, a.version, a.sha256) for a in admin.list()] == before
        assert not admin.get("kept").aliases
    with RegistryClient(address, token=TOKENS[WORKER]) as worker:  # what a worker needs still works
        assert worker.get("kept").version == 1
