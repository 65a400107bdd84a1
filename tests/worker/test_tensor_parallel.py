"""Tensor parallelism on CPU devices (docs/design.md §10.2): N = 1, 2, 4, 8 serve the same tokens.

JAX needs ``--xla_force_host_platform_device_count=8`` before it starts, so the runs happen in child
processes (``tests/worker/tp_child.py``, JSON on stdout): one for every f32 backend, one for bf16. The model: a tiny Qwen2 (qkv
bias, tied embeddings) with 8 heads, 2 KV heads (so N = 4 and 8 repeat KV heads), intermediate 128,
vocab 384, 2 layers; the batch mixes four adapters (ranks 2..16, rsLoRA, target subsets) and a base row.

Tolerance: f32 logits within 1e-4 absolute of the cpu backend's N = 1 (only the order of the split sums, and
of the backends' sums, differs; 1e-6 measured); a bf16 model within 0.0625 (0.031 measured: one rounding of a split sum); greedy tokens
identical.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loraserve.common.errors import FailedPrecondition, InvalidArgument
from loraserve.engine.config import EngineConfig
from loraserve.models.config import ModelConfig
from loraserve.models.sharding import check_tensor_parallel, fuse_order
from loraserve.testing import make_adapter, save_model
from tests.conftest import ADAPTERS, TEST_XLA_FLAGS

ROOT = Path(__file__).resolve().parents[2]
ATOL = 1e-4
ATOL_BF16 = 0.0625  # bf16 model: 4 bf16 ulps at the logits' magnitude (< 4); 0.031 measured
TP_MODEL = dict(tie_word_embeddings=True, num_attention_heads=8, num_key_value_heads=2, intermediate_size=128)
SPLIT, WHOLE = "('model', None)", "(None, None, None)"


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Path]]:
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("tp")
    # two decoder layers, not the qwen2 test model's three: the layers are unrolled copies of the same
    # sharded code and every size compiles its own programs (one layer-to-layer hand-off still runs);
    # the weakest adapter row still moves the first step's logits by 0.11 (> 0.1 asserted below)
    model = save_model(root / "qwen2", "qwen2", seed=7, **TP_MODEL, num_hidden_layers=2)
    adapters = []
    for name, kw in ADAPTERS.items():
        make_adapter(AutoModelForCausalLM.from_pretrained(str(model)), root / name, **kw)
        adapters.append(root / name)
    return model, adapters


def run_child(*args: str) -> dict:
    # compile-bound (every size warms up its own programs): the suite's faster-compiling XLA level too
    flags = f"{os.environ.get('XLA_FLAGS', '')} {TEST_XLA_FLAGS} --xla_force_host_platform_device_count=8"
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.worker.tp_child", *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=480,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def expected_pool_specs(backend: str) -> dict[str, str]:
    """B split by output for q/k/v/gate/up, A split by input for o/down, the rest whole (pool axes
    of the backend's layout: docs/design.md §6 ``A [S, in, n*R]``, ``B [S, R, out]``; xla-grouped's both
    transposed, pallas's A transposed)."""
    b_out = "(None, 'model', None)" if backend == "xla-grouped" else "(None, None, 'model')"
    a_in = "(None, None, 'model')" if backend in ("xla-grouped", "pallas") else "(None, 'model', None)"
    column = {k: b_out for k in ("B_q", "B_k", "B_v", "B_gate", "B_up")}
    return {
        **column,
        "A_o": a_in,
        "A_down": a_in,
        "A_qkv": WHOLE,
        "A_gate_up": WHOLE,
        "B_o": WHOLE,
        "B_down": WHOLE,
        # models.lora.dora_bias's [S, out] DoRA-scale and LoRA-bias vectors: split like the layer's output
        **{f"{v}_{g}": "(None, 'model')" for v in ("dora_scale", "lora_bias") for g in ("qkv", "gate_up")},
        **{f"{v}_{g}": "()" for v in ("dora_scale", "lora_bias") for g in ("o", "down")},
        # models.lora.embedding's pools (layer 0): A_embed by vocab like the embedding, B_lm_head like lm_head
        "A_embed": "(None, 'model', None)",
        "B_lm_head": "(None, None, 'model')",
        "B_embed": "()",
        "A_lm_head": "()",
    }


# f32: every LoRA backend in one child process (one JAX start), each size compared with the cpu backend's
# N = 1 (the backends' f32 results agree within 1e-6: only their order of sums differs); bf16 on its own.
F32_RUNS = {
    # the KV heads repeated x2 at 4 and x4 at 8; N = 2 (no repetition) is pallas's run below, with the same
    # shardings, shapes and reference (one warm-up fewer: the fixture is the suite's longest setup)
    "cpu": (1, 4, 8),
    "xla-grouped": (8,),  # its weights-first pool layout at the extreme
    "xla-onehot": (8,),
    "pallas": (2,),  # interpreted on CPU
}


# --quantization int8 and int4 (cpu backend) at N = 1 and 4: N = 4 splits and repeats the KV heads' rows and
# their scales, and splits int4's groups (8 and 16 inputs a group here) with the row-parallel inputs; the int4
# runs quantize the head too (--quantize-lm-head: split by vocab rows, its group scales with them)


@pytest.fixture(scope="module")
def f32_runs(tp_model) -> dict:
    model, adapters = tp_model
    runs = " ".join(f"{b}={','.join(map(str, sizes))}" for b, sizes in F32_RUNS.items())
    runs += " cpu:int8=1,4 cpu:int4+head=1,4"
    return run_child(
        "--model", str(model), "--adapters", ",".join(map(str, adapters)), "--runs", runs,
        "--steps", "4", "--swaps", "200", "--dtype", "float32",
    )  # fmt: skip


@pytest.mark.parametrize(
    ("backend", "sizes", "dtype"),
    [*((b, sizes, "float32") for b, sizes in F32_RUNS.items()), ("cpu", (1, 4), "bfloat16")],
)
def test_sizes_serve_the_same_tokens(
    tp_model, f32_runs, backend: str, sizes: tuple[int, ...], dtype: str
) -> None:
    import numpy as np

    model, adapters = tp_model
    if dtype == "float32":
        out = {**f32_runs[backend], "1": f32_runs["cpu"]["1"]}
    else:
        out = run_child(
            "--model", str(model), "--adapters", ",".join(map(str, adapters)), "--backend", backend,
            "--sizes", ",".join(map(str, sizes)), "--steps", "4", "--swaps", "200", "--dtype", dtype,
        )  # fmt: skip
    atol = ATOL if dtype == "float32" else ATOL_BF16
    ref = out["1"]
    ref_logits = np.array(ref["logits"])
    assert ref_logits.shape == (4, 6, 384)
    # the adapters are applied: the first step without LoRA matches the base row only (within the
    # rounding of another program: 1e-5 in f32, atol in bf16), every adapter row moves by more than 0.1
    moved = np.abs(ref_logits[0] - np.array(ref["base_logits"])).max(axis=-1)
    same = 1e-5 if dtype == "float32" else atol
    assert moved[4] < same and (moved[[0, 1, 2, 3, 5]] > 0.1).all(), moved
    for n in sizes:
        got = out[str(n)]
        assert got["devices"] == 8
        assert got["tokens"] == ref["tokens"], f"N={n}"
        np.testing.assert_allclose(np.array(got["logits"]), ref_logits, atol=atol, rtol=0, err_msg=f"N={n}")
        assert got["compilations"] == 0, (n, got["compiled"])  # 200 swaps and 10 decode steps after warm-up
        if n == 1:
            assert set(got["pools_after_swaps"].values()) == {"single"}
            continue
        # sharding.abstract_state (the planner's AOT shapes) has the runner's shapes, dtypes and specs
        assert got["abstract_matches"] == {"params": True, "cache": True, "pools": True}
        sh = got["shardings"]
        assert sh["params"] == {
            "attn_norm": "(None,)", "mlp_norm": "(None,)", "bqkv": "('model',)", "wqkv": SPLIT,
            "w_gate_up": SPLIT, "wo": "(None, 'model')", "w_down": "(None, 'model')",
        }  # fmt: skip
        assert sh["embed"] == SPLIT
        assert sh["cache"] == ["('model', None, None, None)"] * 2
        assert sh["pools"] == expected_pool_specs(backend)
        assert got["pools_after_swaps"] == expected_pool_specs(backend)
        # one device's pool block: q is 8 heads x 8, k/v 2 heads x 8 repeated up to N heads, I = 128
        shapes = {k: sorted(v[1:]) for k, v in sh["pool_shapes"].items()}
        assert shapes["B_q"] == sorted([16, 64 // n])
        assert shapes["B_k"] == shapes["B_v"] == sorted([16, 8 * max(2, n) // n])
        assert shapes["B_gate"] == shapes["B_up"] == sorted([16, 128 // n])
        assert shapes["A_o"] == sorted([16, 64 // n])
        assert shapes["A_down"] == sorted([16, 128 // n])
        assert shapes["A_qkv"] == sorted([64, 48])
        assert shapes["A_embed"] == shapes["B_lm_head"] == sorted([384 // n, 16])  # vocab 384 split
        assert shapes["B_embed"] == shapes["A_lm_head"] == sorted([16, 64])


@pytest.mark.parametrize("backend", ["cpu", "xla-grouped"])
def test_lora_collectives_are_rank_sized(tp_model, backend: str) -> None:
    """docs/design.md §7: at N = 4 the collectives LoRA adds to the compiled decode step move at most
    (2 · layers + 1) · batch · rank elements (one [batch, rank] reduction per row-parallel module, and one
    for the embed_tokens LoRA's gather from the vocab-split ``A_embed``; lm_head's ``B_lm_head`` is split
    like the logits and adds none)."""
    model, _ = tp_model
    out = run_child("--model", str(model), "--adapters", "-", "--backend", backend, "--sizes", "4", "--hlo")[
        "4"
    ]
    bound = (2 * out["layers"] + 1) * out["batch"] * out["rank"]
    base = out["base"]
    assert base["all-reduce"] > 0  # the base model's own reductions are there and counted
    assert out["lora"], "no plan variant with adapter rows"
    for variant in out["lora"]:
        added = {k: variant[k] - base[k] for k in base}
        assert added["all-reduce"] == bound, (
            added
        )  # exactly two [batch, rank] psums per layer + the embedding's
        assert sum(added.values()) <= bound, added  # nothing hidden-sized anywhere else


def test_fuse_order_gives_each_shard_its_parts() -> None:
    order = fuse_order((4, 2, 2), 2)  # q rows 0-3, k rows 4-5, v rows 6-7
    assert order.tolist() == [0, 1, 4, 6, 2, 3, 5, 7]
    assert fuse_order((3, 3), 1).tolist() == list(range(6))


def _cfg(**kw) -> ModelConfig:
    base = dict(
        model_type="llama", vocab_size=384, hidden_size=64, intermediate_size=128, num_layers=2,
        num_heads=8, num_kv_heads=2, head_dim=8,
    )  # fmt: skip
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize(
    ("kw", "n", "devices", "error", "words"),
    [
        ({}, 3, 8, InvalidArgument, ["tensor_parallel_size 3", "8 heads"]),
        (
            {"intermediate_size": 100},
            8,
            8,
            InvalidArgument,
            ["tensor_parallel_size 8", "intermediate size 100"],
        ),
        (
            {"num_heads": 12, "num_kv_heads": 3},
            2,
            8,
            InvalidArgument,
            ["tensor_parallel_size 2", "3 KV heads"],
        ),
        ({}, 4, 2, FailedPrecondition, ["tensor_parallel_size 4", "2 visible"]),
        ({}, 0, 8, InvalidArgument, ["must be >= 1, got 0"]),
    ],
)
def test_bad_configurations_are_refused(kw, n, devices, error, words) -> None:
    with pytest.raises(error) as info:
        check_tensor_parallel(_cfg(**kw), n, devices)
    for word in words:
        assert word in str(info.value)


def test_runner_refuses_more_devices_than_visible(llama_dir) -> None:
    """This pytest process has one CPU device: a TP=2 runner is refused before anything is placed."""
    import jax

    from loraserve.engine.jax_runner import JaxRunner
    from loraserve.models.checkpoint import load_checkpoint

    assert len(jax.devices()) == 1
    config = EngineConfig(tensor_parallel_size=2, kernel_backend="xla-grouped")
    with pytest.raises(
        FailedPrecondition, match="tensor_parallel_size 2 is larger than the 1 visible cpu devices"
    ):
        JaxRunner(load_checkpoint(str(llama_dir)), config)
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1"):
        EngineConfig(tensor_parallel_size=0)


def test_sharded_pallas_decode_lowers_for_tpu() -> None:
    """docs/design.md §6's TPU check for the N-device step: ``jax.export`` for the TPU platform runs the Mosaic
    lowering of every Pallas kernel inside ``shard_map`` (block rules enforced) on abstract shapes from
    ``sharding.abstract_state`` (bf16, 128-wide heads; nothing allocated)."""
    out = run_child("--tpu-export", "--sizes", "2,4,8")
    for n in ("2", "4", "8"):
        got = out[n]
        assert got["platforms"] == ["tpu"] and got["devices"] == int(n)
        # per layer one decode kernel (kernels.pallas_decode) for each of qkv, gate_up, o and down; o and down
        # (row-parallel) after the psum of their partial [batch, rank] shrink, which XLA computes (its width,
        # the rank, is not a multiple of 128 lanes)
        assert got["custom_calls"] == 4 * got["layers"], got
        assert got["psums"] == 2 * got["layers"], got  # the row-parallel [batch, rank] reductions


def test_sharded_paged_attention_kernel_lowers_for_tpu() -> None:
    """``--attention-backend pallas`` under tensor parallelism: JAX's paged-attention kernel runs inside
    ``shard_map`` (q by heads, pages by KV head; at N = 4 and 8 the 2 KV heads are repeated) and lowers
    for TPU in the whole N-device decode step: one kernel (a ``jax.jit`` function, exported once) called
    per layer, next to the LoRA kernels, and no collective added."""
    out = run_child("--tpu-export", "--attention", "pallas", "--sizes", "2,4,8")
    for n in ("2", "4", "8"):
        got = out[n]
        assert got["platforms"] == ["tpu"] and got["devices"] == int(n)
        assert got["attention_calls"] == got["layers"], got
        assert got["custom_calls"] == 4 * got["layers"] + 1, got
        assert got["psums"] == 2 * got["layers"], got
        assert got["attention_mesh"] == f"OrderedDict([('model', {n})])"


def test_sharded_pallas_attention_matches_xla() -> None:
    """The kernel interpreted on N CPU devices inside ``shard_map`` equals the xla impl on the same sharded
    arrays (bf16-exact pages; within 2e-5, measured 3.6e-7) and keeps q's head sharding."""
    out = run_child("--paged-attention", "--sizes", "2,4")
    for n in ("2", "4"):
        assert out[n]["devices"] == int(n)
        assert out[n]["max_abs_diff"] < 2e-5, out[n]
        assert out[n]["out_spec"] == "(None, 'model', None)"


def test_flag_and_environment_twin() -> None:
    import argparse

    from loraserve.common.config import config_from_args, field_help
    from loraserve.worker.cli import add_arguments
    from loraserve.worker.config import ENV_PREFIX, WorkerConfig

    env = WorkerConfig.from_env({"LORASERVE_WORKER_TENSOR_PARALLEL_SIZE": "4"})
    assert env.engine_config().tensor_parallel_size == 4
    assert WorkerConfig.from_env({}).tensor_parallel_size == 1
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--tensor-parallel-size", "8"])
    assert config_from_args(WorkerConfig, ENV_PREFIX, args).engine_config().tensor_parallel_size == 8
    assert field_help(WorkerConfig, "tensor_parallel_size").startswith("devices one model is split over")


# --quantization -> the quantized projections' "values/scales" shardings at N = 4: column-parallel (wqkv,
# w_gate_up), row-parallel (wo, w_down)
QUANTIZED_SPECS = {
    "int8": (f"{SPLIT}/('model',)", "(None, 'model')/()"),  # a scale per row: split with the rows, or whole
    "int4": (f"{SPLIT}/{SPLIT}", "(None, 'model')/(None, 'model')"),  # group scales: with rows or inputs
}


RUNS = {"int8": "cpu:int8", "int4": "cpu:int4+head"}  # the f32_runs key of each quantization


@pytest.mark.parametrize("quantization", list(QUANTIZED_SPECS))
def test_a_quantized_base_splits_with_its_scales_and_serves_the_same_tokens(f32_runs, quantization) -> None:
    """--quantization int8|int4 at N = 4 (models.quantization): the quantized values split like the float weights,
    the scales with their rows (column-parallel) or, row-parallel, whole (int8: one per row) or with their
    groups of inputs (int4: each device holds whole groups); tokens and logits as at N = 1 (f32 within ATOL:
    only the order of the split sums differs), the planner's abstract state equal to the runner's, 200 swaps
    compile nothing."""
    import numpy as np

    out = f32_runs[RUNS[quantization]]
    ref, got = out["1"], out["4"]
    assert got["tokens"] == ref["tokens"]
    np.testing.assert_allclose(np.array(got["logits"]), np.array(ref["logits"]), atol=ATOL, rtol=0)
    assert got["compilations"] == 0, got["compiled"]
    assert got["abstract_matches"] == {"params": True, "cache": True, "pools": True}
    params = got["shardings"]["params"]
    column, row = QUANTIZED_SPECS[quantization]
    assert params["wqkv"] == params["w_gate_up"] == column
    assert params["wo"] == params["w_down"] == row
    assert ref["shardings"]["params"]["wqkv"] == "single/single"
    # the int4 run quantizes the tied head too (a copy beside the float embedding): values and group scales
    # split by vocab rows; int8's head is the embedding itself
    assert got["shardings"]["lm_head"] == (f"{SPLIT}/{SPLIT}" if quantization == "int4" else None)
    assert got["shardings"]["embed"] == SPLIT


def test_int4_is_its_own_model(f32_runs) -> None:
    """The int4 and int8 runs are different models (the int4 test cannot pass on int8's logits)."""
    import numpy as np

    int4, int8 = (np.array(f32_runs[RUNS[q]]["1"]["logits"]) for q in ("int4", "int8"))
    assert np.abs(int4 - int8).max() > 10 * ATOL
