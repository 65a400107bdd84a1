"""Validate a PEFT adapter from its safetensors file tensor by tensor, in bounded memory (the registry's uploads).

``adapters.peft.parse_adapter`` builds what a slot holds: float32 copies of every tensor and zero-padded
per-layer stacks, several times the file's size in memory. The registry needs none of that, only the
verdict and a few numbers (rank, alpha, targets). :func:`validate_adapter_file` applies the same rules with
the same messages to a file on disk, reading each tensor ``chunk_bytes`` at a time: per chunk it widens the
values to float32, checks they are finite and keeps the largest magnitude, unscaled and (for ``lora_B``
and its bias) once scaled the way ``fold_scaling`` scales it. Every rule of ``parse_adapter`` that looks at
shapes then runs on the header's shapes, and ``check_weights``'s bound on those peaks, in the same order. Its
memory is a few chunks whatever the file's size. ``tests/adapters/test_peft_stream.py`` holds the two to
the same answers.

One difference: ``parse_adapter`` sees the tensors in the order safetensors' hash map yields them (random per
process); this reads them in file order. When two tensors are each wrong in their own way, which of the two
errors is reported may differ; every single error is the same.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from loraserve.adapters.errors import AdapterError, AdapterMismatchError, AdapterRankError, UnknownModuleError
from loraserve.adapters.files import WEIGHTS_FILE
from loraserve.adapters.peft import (
    LORA_MODULES,
    _check_header,
    _module_path,
    _pattern_value,
    check_layer_fans,
    check_module_pair,
    check_slot_peak,
    layer_kind,
    parse_config,
)
from loraserve.adapters.peft_experts import (
    EXPERT_KEY,
    EXPERT_MODULES,
    GATE_UP,
    PER_EXPERT_KEY,
    Site,
    check_expert_pair,
    check_per_expert,
    check_target_parameters,
    expert_site,
    name_sites,
    path_of,
    per_expert_path,
    per_expert_site,
)
from loraserve.adapters.peft_vocab import VOCAB_KEY, fold_scaling, vocab_kind, vocab_path

CHUNK_BYTES = 1 << 20  # bytes of one tensor read at a time; the float32 work of a chunk is a few times this
_ITEM_BYTES = {"F16": 2, "BF16": 2, "F32": 4, "F64": 8}


@dataclass(frozen=True)
class AdapterSummary:
    """What the registry records of a valid adapter (the fields of ``LoraWeights`` it stores)."""

    rank: int  # largest rank over modules
    alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]
    size_bytes: int
    config: dict[str, Any]


@dataclass(frozen=True)
class _Tensor:
    """One tensor as the checks after the first pass need it: its shape and its peaks."""

    shape: tuple[int, ...]
    peak: float | None  # largest |value| in float32 (NaN when one is NaN); None: no elements
    scaled: float | None  # the same of ``fold_scaling(value, scaling)`` (lora_B, its bias, vocab B)


def _largest(a: float, b: float) -> float:
    """``max`` for which a NaN wins, as ``np.max`` over the whole array would have it."""
    return a if a != a or a >= b else b


def _scan(
    f: BinaryIO, start: int, info: dict[str, Any], key: str, scaling: float | None, chunk: int
) -> _Tensor:
    """Read one tensor ``chunk`` bytes at a time: AdapterError unless every value is finite as float32;
    its peaks (``scaling``: also those of the scaled values)."""
    dtype, shape = info["dtype"], tuple(info["shape"])
    item = _ITEM_BYTES[dtype]
    count = math.prod(shape)
    if count == 0:
        return _Tensor(shape, None, None)
    per = max(1, chunk // item)
    peak = scaled = 0.0
    f.seek(start + info["data_offsets"][0])
    for first in range(0, count, per):
        raw = f.read(min(per, count - first) * item)
        values = _float32(raw, dtype)
        if not np.isfinite(values).all():
            raise AdapterError(f"tensor {key} contains NaN or inf")
        peak = _largest(peak, float(np.max(np.abs(values))))
        if scaling is not None:
            scaled = _largest(scaled, float(np.max(np.abs(fold_scaling(values, scaling)))))
    return _Tensor(shape, peak, scaled if scaling is not None else None)


def _float32(raw: bytes, dtype: str) -> np.ndarray:
    """A chunk of one tensor's little-endian values as float32 (``adapters.peft.load_tensors``'s widening)."""
    if dtype == "BF16":
        bits = np.frombuffer(raw, "<u2").astype("<u4")
        bits <<= 16
        return bits.view("<f4")
    values = np.frombuffer(raw, {"F16": "<f2", "F32": "<f4", "F64": "<f8"}[dtype])
    with np.errstate(over="ignore"):  # an F64 beyond float32 becomes inf, refused by the caller
        return np.asarray(values, dtype=np.float32)


def _read_header(f: BinaryIO, path: str) -> tuple[dict[str, Any], int]:
    """The safetensors header's tensors (by name) and where the data starts; the checks of
    ``adapters.peft.load_tensors``: ``_check_header`` and safetensors' own, with the same messages."""
    from safetensors import SafetensorError, safe_open

    size = os.fstat(f.fileno()).st_size
    with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if size else _Empty() as data:
        _check_header(data)  # only the header's pages are read
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
    try:  # the library's validation: offsets, dtypes and shapes agree and cover the file exactly
        with safe_open(path, framework="numpy"):
            pass
    except (SafetensorError, ValueError, TypeError, KeyError) as exc:
        # safetensors.numpy.load says "Error while deserializing: …" where safe_open says "… header: …"
        message = str(exc).replace("Error while deserializing header: ", "Error while deserializing: ", 1)
        raise AdapterError(f"{WEIGHTS_FILE} is not a valid safetensors file: {message}") from exc
    return {k: v for k, v in header.items() if k != "__metadata__"}, 8 + n


class _Empty(bytes):
    """An empty file's contents (``mmap`` refuses a length of 0), usable in ``with``."""

    def __enter__(self) -> bytes:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def validate_adapter_file(
    config_bytes: bytes,
    weights_path: str,
    *,
    module_shapes: dict[str, tuple[int, int]] | None = None,
    num_layers: int | None = None,
    max_rank: int | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> AdapterSummary:
    """``adapters.peft.parse_adapter``'s verdict on ``adapter_config.json`` + the safetensors file at
    ``weights_path`` (the same AdapterError, or the numbers the registry stores), in O(``chunk_bytes``) memory."""
    cfg = parse_config(config_bytes)
    with open(weights_path, "rb") as f:
        infos, data_start = _read_header(f, weights_path)
        if not infos:
            raise AdapterError(f"{WEIGHTS_FILE} holds no tensors")
        return _validate(f, cfg, infos, data_start, module_shapes, num_layers, max_rank, chunk_bytes)


def _validate(
    f: BinaryIO,
    cfg: dict[str, Any],
    infos: dict[str, Any],
    data_start: int,
    module_shapes: dict[str, tuple[int, int]] | None,
    num_layers: int | None,
    max_rank: int | None,
    chunk: int,
) -> AdapterSummary:
    dora, lora_bias = bool(cfg.get("use_dora")), bool(cfg.get("lora_bias"))
    rank_pattern, alpha_pattern = cfg.get("rank_pattern") or {}, cfg.get("alpha_pattern") or {}
    default_r, default_alpha = int(cfg.get("r", 8)), float(cfg.get("lora_alpha", cfg.get("r", 8)))
    rslora = bool(cfg.get("use_rslora", False))

    def rank_and_scaling(path: str) -> tuple[int, float]:
        r = int(_pattern_value(rank_pattern, path, default_r))
        alpha = float(_pattern_value(alpha_pattern, path, default_alpha))
        return r, alpha / math.sqrt(r) if rslora else alpha / r

    # the mixture of experts' pairs are named from the header's shapes (adapters.peft_experts.name_sites)
    sites: dict[Site, dict[str, tuple[int, ...]]] = {}
    for key, info in infos.items():
        ematch = EXPERT_KEY.search(key)
        if ematch is not None:
            site, which = expert_site(key, ematch, tuple(info["shape"]))
            sites.setdefault(site, {})[which] = tuple(info["shape"])
    names = name_sites(sites, check_target_parameters(cfg), module_shapes)

    # the first pass: parse_adapter's loop over the tensors (adapters.peft_vocab.vocab_tensor for the
    # vocabulary-sized ones), each tensor read once
    found: dict[tuple[str, int], dict[str, _Tensor]] = {}
    vocab_found: dict[str, dict[str, _Tensor]] = {}
    expert_found: dict[Site, dict[str, _Tensor]] = {}
    per_expert: dict[tuple[int, str], dict[int, dict[str, _Tensor]]] = {}
    for key, info in sorted(infos.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        shape = tuple(info["shape"])
        vmatch = VOCAB_KEY.search(key)
        if vmatch is not None:
            module, which = vocab_kind(key, vmatch, shape, module_shapes)
            scaling = rank_and_scaling(vocab_path(module))[1] if which == "B" else None
            vocab_found.setdefault(module, {})[which] = _scan(f, data_start, info, key, scaling, chunk)
            continue
        ematch = EXPERT_KEY.search(key)
        if ematch is not None:
            site, which = expert_site(key, ematch, shape)
            scaling = rank_and_scaling(path_of(site, names[site]))[1] if which == "B" else None
            expert_found.setdefault(site, {})[which] = _scan(f, data_start, info, key, scaling, chunk)
            continue
        pmatch = PER_EXPERT_KEY.search(key)
        if pmatch is not None:
            group, expert, which = per_expert_site(key, pmatch, shape)
            path = per_expert_path(group[0], group[1], expert)
            scaling = rank_and_scaling(path)[1] if which == "B" else None
            scanned = _scan(f, data_start, info, key, scaling, chunk)
            per_expert.setdefault(group, {}).setdefault(expert, {})[which] = scanned
            continue
        layer, module, which = layer_kind(key, shape, dora, lora_bias)
        scaling = rank_and_scaling(_module_path(module, layer))[1] if which in ("B", "bias") else None
        found.setdefault((module, layer), {})[which] = _scan(f, data_start, info, key, scaling, chunk)

    # the second pass: parse_adapter's checks of each module and layer, on the shapes
    per_module: dict[str, dict[int, tuple[_Tensor, _Tensor]]] = {}
    vectors: dict[str, dict[str, dict[int, _Tensor]]] = {"m": {}, "bias": {}}
    max_seen = 0
    for (module, layer), pair in sorted(found.items()):
        path = _module_path(module, layer)
        r = int(_pattern_value(rank_pattern, path, default_r))
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
        a, b = pair["A"].shape, pair["B"].shape  # PEFT: A [r, in], B [out, r]
        per_module.setdefault(module, {})[layer] = (pair["A"], pair["B"])
        for which in ("m", "bias"):
            if which in pair:
                vectors[which].setdefault(module, {})[layer] = pair[which]
        max_seen = max(max_seen, r)
    # adapters.peft_vocab.vocab_pair, then check_vocab_shapes_of
    vocab: dict[str, tuple[_Tensor, _Tensor]] = {}
    for module, pair in sorted(vocab_found.items()):
        if set(pair) == {"base"}:
            continue
        path = vocab_path(module)
        if not {"A", "B"} <= set(pair):
            missing = ({"A", "B"} - set(pair)).pop()
            raise AdapterError(f"{path}: lora_{missing} is missing")
        a, b = pair["A"].shape, pair["B"].shape
        r = int(_pattern_value(rank_pattern, path, default_r))
        if a[0] != r or b[1] != r:
            raise AdapterError(
                f"{path}: A {list(a)} / B {list(b)} do not match rank {r} (A [r, in], B [out, r])"
            )
        if max_rank is not None and r > max_rank:
            raise AdapterRankError(f"{path}: rank {r} is above the largest slot rank {max_rank}")
        vocab[module] = (pair["A"], pair["B"])
    if module_shapes is not None:
        for module, (a, b) in vocab.items():
            if module not in module_shapes:
                raise UnknownModuleError(f"{module}: this base model does not report an adaptable {module}")
            want_in, want_out = module_shapes[module]
            if a.shape[1] != want_in or b.shape[0] != want_out:
                raise AdapterMismatchError(
                    f"{module}: A [in={a.shape[1]}] / B [out={b.shape[0]}] expect in={want_in}, out={want_out}; "
                    "the adapter was built for another base model (vocabulary or hidden size)"
                )
    max_seen = max([max_seen, *(a.shape[0] for a, _ in vocab.values())])
    # adapters.peft._fold_experts, on the shapes
    experts: dict[str, dict[int, tuple[_Tensor, _Tensor]]] = {}
    for site, name in sorted(names.items()):
        pair, path = expert_found[site], path_of(site, names[site])
        for need in ("A", "B"):
            if need not in pair:
                raise AdapterError(f"{path}: lora_{need} is missing")
        r = int(_pattern_value(rank_pattern, path, default_r))
        a, b = pair["A"].shape, pair["B"].shape
        check_expert_pair(path, name, r, a, b, max_rank, module_shapes, num_layers, site[0])
        if site[0] in experts.get(name, {}):
            raise AdapterError(f"{path}: two LoRA pairs adapt it")
        experts.setdefault(name, {})[site[0]] = (pair["A"], pair["B"])
        max_seen = max(max_seen, r)
    if per_expert:  # the per-expert module layout: peaks per fused target and layer, as parse_adapter folds
        shapes = {
            g: {e: {k: v.shape for k, v in p.items()} for e, p in es.items()} for g, es in per_expert.items()
        }
        ranks = check_per_expert(
            shapes, lambda path: rank_and_scaling(path)[0], max_rank, module_shapes, num_layers
        )
        fused = {name: set(by_layer) for name, by_layer in experts.items()}
        order = {"gate": 0, "up": 1, "down": 2}
        for (layer, kind), by_expert in sorted(
            per_expert.items(), key=lambda kv: (kv[0][0], order[kv[0][1]])
        ):
            name = EXPERT_MODULES[1] if kind == "down" else GATE_UP
            if layer in fused.get(name, ()):
                raise AdapterError(f"{path_of((layer, '', 0), name)}: adapted both fused and per expert")
            a_peak = max(p["A"].peak or 0.0 for p in by_expert.values())
            b_peak = max(p["B"].scaled or 0.0 for p in by_expert.values())
            have = experts.setdefault(name, {}).get(layer)
            if have is not None:  # gate's, then up's: one fused pair
                a_peak, b_peak = max(have[0].peak or 0.0, a_peak), max(have[1].scaled or 0.0, b_peak)
            experts[name][layer] = (_Tensor((), a_peak, None), _Tensor((), None, b_peak))
        for layer in {layer for layer, _ in ranks}:
            gate_up = ranks.get((layer, "gate"), 0) + ranks.get((layer, "up"), 0)
            max_seen = max(max_seen, gate_up, ranks.get((layer, "down"), 0))
    if not found and not vocab and not expert_found and not per_expert:
        raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA matrices")
    for module, by_layer in per_module.items():  # parse_adapter's stacks: one in/out per module
        first_a, first_b = next(iter(by_layer.values()))
        for layer, (a, b) in by_layer.items():
            check_layer_fans(module, layer, a.shape[1], b.shape[0], first_a.shape[1], first_b.shape[0])

    # adapters.peft.check_weights, in its order, on the peaks
    def check(what: str, peak: float | None) -> None:
        if peak is not None:
            check_slot_peak(what, peak)

    for module, by_layer in per_module.items():
        for layer in sorted(by_layer):
            check(f"{_module_path(module, layer)}: lora_A", by_layer[layer][0].peak)
        for layer in sorted(by_layer):
            check(f"{_module_path(module, layer)}: lora_B x scaling", by_layer[layer][1].scaled)
    for module, by_layer in vectors["m"].items():
        for layer in sorted(by_layer):
            check(f"{_module_path(module, layer)}: lora_magnitude_vector", by_layer[layer].peak)
    for module, by_layer in vectors["bias"].items():
        for layer in sorted(by_layer):
            check(f"{_module_path(module, layer)}: lora_B bias x scaling", by_layer[layer].scaled)
    for module, (a, b) in vocab.items():
        check(f"{vocab_path(module)}: lora_A", a.peak)
        check(f"{vocab_path(module)}: lora_B x scaling", b.scaled)
    for name, by_layer in experts.items():
        for layer in sorted(by_layer):
            check(f"{path_of((layer, '', 0), name)}: lora_A", by_layer[layer][0].peak)
            check(f"{path_of((layer, '', 0), name)}: lora_B x scaling", by_layer[layer][1].scaled)
    return AdapterSummary(
        rank=max_seen,
        alpha=default_alpha,
        use_rslora=rslora,
        target_modules=tuple(m for m in LORA_MODULES if m in per_module)
        + tuple(vocab)
        + tuple(m for m in EXPERT_MODULES if m in experts),
        size_bytes=os.fstat(f.fileno()).st_size,
        config=cfg,
    )
