"""LoRA on a mixture of experts' experts and router, made by ``peft`` (``target_parameters`` on the fused
expert weights and the router), served in one batch with attention adapters and base rows.

Parity with ``peft`` per family (Qwen3-MoE, Mixtral, Qwen2-MoE with its shared expert): four adapters
(experts' gate/up and down; down + router + attention; attention only; gate/up + o_proj) and a base row,
prefill then the teacher-forced decode steps of tests/worker/test_lora_parity.py: f32 logits within 2e-4 (observed <= 3.2e-6), each adapter
moving its rows by > 0.5; every LoRA backend serves them (the experts' LoRA is the model's own code; the
backend serves attention's). bf16 (model, pools and peft in bf16): peft merges each expert's delta into
its bf16 weight (one rounding of W + BA) where we add x·A·B to the f32 accumulator, and a router's top-k can
flip at a near-tie: logits within 0.08 on >= 85 % of steps and within 0.5 everywhere (observed: all
within 0.064). The gathered (CPU)
and grouped (TPU) expert paths agree, a row's bits never depend on the other rows' slots, and slot swaps
after warm-up compile nothing.
"""

from __future__ import annotations

import uuid
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loraserve.adapters.files import read_adapter_files
from loraserve.adapters.peft import parse_adapter
from loraserve.kernels import LORA_BACKENDS, get_backend
from loraserve.kernels.testing import count_compilations
from loraserve.models import decoder, moe
from loraserve.models.checkpoint import load_checkpoint
from loraserve.models.lora.pools import SlotPools, slot_arrays
from loraserve.testing import MOE_FAMILIES, make_adapter, save_model
from tests.platform import NATIVE_BACKEND, backends
from tests.worker.model_steps import ModelSteps
from tests.worker.test_lora_parity import PROMPT, STEPS, _reference_logits, _serve_mixed

ATOL = 2e-4
ATOL_BF16, ATOL_BF16_FLIP = 0.08, 0.5
RANK = 16
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# (targets, target_parameters, rank): what each slot's adapter adapts
ADAPTERS = [
    ((), EXPERTS, 4),
    (("q_proj", "v_proj"), ["mlp.experts.down_proj", "mlp.gate.weight"], 8),
    (("q_proj", "k_proj", "v_proj", "o_proj"), None, 4),
    (("o_proj",), ["experts.gate_up_proj"], 8),
]
ROW_SLOTS = np.array([0, -1, 1, 2, 3, 0], np.int32)
SEQ = [*PROMPT, *[(11 * i + 3) % 250 for i in range(STEPS + 1)]]


def _adapters(base, root, dtype: str = "float32"):
    import torch
    from transformers import AutoModelForCausalLM

    dirs = []
    for i, (targets, params, r) in enumerate(ADAPTERS):
        hf = AutoModelForCausalLM.from_pretrained(str(base), dtype=getattr(torch, dtype))
        extra = {"target_parameters": params} if params else {}
        make_adapter(hf, root / f"a{i}", r=r, alpha=16.0, targets=targets, seed=i, scale=0.1, **extra)
        dirs.append(root / f"a{i}")
    return dirs


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Per family: the base, its four adapters and peft's logits for each slot (and the base)."""
    cache = {}

    def get(family: str):
        if family not in cache:
            root = tmp_path_factory.mktemp(family)
            base = save_model(root / "base", family, seed=3)
            dirs = _adapters(base, root)
            refs = {s: _reference_logits(base, None if s < 0 else dirs[s], SEQ) for s in range(-1, len(dirs))}
            cache[family] = (base, dirs, refs)
        return cache[family]

    return get


def _weights(cfg, path):
    return parse_adapter(
        *read_adapter_files(str(path)),
        module_shapes=cfg.adapter_shapes(),
        num_layers=cfg.num_layers,
        max_rank=RANK,
    )


def _pools(cfg, dirs, backend, dtype: str) -> SlotPools:
    pools = SlotPools(cfg, len(dirs), RANK, jnp.dtype(dtype), backend)
    for slot, path in enumerate(dirs):
        values = slot_arrays(cfg, _weights(cfg, path), RANK)
        pools.write(slot, values)
        for got, want in zip(pools.read(slot), values, strict=True):  # expert-major pools round-trip
            for k in moe.expert_slot_shapes(cfg, RANK):
                np.testing.assert_array_equal(
                    got[k].astype(np.float32), want[k].astype(dtype).astype(np.float32)
                )
    return pools


def _check_f32(got, refs) -> None:
    for row, slot in enumerate(ROW_SLOTS):
        want = refs[int(slot)][len(PROMPT) - 1 : len(PROMPT) - 1 + got.shape[1]]
        np.testing.assert_allclose(got[row], want, atol=ATOL, rtol=0, err_msg=f"row {row} (slot {slot})")
    for slot in range(len(ADAPTERS)):  # every adapter moves its rows: parity cannot pass by accident
        assert np.abs(refs[slot] - refs[-1]).max() > 0.5


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_expert_adapters_serve_as_peft_computes_them(served, family) -> None:
    base, dirs, refs = served(family)
    ck = load_checkpoint(str(base))
    w = _weights(ck.config, dirs[0])
    assert w.target_modules == ("experts.gate_up_proj", "experts.down_proj")
    assert w.experts["experts.gate_up_proj"][0].shape[:2] == (ck.config.num_layers, ck.config.num_experts)
    backend = get_backend(NATIVE_BACKEND)
    pools = _pools(ck.config, dirs, backend, "float32")
    _check_f32(
        _serve_mixed(ck, backend, pools, ROW_SLOTS, backend.plan(ROW_SLOTS, len(dirs)), SEQ, "float32"), refs
    )


@pytest.mark.parametrize("name", backends(*(n for n in LORA_BACKENDS if n != NATIVE_BACKEND)))
def test_every_lora_backend_serves_expert_adapters(served, name) -> None:
    base, dirs, refs = served("qwen3_moe")
    ck = load_checkpoint(str(base))
    backend = get_backend(name)
    pools = _pools(ck.config, dirs, backend, "float32")
    _check_f32(
        _serve_mixed(ck, backend, pools, ROW_SLOTS, backend.plan(ROW_SLOTS, len(dirs)), SEQ, "float32"), refs
    )


def test_bf16_follows_peft_within_the_routing_rule(tmp_path) -> None:
    base = save_model(tmp_path / "base", "qwen3_moe", seed=3)
    dirs = _adapters(base, tmp_path, "bfloat16")
    ck = load_checkpoint(str(base), dtype="bfloat16")
    backend = get_backend(NATIVE_BACKEND)
    pools = _pools(ck.config, dirs, backend, "bfloat16")
    got = _serve_mixed(ck, backend, pools, ROW_SLOTS, backend.plan(ROW_SLOTS, len(dirs)), SEQ, "bfloat16")
    errors = []
    for row, slot in enumerate(ROW_SLOTS):
        want = _reference_logits(base, None if slot < 0 else dirs[slot], SEQ, "bfloat16")
        errors.append(np.abs(got[row] - want[len(PROMPT) - 1 : len(PROMPT) - 1 + got.shape[1]]).max(axis=-1))
    errors = np.stack(errors)
    assert errors.max() <= ATOL_BF16_FLIP, errors.max()
    assert (errors <= ATOL_BF16).mean() >= 0.85, (errors <= ATOL_BF16).mean()


def _random_pools(cfg, slots: int, rng) -> dict:
    layer = moe.init_expert_pools(cfg, slots, 4, jnp.float32)
    return {k: jnp.asarray(rng.normal(0, 0.2, v.shape), jnp.float32) for k, v in layer.items()}


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_the_gathered_and_grouped_paths_agree_and_rows_keep_their_bits(served, family) -> None:
    """With expert and router LoRA in three slots: the gathered path (the reference), the CPU's tiled one
    (decode-sized: the C++ grouped kernels over (expert, slot); prefill-sized: tiles of one (expert, slot))
    and the TPU's (expert, slot) grouped matmuls agree within 1e-5; a row's result is bit-for-bit the same
    whatever the other rows' slots (base rows included) and tokens, on every path."""
    ck = load_checkpoint(str(served(family)[0]))
    cfg, lp = ck.config, ck.params["layers"][0]
    rng = np.random.default_rng(0)
    ll = _random_pools(cfg, 3, rng)
    paths = ("gather", "tiled", "ragged")
    mlp = jax.jit(partial(moe.moe_mlp, cfg), static_argnames="path")  # as the steps run it: one program each
    # under and over a gather chunk; the last one's pairs past GATHER_LORA_PAIRS (the tiled path's prefill way)
    for tokens in (5, 40, moe.GATHER_LORA_PAIRS // cfg.experts_per_token + 3):
        x = jnp.asarray(rng.standard_normal((tokens, cfg.hidden_size)), jnp.float32)
        slots = jnp.asarray(rng.integers(-1, 3, tokens), jnp.int32).at[0].set(1)
        out = {p: mlp(lp, x, path=p, ll=ll, slots=slots) for p in paths}
        for path in paths[1:]:
            np.testing.assert_allclose(np.asarray(out[path]), np.asarray(out["gather"]), atol=1e-5, rtol=1e-5)
        base = mlp(lp, x, path="gather")
        assert np.abs(np.asarray(out["gather"])[0] - np.asarray(base)[0]).max() > 1e-2  # slot 1 moves row 0
        others = x.at[1:].set(jnp.asarray(rng.standard_normal((tokens - 1, x.shape[1])), jnp.float32))
        other_slots = slots.at[1:].set(jnp.asarray(rng.integers(-1, 3, tokens - 1), jnp.int32))
        for path in paths:
            after = mlp(lp, others, path=path, ll=ll, slots=other_slots)
            np.testing.assert_array_equal(np.asarray(after)[0], np.asarray(out[path])[0])
        # a base row (-1) computes what the model without any LoRA computes, bit for bit
        for path in ("gather", "tiled"):
            no_lora = np.asarray(mlp(lp, x, path=path))
            as_base = np.asarray(mlp(lp, x, path=path, ll=ll, slots=jnp.full(tokens, -1, jnp.int32)))
            np.testing.assert_array_equal(as_base, no_lora)


def test_expert_adapter_swaps_after_warmup_compile_nothing(served) -> None:
    """200 slot writes of expert adapters (and zeroing) between decode steps over slot mixes: no compilation."""
    base, dirs, _ = served("qwen3_moe")
    ck = load_checkpoint(str(base))
    cfg, backend = ck.config, get_backend(NATIVE_BACKEND)
    values = [slot_arrays(cfg, _weights(cfg, d), RANK) for d in dirs]
    pools = SlotPools(cfg, 2, RANK, jnp.dtype(jnp.float32), backend)
    rows = 4
    cache = decoder.init_cache(cfg, rows * 2 + 1, 16, jnp.float32)
    tables = decoder.contiguous_page_tables(rows, 2)
    steps = ModelSteps(cfg, backend, ck.params, pools, cache)
    tokens = np.zeros(16, np.int32)
    tokens[: len(PROMPT)] = PROMPT
    same, nines = np.full(rows, len(PROMPT), np.int32), np.full(rows, 9, np.int32)
    pools.zero(0)
    pools.write(1, values[0])
    steps.prefill_one(tokens, len(PROMPT), 0, 0, tables[0])
    for plan in backend.warmup_plans(rows, 2):
        steps.decode(nines, same, tables, plan)
    jax.block_until_ready(steps.cache)
    mixes = [[0, 1, -1, 1], [1, 1, 1, 1], [-1, 0, 0, -1]]
    with count_compilations() as count:
        for i in range(200):
            if i % 50 == 49:
                pools.zero(i % 2)
            else:
                pools.write(i % 2, values[i % len(values)])
            if i % 20 == 0:
                mix = np.array(mixes[(i // 20) % len(mixes)], np.int32)
                steps.decode(nines, same, tables, backend.plan(mix, 2))
        jax.block_until_ready(steps.cache)
    assert count.compilations == 0, count.names


def test_the_engine_serves_expert_adapters_token_for_token(served) -> None:
    """Through the whole engine (residency loads from a local source, paged KV, chunked prefill, one decode
    batch): greedy tokens of each expert adapter, two slots for three adapters (swaps while others decode),
    and a base request are peft's greedy ``generate``."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from loraserve.engine.config import EngineConfig
    from loraserve.engine.request import EngineRequest, Finished, Sampling
    from tests.engines import started_engine
    from tests.worker.fake_engine import Collector

    base, dirs, _ = served("qwen3_moe")
    names = {f"a{i}": str(d) for i, d in enumerate(dirs)}
    steps = 12

    def peft_greedy(name: str) -> list[int]:
        model = AutoModelForCausalLM.from_pretrained(str(base)).eval()
        if name:
            model = PeftModel.from_pretrained(model, names[name]).eval()
        with torch.no_grad():
            out = model.generate(torch.tensor([PROMPT]), max_new_tokens=steps, do_sample=False)
        return out[0, len(PROMPT) :].tolist()

    asked = ["a0", "", "a1", "a3", "a0"]
    config = EngineConfig(max_batch_size=4, max_seq_len=32, max_loras=2, max_lora_rank=RANK, prefill_chunk=4)
    with started_engine(base, config, names, warmup=False) as engine:
        collectors = [Collector() for _ in asked]
        for name, c in zip(asked, collectors, strict=True):
            sampling = Sampling(max_tokens=steps, ignore_eos=True)
            engine.submit(EngineRequest(uuid.uuid4().hex, name, list(PROMPT), sampling, c))
        for c in collectors:
            assert c.done.wait(120) and isinstance(c.end, Finished), c.end
    want = {name: peft_greedy(name) for name in set(asked)}
    assert [c.tokens for c in collectors] == [want[name] for name in asked]
    assert len({tuple(t) for t in want.values()}) == len(want)  # each adapter answers differently


def _per_module_adapter(base, out, family: str, r: int, seed: int) -> None:
    """A peft adapter of the per-expert module layout transformers 4.x had (``mlp.experts.<e>.gate_proj``…;
    Mixtral's ``block_sparse_moe.experts.<e>.w1/w3/w2``), as users trained them: the model's fused experts
    replaced by modules of that layout, which peft's ``target_modules`` adapts (no forward needed). The
    model type is renamed meanwhile: on transformers 5 peft rewrites those names to ``target_parameters``
    of the fused experts, which this model no longer has."""
    from torch import nn
    from transformers import AutoModelForCausalLM

    names = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    shaped = AutoModelForCausalLM.from_pretrained(str(base))
    shaped.config.model_type = f"{family}_before_transformers_5"
    for layer in shaped.model.layers:
        e, two_i, h = layer.mlp.experts.gate_up_proj.shape
        experts = nn.ModuleList()
        for _ in range(e):
            m = nn.Module()
            for name, (i, o) in zip(names, ((h, two_i // 2), (h, two_i // 2), (two_i // 2, h)), strict=True):
                setattr(m, name, nn.Linear(i, o, bias=False))
            experts.append(m)
        if family == "mixtral":
            layer.block_sparse_moe = nn.Module()
            layer.block_sparse_moe.experts = experts
            del layer.mlp.experts
        else:
            layer.mlp.experts = experts
    make_adapter(shaped, out, r=r, alpha=16.0, targets=names, seed=seed, scale=0.1)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_per_expert_module_adapters_serve_as_peft_loads_them(served, tmp_path, family) -> None:
    """An adapter of the per-expert module layout (rank 4 on every expert's gate, up and down), beside a
    fused one and a base row: each row's logits are peft's own, loading that adapter onto transformers 5's
    fused model (peft converts it as we do: gate and up side by side at rank 8, B block-diagonal), within
    2e-4."""
    base, dirs, refs = served(family)
    _per_module_adapter(base, tmp_path / "per-module", family, 4, seed=7)
    want = _reference_logits(base, tmp_path / "per-module", SEQ)
    ck = load_checkpoint(str(base))
    w = _weights(ck.config, tmp_path / "per-module")
    assert w.target_modules == ("experts.gate_up_proj", "experts.down_proj") and w.rank == 8  # gate + up
    backend = get_backend(NATIVE_BACKEND)
    pools = _pools(ck.config, [dirs[0], tmp_path / "per-module"], backend, "float32")
    rows = np.array([1, -1, 0, 1], np.int32)
    got = _serve_mixed(ck, backend, pools, rows, backend.plan(rows, 2), SEQ, "float32")
    by_slot = {-1: refs[-1], 0: refs[0], 1: want}
    for row, slot in enumerate(rows):
        np.testing.assert_allclose(
            got[row], by_slot[int(slot)][len(PROMPT) - 1 : len(PROMPT) - 1 + got.shape[1]], atol=ATOL, rtol=0
        )
    assert np.abs(want - refs[-1]).max() > 0.5
