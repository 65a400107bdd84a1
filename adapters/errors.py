"""Adapter errors: each names the gRPC status a server answers with (DESIGN.md §8)."""

from __future__ import annotations


class AdapterError(ValueError):
    """An adapter that cannot be served; ``code`` names the gRPC status (INVALID_ARGUMENT by default)."""

    code = "INVALID_ARGUMENT"


class AdapterMismatchError(AdapterError):
    """A well-formed adapter that does not fit this base model or worker (FAILED_PRECONDITION)."""

    code = "FAILED_PRECONDITION"


class AdapterRankError(AdapterMismatchError):
    """A rank above the largest slot rank (the registry refuses these uploads as INVALID_ARGUMENT)."""


class UnknownModuleError(AdapterMismatchError):
    """A target module the model family does not adapt (INVALID_ARGUMENT at upload)."""


class AdapterNotFoundError(AdapterError):
    code = "NOT_FOUND"


class AdapterDataLossError(AdapterError):
    code = "DATA_LOSS"


class AdapterUnavailableError(AdapterError):
    """The adapter's storage could not be read right now."""

    code = "UNAVAILABLE"
