"""embed_tokens and lm_head as LoRA targets (#16 item 3), served per row's slot in ONE batch with plain and
DoRA adapters and base rows, against PEFT.

Real PEFT adapters made on the tiny random models: embed_tokens + lm_head + q/v, embed_tokens + down_proj,
lm_head alone (rsLoRA, rank 2), a plain adapter and a DoRA one. Their logits (a prefill and STEPS
teacher-forced decode steps) are PEFT's within ATOL (f32) with the same greedy tokens through the
reference, cpu and xla-grouped backends on Llama, on tied-embedding Qwen2 (PEFT's lm_head LoRA adapts the
output projection only, its embed_tokens LoRA the input embedding only, as here) and on Gemma 2 / 3
(embedding scale, final soft-cap); the stored pools hold PEFT's matrices; the packed prefill; the whole
engine; nothing compiles after warm-up; malformed adapters are refused; N = 2 tensor parallelism serves
what N = 1 serves.
"""

from __future__ import annotations

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from loraserve.adapters.errors import AdapterError
from loraserve.adapters.files import read_adapter_files
from loraserve.adapters.peft import parse_adapter
from loraserve.kernels import get_backend
from loraserve.kernels.testing import count_compilations
from loraserve.models import decoder
from loraserve.models.checkpoint import load_checkpoint
from loraserve.models.lora.pools import SlotPools, base_weights, slot_arrays
from loraserve.models.step import PrefillBatch
from loraserve.testing import make_adapter
from tests.conftest import DORA_ADAPTERS, _adapters_per_family
from tests.platform import NATIVE_BACKEND, SUBPROCESS_JAX, backends
from tests.worker.model_steps import ModelSteps
from tests.worker.test_dora_worker import _edit, _first
from tests.worker.test_lora_parity import PROMPT, STEPS, _reference_logits, _serve_mixed

ATOL = 2e-4
RANK = 16
EMBED_ADAPTERS = {
    "embed-head-qv": dict(r=4, alpha=8.0, targets=("q_proj", "v_proj", "embed_tokens", "lm_head"), seed=21),
    "embed-down": dict(r=8, alpha=16.0, targets=("embed_tokens", "down_proj"), seed=22),
    "head-rslora": dict(r=2, alpha=8.0, use_rslora=True, targets=("lm_head",), seed=23),
    "plain-r4": DORA_ADAPTERS["plain-r4"],
    "dora-all-r4": DORA_ADAPTERS["dora-all-r4"],
}
NAMES = list(EMBED_ADAPTERS)
# every slot, the embed+lm_head slot on two rows, a base row
ROW_SLOTS = np.array([0, 1, -1, 2, 3, 4, 0], np.int32)


@pytest.fixture(scope="module")
def embed_dirs(model_dirs, tmp_path_factory):
    """``family -> {name -> folder}`` of EMBED_ADAPTERS made on that family's base, built on first use."""
    return _adapters_per_family(model_dirs, tmp_path_factory, "embed", EMBED_ADAPTERS)


def _weights(cfg, path):
    return parse_adapter(
        *read_adapter_files(str(path)),
        module_shapes=cfg.adapter_shapes(),
        num_layers=cfg.num_layers,
        max_rank=RANK,
    )


def _pools(ck, dirs, backend) -> SlotPools:
    cfg = ck.config
    pools = SlotPools(cfg, len(dirs), RANK, jnp.dtype(jnp.float32), backend, base=base_weights(ck.params))
    for slot, path in enumerate(dirs):
        pools.write(slot, slot_arrays(cfg, _weights(cfg, path), RANK))
    return pools


def _check_against_peft(model_dir, dirs, backend_name: str) -> float:
    ck = load_checkpoint(str(model_dir))
    backend = get_backend(backend_name)
    pools = _pools(ck, [dirs[n] for n in NAMES], backend)
    rng = np.random.default_rng(5)
    seq = PROMPT + rng.integers(3, ck.config.vocab_size, STEPS).tolist()
    want = {
        s: _reference_logits(model_dir, None if s < 0 else dirs[NAMES[s]], seq)[len(PROMPT) - 1 :]
        for s in set(ROW_SLOTS.tolist())
    }
    got = _serve_mixed(ck, backend, pools, ROW_SLOTS, backend.plan(ROW_SLOTS, len(NAMES)), seq, "float32")
    worst = 0.0
    for row, slot in enumerate(ROW_SLOTS):
        err = np.abs(got[row] - want[slot]).max(axis=-1)
        assert err.max() <= ATOL, f"row {row} (slot {slot}): max |diff| per step {err.tolist()}"
        np.testing.assert_array_equal(got[row].argmax(-1), want[slot].argmax(-1), err_msg=f"row {row}")
        worst = max(worst, float(err.max()))
    for slot in range(len(NAMES)):  # every adapter moves PEFT's logits far more than our deviation
        assert np.abs(want[slot] - want[-1]).max() > max(0.1, 100 * worst), slot
    return worst


# measured max |diff| (f32): llama 1.5e-6 reference, 1.7e-6 cpu, 1.7e-6 xla-grouped; with cpu 1.3e-6 qwen2
# (tied), 1.8e-6 gemma2, 2.4e-6 gemma3
@pytest.mark.parametrize("backend", backends("reference", "cpu", "xla-grouped"))
def test_embed_and_lm_head_lora_mixed_batch_match_peft(model_dirs, embed_dirs, backend: str) -> None:
    assert _check_against_peft(model_dirs["llama"], embed_dirs("llama"), backend) <= ATOL


# Qwen2 ties lm_head to embed_tokens (PEFT warns, ensure_weight_tying off: each LoRA adapts its own side);
# Gemma scales the embedding (PEFT scales the LoRA output alike) and soft-caps the logits after lm_head
@pytest.mark.parametrize("family", ["qwen2", "gemma2", "gemma3_text"])
def test_embed_and_lm_head_lora_on_tied_and_gemma_families_match_peft(
    model_dirs, embed_dirs, family: str
) -> None:
    assert _check_against_peft(model_dirs[family], embed_dirs(family), NATIVE_BACKEND) <= ATOL


def test_stored_pools_are_peft_s_matrices(model_dirs, embed_dirs) -> None:
    """``A_embed[s] [:, :r]`` is ``lora_embedding_A.T``, ``B_embed[s][:r]`` is ``lora_embedding_B.T · s``;
    ``A_lm_head`` / ``B_lm_head`` the lm_head's ``lora_A.T`` / ``lora_B.T · s``; zero-padded to R; zeros
    for slots without them."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ck = load_checkpoint(str(model_dirs["llama"]))
    dirs = embed_dirs("llama")
    pools = _pools(ck, [dirs[n] for n in NAMES], get_backend(NATIVE_BACKEND))
    for slot, name in enumerate(NAMES):
        base = AutoModelForCausalLM.from_pretrained(str(model_dirs["llama"]))
        peft = PeftModel.from_pretrained(base, str(dirs[name])).eval()
        stored = pools.read(slot)[0]
        emb, head = peft.base_model.model.model.embed_tokens, peft.base_model.model.lm_head
        want = {
            k: np.zeros(v.shape, np.float32) for k, v in stored.items() if k.endswith(("embed", "lm_head"))
        }
        if hasattr(emb, "lora_embedding_A") and "default" in emb.lora_embedding_A:
            a, b = emb.lora_embedding_A["default"].detach().numpy(), emb.lora_embedding_B["default"].detach()
            want["A_embed"][:, : a.shape[0]] = a.T
            want["B_embed"][: a.shape[0]] = b.numpy().T * emb.scaling["default"]
        if hasattr(head, "lora_A") and "default" in head.lora_A:
            a, b = head.lora_A["default"].weight.detach().numpy(), head.lora_B["default"].weight.detach()
            want["A_lm_head"][:, : a.shape[0]] = a.T
            want["B_lm_head"][: a.shape[0]] = b.numpy().T * head.scaling["default"]
        assert set(want) == {"A_embed", "B_embed", "A_lm_head", "B_lm_head"}
        for k, v in want.items():
            np.testing.assert_allclose(stored[k], v, rtol=1e-6, atol=0, err_msg=f"{name} {k}")
        assert not set(pools.read(slot)[1]) & set(want)


@pytest.mark.parametrize("backend", [NATIVE_BACKEND, "xla-grouped"])
def test_packed_prefill_of_embed_and_lm_head_prompts_matches_peft(
    model_dirs, embed_dirs, backend: str
) -> None:
    """Prompts of different lengths on each adapter and none, packed into one prefill of G segments: each
    segment's last-token logits are PEFT's (the embedding delta gathered per token of its own segment)."""
    model_dir, dirs = model_dirs["llama"], embed_dirs("llama")
    ck = load_checkpoint(str(model_dir))
    cfg, lora = ck.config, get_backend(backend)
    pools = _pools(ck, [dirs[n] for n in NAMES], lora)
    prompts = [
        [5, 17, 33, 100, 7, 9],
        [3, 4],
        [250, 11, 12, 13, 14, 15, 16, 2, 8],
        [60, 61, 62],
        [8, 8, 1],
        [9],
    ]
    seg_slots = np.array([0, 1, -1, 2, 3, 4], np.int32)
    g, t = len(prompts), 16
    tokens = np.zeros((g, t), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    lengths = np.array([len(p) for p in prompts], np.int32)
    steps = ModelSteps(cfg, lora, ck.params, pools, decoder.init_cache(cfg, g + 1, 16, jnp.float32))
    tables, zeros = decoder.contiguous_page_tables(g, 1), np.zeros(g, np.int32)
    logits = steps.prefill(PrefillBatch(tokens, lengths, zeros, seg_slots, tables, np.int32(1)))
    for i, (p, slot) in enumerate(zip(prompts, seg_slots, strict=True)):
        want = _reference_logits(model_dir, None if slot < 0 else dirs[NAMES[slot]], p)[-1]
        np.testing.assert_allclose(
            np.asarray(logits[i]), want, atol=ATOL, err_msg=f"segment {i} (slot {slot})"
        )


@pytest.mark.parametrize("backend", [NATIVE_BACKEND, "xla-grouped"])
def test_loading_and_serving_embed_lora_compiles_nothing_after_warmup(
    model_dirs, embed_dirs, backend: str
) -> None:
    ck = load_checkpoint(str(model_dirs["llama"]))
    cfg, lora = ck.config, get_backend(backend)
    dirs = embed_dirs("llama")
    values = [slot_arrays(cfg, _weights(cfg, dirs[n]), RANK) for n in NAMES]
    rows, slots = 4, 3
    pools = SlotPools(cfg, slots, RANK, jnp.dtype(jnp.float32), lora, base=base_weights(ck.params))
    tables = decoder.contiguous_page_tables(rows, 2)
    steps = ModelSteps(cfg, lora, ck.params, pools, decoder.init_cache(cfg, rows * 2 + 1, 16, jnp.float32))
    tokens = np.zeros(16, np.int32)
    tokens[: len(PROMPT)] = PROMPT
    n, same, nines = len(PROMPT), np.full(rows, len(PROMPT), np.int32), np.full(rows, 9, np.int32)
    pools.zero(0)  # warm-up, as the runner does it
    steps.prefill_one(tokens, n, 0, 0, tables[0])
    for plan in lora.warmup_plans(rows, slots):
        steps.decode(nines, same, tables, plan)
    jax.block_until_ready(steps.cache)
    with count_compilations() as count:
        for i, v in enumerate(values * 2):  # embed/lm_head, plain and DoRA adapters swapped through 3 slots
            pools.write(i % slots, v)
        for row, slot in enumerate([0, 1, 2, -1]):
            steps.prefill_one(tokens, n, 0, slot, tables[row])
        for mix in ([0, 1, 2, -1], [0, 0, 0, 0], [2, -1, 1, 1]):
            out = steps.decode(nines, same, tables, lora.plan(np.array(mix, np.int32), slots))
        jax.block_until_ready(out)
    assert count.compilations == 0, count.names
    # the last writes left head-rslora, plain-r4 and dora-all-r4 in slots 1, 2, 0 (values * 2 over 3 slots)
    assert np.abs(np.asarray(pools.pools.vocab["B_lm_head"][1])).max() > 0
    assert not np.asarray(pools.pools.vocab["A_embed"]).any()


def _replace(needle: str, shape_fn):
    def fn(t: dict) -> None:
        k = _first(t, needle)
        t[k] = np.zeros(shape_fn(t[k].shape), np.float32)

    return fn


# (adapter, config changes, tensor edit, message, status): refused before anything is stored, at the worker
# and at the registry alike (one parser)
INVALID, MISMATCH = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
REFUSED = [
    # another vocabulary / hidden size: built for another base model (as for the projections' shapes)
    ("embed-down", None, _replace("lora_embedding_A", lambda s: (s[0], s[1] + 8)), "expect in=384", MISMATCH),
    (
        "embed-down",
        None,
        _replace("lora_embedding_B", lambda s: (s[0] * 2, s[1])),
        "expect in=384, out=64",
        MISMATCH,
    ),
    ("head-rslora", None, _replace("lm_head.lora_B", lambda s: (s[0] - 1, s[1])), "out=384", MISMATCH),
    ("head-rslora", None, _replace("lm_head.lora_A", lambda s: (s[0], s[1] + 1)), "expect in=64", MISMATCH),
    (
        "embed-down",
        None,
        _replace("embed_tokens.base_layer", lambda s: (s[0] + 16, s[1])),
        "resized",
        MISMATCH,
    ),
    (
        "embed-down",
        None,
        _replace("lora_embedding_A", lambda s: (s[0] + 1, s[1])),
        "do not match rank",
        INVALID,
    ),
    ("embed-down", None, lambda t: t.pop(_first(t, "lora_embedding_B")), "lora_B is missing", INVALID),
    ("embed-head-qv", {"use_dora": True}, None, "DoRA on embed_tokens/lm_head is not supported", INVALID),
    (
        "embed-head-qv",
        {"lora_bias": True},
        None,
        "LoRA bias on embed_tokens/lm_head is not supported",
        INVALID,
    ),
    ("embed-head-qv", {"ensure_weight_tying": True}, None, "ensure_weight_tying", INVALID),
    (
        "head-rslora",
        None,
        lambda t: t.update({"base_model.model.lm_head.lora_B.bias": np.zeros(384, np.float32)}),
        "LoRA bias on lm_head is not supported",
        INVALID,
    ),
    # PEFT's modules_to_save=["lm_head"] is a full copy, not LoRA: still refused
    ("head-rslora", {"modules_to_save": ["lm_head"]}, None, "modules_to_save", INVALID),
]


@pytest.mark.parametrize(("name", "config", "edit", "needle", "code"), REFUSED)
def test_malformed_embed_and_lm_head_adapters_are_refused(
    model_dirs, embed_dirs, name, config, edit, needle, code
) -> None:
    cfg = load_checkpoint(str(model_dirs["llama"])).config
    config_bytes, weights = _edit(embed_dirs("llama")[name], config, edit)
    with pytest.raises(AdapterError, match=needle) as info:
        parse_adapter(config_bytes, weights, module_shapes=cfg.adapter_shapes(), num_layers=cfg.num_layers)
    assert info.value.code == code
    weights = _weights(cfg, embed_dirs("llama")[name])  # the untouched adapter parses, with its targets
    assert set(weights.vocab) == {
        m for m in ("embed_tokens", "lm_head") if m in EMBED_ADAPTERS[name]["targets"]
    }
    assert set(weights.vocab) <= set(weights.target_modules)


def test_a_model_without_vocab_shapes_refuses_them(model_dirs, embed_dirs) -> None:
    """A base model known only by its projections (e.g. registered by an older worker) cannot validate an
    embed_tokens LoRA: refused as a module the model does not report."""
    cfg = load_checkpoint(str(model_dirs["llama"])).config
    with pytest.raises(AdapterError, match="does not report an adaptable embed_tokens"):
        parse_adapter(
            *read_adapter_files(str(embed_dirs("llama")["embed-down"])), module_shapes=cfg.module_shapes()
        )


def test_engine_serves_embed_and_lm_head_lora_with_peft_s_greedy_tokens(model_dirs, embed_dirs) -> None:
    """The whole worker path (residency: fetch, validate against the model's vocab, prepare; slot writes;
    packed prefill; decode): embed/lm_head, plain and DoRA adapters and the base model, concurrently,
    through 2 slots (so loads evict and reload), give PEFT's greedy tokens; nothing compiles after start."""
    import uuid

    from loraserve.engine.config import EngineConfig
    from loraserve.engine.request import EngineRequest, Sampling
    from tests.engines import started_engine
    from tests.worker.fake_engine import Collector
    from tests.worker.test_dora_worker import _peft_greedy

    model_dir, dirs = model_dirs["qwen2"], embed_dirs("qwen2")  # tied embeddings
    # max_seq_len 16: 5-token prompts + 8 new fit, and the warm-up skips the 32/64-token prefill buckets
    config = EngineConfig(max_batch_size=4, max_seq_len=16, max_loras=2, max_lora_rank=RANK, max_cpu_loras=1)
    prompts = {name: [5, 17, 33 + i, 100, 7] for i, name in enumerate(["", *NAMES])}
    with started_engine(model_dir, config, dirs) as engine:
        with count_compilations() as count:
            collectors = {}
            for round_ in range(2):  # the second round reloads what the first evicted
                for name, prompt in prompts.items():
                    c = Collector()
                    req = EngineRequest(
                        uuid.uuid4().hex, name, prompt, Sampling(max_tokens=8, ignore_eos=True), c
                    )
                    engine.submit(req)
                    collectors[name, round_] = c
            for c in collectors.values():
                assert c.done.wait(120), "request did not finish"
        assert count.compilations == 0, count.names
    for (name, _), c in collectors.items():
        want = _peft_greedy(model_dir, dirs[name] if name else None, prompts[name], 8)
        assert c.tokens == want, name


@pytest.mark.cpu_only(SUBPROCESS_JAX)
def test_tensor_parallel_embed_and_lm_head_lora_matches_one_device(model_dirs, tmp_path_factory) -> None:
    """N = 2 (A_embed and B_lm_head split by vocab) serves the embed/lm_head, plain and DoRA adapters with
    N = 1's logits and greedy tokens; 100 slot swaps of them after warm-up compile nothing."""
    from transformers import AutoModelForCausalLM

    from loraserve.testing import save_model
    from tests.worker.test_tensor_parallel import ATOL as TP_ATOL
    from tests.worker.test_tensor_parallel import TP_MODEL, run_child

    root = tmp_path_factory.mktemp("tp-embed")
    model = save_model(root / "qwen2", "qwen2", seed=7, **TP_MODEL)
    adapters = []
    for name, kw in EMBED_ADAPTERS.items():
        make_adapter(AutoModelForCausalLM.from_pretrained(str(model)), root / name, **kw)
        adapters.append(str(root / name))
    out = run_child(
        "--model", str(model), "--adapters", ",".join(adapters), "--backend", "cpu",
        "--sizes", "1,2", "--steps", "4", "--swaps", "100",
    )  # fmt: skip
    ref = np.array(out["1"]["logits"])
    moved = np.abs(ref[0] - np.array(out["1"]["base_logits"])).max(axis=-1)
    assert moved[4] < 1e-5 and (moved[[0, 1, 2, 3, 5]] > 0.1).all(), moved
    got = out["2"]
    assert got["tokens"] == out["1"]["tokens"]
    np.testing.assert_allclose(np.array(got["logits"]), ref, atol=TP_ATOL, rtol=0)
    assert out["1"]["compilations"] == got["compilations"] == 0, (out["1"]["compiled"], got["compiled"])
    assert got["abstract_matches"] == {"params": True, "cache": True, "pools": True}
    assert got["shardings"]["pools"]["A_embed"] == "(None, 'model', None)"
    assert got["shardings"]["pools"]["B_lm_head"] == "(None, None, 'model')"


def test_rows_without_embed_or_lm_head_lora_are_bit_exact(model_dirs, embed_dirs) -> None:
    """Base rows and rows of slots without these targets give the same bits whether or not other slots hold
    embed_tokens / lm_head LoRA (the same batch, the same programs; only the vocab pools' contents differ)."""
    ck = load_checkpoint(str(model_dirs["llama"]))
    backend = get_backend(NATIVE_BACKEND)
    dirs = embed_dirs("llama")
    pools = _pools(ck, [dirs[n] for n in NAMES], backend)
    seq = PROMPT + list(range(10, 10 + STEPS))
    plan = backend.plan(ROW_SLOTS, len(NAMES))
    with_vocab = _serve_mixed(ck, backend, pools, ROW_SLOTS, plan, seq, "float32")
    for name in ("A_embed", "B_embed", "A_lm_head", "B_lm_head"):
        pools.pools.vocab[name] = jnp.zeros_like(pools.pools.vocab[name])
    without = _serve_mixed(ck, backend, pools, ROW_SLOTS, plan, seq, "float32")
    for row, slot in enumerate(ROW_SLOTS):
        name = NAMES[slot] if slot >= 0 else "base"
        if slot < 0 or not {"embed_tokens", "lm_head"} & set(EMBED_ADAPTERS[name].get("targets", ())):
            np.testing.assert_array_equal(with_vocab[row], without[row], err_msg=f"row {row} ({name})")
        else:
            assert np.abs(with_vocab[row] - without[row]).max() > 0.1, name
