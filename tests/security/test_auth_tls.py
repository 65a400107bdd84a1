"""Bearer tokens on every RPC of every streaming kind (health exempt), separate admin and inference
tokens, and TLS / mTLS round trips — all over real servers on loopback. Every scope against every RPC:
test_scopes.py."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loraserve.client.registry_client import RegistryClient
from loraserve.client.sdk import Client
from loraserve.common.errors import LoraserveError
from loraserve.common.security import ServerSecurity, channel
from loraserve.engine.config import EngineConfig
from loraserve.protos.v1 import inference_pb2 as ipb
from loraserve.protos.v1 import (
    inference_pb2_grpc,
    placement_pb2_grpc,
    registry_pb2_grpc,
    worker_admin_pb2_grpc,
)
from loraserve.protos.v1 import placement_pb2 as pp
from loraserve.protos.v1 import registry_pb2 as rp
from loraserve.protos.v1 import worker_admin_pb2 as wa
from loraserve.registry.app import open_registry
from loraserve.registry.config import RegistryConfig
from loraserve.registry.server import build_server as build_registry
from loraserve.worker.server import build_server as build_worker
from tests.aio_thread import aio_server_thread
from tests.engines import started_engine
from tests.security.certs import make_pki

ADMIN, INFER = "admin-secret", "inference-secret"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def _registry(tmp_path, security):
    registry = open_registry(RegistryConfig(db=f"sqlite:///{tmp_path / 'r.db'}", storage=str(tmp_path / "s")))

    async def build():
        server, port, _ = build_registry(registry.catalog, registry.placement, "127.0.0.1:0", security)
        return server, port

    return registry, aio_server_thread(build)


REGISTRY_CALLS = {  # every admin RPC, with a harmless request, by streaming kind
    "UploadAdapter": lambda s: s.UploadAdapter(
        iter([rp.UploadAdapterRequest(header=rp.UploadHeader(name="x"))]), timeout=5
    ),
    "ImportAdapter": lambda s: s.ImportAdapter(rp.ImportAdapterRequest(uri="/nope", name="x"), timeout=5),
    "GetAdapter": lambda s: s.GetAdapter(rp.GetAdapterRequest(adapter="x"), timeout=5),
    "ListAdapters": lambda s: s.ListAdapters(rp.ListAdaptersRequest(), timeout=5),
    "DeleteAdapter": lambda s: s.DeleteAdapter(rp.DeleteAdapterRequest(adapter="x"), timeout=5),
    "DownloadAdapter": lambda s: list(s.DownloadAdapter(rp.DownloadAdapterRequest(adapter="x"), timeout=5)),
}
PLACEMENT_CALLS = {
    "RegisterWorker": lambda s: s.RegisterWorker(pp.RegisterWorkerRequest(), timeout=5),
    "Heartbeat": lambda s: s.Heartbeat(pp.HeartbeatRequest(worker_id="w"), timeout=5),
    "ListWorkers": lambda s: s.ListWorkers(pp.ListWorkersRequest(), timeout=5),
    "LocateAdapter": lambda s: s.LocateAdapter(pp.LocateAdapterRequest(adapter="x"), timeout=5),
}


def _code(fn) -> grpc.StatusCode:
    try:
        fn()
    except grpc.RpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_every_registry_rpc_needs_the_admin_token(tmp_path) -> None:
    registry, server = _registry(tmp_path, ServerSecurity(admin_tokens=(ADMIN, "rotated-admin")))
    with server as port:
        address = f"127.0.0.1:{port}"
        for token in ("", "wrong", INFER):
            with channel(address, token=token) as ch:
                stubs = (registry_pb2_grpc.AdapterRegistryStub(ch), placement_pb2_grpc.PlacementStub(ch))
                for calls, stub in zip((REGISTRY_CALLS, PLACEMENT_CALLS), stubs, strict=True):
                    for name, call in calls.items():
                        assert _code(lambda c=call, st=stub: c(st)) == grpc.StatusCode.UNAUTHENTICATED, (
                            token,
                            name,
                        )
                # health stays open for probes
                assert (
                    health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status
                    == 1
                )
        for token in (ADMIN, "rotated-admin"):  # several tokens: one can be rotated out without downtime
            with RegistryClient(address, token=token) as client:
                assert list(client.list()) == []
                with pytest.raises(LoraserveError) as exc:
                    client.get("x")
                assert exc.value.code_name == "NOT_FOUND"  # authenticated: the call really ran
    with registry.catalog.sessions() as s:  # nothing was stored by the refused calls
        from sqlalchemy import func, select

        from loraserve.registry.db import AdapterRow, WorkerRow

        assert s.scalar(select(func.count()).select_from(AdapterRow)) == 0
        assert s.scalar(select(func.count()).select_from(WorkerRow)) == 0
    registry.close()


def test_worker_inference_and_admin_tokens(llama_dir) -> None:
    config = EngineConfig(
        max_batch_size=2, max_seq_len=32, max_loras=1, min_prefill_bucket=32
    )  # one prefill bucket: a shorter warm-up
    with started_engine(llama_dir, config) as engine:

        async def build():
            server, port, _ = build_worker(
                engine,
                None,
                "tiny",
                "127.0.0.1:0",
                ServerSecurity(inference_tokens=(INFER,), admin_tokens=(ADMIN,)),
            )
            return server, port

        with aio_server_thread(build) as port:
            address = f"127.0.0.1:{port}"
            gen = ipb.GenerateRequest(
                tokens=ipb.TokenIds(ids=[5, 6]), sampling=ipb.SamplingParams(max_tokens=2)
            )
            for token, generate_code, admin_code in [
                ("", grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAUTHENTICATED),
                ("nope", grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAUTHENTICATED),
                (INFER, grpc.StatusCode.OK, grpc.StatusCode.PERMISSION_DENIED),  # a known token, wrong scope
                (ADMIN, grpc.StatusCode.OK, grpc.StatusCode.OK),
            ]:
                with channel(address, token=token) as ch:
                    infer = inference_pb2_grpc.InferenceStub(ch)
                    admin = worker_admin_pb2_grpc.WorkerAdminStub(ch)
                    assert _code(lambda i=infer: list(i.Generate(gen, timeout=30))) == generate_code, token
                    for call in (
                        lambda a: a.ListSlots(wa.ListSlotsRequest(), timeout=5),
                        lambda a: a.GetWorkerInfo(wa.GetWorkerInfoRequest(), timeout=5),
                        lambda a: a.UnloadAdapter(wa.UnloadAdapterRequest(adapter="x"), timeout=5),
                        lambda a: a.LoadAdapter(
                            wa.LoadAdapterRequest(adapter="x", source_uri="/nope"), timeout=5
                        ),
                    ):
                        code = _code(lambda c=call, a=admin: c(a))
                        if admin_code == grpc.StatusCode.OK:  # ran: whatever the method itself answered
                            assert code not in (
                                grpc.StatusCode.UNAUTHENTICATED,
                                grpc.StatusCode.PERMISSION_DENIED,
                            ), token
                        else:
                            assert code == admin_code, token
            with Client(address, token=INFER) as client:
                assert client.complete([5, 6], max_tokens=3).completion_tokens == 3


def test_tls_and_mtls_round_trips(tmp_path, pki) -> None:
    tls = ServerSecurity(admin_tokens=(ADMIN,), tls_cert=pki["server_cert"], tls_key=pki["server_key"])
    registry, server = _registry(tmp_path, tls)
    with server as port:
        address = f"127.0.0.1:{port}"
        with RegistryClient(address, token=ADMIN, tls_ca=pki["ca"]) as client:
            assert list(client.list()) == []
        with grpc.insecure_channel(address) as ch:  # plaintext to a TLS port fails
            assert (
                _code(
                    lambda: health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=3)
                )
                == grpc.StatusCode.UNAVAILABLE
            )
    registry.close()
    mtls = ServerSecurity(tls_cert=pki["server_cert"], tls_key=pki["server_key"], tls_client_ca=pki["ca"])
    (tmp_path / "m").mkdir()
    registry, server = _registry(tmp_path / "m", mtls)
    with server as port:
        address = f"127.0.0.1:{port}"
        with channel(address, tls_ca=pki["ca"]) as ch:  # no client certificate: refused
            assert (
                _code(
                    lambda: registry_pb2_grpc.AdapterRegistryStub(ch).ListAdapters(
                        rp.ListAdaptersRequest(), timeout=3
                    )
                )
                == grpc.StatusCode.UNAVAILABLE
            )
        with RegistryClient(
            address, tls_ca=pki["ca"], tls_cert=pki["client_cert"], tls_key=pki["client_key"]
        ) as client:
            assert list(client.list()) == []
    registry.close()
