"""Qwen3-MoE: Qwen3's attention (q/k norm, explicit ``head_dim``); every layer's MLP a mixture of
``num_experts`` experts of width ``moe_intermediate_size``, ``num_experts_per_tok`` chosen per token, their
weights renormalised when ``norm_topk_prob``; Qwen's optional sliding window."""

from __future__ import annotations

from typing import Any

from loraserve.models.families import rules

MODEL_TYPE = "qwen3_moe"


def fields(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    return {
        "qk_norm": True,
        **rules.moe(MODEL_TYPE, cfg, expert_width="moe_intermediate_size"),
        **rules.sliding(cfg, layers, rules.after_max_window_layers, gated=True),
    }
