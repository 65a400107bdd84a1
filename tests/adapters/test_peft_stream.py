"""``adapters.peft_stream.validate_adapter_file`` (the registry's tensor-by-tensor validation) gives
``adapters.peft.parse_adapter``'s verdict: the same error type and message for every way an adapter can be
wrong, the same rank, alpha and targets for every valid one, whatever its chunk size. Small adapters made with
numpy (no torch): every check is about shapes, names and values, not about a real model."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from loraserve.adapters.errors import AdapterError
from loraserve.adapters.peft import LORA_MODULES, parse_adapter
from loraserve.adapters.peft_stream import validate_adapter_file
from tests.registry.test_validation_rpc import CASES, _break

H, INTER, V, LAYERS = 8, 12, 16, 2
SHAPES = {
    **{m: (H, H) for m in ("q_proj", "k_proj", "v_proj", "o_proj")},
    "gate_proj": (H, INTER),
    "up_proj": (H, INTER),
    "down_proj": (INTER, H),
    "embed_tokens": (V, H),
    "lm_head": (H, V),
}
PREFIX = "base_model.model.model"


def _key(layer: int, module: str, rest: str) -> str:
    part = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"{PREFIX}.layers.{layer}.{part}.{module}.{rest}"


def make(folder: Path, *, r: int = 4, vocab: bool = False, dtype=np.float32, **config) -> Path:
    """A PEFT folder: every projection of LAYERS layers (DoRA magnitudes / lora_B biases as the config says),
    with ``vocab`` embed_tokens and lm_head LoRA and embed_tokens' saved base weight."""
    rng = np.random.default_rng(0)

    def normal(*shape):
        return (rng.standard_normal(shape) * 0.05).astype(dtype)

    t = {}
    for layer in range(LAYERS):
        for module in LORA_MODULES:
            fan_in, fan_out = SHAPES[module]
            t[_key(layer, module, "lora_A.weight")] = normal(r, fan_in)
            t[_key(layer, module, "lora_B.weight")] = normal(fan_out, r)
            if config.get("use_dora"):
                t[_key(layer, module, "lora_magnitude_vector")] = (1 + normal(fan_out)).astype(dtype)
            if config.get("lora_bias"):
                t[_key(layer, module, "lora_B.bias")] = normal(fan_out)
    if vocab:
        t[f"{PREFIX}.embed_tokens.lora_embedding_A"] = normal(r, V)
        t[f"{PREFIX}.embed_tokens.lora_embedding_B"] = normal(H, r)
        t[f"{PREFIX}.embed_tokens.base_layer.weight"] = normal(V, H)
        t["base_model.model.lm_head.lora_A.weight"] = normal(r, H)
        t["base_model.model.lm_head.lora_B.weight"] = normal(V, r)
    folder.mkdir(parents=True)
    _save(folder, t)
    targets = list(LORA_MODULES) + (["embed_tokens", "lm_head"] if vocab else [])
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": targets, **config}
    (folder / "adapter_config.json").write_text(json.dumps(cfg))
    return folder


def _save(folder: Path, tensors: dict) -> None:
    if any(v.dtype == "bfloat16" for v in tensors.values()):
        raise AssertionError("use _save_bf16")
    save_file(tensors, str(folder / "adapter_model.safetensors"))


def _save_bf16(folder: Path, tensors: dict[str, np.ndarray]) -> None:
    """safetensors' numpy writer has no bfloat16: write the header and the top 16 bits of each float32."""
    header, blobs, offset = {}, [], 0
    for name, value in tensors.items():
        bits = (np.ascontiguousarray(value, np.float32).view("<u4") >> 16).astype("<u2").tobytes()
        header[name] = {
            "dtype": "BF16",
            "shape": list(value.shape),
            "data_offsets": [offset, offset + len(bits)],
        }
        blobs.append(bits)
        offset += len(bits)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    (folder / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def _load(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


def _edit(folder: Path, fn) -> None:
    t = _load(folder)
    fn(t)
    _save(folder, t)


def _config(folder: Path, **changes) -> None:
    path = folder / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def verdict(fn, *args, **kwargs):
    try:
        out = fn(*args, **kwargs)
    except AdapterError as exc:
        return type(exc).__name__, str(exc)
    except Exception as exc:  # an unexpected failure must be the same one too
        return "unexpected " + type(exc).__name__, str(exc)
    return out.rank, out.alpha, out.use_rslora, tuple(out.target_modules), out.size_bytes


def assert_same(folder: Path, known: bool, max_rank: int | None = 8) -> tuple:
    config = (folder / "adapter_config.json").read_bytes()
    path = folder / "adapter_model.safetensors"
    kw = dict(
        module_shapes=SHAPES if known else None, num_layers=LAYERS if known else None, max_rank=max_rank
    )
    want = verdict(parse_adapter, config, path.read_bytes(), **kw)
    for chunk in (1 << 20, 24, 2):  # whole tensors, a few values, one value at a time
        got = verdict(validate_adapter_file, config, str(path), chunk_bytes=chunk, **kw)
        assert got == want, f"chunk {chunk}"
    return want


def _first(t, needle):
    return next(k for k in sorted(t) if needle in k)


def _last(t, needle):
    return [k for k in sorted(t) if needle in k][-1]


def _set(needle, fn, last=False):
    def edit(t):
        k = (_last if last else _first)(t, needle)
        t[k] = fn(t[k].copy())

    return edit


def _poke(value, index, to):
    value.flat[index] = to
    return value


# name -> (make kwargs, edit of the folder); every one is checked with the base model's shapes known and not
EXTRA = {
    "plain": (dict(), None),
    "rslora-patterns": (
        dict(use_rslora=True, rank_pattern={"k_proj": 2}, alpha_pattern={"o_proj": 3.0}),
        lambda f: _edit(
            f,
            lambda t: [
                t.update({k: t[k][:2] if "lora_A" in k else t[k][:, :2]})
                for k in list(t)
                if "k_proj" in k and "lora_" in k
            ],
        ),
    ),
    "dora": (dict(use_dora=True), None),
    "lora-bias": (dict(lora_bias=True), None),
    "vocab": (dict(vocab=True), None),
    "float16": (dict(dtype=np.float16), None),
    "float64": (dict(dtype=np.float64), None),
    "bfloat16": (dict(), lambda f: _save_bf16(f, _load(f))),
    "float64-overflows-float32": (dict(dtype=np.float64), lambda f: _edit(f, _set("lora_A", lambda v: _poke(v, 5, 1e300)))),
    "nan-late-in-a-tensor": (dict(), lambda f: _edit(f, _set("down_proj.lora_A", lambda v: _poke(v, -1, np.nan), True))),
    "inf": (dict(), lambda f: _edit(f, _set("lora_B", lambda v: _poke(v, 3, np.inf)))),
    "a-over-the-bound": (dict(), lambda f: _edit(f, _set("up_proj.lora_A", lambda v: _poke(v, 7, -2e4), True))),
    "b-over-the-bound-once-scaled": (dict(), lambda f: _edit(f, _set("v_proj.lora_B", lambda v: _poke(v, 2, 6e3)))),
    "magnitude-over-the-bound": (
        dict(use_dora=True),
        lambda f: _edit(f, _set("q_proj.lora_magnitude", lambda v: _poke(v, 1, 1e5), True)),
    ),
    "bias-over-the-bound-once-scaled": (
        dict(lora_bias=True),
        lambda f: _edit(f, _set("o_proj.lora_B.bias", lambda v: _poke(v, 0, 9e3))),
    ),
    "bias-overflows-float32": (dict(lora_bias=True), lambda f: _config(f, alpha_pattern={"gate_proj": 1e39})),
    "vocab-b-over-the-bound": (dict(vocab=True), lambda f: _edit(f, _set("lm_head.lora_B", lambda v: _poke(v, 0, 1e4)))),
    "vocab-a-over-the-bound": (
        dict(vocab=True),
        lambda f: _edit(f, _set("lora_embedding_A", lambda v: _poke(v, 0, 1e5))),
    ),
    "vocab-nan-in-base": (dict(vocab=True), lambda f: _edit(f, _set("base_layer", lambda v: _poke(v, 3, np.nan)))),
    "missing-b": (dict(), lambda f: _edit(f, lambda t: t.pop(_first(t, "k_proj.lora_B")))),
    "missing-a": (dict(), lambda f: _edit(f, lambda t: t.pop(_last(t, "down_proj.lora_A")))),
    "magnitude-without-dora": (dict(), lambda f: _edit(f, lambda t: t.update({_key(1, "up_proj", "lora_magnitude_vector"): np.ones(INTER, np.float32)}))),
    "bias-without-lora-bias": (dict(), lambda f: _edit(f, lambda t: t.update({_key(0, "k_proj", "lora_B.bias"): np.ones(H, np.float32)}))),
    "magnitude-wrong-size": (dict(use_dora=True), lambda f: _edit(f, _set("lora_magnitude", lambda v: v[:-1]))),
    "bias-wrong-size": (dict(lora_bias=True), lambda f: _edit(f, _set("lora_B.bias", lambda v: v[:-1]))),
    "magnitude-2d": (dict(use_dora=True), lambda f: _edit(f, _set("lora_magnitude", lambda v: v[None]))),
    "a-1d": (dict(), lambda f: _edit(f, _set("lora_A", lambda v: v[0]))),
    "a-3d": (dict(), lambda f: _edit(f, _set("lora_A", lambda v: v[None]))),
    "wrong-in-features": (dict(), lambda f: _edit(f, _set("gate_proj.lora_A", lambda v: np.zeros((4, 9), v.dtype)))),
    "layers-disagree": (
        dict(),
        lambda f: _edit(
            f,
            lambda t: [
                t.update({k: np.zeros((4, 5), np.float32)})
                for k in list(t)
                if "layers.1." in k and "q_proj.lora_A" in k
            ],
        ),
    ),
    "layer-beyond-the-model": (
        dict(),
        lambda f: _edit(f, lambda t: t.update({k.replace("layers.1.", "layers.7."): t.pop(k) for k in list(t) if "layers.1." in k})),
    ),
    "rank-above-max": (dict(r=12), None),
    "rank-pattern-mismatch": (dict(rank_pattern={"v_proj": 2}), None),
    "unknown-module": (dict(), lambda f: _edit(f, lambda t: t.update({_key(0, "score", "lora_A.weight"): np.zeros((4, 4), np.float32)}))),
    "not-a-lora-tensor": (dict(), lambda f: _edit(f, lambda t: t.update({"model.norm.weight": np.zeros(8, np.float32)}))),
    "vocab-rank-mismatch": (dict(vocab=True), lambda f: _config(f, rank_pattern={"lm_head": 2})),
    "vocab-rank-above-max": (dict(vocab=True), lambda f: _config(f, rank_pattern={"embed_tokens": 2, "lm_head": 2})),
    "vocab-missing-b": (dict(vocab=True), lambda f: _edit(f, lambda t: t.pop(_first(t, "lora_embedding_B")))),
    "vocab-wrong-vocabulary": (
        dict(vocab=True),
        lambda f: _edit(f, _set("lm_head.lora_B", lambda v: np.zeros((V + 1, v.shape[1]), v.dtype))),
    ),
    "vocab-wrong-base": (dict(vocab=True), lambda f: _edit(f, _set("base_layer", lambda v: v[:-1]))),
    "vocab-bias": (dict(vocab=True), lambda f: _edit(f, lambda t: t.update({"base_model.model.lm_head.lora_B.bias": np.zeros(V, np.float32)}))),
    "embed-as-linear": (
        dict(vocab=True),
        lambda f: _edit(f, lambda t: t.update({f"{PREFIX}.embed_tokens.lora_A.weight": t.pop(f"{PREFIX}.embed_tokens.lora_embedding_A")})),
    ),
    "lm-head-as-embedding": (
        dict(vocab=True),
        lambda f: _edit(f, lambda t: t.update({"base_model.model.lm_head.lora_embedding_A": t.pop("base_model.model.lm_head.lora_A.weight")})),
    ),
    "vocab-1d": (dict(vocab=True), lambda f: _edit(f, _set("lora_embedding_B", lambda v: v[0]))),
    "only-a-base-weight": (dict(vocab=True), lambda f: _edit(f, lambda t: [t.pop(k) for k in list(t) if "lora_" in k])),
    "no-tensors": (dict(), lambda f: (f / "adapter_model.safetensors").write_bytes(_only_metadata())),
    "empty-file": (dict(), lambda f: (f / "adapter_model.safetensors").write_bytes(b"")),
    "header-a-list": (dict(), lambda f: (f / "adapter_model.safetensors").write_bytes(struct.pack("<Q", 8) + b"[]      ")),
    "trailing-bytes": (dict(), lambda f: (f / "adapter_model.safetensors").write_bytes((f / "adapter_model.safetensors").read_bytes() + b"xx")),
    "empty-tensors": (
        dict(),
        lambda f: _edit(f, lambda t: [t.update({k: np.zeros((4, 0), np.float32)}) for k in list(t) if "q_proj.lora_A" in k]),
    ),
}  # fmt: skip


def _only_metadata() -> bytes:
    raw = json.dumps({"__metadata__": {"format": "pt"}}).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


def _bf16_nan(folder: Path) -> None:
    t = _load(folder)
    t[_first(t, "up_proj.lora_A")][1, 2] = np.nan
    _save_bf16(folder, t)


EXTRA["bfloat16-nan"] = (dict(), _bf16_nan)


# valid when the base model's shapes are unknown (refused when they are)
UNKNOWN_BASE_VALID = ("empty-tensors", "layer-beyond-the-model", "vocab-wrong-vocabulary", "vocab-wrong-base")


@pytest.mark.parametrize("known", [True, False], ids=["known-base", "unknown-base"])
@pytest.mark.parametrize("name", list(EXTRA))
def test_the_same_verdict_as_parse_adapter(tmp_path, name, known) -> None:
    kwargs, edit = EXTRA[name]
    folder = make(tmp_path / name, **kwargs)
    if edit is not None:
        edit(folder)
    want = assert_same(folder, known)
    if name in ("plain", "rslora-patterns", "dora", "lora-bias", "vocab", "float16", "float64", "bfloat16"):
        assert isinstance(want[0], int), want  # valid: a rank, not an error
    elif not known and name in UNKNOWN_BASE_VALID:
        pass
    else:
        assert not isinstance(want[0], int), f"{name} was accepted: {want}"
        assert not want[0].startswith("unexpected"), want


@pytest.mark.parametrize("kind", [c[0] for c in CASES])
def test_the_registry_rejection_cases_get_the_same_verdict(tmp_path, kind) -> None:
    """tests/registry/test_validation_rpc.py's broken adapters, on a numpy-made one."""
    folder = make(tmp_path / kind)
    _break(kind, folder)
    want = assert_same(folder, True)
    assert not isinstance(want[0], int) and not want[0].startswith("unexpected"), want
