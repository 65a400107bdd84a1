"""Mixtral: Mistral's attention; every layer's MLP a mixture of ``num_local_experts`` experts of width
``intermediate_size``, the top 2 per token, their weights renormalised and kept in f32 when scaling the
experts' outputs."""

from __future__ import annotations

from typing import Any

from loraserve.models.families import rules

MODEL_TYPE = "mixtral"


def fields(cfg: dict[str, Any], layers: int) -> dict[str, Any]:
    return {
        **rules.moe(MODEL_TYPE, cfg, expert_width="intermediate_size", always_renormalise=True),
        "routing_in_f32": True,
        **rules.sliding(cfg, layers, rules.every_layer),
    }
