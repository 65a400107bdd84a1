"""Gemma 2: Gemma's norms and scales (``rules.gemma``: ``1 + w`` RMSNorm in f32, four norms a layer,
embeddings times sqrt(hidden), GELU-tanh, ``query_pre_attn_scalar``, attention and final logit soft-capping, a
tied head); sliding-window layers from ``layer_types``, or every other layer."""

from __future__ import annotations

from typing import Any

from loraserve.models.families import rules

MODEL_TYPE = "gemma2"


def alternating(cfg: dict[str, Any], layers: int) -> list[str]:
    return [rules.SLIDING if (i + 1) % 2 else rules.FULL for i in range(layers)]


def fields(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    return {**rules.gemma(cfg), **rules.sliding(cfg, layers, alternating)}
