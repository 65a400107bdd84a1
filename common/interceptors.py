"""The one server interceptor every loraserve server runs: errors become statuses, every RPC is measured.

``StatusInterceptor(server)`` wraps each handler, whatever its streaming kind, so that

- a raised ``LoraserveError`` ends the RPC with its own status and message (``context.abort``), and its
  retry hint in the trailing metadata when it has one (``LoraserveError.retry_metadata``);
- an abort the handler made itself, and any other gRPC error, pass through untouched;
- any other exception ends the RPC as INTERNAL (``internal error: <type>``) with its traceback logged;
- ``loraserve_rpc_requests_total{server,method,code}`` and ``loraserve_rpc_seconds{server,method}`` are
  recorded once per RPC: for a unary call when it returns, for a stream when it ends (finished, failed or
  cancelled by the client: CANCELLED).

``method`` is the RPC's name (``GetAdapter``, ``Generate``, health's ``Check``). Servicers therefore raise
``LoraserveError`` subclasses from plain code and keep no per-RPC try/except of their own.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, NoReturn

import grpc

from loraserve.common.errors import LoraserveError
from loraserve.common.observability import observe_rpc

log = logging.getLogger("loraserve.rpc")


def _status(exc: BaseException | None, context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    """The status the RPC ended with, for the metric."""
    if isinstance(exc, LoraserveError):
        return exc.code
    if isinstance(exc, asyncio.CancelledError | GeneratorExit):
        return grpc.StatusCode.CANCELLED
    set_code = context.code()  # what the handler set with set_code() or abort(), else None
    if isinstance(set_code, grpc.StatusCode):
        return set_code
    if exc is None:
        return grpc.StatusCode.OK
    if isinstance(exc, grpc.RpcError | grpc.aio.AbortError):
        return grpc.StatusCode.UNKNOWN
    return grpc.StatusCode.INTERNAL


class StatusInterceptor(grpc.aio.ServerInterceptor):
    """Maps ``LoraserveError`` to its status and records the RPC metrics of ``server`` (worker, registry, router)."""

    def __init__(self, server: str) -> None:
        self.server = server

    async def intercept_service(
        self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method.rsplit("/", 1)[-1]
        kw = dict(
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(self._unary(handler.unary_unary, method), **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(self._unary(handler.stream_unary, method), **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(self._stream(handler.unary_stream, method), **kw)
        return grpc.stream_stream_rpc_method_handler(self._stream(handler.stream_stream, method), **kw)

    def _observe(self, method: str, started: float, exc: BaseException | None, context: Any) -> None:
        observe_rpc(self.server, method, _status(exc, context).name, started)

    async def _fail(self, exc: BaseException, context: grpc.aio.ServicerContext, method: str) -> NoReturn:
        """End the RPC for ``exc``: its own status, untouched, or INTERNAL with the traceback logged."""
        if isinstance(exc, LoraserveError):
            await context.abort(exc.code, exc.message, exc.retry_metadata())
        if isinstance(exc, grpc.RpcError | grpc.aio.AbortError) or not isinstance(exc, Exception):
            raise exc  # an abort, an upstream gRPC error, a cancellation: as it is
        log.error("unexpected error in %s/%s", self.server, method, exc_info=exc)
        await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}")
        raise AssertionError("unreachable")  # pragma: no cover - abort always raises

    def _unary(self, behavior: Callable, method: str) -> Callable:
        async def handle(request: Any, context: grpc.aio.ServicerContext) -> Any:
            started, failure = time.perf_counter(), None
            try:
                result = behavior(request, context)
                return (await result) if inspect.isawaitable(result) else result
            except BaseException as exc:
                failure = exc
                await self._fail(exc, context, method)
            finally:
                self._observe(method, started, failure, context)

        return handle

    def _stream(self, behavior: Callable, method: str) -> Callable:
        if not inspect.isasyncgenfunction(behavior):  # a coroutine that writes with context.write()
            return self._unary(behavior, method)

        async def handle(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            started, failure = time.perf_counter(), None
            try:
                async with contextlib.aclosing(behavior(request, context)) as stream:
                    async for item in stream:
                        yield item
            except BaseException as exc:
                failure = exc
                await self._fail(exc, context, method)
            finally:
                self._observe(method, started, failure, context)

        return handle
