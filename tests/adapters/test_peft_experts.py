"""LoRA on a mixture of experts (``adapters.peft_experts``): PEFT's ``target_parameters`` layout read right,
and every way such an adapter can be wrong refused with the tensor named and the right status, by
``parse_adapter`` (the worker) and ``validate_adapter_file`` (the registry) alike. Adapters made with numpy
in PEFT's layout (the peft-made ones are in tests/worker/test_moe_lora.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import grpc
import numpy as np
import pytest
from safetensors.numpy import save_file

from loraserve.adapters.errors import AdapterError
from loraserve.adapters.peft import parse_adapter
from tests.adapters.test_peft_stream import assert_same

H, INTER, E, LAYERS, R = 8, 6, 4, 2, 2
MOE_SHAPES = {
    **{m: (H, H) for m in ("q_proj", "k_proj", "v_proj", "o_proj")},
    "embed_tokens": (16, H),
    "lm_head": (H, 16),
    "experts.gate_up_proj": (H, 2 * INTER),
    "experts.down_proj": (INTER, H),
    "router": (H, E),
}
DENSE_SHAPES = {k: v for k, v in MOE_SHAPES.items() if "experts" not in k and k != "router"}
P = "base_model.model.model.layers"
TARGETS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"]


def _tensors(r: int = R, experts: int = E) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    t = {}
    for layer in range(LAYERS):
        # PEFT nests the two expert parameters: gate_up_proj (wrapped first) under base_layer
        for nest, (fan_in, fan_out) in (("base_layer.", (H, 2 * INTER)), ("", (INTER, H))):
            t[f"{P}.{layer}.mlp.experts.{nest}lora_A.weight"] = rng.normal(0, 0.1, (experts * r, fan_in))
            t[f"{P}.{layer}.mlp.experts.{nest}lora_B.weight"] = rng.normal(0, 0.1, (fan_out, r * experts))
        t[f"{P}.{layer}.mlp.gate.lora_A.weight"] = rng.normal(0, 0.1, (r, H))
        t[f"{P}.{layer}.mlp.gate.lora_B.weight"] = rng.normal(0, 0.1, (E, r))
    return {k: v.astype(np.float32) for k, v in t.items()}


def make(folder: Path, tensors: dict[str, np.ndarray] | None = None, **config) -> Path:
    folder.mkdir(parents=True)
    save_file(_tensors() if tensors is None else tensors, str(folder / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "r": R, "lora_alpha": 4, "target_modules": [], "target_parameters": TARGETS}
    (folder / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
    return folder


def _parse(folder: Path, shapes=MOE_SHAPES, max_rank: int | None = 8):
    return parse_adapter(
        (folder / "adapter_config.json").read_bytes(),
        (folder / "adapter_model.safetensors").read_bytes(),
        module_shapes=shapes,
        num_layers=LAYERS,
        max_rank=max_rank,
    )


def test_the_saved_layout_folds_into_each_experts_a_and_b(tmp_path) -> None:
    """Expert e's A is rows e*r.. of lora_A, its B every E-th column of lora_B from e (PEFT's
    get_delta_weight), the scaling alpha / r folded into B; the router is an ordinary pair."""
    t = _tensors()
    w = _parse(make(tmp_path / "a", t))
    assert w.target_modules == ("experts.gate_up_proj", "experts.down_proj", "router") and w.rank == R
    a_raw = t[f"{P}.1.mlp.experts.base_layer.lora_A.weight"]
    b_raw = t[f"{P}.1.mlp.experts.base_layer.lora_B.weight"]
    a, b = w.experts["experts.gate_up_proj"]
    assert a.shape == (LAYERS, E, H, R) and b.shape == (LAYERS, E, R, 2 * INTER)
    for e in range(E):
        peft_delta = (
            b_raw.reshape(2 * INTER, R, E)[:, :, e] @ a_raw.reshape(E, R, H)[e] * (4 / R)
        )  # [out, in]
        np.testing.assert_allclose((a[1, e] @ b[1, e]).T, peft_delta, rtol=1e-6, atol=1e-7)
    ra, rb = w.experts["router"]
    np.testing.assert_allclose(ra[0], t[f"{P}.0.mlp.gate.lora_A.weight"].T)
    np.testing.assert_allclose(rb[0], t[f"{P}.0.mlp.gate.lora_B.weight"].T * 2.0, rtol=1e-6)


def _drop_b(t):
    t.pop(f"{P}.1.mlp.experts.lora_B.weight")
    return t


# name -> (tensors, config changes, shapes, status, a part of the message)
BAD = {
    "more-experts-than-the-base": (
        _tensors(experts=E + 2), {}, MOE_SHAPES, grpc.StatusCode.FAILED_PRECONDITION, "holds 6 experts' LoRA at rank 2; the base model has 4 experts"
    ),
    "experts-on-a-dense-base": (_tensors(), {}, DENSE_SHAPES, grpc.StatusCode.FAILED_PRECONDITION, "this base model has none"),
    "a-missing-lora-b": (_drop_b(_tensors()), {}, MOE_SHAPES, grpc.StatusCode.INVALID_ARGUMENT, "lora_B is missing"),
    "a-rank-the-rows-do-not-divide": (_tensors(), {"r": 3}, MOE_SHAPES, grpc.StatusCode.INVALID_ARGUMENT, "do not match rank 3"),
    "a-non-existent-parameter": (
        _tensors(), {"target_parameters": ["mlp.experts.gate_proj"]}, MOE_SHAPES, grpc.StatusCode.INVALID_ARGUMENT,
        "'mlp.experts.gate_proj' is not an adaptable parameter",
    ),
    "dora-on-parameters": (_tensors(), {"use_dora": True}, MOE_SHAPES, grpc.StatusCode.INVALID_ARGUMENT, "use_dora with target_parameters"),
    "a-rank-above-the-slots": (_tensors(r=4), {"r": 4}, MOE_SHAPES, grpc.StatusCode.FAILED_PRECONDITION, "above the largest slot rank 3"),
    "a-bias-on-experts": (
        {**_tensors(), f"{P}.0.mlp.experts.lora_B.bias": np.zeros(H, np.float32)}, {}, MOE_SHAPES,
        grpc.StatusCode.INVALID_ARGUMENT, "a LoRA bias on experts is not supported",
    ),
    "another-bases-intermediate-size": (
        {k: (v if "base_layer.lora_B" not in k else np.zeros((2 * INTER + 2, v.shape[1]), np.float32)) for k, v in _tensors().items()},
        {}, MOE_SHAPES, grpc.StatusCode.FAILED_PRECONDITION, "fit neither gate_up_proj",
    ),
    "an-infinite-expert-b": (
        {k: (np.full_like(v, np.inf) if k.endswith("1.mlp.experts.lora_B.weight") else v) for k, v in _tensors().items()},
        {}, MOE_SHAPES, grpc.StatusCode.INVALID_ARGUMENT, "mlp.experts.lora_B.weight contains NaN or inf",
    ),
    "an-expert-b-past-the-bound": (
        {k: (v * 1e6 if k.endswith("0.mlp.experts.lora_B.weight") else v) for k, v in _tensors().items()},
        {}, MOE_SHAPES, grpc.StatusCode.INVALID_ARGUMENT, "model.layers.0.mlp.experts.down_proj: lora_B x scaling reaches",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_expert_adapter_is_refused_naming_the_tensor(tmp_path, name) -> None:
    tensors, changes, shapes, status, message = BAD[name]
    folder = make(tmp_path / name, tensors, **changes)
    max_rank = 3 if name == "a-rank-above-the-slots" else 8
    with pytest.raises(AdapterError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        _parse(folder, shapes, max_rank)
    code = (
        grpc.StatusCode.FAILED_PRECONDITION
        if err.value.code != grpc.StatusCode.INVALID_ARGUMENT
        else err.value.code
    )
    assert code == status, err.value
    # the registry's streaming validator says exactly the same
    config = (folder / "adapter_config.json").read_bytes()
    from loraserve.adapters.peft_stream import validate_adapter_file

    for chunk in (1 << 20, 8):
        with pytest.raises(type(err.value)) as streamed:
            validate_adapter_file(
                config, str(folder / "adapter_model.safetensors"), module_shapes=shapes, num_layers=LAYERS,
                max_rank=max_rank, chunk_bytes=chunk,
            )  # fmt: skip
        assert str(streamed.value) == str(err.value)


@pytest.mark.parametrize("known", [True, False], ids=["known-base", "unknown-base"])
@pytest.mark.parametrize(
    "targets", [TARGETS, ["mlp.experts.down_proj", "mlp.experts.gate_up_proj", "mlp.gate.weight"]]
)
def test_valid_expert_adapters_get_the_same_verdict_either_way(tmp_path, known, targets) -> None:
    """Named by shapes against the base, or (base unknown) by the shapes' relation between the two."""
    folder = make(tmp_path / "ok", target_parameters=targets)
    from tests.adapters import test_peft_stream

    shapes, test_peft_stream.SHAPES = test_peft_stream.SHAPES, MOE_SHAPES
    try:
        want = assert_same(folder, known)
    finally:
        test_peft_stream.SHAPES = shapes
    assert want[:4] == (R, 4.0, False, ("experts.gate_up_proj", "experts.down_proj", "router"))


def test_one_expert_target_on_an_unknown_base_is_named_by_the_config(tmp_path) -> None:
    t = {k: v for k, v in _tensors().items() if "base_layer" not in k and "gate." not in k}  # down_proj only
    folder = make(tmp_path / "down", t, target_parameters=["experts.down_proj"])
    w = parse_adapter(
        (folder / "adapter_config.json").read_bytes(), (folder / "adapter_model.safetensors").read_bytes()
    )
    assert w.target_modules == ("experts.down_proj",) and w.experts["experts.down_proj"][0].shape == (
        2,
        E,
        INTER,
        R,
    )


def _per_expert(r: int = R, experts: int = E, mixtral: bool = False) -> dict[str, np.ndarray]:
    """The per-expert module layout (transformers 4.x): one LoRA per expert module."""
    rng = np.random.default_rng(2)
    names = (
        {"gate": "w1", "up": "w3", "down": "w2"}
        if mixtral
        else {k: f"{k}_proj" for k in ("gate", "up", "down")}
    )
    block = "block_sparse_moe" if mixtral else "mlp"
    t = {}
    for layer in range(LAYERS):
        for e in range(experts):
            for kind, (fan_in, fan_out) in (("gate", (H, INTER)), ("up", (H, INTER)), ("down", (INTER, H))):
                key = f"{P}.{layer}.{block}.experts.{e}.{names[kind]}"
                t[f"{key}.lora_A.weight"] = rng.normal(0, 0.1, (r, fan_in)).astype(np.float32)
                t[f"{key}.lora_B.weight"] = rng.normal(0, 0.1, (fan_out, r)).astype(np.float32)
    return t


@pytest.mark.parametrize("mixtral", [False, True], ids=["qwen", "mixtral-w1-w3-w2"])
def test_the_per_expert_layout_folds_gate_and_up_side_by_side(tmp_path, mixtral) -> None:
    """Expert e's gate and up LoRA become one fused gate/up pair of rank r_gate + r_up (A side by side, B
    block-diagonal), so x·A·B equals gate's delta on the first I outputs and up's on the last."""
    t = _per_expert(mixtral=mixtral)
    folder = make(
        tmp_path / "m", t, target_parameters=None, target_modules=["gate_proj", "up_proj", "down_proj"]
    )
    w = _parse(folder)
    assert w.target_modules == ("experts.gate_up_proj", "experts.down_proj") and w.rank == 2 * R
    a, b = w.experts["experts.gate_up_proj"]
    assert a.shape == (LAYERS, E, H, 2 * R) and b.shape == (LAYERS, E, 2 * R, 2 * INTER)
    block, (g, u) = ("block_sparse_moe", ("w1", "w3")) if mixtral else ("mlp", ("gate_proj", "up_proj"))
    x = np.random.default_rng(3).normal(size=H).astype(np.float32)
    for e in (0, E - 1):
        key = f"{P}.1.{block}.experts.{e}"
        gate = t[f"{key}.{g}.lora_B.weight"] @ t[f"{key}.{g}.lora_A.weight"] @ x * (4 / R)
        up = t[f"{key}.{u}.lora_B.weight"] @ t[f"{key}.{u}.lora_A.weight"] @ x * (4 / R)
        np.testing.assert_allclose(x @ a[1, e] @ b[1, e], np.concatenate([gate, up]), rtol=1e-5, atol=1e-6)
    want = assert_same_as_stream(folder)
    assert want[0] == 2 * R


def assert_same_as_stream(folder: Path, shapes=MOE_SHAPES, max_rank: int = 8):
    from tests.adapters import test_peft_stream

    saved, test_peft_stream.SHAPES = test_peft_stream.SHAPES, shapes
    try:
        return assert_same(folder, True, max_rank)
    finally:
        test_peft_stream.SHAPES = saved


def _without(t, needle):
    return {k: v for k, v in t.items() if needle not in k}


PER_EXPERT_BAD = {
    "a-missing-expert": (_without(_per_expert(), "layers.1.mlp.experts.2.up_proj"), "experts.2.up_proj: missing"),
    "an-expert-beyond-the-base": (_per_expert(experts=E + 1), "expert 4 does not exist (the base model has 4 experts)"),
    "gate-and-up-over-the-slot-rank": (_per_expert(r=5), "gate_proj + up_proj ranks (they share the fused gate/up slot) 10 above the largest slot rank 8"),
    "a-missing-lora-a": (_without(_per_expert(), "layers.0.mlp.experts.1.down_proj.lora_A"), "experts.1.down_proj: lora_A is missing"),
    "both-layouts-in-one-layer": ({**_per_expert(), **_tensors()}, "adapted both fused and per expert"),
}  # fmt: skip


@pytest.mark.parametrize("name", list(PER_EXPERT_BAD))
def test_a_bad_per_expert_adapter_is_refused_alike(tmp_path, name) -> None:
    tensors, message = PER_EXPERT_BAD[name]
    r = 5 if name.startswith("gate-and-up") else R
    folder = make(tmp_path / name, tensors, r=r, target_modules=["gate_proj", "up_proj", "down_proj"])
    with pytest.raises(AdapterError, match=re.escape(message)):
        _parse(folder)
    want = assert_same_as_stream(folder)
    assert message in want[1]


def test_per_expert_adapters_on_a_dense_base_fail_precondition(tmp_path) -> None:
    folder = make(tmp_path / "d", _per_expert(), target_parameters=None, target_modules=["gate_proj"])
    with pytest.raises(AdapterError, match="this base model has none") as err:
        _parse(folder, DENSE_SHAPES)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert assert_same_as_stream(folder, DENSE_SHAPES)[0] == "AdapterMismatchError"


def test_a_huge_expert_index_on_an_unknown_base_is_refused_without_counting_to_it(tmp_path) -> None:
    """``experts.999999999`` with no base registered: "missing" is found among the experts the file names
    (nothing is sized by the index), by the worker's parser and the registry's alike."""
    t = {k.replace("experts.1.", "experts.999999999."): v for k, v in _per_expert().items()}
    folder = make(
        tmp_path / "huge", t, target_parameters=None, target_modules=["gate_proj", "up_proj", "down_proj"]
    )
    config, weights = (folder / "adapter_config.json").read_bytes(), (folder / "adapter_model.safetensors")
    with pytest.raises(AdapterError, match=r"experts\.1\.\w+_proj: missing"):
        parse_adapter(config, weights.read_bytes())
    from loraserve.adapters.peft_stream import validate_adapter_file

    with pytest.raises(AdapterError, match=r"experts\.1\.\w+_proj: missing"):
        validate_adapter_file(config, str(weights))
