"""Why a generation ended, both ways between the wire enum and the names the SDK and the worker use."""

from __future__ import annotations

from loraserve.protos.v1 import inference_pb2 as pb

FINISH_TO_PROTO: dict[str, int] = {
    "length": pb.FINISH_REASON_LENGTH,
    "stop": pb.FINISH_REASON_STOP,
    "eos": pb.FINISH_REASON_EOS,
}
FINISH_FROM_PROTO: dict[int, str] = {v: k for k, v in FINISH_TO_PROTO.items()}
