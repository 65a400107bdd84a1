"""A quantized checkpoint's format on disk (what ``loraserve quantize`` writes and ``models.checkpoint`` reads;
no JAX): the ``quant_method`` names, which tensors are stored quantized, and their scales' names."""

from __future__ import annotations

import re

QUANT_METHODS = {"int8": "loraserve-int8", "int4": "loraserve-int4"}  # --quantization -> quant_method
# the projections quantized: HF names of a layer's linear weights (models.quantization.QUANTIZED, unfused)
PROJECTION = re.compile(
    r"^model\.layers\.\d+\.(?:self_attn\.(?:q|k|v|o)_proj|mlp\.(?:gate|up|down)_proj)\.weight$"
)
SCALE_SUFFIX = "_scale"
HEAD, EMBED = "lm_head.weight", "model.embed_tokens.weight"  # --lm-head: the head quantized as well


def quantized_name(name: str, head: bool) -> bool:
    """A tensor a checkpoint written with (``head``: and with ``--lm-head``) stores quantized."""
    return bool(PROJECTION.match(name)) or (head and name == HEAD)
