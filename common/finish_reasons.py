"""Why a generation ended, both ways between the wire enum and the names the SDK and the worker use."""

from __future__ import annotations

from enum import StrEnum

from loraserve.protos.v1 import inference_pb2 as pb


class FinishReason(StrEnum):
    """Why a generation ended; the value is the name the SDK, the worker and ``loraserve generate`` use
    (the OpenAI-compatible API says "stop" for EOS too: ``httpapi.responses``)."""

    LENGTH = "length"  # max_new_tokens reached
    STOP = "stop"  # a stop string or stop token id
    EOS = "eos"  # the model's end-of-sequence token


FINISH_TO_PROTO: dict[FinishReason, int] = {
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.EOS: pb.FINISH_REASON_EOS,
}
FINISH_FROM_PROTO: dict[int, FinishReason] = {v: k for k, v in FINISH_TO_PROTO.items()}
