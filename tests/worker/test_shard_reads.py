"""Shard-wise checkpoint reads (``models.checkpoint``): the files read by byte ranges, exactly; a split
model's every leaf read shard by shard equal, bit for bit and spec for spec, to the whole checkpoint laid out
for N devices (``tests/worker/shard_child.py``, forced host devices); a process reads only its rows; broken
files refused naming what."""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import sys

import numpy as np
import pytest
from safetensors.numpy import save_file

from loraserve.models import checkpoint as ck
from loraserve.models import sharding
from loraserve.models.checkpoint import CheckpointError, TensorFiles, load_checkpoint, open_checkpoint
from loraserve.testing import save_model
from tests.worker.test_moe import _per_expert_layout

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _bf16_file(folder, tensors: dict[str, np.ndarray]) -> None:
    """``tensors`` (float32) written as BF16 safetensors by hand (numpy has no bfloat16 dtype)."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        data = (np.ascontiguousarray(t, np.float32).view("<u4") >> 16).astype("<u2").tobytes()
        header[name] = {"dtype": "BF16", "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header).encode()
    (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(head)) + head + b"".join(blobs))


def test_rows_and_columns_are_read_exactly_and_only_them(tmp_path, monkeypatch) -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((12, 10)).astype(np.float32)
    bf = (w.view("<u4") & 0xFFFF0000).view("<f4")  # values a bfloat16 holds exactly
    save_file({"w": w, "i": np.arange(24, dtype=np.int8).reshape(6, 4)}, str(tmp_path / "model.safetensors"))
    files = TensorFiles(str(tmp_path))
    assert files.total_bytes == 12 * 10 * 4 + 24
    monkeypatch.setattr(ck, "LOCAL_GAP", 0)  # no joining: the bytes read are the bytes asked for
    rows = np.array([7, 2, 3, 11])
    np.testing.assert_array_equal(files.read("w", rows), w[rows])
    assert files.bytes_read == 4 * 10 * 4
    np.testing.assert_array_equal(files.read("w", rows, slice(3, 8)), w[rows, 3:8])
    assert files.bytes_read == 4 * 10 * 4 + 4 * 5 * 4
    got = files.read("i", np.array([5, 0]))
    assert got.dtype == np.int8 and got.tolist() == [[20, 21, 22, 23], [0, 1, 2, 3]]
    monkeypatch.setattr(ck, "LOCAL_GAP", 1 << 20)  # joined: one range spanning the gaps, sliced apart
    before = files.bytes_read
    np.testing.assert_array_equal(files.read("w", np.arange(12), slice(0, 2)), w[:, :2])
    assert files.bytes_read - before == (11 * 10 + 2) * 4

    bf_dir = tmp_path / "bf16"
    bf_dir.mkdir()
    _bf16_file(bf_dir, {"w": bf})
    got = TensorFiles(str(bf_dir)).read("w", np.array([1, 9]), slice(2, 6))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, bf[[1, 9], 2:6])


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict:
    from loraserve.worker.quantize_cmd import quantize_checkpoint

    root = tmp_path_factory.mktemp("shards")
    out = {
        name: save_model(root / name, name, seed=5) for name in ("llama", "qwen2", "gemma3_text", "qwen2_moe")
    }
    out["qwen3_moe"] = save_model(root / "qwen3_moe", "qwen3_moe", seed=5)
    _per_expert_layout(save_model(root / "mixtral_fused", "mixtral", seed=5), root / "mixtral", "mixtral")
    out["mixtral"] = root / "mixtral"
    for q in ("int8", "int4"):
        quantize_checkpoint(str(out["llama"]), str(root / f"llama-{q}"), q)
        out[f"llama-{q}"] = root / f"llama-{q}"
    quantize_checkpoint(str(out["llama"]), str(root / "llama-int4-head"), "int4", lm_head=True)
    out["llama-int4-head"] = root / "llama-int4-head"
    return out


# name, model, N, dtype, quantization at load: KV heads repeated (llama at 4, gemma3's one KV head), qkv
# bias, sandwich norms, experts fused and per expert, a shared expert, int8 and int4 at load and as written,
# a quantized head (+head: --quantize-lm-head; gemma3 ties it to the embedding) at load and as written
CASES = [
    ("llama", "llama", 2, "float32", "none"),
    ("llama", "llama", 4, "float32", "none"),
    ("llama-bf16", "llama", 4, "bfloat16", "none"),
    ("qwen2", "qwen2", 4, "float32", "none"),
    ("gemma3", "gemma3_text", 2, "bfloat16", "none"),
    ("qwen2_moe", "qwen2_moe", 2, "float32", "none"),
    ("qwen3_moe", "qwen3_moe", 4, "float32", "none"),
    ("mixtral-per-expert", "mixtral", 4, "float32", "none"),
    ("int8-at-load", "llama", 4, "bfloat16", "int8"),
    ("int4-at-load", "llama", 4, "float32", "int4"),
    ("int8-written", "llama-int8", 2, "float32", "none"),
    ("int4-written", "llama-int4", 4, "bfloat16", "none"),
    ("int8-head-at-load", "gemma3_text", 2, "bfloat16", "int8+head"),
    ("int4-head-written", "llama-int4-head", 4, "float32", "none"),
]


def test_every_shard_read_from_the_files_is_the_whole_model_laid_out(models) -> None:
    cases = [dict(name=c[0], path=str(models[c[1]]), n=c[2], dtype=c[3], quantization=c[4]) for c in CASES]
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.worker.shard_child", json.dumps(cases)],
        cwd=ROOT, env={**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"},
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    problems = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(problems) == {f"{c[0]}@{c[2]}" for c in CASES}
    assert {k: v for k, v in problems.items() if v} == {}


def test_a_device_reads_only_its_rows(models, monkeypatch) -> None:
    """What device 1 of 4 holds of a column-parallel projection (its q, k and v rows, by the layout's row
    order) is read from the files and nothing more; a row-parallel one, its columns."""
    monkeypatch.setattr(ck, "LOCAL_GAP", 0)
    opened = open_checkpoint(str(models["llama"]))
    cfg, layer = opened.config, opened.params["layers"][0]
    whole = load_checkpoint(str(models["llama"]), place=False).params["layers"][0]
    order = sharding.layer_row_order(cfg, "wqkv", layer["wqkv"].shape[0], 4)
    share = order[len(order) // 4 : len(order) // 2]
    got = layer["wqkv"].read(share)
    np.testing.assert_array_equal(got, np.asarray(whole["wqkv"])[share])
    # llama at N = 4 repeats each of its 2 KV heads twice: device 1 holds a quarter of q's rows and one
    # KV head's k and v rows (half of each), read once each
    h, d = cfg.hidden_size, cfg.head_dim
    assert opened.files.bytes_read == (cfg.q_size // 4 + 2 * d) * h * 4
    before = opened.files.bytes_read
    cols = slice(cfg.q_size // 4, cfg.q_size // 2)
    np.testing.assert_array_equal(layer["wo"].read(None, (cols,)), np.asarray(whole["wo"])[:, cols])
    assert opened.files.bytes_read - before == h * (cfg.q_size // 4) * 4


def test_opening_reads_headers_only_and_checks_every_tensor(models, tmp_path) -> None:
    opened = open_checkpoint(str(models["qwen2"]))
    assert opened.files.bytes_read == 0 and opened.files.total_bytes > 100_000
    assert opened.params["layers"][2]["wqkv"].shape == (64 + 2 * 64, 64)
    from safetensors.numpy import load_file

    tensors = load_file(str(models["qwen2"] / "model.safetensors"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_bytes((models["qwen2"] / "config.json").read_bytes())
    tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(
        CheckpointError, match=r"^checkpoint lacks tensor model\.layers\.1\.mlp\.up_proj\.weight$"
    ):
        open_checkpoint(str(broken))


def _file(header: dict, data: int) -> bytes:
    head = json.dumps(header).encode()
    return struct.pack("<Q", len(head)) + head + b"\0" * data


@pytest.mark.parametrize(
    "data, words",
    [
        (b"\x05\x00", "header length -1"),
        (struct.pack("<Q", 1 << 40) + b"{}", "header length 1099511627776"),
        (struct.pack("<Q", 4) + b"{no}" + b"\0" * 8, "its header is not JSON"),
        (
            _file({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, 8),
            "tensor w's bytes do not match its shape (4,) and dtype",
        ),
        (
            _file({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}, 16),
            "tensor w's bytes do not match its shape (4,) and dtype",
        ),
        (
            _file({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [4, 0]}}, 8),
            "tensor w's bytes do not match its shape (-1,) and dtype",
        ),
        (
            _file({"w": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}}, 2),
            "tensor w has dtype F8_E4M3, which is not served",
        ),
        (_file({"w": {"dtype": "F32", "shape": 3}}, 0), "tensor w's header entry is malformed"),
    ],
    ids=["short", "huge-header", "not-json", "past-the-end", "wrong-size", "negative", "dtype", "malformed"],
)
def test_a_broken_file_is_refused_naming_it(tmp_path, data: bytes, words: str) -> None:
    (tmp_path / "model.safetensors").write_bytes(data)
    with pytest.raises(CheckpointError, match=re.escape(words)) as err:
        TensorFiles(str(tmp_path))
    assert err.value.code.name == "INVALID_ARGUMENT"


@pytest.mark.gcs
def test_a_checkpoint_in_gcs_is_read_by_ranges(models, monkeypatch) -> None:
    """The gs:// path (gcsfs on the in-process emulator): the same params, and a device's share read by
    range requests alone."""
    import uuid

    import fsspec
    import jax

    from loraserve.registry.gcs_emulator import start_gcs_emulator

    gcs = start_gcs_emulator("ckpt-test")
    try:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.endpoint)
        url = f"gs://ckpt-test/{uuid.uuid4().hex}"
        fs = fsspec.filesystem("gs")
        for f in models["qwen2"].iterdir():
            fs.pipe(f"{url}/{f.name}", f.read_bytes())
        local = load_checkpoint(str(models["qwen2"]), place=False).params
        remote = load_checkpoint(url, place=False).params
        for x, y in zip(jax.tree.leaves(local), jax.tree.leaves(remote), strict=True):
            np.testing.assert_array_equal(x, y)
        monkeypatch.setattr(ck, "REMOTE_GAP", 0)
        opened = open_checkpoint(url)
        cols = slice(16, 32)
        got = opened.params["layers"][1]["w_down"].read(None, (cols,))
        np.testing.assert_array_equal(got, local["layers"][1]["w_down"][:, cols])
        assert opened.files.bytes_read == got.size * 4
    finally:
        gcs.stop()
