"""What a decode row's device arrays hold at most, fixed by the request limits, and their bytes (no JAX: the
engine validates requests against the same numbers, the planner sizes memory with them)."""

from __future__ import annotations

from loraserve.common import limits
from loraserve.common.limits import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS

MAX_LOGPROBS = limits.MAX_LOGPROBS  # most alternatives a request may ask for (the device computes this many)
MAX_EOS_IDS = 16  # end-of-sequence ids a model may have (min_tokens bans them on the device)
# entries of a decode row's bias table: its logit_bias, and min_tokens' bans (stop token ids and EOS)
BIAS_ENTRIES = MAX_LOGIT_BIAS + MAX_STOP_TOKEN_IDS + MAX_EOS_IDS


def history_bytes(rows: int, vocab: int) -> int:
    """Device bytes of ``rows`` decode rows' history (``models.sampling.RowHistory``): token counts (int32)
    and seen flags (bool) over the vocabulary, and the bias table (id, value, until)."""
    return rows * vocab * (4 + 1) + rows * BIAS_ENTRIES * (4 + 4 + 4)
