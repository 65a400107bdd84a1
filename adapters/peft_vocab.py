"""embed_tokens and lm_head LoRA in PEFT's files: their tensor names, shape checks and scaling.

``adapters.peft.parse_adapter`` hands every tensor whose name matches :data:`VOCAB_KEY` here. PEFT saves
the embedding LoRA as ``lora_embedding_A [r, vocab]`` / ``lora_embedding_B [hidden, r]`` and lm_head's as an
ordinary Linear LoRA (``lora_A [r, hidden]`` / ``lora_B [vocab, r]``), scaled like any LoRA module (PEFT's
``Embedding`` applies no dropout). The results are ``(A [in, r], B [r, out])`` with the scaling folded
into B, ``module_shapes`` giving ``embed_tokens (vocab, hidden)`` and ``lm_head (hidden, vocab)``.
"""

from __future__ import annotations

import math
import re

import numpy as np

from loraserve.adapters.errors import AdapterError, AdapterMismatchError, AdapterRankError, UnknownModuleError

# The vocabulary-sized targets (one per model, not per layer): ``(in, out)`` is ``(vocab, hidden)`` for the
# embedding and ``(hidden, vocab)`` for lm_head in ``module_shapes``.
VOCAB_MODULES = ("embed_tokens", "lm_head")
# PEFT's names for them: ``…embed_tokens.lora_embedding_A`` ``[r, vocab]`` / ``lora_embedding_B``
# ``[hidden, r]`` (parameters, no ``.weight``), ``…lm_head.lora_A.weight`` ``[r, hidden]`` / ``lora_B.weight``
# ``[vocab, r]``, and the base weights PEFT saves next to them (``save_embedding_layers``):
# ``….base_layer.weight``.
VOCAB_KEY = re.compile(
    r"(?:^|\.)(embed_tokens|lm_head)\."
    r"(?:lora_embedding_(A|B)(?:\.[\w-]+)?|lora_(A|B)(?:\.[\w-]+)?\.(weight|bias)|(base_layer)\.weight)$"
)


def vocab_path(module: str) -> str:
    """The module path ``rank_pattern``/``alpha_pattern`` match: ``model.embed_tokens`` or ``lm_head``."""
    return "model.embed_tokens" if module == "embed_tokens" else "lm_head"


def vocab_kind(
    key: str, match: re.Match[str], shape: tuple[int, ...], module_shapes: dict[str, tuple[int, int]] | None
) -> tuple[str, str]:
    """An embed_tokens / lm_head tensor's ``(module, which)`` (``A``, ``B`` or ``base``) from its name and shape,
    refusing what PEFT never saves there (a bias, the other LoRA kind's names), a non-matrix, and a saved base
    weight whose ``[vocab, hidden]`` is not the model's (an adapter for a resized vocabulary)."""
    module = match.group(1)
    if match.group(4) == "bias":
        raise AdapterError(f"tensor {key} is a lora_B bias; a LoRA bias on {module} is not supported")
    if module == "embed_tokens" and match.group(3):
        raise AdapterError(f"tensor {key}: PEFT saves embed_tokens LoRA as lora_embedding_A/B")
    if module == "lm_head" and match.group(2):
        raise AdapterError(f"tensor {key}: lm_head LoRA is lora_A/lora_B (a Linear LoRA)")
    which = "base" if match.group(5) else (match.group(2) or match.group(3))
    if len(shape) != 2:
        raise AdapterError(f"tensor {key} has shape {list(shape)}; LoRA matrices are 2-D")
    if which == "base" and module_shapes is not None and module in module_shapes:
        want = (
            module_shapes["embed_tokens"] if "embed_tokens" in module_shapes else module_shapes[module][::-1]
        )
        if tuple(shape) != tuple(want):
            raise AdapterMismatchError(
                f"{module}: the saved base weight {list(shape)} is not the model's [vocab, hidden] "
                f"{list(want)}; the adapter was built for another (or resized) vocabulary"
            )
    return module, which


def vocab_tensor(
    key: str,
    value: np.ndarray,
    match: re.Match[str],
    found: dict[str, dict[str, np.ndarray]],
    module_shapes: dict[str, tuple[int, int]] | None,
) -> None:
    """Check one embed_tokens / lm_head tensor (:func:`vocab_kind`, finite values) and file it under
    ``found[module]`` (``A``, ``B``, ``base``). The base weights PEFT saves with them are checked for shape and
    otherwise ignored: the worker serves its own base."""
    module, which = vocab_kind(key, match, value.shape, module_shapes)
    if not np.isfinite(value).all():
        raise AdapterError(f"tensor {key} contains NaN or inf")
    found.setdefault(module, {})[which] = value


def vocab_pair(
    module: str,
    pair: dict[str, np.ndarray],
    r: int,
    alpha: float,
    rslora: bool,
    max_rank: int | None,
) -> tuple[np.ndarray, np.ndarray]:
    """``embed_tokens``: ``lora_embedding_A [r, vocab]``, ``B [hidden, r]``; ``lm_head``: ``lora_A [r, hidden]``,
    ``lora_B [vocab, r]`` of rank ``r`` (``rank_pattern`` applied) -> ``(A [in, r], B [r, out] · scaling)`` (PEFT's ``Embedding``/``Linear``: the
    same ``alpha / r`` or rsLoRA scaling; no dropout at inference)."""
    path = vocab_path(module)
    if not {"A", "B"} <= set(pair):
        missing = ({"A", "B"} - set(pair)).pop()
        raise AdapterError(f"{path}: lora_{missing} is missing")
    a, b = pair["A"], pair["B"]
    if a.shape[0] != r or b.shape[1] != r:
        raise AdapterError(
            f"{path}: A {list(a.shape)} / B {list(b.shape)} do not match rank {r} (A [r, in], B [out, r])"
        )
    if max_rank is not None and r > max_rank:
        raise AdapterRankError(f"{path}: rank {r} is above the largest slot rank {max_rank}")
    scaling = alpha / math.sqrt(r) if rslora else alpha / r
    return a.T.copy(), fold_scaling(b.T, scaling)


def fold_scaling(value: np.ndarray, scaling: float) -> np.ndarray:
    """``value * scaling`` in float32, as a slot holds it. An overflow gives inf (no warning):
    ``adapters.peft.check_weights`` then refuses the adapter, naming the tensor."""
    with np.errstate(over="ignore", invalid="ignore"):
        return (value * np.float32(scaling)).astype(np.float32)


def check_vocab_shapes_of(
    vocab: dict[str, tuple[np.ndarray, np.ndarray]], module_shapes: dict[str, tuple[int, int]]
) -> None:
    """Raise AdapterMismatchError when an embed_tokens / lm_head LoRA does not fit ``module_shapes``
    (``embed_tokens: (vocab, hidden)``, ``lm_head: (hidden, vocab)``); UnknownModuleError when the model
    does not report that module."""
    for module, (a, b) in vocab.items():
        if module not in module_shapes:
            raise UnknownModuleError(f"{module}: this base model does not report an adaptable {module}")
        want_in, want_out = module_shapes[module]
        if a.shape[0] != want_in or b.shape[1] != want_out:
            raise AdapterMismatchError(
                f"{module}: A [in={a.shape[0]}] / B [out={b.shape[1]}] expect in={want_in}, out={want_out}; "
                "the adapter was built for another base model (vocabulary or hidden size)"
            )
