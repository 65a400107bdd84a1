"""The model families, one module each: what a family's ``config.json`` means in ``ModelConfig``'s fields.

A family is a module with ``MODEL_TYPE`` (the ``model_type`` of the configs it serves) and ``fields(cfg,
layers)``: the ``ModelConfig`` fields in which it differs from reading the same config as Llama's
(``models.config.ModelConfig.from_hf`` reads what every family shares: sizes, heads, RoPE, EOS ids, biases).
Every family runs through the one decoder (``models.decoder``, its layers in ``models.layers``), switched by
those fields, so a family costs no compiled variant of its own. A new architecture is a new module here, listed
in :data:`FAMILIES`; one that needs a layer the others lack adds a field, its layer beside the shared ones, and
its parity test against transformers (``tests/worker/test_model_parity.py``, ``test_families.py``).
"""

from __future__ import annotations

from types import ModuleType

from loraserve.models.families import (
    gemma2,
    gemma3_text,
    llama,
    mistral,
    mixtral,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_moe,
)

FAMILIES: dict[str, ModuleType] = {
    family.MODEL_TYPE: family
    for family in (llama, mistral, qwen2, qwen3, gemma2, gemma3_text, qwen3_moe, mixtral, qwen2_moe)
}
