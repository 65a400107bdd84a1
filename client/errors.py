"""SDK errors: one exception type carrying the gRPC status name and the server's message."""

from __future__ import annotations

import grpc


class LoraserveError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message

    @classmethod
    def from_rpc(cls, exc: grpc.RpcError) -> LoraserveError:
        code = exc.code() if hasattr(exc, "code") else None
        return cls(
            code.name if code is not None else "UNKNOWN",
            exc.details() if hasattr(exc, "details") else str(exc),
        )
