"""loraserve.common.errors: one error type carrying a gRPC status, the same on both sides of the wire."""

from __future__ import annotations

import pickle

import grpc
import pytest

from loraserve.common import errors


def test_each_status_class_carries_its_code_and_message() -> None:
    err = errors.NotFound("adapter 'x' is not registered")
    assert err.code is grpc.StatusCode.NOT_FOUND
    assert err.code_name == "NOT_FOUND"
    assert str(err) == err.message == "adapter 'x' is not registered"
    assert isinstance(err, errors.LoraserveError)


def test_an_instance_may_name_another_status() -> None:
    err = errors.InvalidArgument("hash mismatch", grpc.StatusCode.DATA_LOSS)
    assert err.code is grpc.StatusCode.DATA_LOSS
    assert errors.InvalidArgument.code is grpc.StatusCode.INVALID_ARGUMENT  # the class is untouched


def test_a_status_name_string_is_refused() -> None:
    with pytest.raises(TypeError, match=r"grpc\.StatusCode"):
        errors.LoraserveError("x", "NOT_FOUND")  # type: ignore[arg-type]


def test_errors_pickle_with_their_code() -> None:
    err = pickle.loads(pickle.dumps(errors.ResourceExhausted("queue is full", grpc.StatusCode.UNAVAILABLE)))
    assert type(err) is errors.ResourceExhausted
    assert (err.code, err.message) == (grpc.StatusCode.UNAVAILABLE, "queue is full")


class _Rpc(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str | None) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str | None:
        return self._details


def test_error_from_rpc_keeps_code_and_details() -> None:
    err = errors.error_from_rpc(_Rpc(grpc.StatusCode.FAILED_PRECONDITION, "built for another base model"))
    assert (err.code, err.message) == (grpc.StatusCode.FAILED_PRECONDITION, "built for another base model")
    bare = errors.error_from_rpc(_Rpc(grpc.StatusCode.UNAVAILABLE, None))
    assert bare.message == "UNAVAILABLE"
