"""Weighted mixes of adapters per request (#16 item 4): exact against PEFT's
``add_weighted_adapter(..., combination_type="cat")`` in one batch with single-adapter and base rows through
every backend, served by the engine next to other requests with nothing compiled after start, and refused
with clear statuses when malformed (nothing queued).

PEFT's ``cat`` adapter takes its config from the first adapter with ``r = lora_alpha = the summed rank``: its
scaling is 1 unless that first adapter uses rsLoRA, so every mix here starts with a plain-scaling adapter.
"""

from __future__ import annotations

import math
import uuid

import grpc
import numpy as np
import pytest
import torch

from loraserve.adapters.errors import AdapterError
from loraserve.adapters.files import read_adapter_files
from loraserve.adapters.mix_weights import concat_adapters
from loraserve.adapters.mixes import MixPart, is_mix, mix_ref, parse_mix, validate_mix
from loraserve.adapters.peft import parse_adapter
from loraserve.engine.request import Failed, Finished, Started
from loraserve.kernels import get_backend
from loraserve.kernels.testing import count_compilations
from loraserve.models.checkpoint import load_checkpoint
from loraserve.models.lora.pools import SlotPools, slot_arrays
from tests.platform import backends
from tests.worker.test_lora_parity import PROMPT, STEPS, _serve_mixed

ATOL = 2e-4
RANK = 16
# (adapter, weight) per mix; ranks 4 + 8 (rsLoRA, q/v only) and 4 + 8 (rank/alpha patterns) fit RANK
MIXES = {
    "mix-a": (("all-r4", 0.7), ("qv-r8-rslora", 0.3)),
    "mix-b": (("all-r4", -0.5), ("attn-pattern", 1.25)),  # negative: task arithmetic
}
# slot 0: all-r4 alone, 1: mix-a, 2: mix-b; -1: base
SLOTS = ["all-r4", "mix-a", "mix-b"]
ROW_SLOTS = np.array([1, 0, -1, 2, 1, 2, 0], np.int32)


def _parsed(cfg, path, max_rank: int = RANK):
    return parse_adapter(
        *read_adapter_files(str(path)),
        module_shapes=cfg.module_shapes(),
        num_layers=cfg.num_layers,
        max_rank=max_rank,
    )


def _mix_weights(cfg, adapter_dirs, parts, max_rank: int = RANK):
    return concat_adapters([(n, _parsed(cfg, adapter_dirs[n]), w) for n, w in parts], max_rank)


def _peft_logits(model_dir, adapter_dirs, name: str | None, seq: list[int]) -> np.ndarray:
    """transformers + peft logits of ``seq`` with no adapter, one adapter, or a MIXES entry made by PEFT's
    ``add_weighted_adapter(..., combination_type="cat")``."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    if name is not None:
        parts = MIXES.get(name, ((name, 1.0),))
        model = PeftModel.from_pretrained(model, str(adapter_dirs[parts[0][0]]), adapter_name=parts[0][0])
        for part, _ in parts[1:]:
            model.load_adapter(str(adapter_dirs[part]), adapter_name=part)
        if name in MIXES:
            model.add_weighted_adapter(
                [p for p, _ in parts], [w for _, w in parts], name, combination_type="cat"
            )
            model.set_adapter(name)
        model.eval()
    with torch.no_grad():
        return model(torch.tensor([seq])).logits[0].float().numpy()


def test_mix_refs_round_trip_and_refusals() -> None:
    parts = (MixPart("a@1", 0.7), MixPart("b", -0.3), MixPart("c@prod", 2.0))
    ref = mix_ref(parts)
    assert ref == "a@1*0.7+b*-0.3+c@prod*2.0" and is_mix(ref) and not is_mix("a@1")
    assert parse_mix(ref) == parts
    validate_mix(parts, max_mix=3)
    refusals = {
        (): "at least one",
        (MixPart("a", 1), MixPart("b", 1), MixPart("c", 1)): "at most 2",
        (MixPart("a", 1), MixPart("a", 2)): "twice",
        (MixPart("a", math.nan),): "finite",
        (MixPart("a", math.inf), MixPart("b", 1)): "finite",
        (MixPart("a", 0.0), MixPart("b", -0.0)): "all zero",
        (MixPart("Bad Name", 1),): "must match",
        (MixPart("", 1),): "no adapter",
        (MixPart("a@0", 1),): "after '@'",
    }
    for bad, words in refusals.items():
        with pytest.raises(AdapterError, match=words) as err:
            validate_mix(bad, max_mix=2)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    for bad in ("a*x", "a+b*1", "a"):
        with pytest.raises(AdapterError):
            parse_mix(bad)


def test_concat_is_the_weighted_sum_and_refuses_what_it_cannot_mix(
    llama_dir, adapter_dirs, dora_dirs
) -> None:
    """``x A_cat B_cat = Σ w_k x A_k B_k`` on every module (a part without a module adds nothing there);
    ranks add up; DoRA, lora_bias, a key twice and a rank above the slots' are refused."""
    cfg = load_checkpoint(str(llama_dir)).config
    parts = [(n, _parsed(cfg, adapter_dirs[n]), w) for n, w in MIXES["mix-a"]]
    mix = concat_adapters(parts, RANK)
    rng = np.random.default_rng(0)
    for module, (a, b) in mix.modules.items():
        x = rng.standard_normal((3, a.shape[1])).astype(np.float32)
        want = sum(
            w * np.einsum("ti,lir,lro->lto", x, *p.modules[module])
            for _, p, w in parts
            if module in p.modules
        )
        np.testing.assert_allclose(np.einsum("ti,lir,lro->lto", x, a, b), want, atol=1e-5)
    assert mix.modules["q_proj"][0].shape[2] == 12 and mix.modules["k_proj"][0].shape[2] == 4
    assert mix.rank == 12 and not mix.use_dora and mix.sha256 != parts[0][1].sha256
    dora = dora_dirs("llama")
    for name, words in (("dora-all-r4", "DoRA"), ("bias-r4", "lora_bias")):
        with pytest.raises(AdapterError, match=words) as err:
            concat_adapters([parts[0], (name, _parsed(cfg, dora[name]), 0.5)], RANK)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(AdapterError, match="twice"):
        concat_adapters([parts[0], parts[0]], RANK)
    big = [parts[0], ("mlp-r16", _parsed(cfg, adapter_dirs["mlp-r16"]), 1.0)]
    with pytest.raises(AdapterError, match="rank 20") as err:
        concat_adapters(big, RANK)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION


# measured max |diff| (f32, every backend): ~2e-6
@pytest.mark.parametrize("backend", backends("reference", "xla-onehot", "xla-grouped", "cpu", "pallas"))
def test_mixes_single_adapters_and_base_rows_in_one_batch_match_peft(
    llama_dir, adapter_dirs, backend
) -> None:
    ck = load_checkpoint(str(llama_dir))
    cfg, lora_backend = ck.config, get_backend(backend)
    pools = SlotPools(cfg, len(SLOTS), RANK, np.dtype("float32"), lora_backend)
    for slot, name in enumerate(SLOTS):
        weights = (
            _mix_weights(cfg, adapter_dirs, MIXES[name])
            if name in MIXES
            else _parsed(cfg, adapter_dirs[name])
        )
        pools.write(slot, slot_arrays(cfg, weights, RANK))
    rng = np.random.default_rng(5)
    seq = PROMPT + rng.integers(3, cfg.vocab_size, STEPS).tolist()
    want = {
        s: _peft_logits(llama_dir, adapter_dirs, None if s < 0 else SLOTS[s], seq)[len(PROMPT) - 1 :]
        for s in set(ROW_SLOTS.tolist())
    }
    plan = lora_backend.plan(ROW_SLOTS, len(SLOTS))
    got = _serve_mixed(ck, lora_backend, pools, ROW_SLOTS, plan, seq, "float32")
    for row, slot in enumerate(ROW_SLOTS):
        err = np.abs(got[row] - want[slot]).max()
        assert err <= ATOL, f"row {row} ({SLOTS[slot] if slot >= 0 else 'base'}): {err}"
        np.testing.assert_array_equal(got[row].argmax(-1), want[slot].argmax(-1))
    # a mix is neither of its parts, nor its parts at weight 1: the comparison could fail
    alone = _peft_logits(llama_dir, adapter_dirs, "all-r4", seq)[len(PROMPT) - 1 :]
    assert np.abs(want[1] - alone).max() > 0.05 and np.abs(want[2] - alone).max() > 0.05


def _engine(llama_dir, adapter_dirs, **kw):
    """A started engine serving every adapter of ``adapter_dirs``, stopped when the ``with`` ends."""
    from loraserve.engine.config import EngineConfig
    from tests.engines import started_engine

    config = EngineConfig(
        max_batch_size=4, max_seq_len=64, max_loras=2, max_lora_rank=RANK, min_prefill_bucket=64, **kw
    )  # one prefill bucket: a shorter warm-up (bucketing itself: test_engine.py)
    return started_engine(llama_dir, config, adapter_dirs)


def _request(adapter: str, prompt: list[int], collector, n: int = 8):
    from loraserve.engine.request import EngineRequest, Sampling

    return EngineRequest(
        uuid.uuid4().hex, adapter, prompt, Sampling(max_tokens=n, ignore_eos=True), collector
    )


def _peft_greedy(model_dir, adapter_dirs, name, prompt, n: int) -> list[int]:
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(_peft_logits(model_dir, adapter_dirs, name, seq)[-1].argmax()))
    return seq[len(prompt) :]


def test_engine_serves_mixes_next_to_single_adapters_with_peft_s_tokens(llama_dir, adapter_dirs) -> None:
    """Mixes (their parts fetched at once, concatenated on the loader thread, written into a slot), one
    adapter and the base model, concurrently through 2 slots, give PEFT's greedy tokens; nothing compiles
    after start; ``Started`` names the mix's resolved parts."""
    from tests.worker.fake_engine import Collector

    names = ["", "all-r4", "mix-a", "mix-b"]
    refs = {n: mix_ref([MixPart(a, w) for a, w in MIXES[n]]) if n in MIXES else n for n in names}
    prompts = {name: [5, 17, 40 + i, 100, 7] for i, name in enumerate(names)}
    with _engine(llama_dir, adapter_dirs, max_cpu_loras=4) as engine:
        with count_compilations() as count:
            collectors = {}
            for round_ in range(2):  # the second round reuses what the first left in slots and host memory
                for name in names:
                    c = Collector()
                    engine.submit(_request(refs[name], prompts[name], c))
                    collectors[name, round_] = c
            for c in collectors.values():
                assert c.done.wait(120), "request did not finish"
        assert count.compilations == 0, count.names
    for (name, _), c in collectors.items():
        assert c.tokens == _peft_greedy(llama_dir, adapter_dirs, name or None, prompts[name], 8), name
    started = [e.adapter for e in collectors["mix-a", 0].events if isinstance(e, Started)]
    assert started == ["all-r4*0.7+qv-r8-rslora*0.3"]  # a local source's keys are the names


def test_engine_refuses_bad_mixes_and_keeps_serving(llama_dir, adapter_dirs) -> None:
    """Malformed mixes are INVALID_ARGUMENT at submit (nothing queued); an unknown part is NOT_FOUND and a
    summed rank above the slots' FAILED_PRECONDITION for that request only; the engine then serves on."""
    from loraserve.common.errors import LoraserveError
    from tests.worker.fake_engine import Collector

    with _engine(llama_dir, adapter_dirs, max_mix=2) as engine:
        for ref, words in (
            ("all-r4*0.5+mlp-r16*0.5+attn-pattern*1.0", "at most 2"),
            ("all-r4*nan", "finite"),
            ("all-r4*0.0+mlp-r16*0.0", "all zero"),
            ("all-r4*1.0+all-r4*2.0", "twice"),
        ):
            with pytest.raises(LoraserveError, match=words) as err:
                engine.submit(_request(ref, [5, 6, 7], Collector()))
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert engine.snapshot().waiting == 0
        for ref, code, words in (
            ("all-r4*0.5+nope*0.5", grpc.StatusCode.NOT_FOUND, "nope"),
            ("all-r4*0.5+mlp-r16*0.5", grpc.StatusCode.FAILED_PRECONDITION, "rank 20"),
        ):
            c = Collector()
            engine.submit(_request(ref, [5, 6, 7], c))
            assert c.done.wait(60)
            assert isinstance(c.end, Failed) and c.end.code == code and words in c.end.message, (ref, c.end)
        c = Collector()
        engine.submit(_request("all-r4*0.5+qv-r8-rslora*0.5", [5, 6, 7], c, n=3))
        assert c.done.wait(60) and isinstance(c.end, Finished) and len(c.tokens) == 3
