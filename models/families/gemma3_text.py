"""Gemma 3 (text): Gemma 2's norms, scaling, MLP and tied head, plus a q/k RMSNorm per head before RoPE; no
soft-capping unless the config sets it; sliding layers from ``layer_types`` (or ``sliding_window_pattern``)
with a RoPE table of their own (``rope_parameters["sliding_attention"]``, 4.x ``rope_local_base_freq``)."""

from __future__ import annotations

from typing import Any

from loraserve.models.families import rules

MODEL_TYPE = "gemma3_text"


def by_pattern(cfg: dict[str, Any], layers: int) -> list[str]:
    pattern = int(cfg.get("sliding_window_pattern", 6))
    return [rules.SLIDING if (i + 1) % pattern else rules.FULL for i in range(layers)]


def fields(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    out = {**rules.gemma(cfg), "qk_norm": True, **rules.sliding(cfg, layers, by_pattern)}
    params = cfg.get("rope_parameters") or {}
    if rules.FULL not in params and rules.SLIDING not in params:  # 4.x: the local table's base apart
        out.update(local_rope_theta=float(cfg.get("rope_local_base_freq", 10000.0)), local_rope_scaling=None)
    return out
