"""What every loraserve gRPC server shares: interceptors, message limits, health, reflection, the port."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from loraserve.common.security import ServerSecurity


def new_server(security: ServerSecurity, max_message_bytes: int | None = None) -> grpc.aio.Server:
    options = []
    if max_message_bytes:
        options = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
        ]
    return grpc.aio.server(interceptors=security.interceptors(), options=options)


def finish_server(
    server: grpc.aio.Server, security: ServerSecurity, address: str, service_names: Sequence[str]
) -> tuple[int, Any]:
    """Add health (NOT_SERVING until told otherwise) and reflection, bind ``address``; returns (port, health)."""
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (*service_names, reflection.SERVICE_NAME, health.SERVICE_NAME), server
    )
    return security.add_port(server, address), health_servicer


async def set_health(health_servicer: Any, service_names: Sequence[str], serving: bool) -> None:
    state = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", *service_names):
        await health_servicer.set(name, state)
