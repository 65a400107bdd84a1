"""One error type for every room: a refusal carries its gRPC status (docs/design.md §8) and a human message.

Servers raise these from plain modules; one interceptor (``loraserve.common.interceptors``) turns them into
the status of the RPC. Clients get the same type back from ``error_from_rpc``, and the CLI prints
``error: CODE: message``. A subclass per status keeps raising sites short (``raise NotFound(...)``); a family
of its own (``AdapterError``, ``StorageError``) subclasses the status it means by default and may pass another
``code`` for one case.

A refusal that will pass if the caller waits (a full queue, a worker warming up) carries ``retry_after``, the
seconds to wait: gRPC sends it as the trailing metadata ``retry-after`` (whole seconds, as HTTP's header) and
``grpc-retry-pushback-ms`` (gRPC's own retry pushback), HTTP as a ``Retry-After`` header, and
``error_from_rpc`` reads it back, so a router passes a worker's hint on unchanged.
"""

from __future__ import annotations

import math

import grpc

RETRY_AFTER_KEY = "retry-after"  # trailing metadata: whole seconds, as HTTP's Retry-After
PUSHBACK_KEY = "grpc-retry-pushback-ms"  # gRPC's retry pushback: milliseconds
DEFAULT_RETRY_AFTER_S = 1.0  # an UNAVAILABLE that named no wait of its own


class LoraserveError(Exception):
    """A refusal with a gRPC status. ``code`` defaults to the class's; ``message`` is what users read."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(
        self, message: str, code: grpc.StatusCode | None = None, *, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            if not isinstance(code, grpc.StatusCode):
                raise TypeError(f"code must be a grpc.StatusCode, got {code!r}")
            self.code = code
        self.retry_after = retry_after  # seconds to wait before trying again; None: not a matter of time

    @property
    def retry_hint(self) -> float | None:
        """The wait to announce: ``retry_after``, else a default for UNAVAILABLE (transient by definition);
        None for a refusal that waiting does not cure (a request too big for the pool stays too big)."""
        if self.retry_after is not None:
            return self.retry_after
        return DEFAULT_RETRY_AFTER_S if self.code == grpc.StatusCode.UNAVAILABLE else None

    def retry_metadata(self) -> tuple[tuple[str, str], ...]:
        """The trailing metadata that carries ``retry_hint`` (empty without one)."""
        hint = self.retry_hint
        if hint is None:
            return ()
        return ((RETRY_AFTER_KEY, str(retry_after_seconds(hint))), (PUSHBACK_KEY, str(int(hint * 1000))))

    @property
    def code_name(self) -> str:
        """The status's name as users see it, e.g. ``NOT_FOUND``."""
        return self.code.name

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):  # picklable across process pools, with its code
        return (_rebuild, (type(self), self.message, self.code, self.retry_after))


def _rebuild(
    cls: type[LoraserveError], message: str, code: grpc.StatusCode, retry_after: float | None = None
) -> LoraserveError:
    err = cls.__new__(cls)
    LoraserveError.__init__(err, message, code, retry_after=retry_after)
    return err


def retry_after_seconds(hint: float) -> int:
    """A wait as HTTP's ``Retry-After`` says it: whole seconds, at least 1."""
    return max(1, math.ceil(hint))


class InvalidArgument(LoraserveError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFound(LoraserveError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(LoraserveError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(LoraserveError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(LoraserveError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class DataLoss(LoraserveError):
    code = grpc.StatusCode.DATA_LOSS


class Unavailable(LoraserveError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceeded(LoraserveError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class PermissionDenied(LoraserveError):
    code = grpc.StatusCode.PERMISSION_DENIED


class Unauthenticated(LoraserveError):
    code = grpc.StatusCode.UNAUTHENTICATED


class Cancelled(LoraserveError):
    code = grpc.StatusCode.CANCELLED


def error_from_rpc(exc: grpc.RpcError) -> LoraserveError:
    """The same error a server raised, rebuilt on the client side from a failed call (sync or asyncio)."""
    code = exc.code() if callable(getattr(exc, "code", None)) else None
    details = exc.details() if callable(getattr(exc, "details", None)) else None
    if not isinstance(code, grpc.StatusCode):
        code = grpc.StatusCode.UNKNOWN
    return LoraserveError(details or code.name, code, retry_after=_retry_after(exc))


def _retry_after(exc: grpc.RpcError) -> float | None:
    """The wait a failed call's trailing metadata announced (pushback first: it is the finer), or None."""
    trailing = exc.trailing_metadata() if callable(getattr(exc, "trailing_metadata", None)) else None
    found = dict(trailing or ())
    for key, scale in ((PUSHBACK_KEY, 1000.0), (RETRY_AFTER_KEY, 1.0)):
        value = found.get(key)
        if isinstance(value, str) and value.isdigit() and len(value) <= 9:
            return int(value) / scale
    return None
