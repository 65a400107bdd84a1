"""Bearer-token auth and TLS for every loraserve server, and the matching client channels.

Servers: ``AuthInterceptor`` checks ``authorization: Bearer <token>`` metadata on every RPC of every
streaming kind with a constant-time compare. Each token has a scope, from the list it is configured in:

- ``inference`` (``auth_tokens``): ``Inference.Generate`` (and the HTTP inference endpoints);
- ``router`` (``router_tokens``): what a router calls: ``Generate`` on workers, ``LocateAdapter``,
  ``ListWorkers`` and ``ListAdapters`` on the registry;
- ``worker`` (``worker_tokens``): what a worker calls: ``RegisterWorker``, ``Heartbeat``, ``GetAdapter``,
  ``DownloadAdapter`` on the registry;
- ``admin`` (``admin_tokens``): every RPC.

``RPC_SCOPES`` names the scopes of every RPC (docs/security.md prints it; tests/security/test_scopes.py
checks it against every service's descriptor and a live server). A missing or unknown token is
UNAUTHENTICATED; a known token whose scope does not cover the RPC is PERMISSION_DENIED; an RPC missing from
the table is admin-only. Health and reflection are exempt so probes and grpcurl discovery work. With no
tokens configured, auth is off.
TLS: a certificate and key turn the port into TLS; a client CA on top requires client certificates (mTLS).

Clients: ``channel(target, token=..., tls_ca=..., tls_cert=..., tls_key=...)`` (sync or aio) adds the
token to every call and uses TLS when a CA is given.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from loraserve.common.errors import InvalidArgument, Unavailable

EXEMPT_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.")

INFERENCE, ROUTER, WORKER, ADMIN = "inference", "router", "worker", "admin"
SCOPES = (INFERENCE, ROUTER, WORKER, ADMIN)
GENERATE = "/loraserve.v1.Inference/Generate"  # the HTTP inference endpoints (/v1/*) take its scopes


def _rpcs(service: str, scopes: tuple[str, ...], *methods: str) -> dict[str, frozenset[str]]:
    return {f"/loraserve.v1.{service}/{m}": frozenset((*scopes, ADMIN)) for m in methods}


# Every RPC of every loraserve.v1 service -> the scopes whose tokens may call it (admin: all of them).
RPC_SCOPES: dict[str, frozenset[str]] = {
    **_rpcs("Inference", (INFERENCE, ROUTER), "Generate"),
    **_rpcs("WorkerAdmin", (), "LoadAdapter", "UnloadAdapter", "ListSlots", "GetWorkerInfo"),
    **_rpcs("Placement", (WORKER,), "RegisterWorker", "Heartbeat"),
    **_rpcs("Placement", (ROUTER,), "LocateAdapter", "ListWorkers"),
    **_rpcs("Placement", (), "GetAdapterStats"),
    **_rpcs("AdapterRegistry", (WORKER,), "GetAdapter", "DownloadAdapter"),
    **_rpcs("AdapterRegistry", (ROUTER,), "ListAdapters"),
    **_rpcs(
        "AdapterRegistry",
        (),
        "UploadAdapter",
        "ImportAdapter",
        "DeleteAdapter",
        "SetAlias",
        "DeleteAlias",
        "ListAliasHistory",
        "SetBaseModelAliases",
        "GetBaseModel",
        "SetRunningLimit",
        "ListRunningLimits",
    ),
}
ADMIN_ONLY = frozenset({ADMIN})


def scopes_for(method: str) -> frozenset[str]:
    """The scopes allowed to call ``method`` (a full gRPC method name); admin only when it is not listed."""
    return RPC_SCOPES.get(method, ADMIN_ONLY)


def split_tokens(value: str) -> tuple[str, ...]:
    """``"a,b"`` -> ("a", "b"): several tokens let an operator rotate one without downtime."""
    return tuple(t.strip() for t in value.split(",") if t.strip())


@dataclass(frozen=True)
class ServerSecurity:
    inference_tokens: tuple[str, ...] = ()
    admin_tokens: tuple[str, ...] = ()
    tls_cert: str = ""  # PEM file
    tls_key: str = ""  # PEM file
    tls_client_ca: str = ""  # PEM file; set = mTLS (clients must present a certificate it signed)
    worker_tokens: tuple[str, ...] = ()  # scope "worker": register, heartbeat, fetch adapters
    router_tokens: tuple[str, ...] = ()  # scope "router": Generate, locate and list

    @classmethod
    def from_strings(
        cls,
        auth_tokens: str = "",
        admin_tokens: str = "",
        tls_cert: str = "",
        tls_key: str = "",
        tls_client_ca: str = "",
        worker_tokens: str = "",
        router_tokens: str = "",
    ) -> ServerSecurity:
        return cls(
            split_tokens(auth_tokens),
            split_tokens(admin_tokens),
            tls_cert,
            tls_key,
            tls_client_ca,
            split_tokens(worker_tokens),
            split_tokens(router_tokens),
        )

    def tokens(self, scope: str) -> tuple[str, ...]:
        return {
            INFERENCE: self.inference_tokens,
            ROUTER: self.router_tokens,
            WORKER: self.worker_tokens,
            ADMIN: self.admin_tokens,
        }[scope]

    @property
    def auth_on(self) -> bool:
        """Whether any token is configured (then every RPC but health and reflection needs one)."""
        return any(self.tokens(scope) for scope in SCOPES)

    def scopes_of(self, token: str) -> frozenset[str]:
        """The scopes of ``token`` (empty: not one of this server's tokens); every list is compared, in
        constant time per token, whatever matches."""
        return frozenset(scope for scope in SCOPES if token_allowed(token, self.tokens(scope)))

    def refusal(self, token: str, method: str) -> tuple[grpc.StatusCode, str] | None:
        """Why ``token`` may not call ``method`` (a full gRPC method name), or None when it may (or auth is
        off): UNAUTHENTICATED for a missing or unknown token, PERMISSION_DENIED for a known token whose
        scope does not cover the method."""
        if not self.auth_on:
            return None
        held = self.scopes_of(token)
        if not held:
            why = "missing bearer token" if not token else "bad token: not one of this server's tokens"
            return grpc.StatusCode.UNAUTHENTICATED, why
        allowed = scopes_for(method)
        if held & allowed:
            return None
        return (
            grpc.StatusCode.PERMISSION_DENIED,
            f"token scope {'/'.join(sorted(held))} may not call {method.lstrip('/')}"
            f" (needs {'/'.join(s for s in SCOPES if s in allowed)})",
        )

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        if not self.auth_on:
            return []
        return [AuthInterceptor(self)]

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Bind ``address`` (TLS when configured); returns the port. Refusals: a certificate without its key
        or an unreadable PEM file (INVALID_ARGUMENT), an address that cannot be bound (UNAVAILABLE)."""
        try:
            if not self.tls_cert:
                return server.add_insecure_port(address)
            if not self.tls_key:
                raise InvalidArgument("a TLS certificate needs its key (--tls-key)")
            try:
                creds = grpc.ssl_server_credentials(
                    [(Path(self.tls_key).read_bytes(), Path(self.tls_cert).read_bytes())],
                    root_certificates=Path(self.tls_client_ca).read_bytes() if self.tls_client_ca else None,
                    require_client_auth=bool(self.tls_client_ca),
                )
            except OSError as exc:
                raise InvalidArgument(f"cannot read a TLS file: {exc}") from exc
            return server.add_secure_port(address, creds)
        except RuntimeError as exc:  # grpc: "Failed to bind to address ..."
            raise Unavailable(f"cannot bind {address}: {exc}") from exc


def _bearer(metadata: Sequence[tuple[str, Any]] | None) -> str:
    for key, value in metadata or ():
        if key == "authorization":
            value = value.decode() if isinstance(value, bytes) else str(value)
            return value[7:] if value[:7].lower() == "bearer " else ""
    return ""


def token_allowed(token: str, allowed: Sequence[str]) -> bool:
    """Constant-time check of a bearer token against every allowed one (gRPC and HTTP)."""
    ok = False
    for candidate in allowed:  # compare against every token: the time does not tell which one was close
        ok |= hmac.compare_digest(token.encode(), candidate.encode())
    return ok and bool(token)


def _deny(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same streaming kind that answers ``code`` without running the method."""

    async def unary(request, context):
        await context.abort(code, message)

    async def streaming(request, context):
        await context.abort(code, message)
        yield  # pragma: no cover - makes this an async generator

    kw = dict(
        request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer
    )
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    return grpc.stream_stream_rpc_method_handler(streaming, **kw)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Lets an RPC run only when its bearer token's scope covers it (``ServerSecurity.refusal``)."""

    def __init__(self, security: ServerSecurity) -> None:
        self.security = security

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(EXEMPT_PREFIXES):
            return handler
        refused = self.security.refusal(_bearer(handler_call_details.invocation_metadata), method)
        return handler if refused is None else _deny(handler, *refused)


# ------------------------------------------------------------------------------------------ clients
class _TokenInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    def __init__(self, token: str) -> None:
        self.header = ("authorization", f"Bearer {token}")

    def _details(self, details):
        metadata = [*(details.metadata or ()), self.header]
        return (
            details._replace(metadata=metadata)
            if hasattr(details, "_replace")
            else _Details(details, metadata)
        )

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


class _Details(grpc.ClientCallDetails):
    def __init__(self, base, metadata) -> None:
        self.method, self.timeout, self.credentials = base.method, base.timeout, base.credentials
        self.wait_for_ready, self.compression = (
            getattr(base, "wait_for_ready", None),
            getattr(base, "compression", None),
        )
        self.metadata = metadata


class _AioToken:
    def __init__(self, token: str) -> None:
        self.header = ("authorization", f"Bearer {token}")

    def _details(self, d):
        metadata = grpc.aio.Metadata(*(tuple(d.metadata) if d.metadata else ()), self.header)
        return grpc.aio.ClientCallDetails(d.method, d.timeout, metadata, d.credentials, d.wait_for_ready)


# grpc.aio files each interceptor under the FIRST call kind it implements, so one class per kind.
class _AioUnaryUnary(_AioToken, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _AioUnaryStream(_AioToken, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._details(details), request)


class _AioStreamUnary(_AioToken, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


class _AioStreamStream(_AioToken, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, details, request_iterator):
        return await continuation(self._details(details), request_iterator)


def _credentials(tls_ca: str, tls_cert: str, tls_key: str) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(
        root_certificates=Path(tls_ca).read_bytes(),
        private_key=Path(tls_key).read_bytes() if tls_key else None,
        certificate_chain=Path(tls_cert).read_bytes() if tls_cert else None,
    )


def channel(
    target: str,
    *,
    token: str = "",
    tls_ca: str = "",
    tls_cert: str = "",
    tls_key: str = "",
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.Channel:
    """A sync channel: TLS when ``tls_ca`` is set (mTLS with cert + key), the token on every call."""
    ch = (
        grpc.secure_channel(target, _credentials(tls_ca, tls_cert, tls_key), options)
        if tls_ca
        else grpc.insecure_channel(target, options)
    )
    return grpc.intercept_channel(ch, _TokenInterceptor(token)) if token else ch


def aio_channel(
    target: str,
    *,
    token: str = "",
    tls_ca: str = "",
    tls_cert: str = "",
    tls_key: str = "",
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.aio.Channel:
    kinds = (_AioUnaryUnary, _AioUnaryStream, _AioStreamUnary, _AioStreamStream)
    interceptors = [kind(token) for kind in kinds] if token else None
    if tls_ca:
        return grpc.aio.secure_channel(
            target, _credentials(tls_ca, tls_cert, tls_key), options, interceptors=interceptors
        )
    return grpc.aio.insecure_channel(target, options, interceptors=interceptors)
