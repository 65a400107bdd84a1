"""Every rejection of docs/design.md §3 over real gRPC, with a real PEFT adapter altered to break it.

After each rejection the database and the store hold nothing new.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from loraserve.common.errors import LoraserveError
from loraserve.protos.v1 import placement_pb2
from tests.registry.conftest import TINY_MODEL


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _edit_config(folder, **changes):
    path = folder / "adapter_config.json"
    cfg = json.loads(path.read_text())
    cfg.update(changes)
    path.write_text(json.dumps(cfg))


def _edit_tensors(folder, fn):
    path = folder / "adapter_model.safetensors"
    tensors = load_file(str(path))
    fn(tensors)
    save_file(tensors, str(path))


def _first(tensors, needle):
    return next(k for k in sorted(tensors) if needle in k)


def _break(kind, folder):
    if kind == "config-not-json":
        (folder / "adapter_config.json").write_text("{not json")
    elif kind == "not-lora":
        _edit_config(folder, peft_type="PREFIX_TUNING")
    elif kind == "dora-without-magnitudes":  # a plain adapter claiming DoRA
        _edit_config(folder, use_dora=True)
    elif kind == "dora-with-lora-bias":
        _edit_config(folder, use_dora=True, lora_bias=True)
    elif kind == "bias-without-lora-bias":  # a lora_B bias the config does not declare

        def add_bias(t):
            k = _first(t, "lora_B")
            t[k.replace(".weight", ".bias")] = np.zeros(t[k].shape[0], np.float32)

        _edit_tensors(folder, add_bias)
    elif kind == "modules-to-save":
        _edit_config(folder, modules_to_save=["lm_head"])
    elif kind == "bias":
        _edit_config(folder, bias="all")
    elif kind == "unknown-target":
        _edit_config(
            folder, target_modules=["q_proj", "score"]
        )  # embed_tokens / lm_head are targets since #16
    elif kind == "zero-rank":
        _edit_config(folder, r=0)
    elif kind == "shape-mismatch":

        def grow(t):
            k = _first(t, "lora_A")
            t[k] = np.zeros((t[k].shape[0] + 1, t[k].shape[1]), np.float32)

        _edit_tensors(folder, grow)
    elif kind == "nan-weights":

        def poison(t):
            k = _first(t, "lora_B")
            t[k] = t[k].copy()
            t[k][0, 0] = np.nan

        _edit_tensors(folder, poison)
    elif kind == "int-weights":

        def to_int(t):
            k = _first(t, "lora_A")
            t[k] = t[k].astype(np.int32)

        _edit_tensors(folder, to_int)
    elif kind == "not-safetensors":
        (folder / "adapter_model.safetensors").write_bytes(
            b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage json...}"
        )
    elif kind == "truncated":
        data = (folder / "adapter_model.safetensors").read_bytes()
        (folder / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    elif kind in ("offsets-lie", "duplicate-names"):
        import struct

        data = (folder / "adapter_model.safetensors").read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
        name = next(k for k in header if k != "__metadata__")
        if kind == "offsets-lie":
            header[name]["data_offsets"][1] += 10_000_000  # claims bytes the file does not have
            raw = json.dumps(header).encode()
        else:  # the same tensor name twice in the JSON header (json.dumps cannot write that)
            entry = json.dumps(header[name])
            raw = json.dumps(header).encode()[:-1] + f', "{name}": {entry}}}'.encode()
        raw += b" " * (-len(raw) % 8)
        (folder / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n :])
    elif kind == "unknown-tensor":
        _edit_tensors(
            folder, lambda t: t.update({"base_model.model.lm_head.weight": np.zeros((2, 2), np.float32)})
        )
    elif kind == "alpha-pattern-nan":  # json.dumps writes NaN, and Python's json (and PEFT's) read it
        _edit_config(folder, alpha_pattern={"q_proj": float("nan")})
    elif kind == "rank-pattern-float":
        _edit_config(folder, rank_pattern={"q_proj": 4.5})
    elif kind == "alpha-overflows-float32":  # finite as a Python float, inf as the float32 scaling
        _edit_config(folder, lora_alpha=1e40)
    elif kind == "alpha-pattern-overflows":
        _edit_config(folder, alpha_pattern={"down_proj": 1e300})
    elif kind == "scaled-over-the-bound":  # finite, but 1e7 / 4 x B (std 0.05) is far over 1e4
        _edit_config(folder, lora_alpha=1e7)
    else:
        raise AssertionError(kind)


CASES = [
    ("config-not-json", "INVALID_ARGUMENT", "not valid JSON"),
    ("not-lora", "INVALID_ARGUMENT", "peft_type"),
    ("dora-without-magnitudes", "INVALID_ARGUMENT", "DoRA lora_magnitude_vector is missing"),
    ("dora-with-lora-bias", "INVALID_ARGUMENT", "DoRA does not support a LoRA bias"),
    ("bias-without-lora-bias", "INVALID_ARGUMENT", "lora_bias is not set"),
    ("modules-to-save", "INVALID_ARGUMENT", "modules_to_save"),
    ("bias", "INVALID_ARGUMENT", "bias"),
    ("unknown-target", "INVALID_ARGUMENT", "score"),
    ("zero-rank", "INVALID_ARGUMENT", "r must be a positive integer"),
    ("shape-mismatch", "INVALID_ARGUMENT", "do not match rank"),
    ("nan-weights", "INVALID_ARGUMENT", "NaN"),
    ("int-weights", "INVALID_ARGUMENT", "floating point"),
    ("not-safetensors", "INVALID_ARGUMENT", "safetensors"),
    ("truncated", "INVALID_ARGUMENT", "safetensors"),
    ("unknown-tensor", "INVALID_ARGUMENT", "lm_head"),
    ("offsets-lie", "INVALID_ARGUMENT", "safetensors"),
    ("duplicate-names", "INVALID_ARGUMENT", "twice"),
    ("alpha-pattern-nan", "INVALID_ARGUMENT", "alpha_pattern['q_proj'] must be a positive finite number"),
    ("rank-pattern-float", "INVALID_ARGUMENT", "rank_pattern['q_proj'] must be a positive integer"),
    ("alpha-overflows-float32", "INVALID_ARGUMENT", "lora_B x scaling is not finite once scaled"),
    ("alpha-pattern-overflows", "INVALID_ARGUMENT", "mlp.down_proj: lora_B x scaling is not finite"),
    ("scaled-over-the-bound", "INVALID_ARGUMENT", "over the bound 10000"),
]


@pytest.mark.parametrize(("kind", "code", "needle"), CASES, ids=[c[0] for c in CASES])
def test_broken_adapter_is_refused_and_nothing_is_stored(
    reg, adapter_dirs, tmp_path, kind, code, needle
) -> None:
    folder = _copy(adapter_dirs["all-r4"], tmp_path / kind)
    _break(kind, folder)
    with pytest.raises(LoraserveError) as exc:
        reg.client.push(folder, "broken", TINY_MODEL)
    assert exc.value.code_name == code
    assert needle in exc.value.message
    assert reg.adapter_rows() == [] and reg.blobs() == []


def test_rank_above_the_limit(reg, adapter_dirs) -> None:
    reg.registry.catalog.max_lora_rank = 8
    with pytest.raises(LoraserveError) as exc:
        reg.client.push(adapter_dirs["mlp-r16"], "too-big", TINY_MODEL)
    assert (
        exc.value.code_name == "INVALID_ARGUMENT"
        and "rank 16 is above the largest slot rank 8" in exc.value.message
    )
    assert reg.adapter_rows() == [] and reg.blobs() == []


def test_pickle_adapter_is_refused(reg, adapter_dirs) -> None:
    folder = Path(reg.store_root) / "imports" / "pickled"  # under the storage root: imports are allowed there
    folder.mkdir(parents=True)
    shutil.copy(adapter_dirs["all-r4"] / "adapter_config.json", folder)
    (folder / "adapter_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(LoraserveError) as exc:
        reg.client.import_uri(str(folder), "pickled", TINY_MODEL)
    assert exc.value.code_name == "INVALID_ARGUMENT" and "pickle" in exc.value.message
    assert reg.adapter_rows() == [] and reg.blobs() == []


def test_adapter_for_another_base_model_fails_precondition(reg, model_dirs, tiny_shapes, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    from loraserve.testing import make_adapter

    shapes = [
        placement_pb2.ModuleShape(module=m, in_features=i, out_features=o, num_layers=n)
        for m, (i, o, n) in tiny_shapes.items()
    ]
    reg.client.placement.RegisterWorker(
        placement_pb2.RegisterWorkerRequest(
            address="127.0.0.1:9", model_id=TINY_MODEL, module_shapes=shapes, slots=1
        )
    )
    other = AutoModelForCausalLM.from_pretrained(str(model_dirs["qwen2"]))  # intermediate 96, not 160
    make_adapter(other, tmp_path / "qwen-adapter", r=4, targets=("gate_proj",))
    with pytest.raises(LoraserveError) as exc:
        reg.client.push(tmp_path / "qwen-adapter", "wrong-base", TINY_MODEL)
    assert exc.value.code_name == "FAILED_PRECONDITION" and "another base model" in exc.value.message
    assert reg.adapter_rows() == [] and reg.blobs() == []
    # the same adapter is accepted for a base model whose shapes the registry does not know yet
    assert reg.client.push(tmp_path / "qwen-adapter", "right-base", "tiny-qwen2").version == 1


@pytest.mark.parametrize("kind", [dict(use_dora=True), dict(lora_bias=True)], ids=["dora", "lora-bias"])
def test_dora_and_lora_bias_adapters_are_accepted(reg, llama_dir, tmp_path, kind) -> None:
    """DoRA (magnitude vectors) and lora_bias (lora_B biases) are served since #16: the registry stores them."""
    from transformers import AutoModelForCausalLM

    from loraserve.testing import make_adapter

    make_adapter(AutoModelForCausalLM.from_pretrained(str(llama_dir)), tmp_path / "a", r=4, **kind)
    assert reg.client.push(tmp_path / "a", "variant", TINY_MODEL).version == 1
    assert len(reg.adapter_rows()) == 1


def _register_tiny(reg, tiny_shapes) -> None:
    shapes = [
        placement_pb2.ModuleShape(module=m, in_features=i, out_features=o, num_layers=n)
        for m, (i, o, n) in tiny_shapes.items()
    ]
    reg.client.placement.RegisterWorker(
        placement_pb2.RegisterWorkerRequest(
            address="127.0.0.1:9", model_id=TINY_MODEL, module_shapes=shapes, slots=1
        )
    )


def test_embed_tokens_and_lm_head_adapters_are_accepted_and_checked(
    reg, llama_dir, tiny_shapes, tmp_path
) -> None:
    """embed_tokens / lm_head LoRA targets are served since #16 item 3: stored when they fit the base model's
    vocabulary and hidden size (which workers register), refused (nothing stored) when they do not."""
    from transformers import AutoModelForCausalLM

    from loraserve.testing import make_adapter

    _register_tiny(reg, tiny_shapes)
    targets = ("q_proj", "embed_tokens", "lm_head")
    make_adapter(AutoModelForCausalLM.from_pretrained(str(llama_dir)), tmp_path / "a", r=4, targets=targets)
    bad = _copy(tmp_path / "a", tmp_path / "bad")

    def grow_vocab(t):
        k = _first(t, "lora_embedding_A")
        t[k] = np.zeros((t[k].shape[0], t[k].shape[1] + 8), np.float32)

    _edit_tensors(bad, grow_vocab)
    with pytest.raises(LoraserveError) as exc:
        reg.client.push(bad, "wrong-vocab", TINY_MODEL)
    assert exc.value.code_name == "FAILED_PRECONDITION" and "vocabulary" in exc.value.message
    assert reg.adapter_rows() == [] and reg.blobs() == []
    assert reg.client.push(tmp_path / "a", "embed-head", TINY_MODEL).version == 1
    rows = reg.adapter_rows()
    assert len(rows) == 1


def test_expert_adapters_are_checked_against_the_registered_experts(reg, tmp_path) -> None:
    """A Qwen3-MoE worker registers its experts' shapes (``experts.gate_up_proj``, ``experts.down_proj``,
    ``router``): a peft adapter on its experts is stored; one made on a Qwen3-MoE with more experts is
    FAILED_PRECONDITION naming the tensor's layer and both counts; expert targets for a dense base whose
    shapes are registered are FAILED_PRECONDITION too; nothing of either is stored."""
    from transformers import AutoModelForCausalLM

    from loraserve.models.checkpoint import read_config
    from loraserve.models.config import ModelConfig
    from loraserve.testing import make_adapter, save_model

    def register(model_id: str, cfg: ModelConfig, address: str) -> None:
        shapes = [
            placement_pb2.ModuleShape(module=m, in_features=i, out_features=o, num_layers=cfg.num_layers)
            for m, (i, o) in cfg.adapter_shapes().items()
        ]
        reg.client.placement.RegisterWorker(
            placement_pb2.RegisterWorkerRequest(
                address=address, model_id=model_id, module_shapes=shapes, slots=1
            )
        )

    base = save_model(tmp_path / "moe", "qwen3_moe", seed=3)
    cfg = ModelConfig.from_hf(read_config(str(base)))
    register("tiny-moe", cfg, "127.0.0.1:9")
    targets = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate.weight"]
    make_adapter(
        AutoModelForCausalLM.from_pretrained(str(base)),
        tmp_path / "ok",
        r=4,
        targets=(),
        target_parameters=targets,
    )
    assert reg.client.push(tmp_path / "ok", "experts", "tiny-moe").version == 1
    pushed = reg.adapter_rows()
    assert len(pushed) == 1 and len(reg.blobs()) > 0
    blobs = reg.blobs()

    from transformers import AutoConfig

    more = tmp_path / "more"
    wide_config = AutoConfig.from_pretrained(str(base))
    wide_config.num_experts = 2 * cfg.num_experts
    wide = AutoModelForCausalLM.from_config(wide_config)
    make_adapter(wide, more, r=4, targets=(), target_parameters=targets)
    with pytest.raises(LoraserveError) as exc:
        reg.client.push(more, "more-experts", "tiny-moe")
    assert exc.value.code_name == "FAILED_PRECONDITION", exc.value.message
    assert (
        f"holds {2 * cfg.num_experts} experts' LoRA at rank 4; the base model has {cfg.num_experts}"
        in exc.value.message
    )
    assert "model.layers.0.mlp.experts" in exc.value.message

    register("tiny-dense", dataclasses.replace(cfg, num_experts=0), "127.0.0.1:10")
    with pytest.raises(LoraserveError) as exc:
        reg.client.push(tmp_path / "ok", "on-dense", "tiny-dense")
    assert exc.value.code_name == "FAILED_PRECONDITION" and "has none (a dense model)" in exc.value.message
    assert reg.adapter_rows() == pushed and reg.blobs() == blobs
