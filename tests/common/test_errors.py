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
    assert (err.code, err.message, err.retry_after) == (grpc.StatusCode.UNAVAILABLE, "queue is full", None)
    err = pickle.loads(pickle.dumps(errors.ResourceExhausted("queue is full", retry_after=0.25)))
    assert err.retry_after == 0.25


def test_retry_hints() -> None:
    """Only a refusal that waiting cures announces a wait: one it names, or 1 s for any UNAVAILABLE."""
    full = errors.ResourceExhausted("queue is full", retry_after=0.25)
    assert (full.retry_hint, full.retry_metadata()) == (
        0.25,
        (("retry-after", "1"), ("grpc-retry-pushback-ms", "250")),
    )
    assert errors.Unavailable("warming up").retry_metadata() == (
        ("retry-after", "1"),
        ("grpc-retry-pushback-ms", "1000"),
    )
    too_big = errors.ResourceExhausted("the request needs more KV pages than the pool holds")
    assert (too_big.retry_hint, too_big.retry_metadata()) == (None, ())
    assert errors.InvalidArgument("bad").retry_hint is None
    assert [errors.retry_after_seconds(s) for s in (0.001, 1.0, 1.2, 30)] == [1, 1, 2, 30]


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


class _Trailed(_Rpc):
    def __init__(self, trailing: tuple[tuple[str, str], ...]) -> None:
        super().__init__(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue is full")
        self._trailing = trailing

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailing


def test_error_from_rpc_reads_the_retry_hint_and_ignores_a_malformed_one() -> None:
    read = [
        errors.error_from_rpc(_Trailed(t)).retry_after
        for t in (
            (("retry-after", "3"), ("grpc-retry-pushback-ms", "2500")),  # the finer one wins
            (("retry-after", "3"),),
            (),
            (("retry-after", "-1"),),
            (("retry-after", "1e9"),),
            (("grpc-retry-pushback-ms", "9" * 40),),  # a hostile upstream's number: not passed on
        )
    ]
    assert read == [2.5, 3.0, None, None, None, None]
