"""PEFT LoRA adapters: parse and validate ``adapter_config.json`` + ``adapter_model.safetensors``.

One parser serves the worker (before a slot write) and the registry (before anything is stored). It
refuses, with an ``AdapterError`` whose ``code`` is the gRPC status to return (docs/design.md §3, §8):
unparsable files, pickle formats, non-LoRA / modules_to_save / ``bias`` adapters, NaN or inf weights,
tensors that are not floats of the right rank, ranks of 0 or above the limit, modules the model lacks,
shapes that do not fit the base model, DoRA modules without (or with a wrongly sized) magnitude vector,
LoRA biases of the wrong size, and DoRA with ``lora_bias`` (PEFT refuses that pair too). The result keeps
per-module ``A [L, in, r]`` and ``B [L, r, out]`` with the LoRA scaling already folded into B, ready to be
zero-padded into a slot, plus DoRA's magnitudes ``m [L, out]`` and ``lora_B``'s biases (scaled) ``[L, out]``,
and the embed_tokens / lm_head LoRA (``adapters.peft_vocab``: shapes checked against the model's vocabulary
and hidden size; neither DoRA nor ``lora_bias`` on them).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import struct
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from loraserve.adapters.errors import AdapterError, AdapterMismatchError, AdapterRankError, UnknownModuleError
from loraserve.adapters.files import CONFIG_FILE, WEIGHTS_FILE
from loraserve.adapters.patterns import check_patterns, pattern_key
from loraserve.adapters.peft_experts import (
    EXPERT_KEY,
    EXPERT_MODULE_NAMES,
    EXPERT_MODULES,
    PER_EXPERT_KEY,
    PerExpert,
    Site,
    check_expert_pair,
    check_per_expert,
    check_target_parameters,
    expert_site,
    fold_expert,
    fold_per_expert,
    name_sites,
    path_of,
    per_expert_site,
    stack_experts,
)
from loraserve.adapters.peft_vocab import (
    VOCAB_KEY,
    VOCAB_MODULES,
    check_vocab_shapes_of,
    fold_scaling,
    vocab_pair,
    vocab_path,
    vocab_tensor,
)

# The modules a LoRA slot can adapt, in the order pools and reports list them.
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# PEFT's saved names: ``…layers.N.<self_attn|mlp>.<module>.`` then ``lora_A.weight``, ``lora_B.weight``,
# ``lora_B.bias`` (lora_bias) or ``lora_magnitude_vector`` (DoRA), optionally with an adapter name before
# the last part (``lora_A.default.weight``, ``lora_magnitude_vector.default.weight``).
_KEY = re.compile(
    r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\."
    r"(?:lora_(A)(?:\.[\w-]+)?\.weight|lora_(B)(?:\.[\w-]+)?\.(weight|bias)|lora_magnitude_vector(?:(?:\.[\w-]+)?\.weight)?)$"
)
_FLOAT_DTYPES = {"F16", "BF16", "F32", "F64"}
# The largest magnitude any value a slot holds may have, checked on the float32 values after the scaling
# (alpha / r, rsLoRA, alpha_pattern, a mix weight) is folded in: A, scaled B, scaled lora_B biases, DoRA
# magnitudes and scales, embed_tokens / lm_head LoRA. Trained adapters stay orders of magnitude below it;
# within it no product of the kernels can overflow float32 (|x A B| <= |x| * in * r * 1e8), so an adapter
# can only ever change its own rows, and that by finite amounts (docs/security.md).
MAX_SLOT_VALUE = 1e4


@dataclass(frozen=True)
class LoraWeights:
    """A validated adapter: per module ``(A [L, in, r], B [L, r, out])`` float32, scaling folded into B.

    ``magnitudes`` (DoRA): module -> ``(m [L, out], mask [L] bool)``, the mask saying which layers are DoRA
    layers (those the adapter targets). ``biases`` (``lora_bias``): module -> ``[L, out]``, the scaling folded
    in (PEFT computes ``(B(A x) + b) * scaling``), zero for layers without one.
    """

    rank: int  # largest rank over modules
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    modules: dict[str, tuple[np.ndarray, np.ndarray]]
    sha256: str
    size_bytes: int
    config: dict[str, Any] = field(default_factory=dict)
    base_model: str = ""
    magnitudes: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    biases: dict[str, np.ndarray] = field(default_factory=dict)
    # embed_tokens / lm_head LoRA (``VOCAB_MODULES``): module -> ``(A [in, r], B [r, out])`` float32, scaling
    # folded into B: ``embed_tokens`` ``A [vocab, r]`` (rows gathered per token), ``B [r, hidden]``;
    # ``lm_head`` ``A [hidden, r]``, ``B [r, vocab]``
    vocab: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    # LoRA on a mixture of experts (``adapters.peft_experts``), scaling folded into B:
    # ``experts.gate_up_proj`` / ``experts.down_proj`` -> ``(A [L, E, in, r], B [L, E, r, out])``,
    # ``router`` -> ``(A [L, hidden, r], B [L, r, E])``
    experts: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    @property
    def use_dora(self) -> bool:
        return bool(self.magnitudes)


def parse_config(data: bytes) -> dict[str, Any]:
    """Parse and check ``adapter_config.json``; raises AdapterError naming the offending field."""
    try:
        cfg = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{CONFIG_FILE} is not valid JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise AdapterError(f"{CONFIG_FILE} must hold a JSON object")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise AdapterError(f"peft_type {cfg.get('peft_type')!r} is not supported (LORA only)")
    if cfg.get("use_dora") and cfg.get("lora_bias"):
        raise AdapterError("use_dora with lora_bias: DoRA does not support a LoRA bias (PEFT refuses it too)")
    if cfg.get("modules_to_save"):
        raise AdapterError(
            f"modules_to_save {cfg['modules_to_save']!r}: full-weight modules are not supported"
        )
    if cfg.get("bias", "none") != "none":
        raise AdapterError(
            f"bias {cfg.get('bias')!r} is not supported (only 'none'; lora_bias=true is the supported LoRA bias)"
        )
    r = cfg.get("r", 8)
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0:
        raise AdapterError(f"r must be a positive integer, got {r!r}")
    alpha = cfg.get("lora_alpha", r)
    if not isinstance(alpha, int | float) or not math.isfinite(alpha) or alpha <= 0:
        raise AdapterError(f"lora_alpha must be a positive number, got {alpha!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        pattern = cfg.get(key) or {}
        if not isinstance(pattern, dict):
            raise AdapterError(f"{key} must be an object")
        check_patterns(key, pattern)  # bounded; keys PEFT and RE2 read alike (adapters.patterns)
        for name, value in pattern.items():
            kinds = int if key == "rank_pattern" else int | float
            if not isinstance(value, kinds) or isinstance(value, bool) or not 0 < value < math.inf:
                what = "a positive integer" if key == "rank_pattern" else "a positive finite number"
                raise AdapterError(f"{key}[{name[:64]!r}] must be {what}, got {value!r}")
    targets = cfg.get("target_modules")
    if isinstance(targets, list):
        known = LORA_MODULES + VOCAB_MODULES + EXPERT_MODULE_NAMES
        unknown = sorted(set(targets) - set(known))
        if unknown:
            raise UnknownModuleError(
                f"target_modules {unknown} are not adaptable modules of this model ({', '.join(known)})"
            )
        vocab = sorted(set(targets) & set(VOCAB_MODULES))
        if vocab and cfg.get("use_dora"):
            raise AdapterError(
                f"use_dora with target_modules {vocab}: DoRA on embed_tokens/lm_head is not supported"
            )
        if vocab and cfg.get("lora_bias"):
            raise AdapterError(
                f"lora_bias with target_modules {vocab}: a LoRA bias on embed_tokens/lm_head is not supported"
            )
        if vocab and cfg.get("ensure_weight_tying"):
            raise AdapterError(
                f"ensure_weight_tying with target_modules {vocab} is not supported (the worker adapts the input "
                "embedding and the output projection separately, PEFT's default)"
            )
    check_target_parameters(cfg)
    return cfg


def layer_kind(key: str, shape: tuple[int, ...], dora: bool, lora_bias: bool) -> tuple[int, str, str]:
    """A decoder-layer tensor's ``(layer, module, which)`` (``A``, ``B``, ``bias`` for lora_B's bias, ``m`` for
    DoRA's magnitude vector) from its name and shape, refusing names that are no LoRA tensor of a projection
    this model adapts, DoRA / bias tensors the config does not declare, and the wrong number of dimensions."""
    match = _KEY.search(key)
    if match is None:
        raise AdapterError(f"tensor {key} is not a LoRA A/B matrix of a decoder layer projection")
    layer, module = int(match.group(1)), match.group(2)
    if match.group(3):
        which = "A"
    elif match.group(4):
        which = "bias" if match.group(5) == "bias" else "B"
    else:
        which = "m"  # lora_magnitude_vector
    if module not in LORA_MODULES:
        raise UnknownModuleError(f"tensor {key} targets {module!r}, which this model does not adapt")
    if which == "m" and not dora:
        raise AdapterError(f"tensor {key} is a DoRA magnitude vector but use_dora is not set")
    if which == "bias" and not lora_bias:
        raise AdapterError(f"tensor {key} is a lora_B bias but lora_bias is not set")
    ndim = 1 if which in ("m", "bias") else 2
    if len(shape) != ndim:
        what = "LoRA matrices are 2-D" if ndim == 2 else "magnitude vectors and biases are 1-D"
        raise AdapterError(f"tensor {key} has shape {list(shape)}; {what}")
    return layer, module, which


def check_module_pair(
    path: str,
    module: str,
    layer: int,
    r: int,
    shapes: dict[str, tuple[int, ...]],
    dora: bool,
    max_rank: int | None,
    module_shapes: dict[str, tuple[int, int]] | None,
    num_layers: int | None,
) -> None:
    """One module of one layer, from its tensors' ``shapes`` (``A``, ``B``, and ``m`` / ``bias`` if saved): both
    matrices present, of rank ``r`` (``rank_pattern`` applied) within ``max_rank``, fitting the base model's
    ``(in, out)`` and layer count, DoRA's magnitude present when ``dora``, vectors as long as lora_B's outputs.
    ``parse_adapter`` and the registry's streaming validator share it, so both refuse alike."""
    if not {"A", "B"} <= set(shapes):
        missing = ({"A", "B"} - set(shapes)).pop()
        raise AdapterError(f"{path}: lora_{missing} is missing")
    a, b = shapes["A"], shapes["B"]  # PEFT: A [r, in], B [out, r]
    if a[0] != r or b[1] != r:
        raise AdapterError(
            f"{path}: lora_A {list(a)} / lora_B {list(b)} do not match rank {r} (lora_A [r, in], lora_B [out, r])"
        )
    if max_rank is not None and r > max_rank:
        raise AdapterRankError(f"{path}: rank {r} is above the largest slot rank {max_rank}")
    if module_shapes is not None:
        want_in, want_out = module_shapes[module]
        if a[1] != want_in or b[0] != want_out:
            raise AdapterMismatchError(
                f"{path}: lora_A {list(a)} / lora_B {list(b)} expect in={want_in}, out={want_out}; "
                "the adapter was built for another base model"
            )
    if num_layers is not None and layer >= num_layers:
        raise AdapterMismatchError(
            f"{path}: layer {layer} does not exist (the model has {num_layers} layers)"
        )
    if dora and "m" not in shapes:
        raise AdapterError(f"{path}: use_dora is set but the DoRA lora_magnitude_vector is missing")
    for which, label in (("m", "lora_magnitude_vector"), ("bias", "lora_B bias")):
        if which in shapes and tuple(shapes[which]) != (b[0],):
            raise AdapterError(
                f"{path}: {label} {list(shapes[which])} does not match lora_B's {b[0]} outputs"
            )


def _pattern_value(pattern: dict[str, Any], key: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: the first pattern matching a dotted suffix of the module
    path, in linear time (``adapters.patterns``)."""
    hit = pattern_key(pattern, key)
    return default if hit is None else pattern[hit]


def _check_header(data: bytes) -> None:
    """Reject safetensors headers the library would accept silently: duplicate names, non-float dtypes."""
    if len(data) < 8:
        raise AdapterError(f"{WEIGHTS_FILE} is truncated ({len(data)} bytes)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise AdapterError(f"{WEIGHTS_FILE} header claims {n} bytes but the file holds {len(data) - 8}")

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        for key, value in pairs:
            if key in seen:
                raise AdapterError(f"{WEIGHTS_FILE} names tensor {key!r} twice")
            seen[key] = value
        return seen

    try:
        header = json.loads(data[8 : 8 + n], object_pairs_hook=no_duplicates)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{WEIGHTS_FILE} header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise AdapterError(f"{WEIGHTS_FILE} header is not a JSON object")
    for name, info in header.items():
        if name != "__metadata__" and isinstance(info, dict) and info.get("dtype") not in _FLOAT_DTYPES:
            raise AdapterError(
                f"tensor {name} has dtype {info.get('dtype')}; LoRA weights must be floating point"
            )


# safetensors dtype -> numpy (little-endian, as the format stores them); BF16 is widened by hand
_NUMPY_DTYPES = {
    "F64": "<f8",
    "F32": "<f4",
    "F16": "<f2",
    "I64": "<i8",
    "I32": "<i4",
    "I16": "<i2",
    "I8": "i1",
}
_NUMPY_DTYPES |= {"U8": "u1", "BOOL": "?"}


def safetensors_to_numpy(data: bytes) -> dict[str, np.ndarray]:
    """safetensors bytes -> numpy arrays, BF16 widened to float32 (exact: a bfloat16 is a float32's top
    16 bits). ``safetensors.numpy`` refuses BF16 (numpy has no such type: TypeError or ValueError, and
    since safetensors 0.8 KeyError('BF16'), its flax loader too), so such files are read through
    ``safetensors.deserialize``; malformed bytes raise ``SafetensorError``."""
    from safetensors import deserialize
    from safetensors.numpy import load

    try:
        return load(data)
    except (TypeError, ValueError, KeyError) as exc:
        if "bfloat16" not in str(exc) and "BF16" not in str(exc):
            raise
    out = {}
    for name, info in deserialize(data):
        if info["dtype"] == "BF16":
            bits = np.frombuffer(info["data"], "<u2").astype("<u4")
            bits <<= 16
            array = bits.view("<f4")
        elif info["dtype"] in _NUMPY_DTYPES:
            array = np.frombuffer(info["data"], _NUMPY_DTYPES[info["dtype"]])
        else:
            raise ValueError(f"tensor {name} has dtype {info['dtype']}, which numpy cannot hold")
        out[name] = array.reshape(info["shape"])
    return out


def load_tensors(data: bytes) -> dict[str, np.ndarray]:
    """safetensors bytes -> float32 numpy arrays, refusing anything malformed with AdapterError."""
    from safetensors import SafetensorError

    _check_header(data)
    try:
        tensors = safetensors_to_numpy(data)
    except (SafetensorError, ValueError, TypeError, KeyError) as exc:
        raise AdapterError(f"{WEIGHTS_FILE} is not a valid safetensors file: {exc}") from exc
    return {k: np.asarray(v, dtype=np.float32) for k, v in tensors.items()}


@dataclass(frozen=True)
class _Scaling:
    """``adapter_config.json``'s ranks and alphas: per module path (``rank_pattern``, ``alpha_pattern``) or
    the defaults, and whether rsLoRA scales by ``alpha / sqrt(r)`` instead of ``alpha / r``."""

    rank_pattern: dict[str, Any]
    alpha_pattern: dict[str, Any]
    default_r: int
    default_alpha: float
    rslora: bool

    @classmethod
    def of(cls, cfg: dict[str, Any]) -> _Scaling:
        return cls(
            cfg.get("rank_pattern") or {},
            cfg.get("alpha_pattern") or {},
            int(cfg.get("r", 8)),
            float(cfg.get("lora_alpha", cfg.get("r", 8))),
            bool(cfg.get("use_rslora", False)),
        )

    def rank(self, path: str) -> int:
        return int(_pattern_value(self.rank_pattern, path, self.default_r))

    def alpha(self, path: str) -> float:
        return float(_pattern_value(self.alpha_pattern, path, self.default_alpha))

    def factor(self, alpha: float, r: int) -> float:
        return alpha / math.sqrt(r) if self.rslora else alpha / r


_Pair = dict[str, np.ndarray]  # "A", "B" and, where present, "m" (DoRA) and "bias" (lora_bias)


def _group_tensors(
    tensors: dict[str, np.ndarray],
    dora: bool,
    lora_bias: bool,
    module_shapes: dict[str, tuple[int, int]] | None,
) -> tuple[dict[tuple[str, int], _Pair], dict[str, _Pair], dict[Site, _Pair], PerExpert]:
    """Every tensor by what it is: ``(module, layer) -> {which: tensor}`` for the projections, ``module ->
    {which: tensor}`` for embed_tokens / lm_head (``adapters.peft_vocab.vocab_tensor``), ``site -> {which:
    tensor}`` for a mixture of experts' fused layout and ``(layer, kind) -> expert -> {which: tensor}`` for its
    per-expert module layout (``adapters.peft_experts``). Refuses a name that is none of these,
    a wrong rank or dtype, NaN or inf."""
    found: dict[tuple[str, int], _Pair] = {}
    vocab_found: dict[str, _Pair] = {}
    expert_found: dict[Site, _Pair] = {}
    per_expert: PerExpert = {}
    for key, value in tensors.items():
        vmatch = VOCAB_KEY.search(key)
        if vmatch is not None:
            vocab_tensor(key, value, vmatch, vocab_found, module_shapes)
            continue
        ematch, pmatch = EXPERT_KEY.search(key), PER_EXPERT_KEY.search(key)
        if ematch is not None:
            site, which = expert_site(key, ematch, value.shape)
            pair = expert_found.setdefault(site, {})
        elif pmatch is not None:
            group, expert, which = per_expert_site(key, pmatch, value.shape)
            pair = per_expert.setdefault(group, {}).setdefault(expert, {})
        else:
            layer, module, which = layer_kind(key, value.shape, dora, lora_bias)
            pair = found.setdefault((module, layer), {})
        if not np.isfinite(value).all():
            raise AdapterError(f"tensor {key} contains NaN or inf")
        pair[which] = value
    return found, vocab_found, expert_found, per_expert


def _fold_experts(
    expert_found: dict[Site, _Pair],
    cfg: dict[str, Any],
    scaling: _Scaling,
    max_rank: int | None,
    module_shapes: dict[str, tuple[int, int]] | None,
    num_layers: int | None,
) -> tuple[dict[str, dict[int, tuple[np.ndarray, np.ndarray]]], int]:
    """The mixture of experts' pairs named, checked and folded (``adapters.peft_experts``): name -> layer
    -> ``(A [E, in, r], B [E, r, out])``, and their largest rank."""
    shapes = {site: {k: v.shape for k, v in pair.items()} for site, pair in expert_found.items()}
    names = name_sites(shapes, check_target_parameters(cfg), module_shapes)
    out: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
    top = 0
    for site, name in sorted(names.items()):
        pair, path = expert_found[site], path_of(site, name)
        for need in ("A", "B"):
            if need not in pair:
                raise AdapterError(f"{path}: lora_{need} is missing")
        r = scaling.rank(path)
        a, b = pair["A"], pair["B"]
        check_expert_pair(path, name, r, a.shape, b.shape, max_rank, module_shapes, num_layers, site[0])
        if site[0] in out.get(name, {}):
            raise AdapterError(f"{path}: two LoRA pairs adapt it")
        out.setdefault(name, {})[site[0]] = fold_expert(a, b, r, scaling.factor(scaling.alpha(path), r))
        top = max(top, r)
    return out, top


@dataclass
class _Folded:
    """The projections checked and scaled, per module and layer: ``(A [in, r], B [r, out] scaled)``, DoRA
    magnitudes (``vectors["m"]``) and scaled lora_B biases (``vectors["bias"]``), and the largest rank."""

    per_module: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)
    vectors: dict[str, dict[str, dict[int, np.ndarray]]] = field(
        default_factory=lambda: {"m": {}, "bias": {}}
    )
    max_rank: int = 0


def _fold_modules(
    found: dict[tuple[str, int], _Pair],
    scaling: _Scaling,
    dora: bool,
    max_rank: int | None,
    module_shapes: dict[str, tuple[int, int]] | None,
    num_layers: int | None,
) -> _Folded:
    """Check each (module, layer)'s tensors against its rank and the base model (``check_module_pair``), in
    (module, layer) order, and fold the LoRA scaling into B and the bias."""
    out = _Folded()
    for (module, layer), pair in sorted(found.items()):
        path = _module_path(module, layer)
        r = scaling.rank(path)
        check_module_pair(
            path,
            module,
            layer,
            r,
            {k: v.shape for k, v in pair.items()},
            dora,
            max_rank,
            module_shapes,
            num_layers,
        )
        a, b = pair["A"], pair["B"]  # PEFT: A [r, in], B [out, r]
        factor = scaling.factor(scaling.alpha(path), r)
        out.per_module.setdefault(module, {})[layer] = (a.T, fold_scaling(b.T, factor))
        if "m" in pair:
            out.vectors["m"].setdefault(module, {})[layer] = pair["m"]
        if "bias" in pair:
            out.vectors["bias"].setdefault(module, {})[layer] = fold_scaling(pair["bias"], factor)
        out.max_rank = max(out.max_rank, r)
    return out


def _vocab_pairs(
    vocab_found: dict[str, _Pair],
    scaling: _Scaling,
    max_rank: int | None,
    module_shapes: dict[str, tuple[int, int]] | None,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """embed_tokens / lm_head LoRA (``adapters.peft_vocab.vocab_pair``; a base-layer copy alone is no LoRA),
    shapes checked against the model's when it is known."""
    vocab = {
        module: vocab_pair(
            module,
            pair,
            scaling.rank(vocab_path(module)),
            scaling.alpha(vocab_path(module)),
            scaling.rslora,
            max_rank,
        )
        for module, pair in sorted(vocab_found.items())
        if set(pair) != {"base"}
    }
    if module_shapes is not None and vocab:
        check_vocab_shapes_of(vocab, module_shapes)
    return vocab


def _stack_modules(
    per_module: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]], layers: int
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per module ``(A [L, in, r], B [L, r, out])``, zero-padded to the module's largest rank and ``layers``
    (a layer the adapter leaves out is zeros). Refuses layers whose fans disagree."""
    modules: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for module, by_layer in per_module.items():
        r = max(a.shape[1] for a, _ in by_layer.values())
        fan_in, fan_out = next(iter(by_layer.values()))[0].shape[0], next(iter(by_layer.values()))[1].shape[1]
        for layer, (a, b) in by_layer.items():  # an unknown base model's layers could disagree
            check_layer_fans(module, layer, a.shape[0], b.shape[1], fan_in, fan_out)
        a_all = np.zeros((layers, fan_in, r), np.float32)
        b_all = np.zeros((layers, r, fan_out), np.float32)
        for layer, (a, b) in by_layer.items():
            a_all[layer, :, : a.shape[1]] = a
            b_all[layer, : b.shape[0]] = b
        modules[module] = (a_all, b_all)
    return modules


def parse_adapter(
    config_bytes: bytes,
    weights_bytes: bytes,
    *,
    module_shapes: dict[str, tuple[int, int]] | None = None,
    num_layers: int | None = None,
    max_rank: int | None = None,
) -> LoraWeights:
    """Validate an adapter and return its weights, scaling folded into B.

    ``module_shapes`` (``module -> (in, out)``) and ``num_layers`` describe the base model; when given,
    an adapter that does not fit raises AdapterMismatchError. ``max_rank`` bounds every module's rank.

    The steps, in the order their refusals come: the config, the tensors (``_group_tensors``), each
    projection (``_fold_modules``), embed_tokens / lm_head (``_vocab_pairs``), the stacks per module
    (``_stack_modules``), then the values (``check_weights``).
    """
    cfg = parse_config(config_bytes)
    tensors = load_tensors(weights_bytes)
    if not tensors:
        raise AdapterError(f"{WEIGHTS_FILE} holds no tensors")
    dora, lora_bias = bool(cfg.get("use_dora")), bool(cfg.get("lora_bias"))
    found, vocab_found, expert_found, per_expert = _group_tensors(tensors, dora, lora_bias, module_shapes)
    scaling = _Scaling.of(cfg)
    folded = _fold_modules(found, scaling, dora, max_rank, module_shapes, num_layers)
    vocab = _vocab_pairs(vocab_found, scaling, max_rank, module_shapes)
    by_expert, expert_rank = _fold_experts(expert_found, cfg, scaling, max_rank, module_shapes, num_layers)
    if per_expert:  # the per-expert module layout (adapters.peft_experts.check_per_expert)
        shapes = {
            g: {e: {k: v.shape for k, v in p.items()} for e, p in es.items()} for g, es in per_expert.items()
        }
        ranks = check_per_expert(shapes, scaling.rank, max_rank, module_shapes, num_layers)

        def factor(path: str, r: int) -> float:
            return scaling.factor(scaling.alpha(path), r)

        for name, by_layer in fold_per_expert(per_expert, ranks, factor).items():
            for layer, pair in by_layer.items():
                if layer in by_expert.get(name, {}):
                    raise AdapterError(f"{path_of((layer, '', 0), name)}: adapted both fused and per expert")
                by_expert.setdefault(name, {})[layer] = pair
                expert_rank = max(expert_rank, pair[0].shape[2])
    max_seen = max([folded.max_rank, expert_rank, *(a.shape[1] for a, _ in vocab.values())])
    if not found and not vocab and not expert_found and not per_expert:
        raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA matrices")
    seen_layers = (
        [layer for _, layer in found] + [site[0] for site in expert_found] + [g[0] for g in per_expert]
    )
    layers = num_layers if num_layers is not None else 1 + max(seen_layers, default=-1)
    modules = _stack_modules(folded.per_module, layers)
    experts = stack_experts(by_expert, layers)
    stacked = {
        which: {m: _stack(v, layers) for m, v in by_module.items()}
        for which, by_module in folded.vectors.items()
    }
    weights = LoraWeights(
        rank=max_seen,
        alpha=scaling.default_alpha,
        use_rslora=scaling.rslora,
        target_modules=tuple(m for m in LORA_MODULES if m in modules)
        + tuple(vocab)
        + tuple(m for m in EXPERT_MODULES if m in experts),
        modules=modules,
        sha256=hashlib.sha256(weights_bytes).hexdigest(),
        size_bytes=len(weights_bytes),
        config=cfg,
        base_model=str(cfg.get("base_model_name_or_path") or ""),
        magnitudes=stacked["m"],
        biases={m: v for m, (v, _) in stacked["bias"].items()},
        vocab=vocab,
        experts=experts,
    )
    check_weights(weights)
    return weights


def check_slot_value(what: str, value: np.ndarray) -> None:
    """INVALID_ARGUMENT naming ``what`` unless every element of ``value`` (float32, scaling folded in) is
    finite and within ``MAX_SLOT_VALUE``. Cheap: one pass, no copy of a finite array."""
    if value.size == 0:
        return
    check_slot_peak(what, float(np.max(np.abs(value))))  # NaN propagates, inf stays inf


def check_slot_peak(what: str, peak: float) -> None:
    """:func:`check_slot_value` of an array whose largest magnitude is ``peak`` (NaN: one was NaN); the
    registry's tensor-by-tensor validation (``adapters.peft_stream``) computes it a chunk at a time."""
    if not math.isfinite(peak):
        raise AdapterError(f"{what} is not finite once scaled to float32 (NaN or inf); refused")
    if peak > MAX_SLOT_VALUE:
        raise AdapterError(
            f"{what} reaches |{peak:.4g}| once scaled, over the bound {MAX_SLOT_VALUE:g} a slot value may have"
        )


def check_weights(weights: LoraWeights) -> None:
    """Every array a slot will hold from ``weights`` through :func:`check_slot_value`, named by module and
    layer (the registry runs it on upload, the worker on every load: neither trusts the other)."""

    def by_layer(module: str, label: str, stacked: np.ndarray) -> None:
        for layer, value in enumerate(stacked):
            check_slot_value(f"{_module_path(module, layer)}: {label}", value)

    for module, (a, b) in weights.modules.items():
        by_layer(module, "lora_A", a)
        by_layer(module, "lora_B x scaling", b)
    for module, (m, _) in weights.magnitudes.items():
        by_layer(module, "lora_magnitude_vector", m)
    for module, bias in weights.biases.items():
        by_layer(module, "lora_B bias x scaling", bias)
    for module, (a, b) in weights.vocab.items():
        check_slot_value(f"{vocab_path(module)}: lora_A", a)
        check_slot_value(f"{vocab_path(module)}: lora_B x scaling", b)
    for name, (a, b) in weights.experts.items():
        for layer in range(a.shape[0]):
            path = path_of((layer, "", 0), name)
            check_slot_value(f"{path}: lora_A", a[layer])
            check_slot_value(f"{path}: lora_B x scaling", b[layer])


def check_layer_fans(module: str, layer: int, fan_in: int, fan_out: int, want_in: int, want_out: int) -> None:
    """AdapterError unless ``module``'s ``layer`` has the in/out features of its first layer."""
    if (fan_in, fan_out) != (want_in, want_out):
        raise AdapterError(
            f"{_module_path(module, layer)}: in={fan_in}, out={fan_out} differ from the module's first layer "
            f"(in={want_in}, out={want_out})"
        )


def _module_path(module: str, layer: int) -> str:
    part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"model.layers.{layer}.{part}.{module}"


def _stack(by_layer: dict[int, np.ndarray], layers: int) -> tuple[np.ndarray, np.ndarray]:
    """``layer -> [out]`` -> ``([L, out]`` zero where absent, ``[L]`` bool: present)."""
    out = np.zeros((layers, next(iter(by_layer.values())).shape[0]), np.float32)
    mask = np.zeros(layers, bool)
    for layer, value in by_layer.items():
        out[layer], mask[layer] = value, True
    return out, mask
