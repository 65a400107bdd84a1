"""Tiny random checkpoints (one per family) and PEFT adapters, built once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker.testing import make_adapter, save_model

FAMILIES = {
    # llama3 rope scaling, untied head
    "llama": dict(
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
    ),
    "mistral": dict(),
    # qkv bias (always on for qwen2) and tied embeddings
    "qwen2": dict(tie_word_embeddings=True),
}


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {
        name: save_model(root / name, name, seed=i, **kw) for i, (name, kw) in enumerate(FAMILIES.items())
    }


@pytest.fixture(scope="session")
def llama_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["llama"]


# name -> make_adapter kwargs: different ranks, alphas, rsLoRA and target subsets.
ADAPTERS = {
    "all-r4": dict(r=4, alpha=8.0, seed=1),
    "qv-r8-rslora": dict(r=8, alpha=4.0, use_rslora=True, targets=("q_proj", "v_proj"), seed=2),
    "mlp-r16": dict(r=16, alpha=32.0, targets=("gate_proj", "up_proj", "down_proj"), seed=3),
    "attn-pattern": dict(
        r=8,
        alpha=8.0,
        targets=("q_proj", "k_proj", "o_proj"),
        rank_pattern={"k_proj": 2},
        alpha_pattern={"o_proj": 3.0},
        seed=4,
    ),
}


@pytest.fixture(scope="session")
def adapter_dirs(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for name, kw in ADAPTERS.items():
        base = AutoModelForCausalLM.from_pretrained(str(llama_dir))
        make_adapter(base, root / name, **kw)
        out[name] = root / name
    return out
