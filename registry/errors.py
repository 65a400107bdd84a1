"""Registry errors: each carries the gRPC status name that the servicers return (DESIGN.md §8)."""

from __future__ import annotations


class RegistryError(Exception):
    code = "INTERNAL"

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code


class InvalidArgument(RegistryError):
    code = "INVALID_ARGUMENT"


class NotFound(RegistryError):
    code = "NOT_FOUND"


class AlreadyExists(RegistryError):
    code = "ALREADY_EXISTS"


class FailedPrecondition(RegistryError):
    code = "FAILED_PRECONDITION"


class ResourceExhausted(RegistryError):
    code = "RESOURCE_EXHAUSTED"
