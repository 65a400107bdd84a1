"""Checkpoints and adapters saved in bf16 load, widened to f32 exactly (numpy has no bfloat16, and since
safetensors 0.8 neither its numpy nor its flax loader reads BF16: ``adapters.peft.safetensors_to_numpy``)."""

from __future__ import annotations

import numpy as np
import torch
from safetensors.torch import save

from loraserve.adapters.peft import load_tensors, parse_adapter, safetensors_to_numpy
from loraserve.models.checkpoint import load_checkpoint
from loraserve.testing import build_model, make_adapter


def test_bf16_tensors_widen_exactly_beside_other_dtypes() -> None:
    x = torch.randn(3, 5).to(torch.bfloat16)
    out = safetensors_to_numpy(
        save({"x": x, "f": torch.randn(4), "h": torch.randn(2).half(), "i": torch.arange(3)})
    )
    assert out["x"].dtype == np.float32 and np.array_equal(out["x"], x.float().numpy())
    assert out["h"].dtype == np.float16 and out["i"].tolist() == [0, 1, 2]
    assert load_tensors(save({"x": x}))["x"].dtype == np.float32


def test_bf16_checkpoint_and_adapter_load(tmp_path) -> None:
    model = build_model("llama").to(torch.bfloat16)
    model.save_pretrained(str(tmp_path / "base"), safe_serialization=True)
    ck = load_checkpoint(str(tmp_path / "base"), dtype="float32")
    embed = model.model.embed_tokens.weight.detach().float().numpy()
    assert np.array_equal(np.asarray(ck.params["embed"]), embed)
    peft_model = make_adapter(model, tmp_path / "a", r=4)
    weights = (tmp_path / "a" / "adapter_model.safetensors").read_bytes()
    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in peft_model.state_dict().items() if "lora_" in k}
    sd = {k.replace(".default", ""): v for k, v in sd.items()}
    assert set(sd) == set(safetensors_to_numpy(weights))
    lora = parse_adapter((tmp_path / "a" / "adapter_config.json").read_bytes(), save(sd))
    a_bf16 = sd["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].float().numpy()
    assert np.array_equal(lora.modules["q_proj"][0][0], a_bf16.T)
