"""One error type for every room: a refusal carries its gRPC status (docs/design.md §8) and a human message.

Servers raise these from plain modules; one interceptor (``loraserve.common.interceptors``) turns them into
the status of the RPC. Clients get the same type back from ``error_from_rpc``, and the CLI prints
``error: CODE: message``. A subclass per status keeps raising sites short (``raise NotFound(...)``); a family
of its own (``AdapterError``, ``StorageError``) subclasses the status it means by default and may pass another
``code`` for one case.
"""

from __future__ import annotations

import grpc


class LoraserveError(Exception):
    """A refusal with a gRPC status. ``code`` defaults to the class's; ``message`` is what users read."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            if not isinstance(code, grpc.StatusCode):
                raise TypeError(f"code must be a grpc.StatusCode, got {code!r}")
            self.code = code

    @property
    def code_name(self) -> str:
        """The status's name as users see it, e.g. ``NOT_FOUND``."""
        return self.code.name

    def __str__(self) -> str:
        return self.message

    def __reduce__(self):  # picklable across process pools, with its code
        return (_rebuild, (type(self), self.message, self.code))


def _rebuild(cls: type[LoraserveError], message: str, code: grpc.StatusCode) -> LoraserveError:
    err = cls.__new__(cls)
    LoraserveError.__init__(err, message, code)
    return err


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
    return LoraserveError(details or code.name, code)
