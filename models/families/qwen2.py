"""Qwen2 and 2.5: Llama with q/k/v bias (no o bias); a sliding window on the layers from
``max_window_layers`` on, when ``use_sliding_window``."""

from __future__ import annotations

from typing import Any

from loraserve.models.families import rules

MODEL_TYPE = "qwen2"


def fields(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    return {
        "qkv_bias": True,
        "o_bias": False,
        **rules.sliding(cfg, layers, rules.after_max_window_layers, gated=True),
    }
