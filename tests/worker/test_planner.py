"""``loraserve plan``: per-device bytes of the tensor-parallel layout, counted by hand for Llama-3-8B."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from loraserve.cli import main
from loraserve.common.errors import InvalidArgument
from loraserve.models import planner
from loraserve.worker import plan_cmd

LLAMA3_8B_PARAMS = 8_030_261_248  # embed + lm_head 2 * 128256 * 4096, 32 layers of 218,112,000 + norms


@pytest.fixture(scope="module")
def llama8b():
    return planner.load_model_config("llama-3-8b")[1]


def test_presets_ship_with_the_package() -> None:
    assert {"llama-3-8b", "llama-3-70b", "gemma-2-9b"} <= set(planner.presets())


def test_weights_are_the_parameter_count_split_by_the_megatron_layout(llama8b) -> None:
    assert planner.weight_bytes(llama8b, 1, "bfloat16") == 2 * LLAMA3_8B_PARAMS
    assert planner.weight_bytes(llama8b, 1, "float32") == 4 * LLAMA3_8B_PARAMS
    # tp=4: every projection and the vocab split four ways; norms (2 * 4096 per layer + final) replicated
    norms = 32 * 2 * 4096 + 4096
    assert planner.weight_bytes(llama8b, 4, "bfloat16") == 2 * ((LLAMA3_8B_PARAMS - norms) // 4 + norms)


def test_kv_cache_is_split_by_kv_head_and_replicated_past_them(llama8b) -> None:
    # k+v, layers, tokens (batch * context in pages of 16, plus the null page), kv heads, head_dim, bf16
    one = 2 * 32 * (16 * 1024 + 16) * 8 * 128 * 2
    assert planner.kv_bytes(llama8b, 1, 16, 1024, "bfloat16") == one
    assert planner.kv_bytes(llama8b, 8, 16, 1024, "bfloat16") == one // 8
    assert planner.kv_bytes(llama8b, 16, 16, 1024, "bfloat16") == one // 8  # 8 KV heads: one each, replicated


def test_lora_pools_shard_like_their_layer(llama8b) -> None:
    r, s, layers = 16, 4, 32

    # column-parallel q,k,v,gate,up: A whole (in = 4096) + B split; row-parallel o, down: A split + B whole
    def per_layer(tp: int) -> int:
        kv = max(8 // tp, 1) * 128
        column = (4096 + 4096 // tp) + 2 * (4096 + kv) + 2 * (4096 + 14336 // tp)
        row = (4096 // tp + 4096) + (14336 // tp + 4096)
        return r * (column + row)

    # the f32 DoRA-scale and LoRA-bias vectors [S, out] of each group: split like the column-parallel
    # outputs, whole for o and down
    def vectors(tp: int) -> int:
        kv = max(8 // tp, 1) * 128
        return 2 * (4096 // tp + 2 * kv + 2 * 14336 // tp + 2 * 4096)

    # once per model, the embed_tokens / lm_head pools: A_embed [V, R] and B_lm_head [R, V] split by vocab
    # (128256 divides by 8), B_embed [R, H] and A_lm_head [H, R] whole
    def vocab(tp: int) -> int:
        return r * (2 * 128256 // tp + 2 * 4096)

    for tp in (1, 2, 4, 8):
        want = s * (layers * (2 * per_layer(tp) + 4 * vectors(tp)) + 2 * vocab(tp))
        assert planner.pool_bytes(llama8b, tp, s, r, "bfloat16") == want


def test_layouts_that_do_not_divide_are_refused(llama8b) -> None:
    with pytest.raises(InvalidArgument, match="tensor_parallel_size 3 does not divide the model's 32 heads"):
        planner.check_layout(llama8b, 3)
    with pytest.raises(InvalidArgument, match="tensor_parallel_size 16 and the model's 12 KV heads"):
        planner.check_layout(replace(llama8b, num_kv_heads=12), 16)
    planner.check_layout(llama8b, 16)  # 8 KV heads replicated twice


def test_fit_and_hosts() -> None:
    name, cfg = planner.load_model_config("llama-3-70b")
    kwargs = dict(max_loras=8, max_lora_rank=16, batch=32, context=4096)
    on_one_host = planner.plan(name, cfg, "v5e", 8, **kwargs)
    assert (on_one_host.hosts, on_one_host.fits) == (1, False)  # 70B bf16 weights alone are 16.4 GiB a chip
    four_hosts = planner.plan(name, cfg, "v5e", 16, **kwargs)  # v5e-16: four 4-chip hosts
    assert (four_hosts.hosts, four_hosts.fits) == (4, True)
    assert planner.plan(name, cfg, "v5p", 8, **kwargs).hosts == 2  # v5p: 4 chips per host
    # the plan says how to start it: the multi-host flags and the LeaderWorkerSet's size
    assert "--num-processes 4 --process-id 0..3 (a LeaderWorkerSet of size 4" in plan_cmd.render(four_hosts)
    assert "hosts" not in plan_cmd.render(planner.plan(name, cfg, "v5e", 4, **kwargs))


def test_cli_prints_the_plan_and_exits_3_when_it_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "plan",
        "--model",
        "llama-3-8b",
        "--tp",
        "4",
        "--chip",
        "v6e",
        "--batch",
        "16",
        "--context",
        "4096",
    ]
    assert main([*args, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["tp"], out["hosts"], out["fits"]) == (4, 1, True)
    assert out["total"] == sum(
        out[k] for k in ("weights", "kv_cache", "lora_pools", "sampling_history", "activations")
    )
    assert main(["plan", "--model", "llama-3-8b", "--chip", "v5e", "--context", "8192", "--batch", "64"]) == 3
    assert "does NOT fit" in capsys.readouterr().out
    assert main(["plan", "--model", "no-such-model"]) == 1
    assert "error: INVALID_ARGUMENT: 'no-such-model' is neither a preset" in capsys.readouterr().err


def test_gemma2_9b_counts_its_four_norms_and_tied_embeddings() -> None:
    name, cfg = planner.load_model_config("gemma-2-9b")
    assert (name, cfg.model_type, cfg.tie_word_embeddings, cfg.head_dim) == (
        "gemma-2-9b",
        "gemma2",
        True,
        256,
    )
    assert planner.weight_bytes(cfg, 1, "bfloat16") == 2 * 9_241_705_984  # Gemma-2-9B's parameter count


SMALL = {
    "model_type": "llama", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 512,
    "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32,
}  # fmt: skip


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_verify_compiled_arguments_equal_the_estimate(tp: int, tmp_path, capsys) -> None:
    """The compiled decode step's per-device arguments are exactly weights + KV + pools + the step's small
    inputs; the KV cache is donated (aliased); f32 temporaries stay under the activation estimate."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(SMALL))
    args = [
        "plan",
        "--model",
        str(path),
        "--tp",
        str(tp),
        "--chip",
        "v5e",
        "--batch",
        "8",
        "--context",
        "256",
    ]
    args += ["--max-loras", "4", "--max-lora-rank", "8", "--dtype", "float32", "--json", "--verify"]
    assert main(args) == 0
    out = json.loads(capsys.readouterr().out)
    compiled = out["compiled"]
    assert compiled["argument_bytes"] == (
        out["weights"]
        + out["kv_cache"]
        + out["lora_pools"]
        + out["sampling_history"]
        + compiled["small_input_bytes"]
    )
    assert compiled["alias_bytes"] == out["kv_cache"] + out["sampling_history"]  # both donated
    assert 0 < compiled["temp_bytes"] <= out["activations"]
