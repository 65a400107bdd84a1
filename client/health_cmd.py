"""``loraserve health ADDRESS``: a gRPC health probe (exit 0 when SERVING) for healthchecks and scripts."""

from __future__ import annotations

import argparse
import sys

from loraserve.client.connection_flags import add_connection_flags, connection_kwargs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("address", help="any loraserve server: host:port or unix:PATH")
    parser.add_argument("--service", default="", help="service name to check (default: the whole server)")
    parser.add_argument("--timeout", type=float, default=3.0)
    add_connection_flags(parser)


def run(args: argparse.Namespace) -> int:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        from loraserve.common.security import channel as make_channel

        with make_channel(args.address, **connection_kwargs(args)) as channel:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout
            )
    except grpc.RpcError as exc:
        print(f"{args.address}: {exc.code().name}", file=sys.stderr)
        return 1
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    print(f"{args.address}: {status}")
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1
