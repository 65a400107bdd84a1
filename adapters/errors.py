"""Adapter errors: each is a ``LoraserveError`` carrying the gRPC status a server answers with (docs/design.md §8).

They keep ``ValueError`` as a second base: parsing callers catch bad input as ``ValueError``.
"""

from __future__ import annotations

import grpc

from loraserve.common.errors import LoraserveError


class AdapterError(LoraserveError, ValueError):
    """An adapter that cannot be served (INVALID_ARGUMENT unless a subclass says otherwise)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class AdapterMismatchError(AdapterError):
    """A well-formed adapter that does not fit this base model or worker (FAILED_PRECONDITION)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class AdapterRankError(AdapterMismatchError):
    """A rank above the largest slot rank (the registry refuses these uploads as INVALID_ARGUMENT)."""


class UnknownModuleError(AdapterMismatchError):
    """A target module the model family does not adapt (INVALID_ARGUMENT at upload)."""


class AdapterNotFoundError(AdapterError):
    code = grpc.StatusCode.NOT_FOUND


class AdapterDataLossError(AdapterError):
    code = grpc.StatusCode.DATA_LOSS


class AdapterUnavailableError(AdapterError):
    """The adapter's storage could not be read right now."""

    code = grpc.StatusCode.UNAVAILABLE
