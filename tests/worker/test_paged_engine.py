"""The paged KV cache with the real JAX model: preemption under a tiny pool, the adapter-keyed prefix cache,
and contexts of thousands of tokens against transformers.

Scheduler-level accounting (which pages, when) is tested over the fake runner in ``test_scheduler.py``;
here the numbers come from the model: a preempted request recomputed from its cached pages must produce
exactly the tokens of an uninterrupted run, and a prompt served from cached pages exactly the tokens of a
run that computed every page.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from loraserve.engine.config import EngineConfig
from loraserve.engine.engine import Engine
from loraserve.engine.request import Finished
from loraserve.kernels.backends import XlaGroupedBackend
from loraserve.kernels.testing import count_compilations
from loraserve.models import decoder
from loraserve.models.checkpoint import load_checkpoint
from loraserve.models.lora import layout
from loraserve.models.step import PrefillBatch
from loraserve.testing import save_model
from tests.engines import local_source, started_engine
from tests.platform import NATIVE_BACKEND
from tests.worker.model_steps import ModelSteps
from tests.worker.test_engine import submit, wait

BASE = dict(max_batch_size=4, max_seq_len=64, max_loras=2, max_lora_rank=16, kv_page_size=4)
PROMPTS = [[5, 17, 33, 100, 7], [9, 9, 9], [200, 3, 44, 91, 12, 8, 71], [1, 2]]
ADAPTERS = ["all-r4", "", "mlp-r16", "all-r4"]


def _run(checkpoint, source, prompts, adapters, new: int, **config) -> tuple[list[list[int]], Engine]:
    """Serve every prompt at once (greedy, ignore_eos, ``new`` tokens); returns each one's tokens."""
    with started_engine(checkpoint, EngineConfig(**{**BASE, **config}), source=source) as engine:
        with count_compilations() as count:
            runs = [
                submit(engine, a, p, max_tokens=new, ignore_eos=True)
                for p, a in zip(prompts, adapters, strict=True)
            ]
            wait(*runs)
        assert count.compilations == 0, count.names  # page-table changes and preemptions compile nothing
        assert all(isinstance(r.end, Finished) for r in runs), [r.end for r in runs]
    return [r.tokens for r in runs], engine


@pytest.fixture(scope="module")
def checkpoint(llama_dir):
    return load_checkpoint(str(llama_dir))


@pytest.fixture(scope="module")
def source(adapter_dirs):
    return local_source(adapter_dirs)


def test_preempted_requests_finish_with_the_tokens_of_an_uninterrupted_run(checkpoint, source) -> None:
    # four requests of 40 new tokens need 11-12 pages of 4 tokens each; a pool of 19 usable pages holds
    # fewer than two of them at full length, so the newest running ones are preempted and recomputed
    alone, roomy = _run(checkpoint, source, PROMPTS, ADAPTERS, 40)  # the default pool: 4 full contexts
    assert roomy.snapshot().preemptions == 0
    tokens, engine = _run(checkpoint, source, PROMPTS, ADAPTERS, 40, kv_pages=20)
    snap = engine.snapshot()
    assert snap.preemptions >= 2, snap.preemptions
    assert tokens == alone  # nothing repeated, nothing lost, greedy text unchanged
    assert all(len(t) == 40 for t in tokens)
    assert snap.kv_pages_used == 0 and snap.kv_pages_total == 19


def test_prefix_cache_hits_give_the_tokens_of_a_full_recompute_and_never_cross_adapters(
    checkpoint, source
) -> None:
    shared = list(range(40, 80))  # 40 tokens = 10 full pages of 4
    prompts = [[*shared, t] for t in (3, 4, 5, 6)] + [[*shared, 3]] * 2
    adapters = ["all-r4"] * 4 + ["", "mlp-r16"]  # the same tokens under the base and another adapter
    cold, off = _run(checkpoint, source, prompts, adapters, 6, enable_prefix_caching=False)
    assert off.snapshot().prefix_hit_tokens == 0
    # one at a time, so that every later request can find the first one's pages
    with started_engine(checkpoint, EngineConfig(**BASE), source=source) as engine:
        warm = []
        for p, a in zip(prompts, adapters, strict=True):
            run = submit(engine, a, p, max_tokens=6, ignore_eos=True)
            wait(run)
            warm.append(run.tokens)
        snap = engine.snapshot()
    assert warm == cold
    # the three later all-r4 requests each reuse the 10 shared pages; the base and mlp-r16 requests
    # reuse nothing (their keys and values differ from all-r4's)
    assert snap.prefix_hit_tokens == 3 * 40
    assert snap.prefix_query_tokens == sum(len(p) for p in prompts)


LONG = 3000


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    return save_model(
        tmp_path_factory.mktemp("long") / "llama", "llama", seed=5, max_position_embeddings=4096
    )


def test_thousands_of_tokens_match_transformers_through_chunks_and_scattered_pages(long_model) -> None:
    """A 3000-token prompt prefilled in two chunks (the second reading the first from its pages, as a
    prefix-cache hit does) into pages scattered over the pool, then 4 teacher-forced decode steps: the
    logits match transformers within 2e-4 (f32) at every step."""
    from transformers import AutoModelForCausalLM

    rng = np.random.default_rng(3)
    seq = rng.integers(3, 384, LONG + 4).tolist()
    hf = AutoModelForCausalLM.from_pretrained(str(long_model)).eval()
    with torch.no_grad():
        want = hf(torch.tensor([seq])).logits[0].numpy()
    ck = load_checkpoint(str(long_model))
    cfg, page, per_row = ck.config, 64, 4096 // 64
    backend = XlaGroupedBackend()
    cache = decoder.init_cache(cfg, 2 * per_row + 1, page, jnp.float32)
    steps = ModelSteps(cfg, backend, ck.params, layout.empty_lora(cfg, 1, 4, jnp.float32, backend), cache)
    table = (1 + rng.permutation(2 * per_row)[:per_row]).astype(np.int32)  # half the pool, shuffled
    got = []
    for start, stop, bucket in ((0, 2048, 2048), (2048, LONG, 1024)):
        tokens = np.zeros(bucket, np.int32)
        tokens[: stop - start] = seq[start:stop]
        got.append((stop - 1, np.asarray(steps.prefill_one(tokens, stop - start, start, -1, table))))
    for pos in range(LONG, LONG + 4):
        logits = steps.decode(np.array([seq[pos]], np.int32), np.array([pos], np.int32), table[None])
        got.append((pos, np.asarray(logits)[0]))
    for pos, logits in got:
        np.testing.assert_allclose(logits, want[pos], atol=2e-4, err_msg=f"position {pos}")


@pytest.mark.parametrize("backend", [NATIVE_BACKEND, "xla-grouped"])
def test_packed_prefill_of_mixed_adapters_matches_one_prompt_per_call(
    checkpoint, adapter_dirs, backend
) -> None:
    """Three prompts of different lengths under two adapters and the base, prefilled in one packed call,
    give each prompt's last-token logits of a one-prompt prefill (within 1e-5, f32) and the same greedy
    first tokens; nothing compiles after warm-up."""
    from loraserve.adapters.files import read_adapter_files
    from loraserve.adapters.peft import parse_adapter
    from loraserve.engine.jax_runner import JaxRunner
    from loraserve.engine.request import SamplingRow
    from loraserve.engine.runner import PrefillInput

    # max_seq_len 16 (the prompts have 2-7 tokens): warm-up compiles the 16-token bucket at 1, 2 and 4 prompts,
    # not also the 32- and 64-token ones no call here uses
    config = EngineConfig(**{**BASE, "max_seq_len": 16, "prefill_per_step": 4, "kernel_backend": backend})
    runner = JaxRunner(checkpoint, config)
    runner.warmup()
    cfg = checkpoint.config
    for slot, name in enumerate(("all-r4", "mlp-r16")):
        files = read_adapter_files(str(adapter_dirs[name]))
        weights = parse_adapter(
            *files, module_shapes=cfg.module_shapes(), num_layers=cfg.num_layers, max_rank=16
        )
        runner.write_slot(slot, runner.prepare(weights))
    tables = decoder.contiguous_page_tables(4, config.pages_per_row)
    items = [
        PrefillInput(p, 0, s, tables[i], SamplingRow())
        for i, (p, s) in enumerate(zip(PROMPTS[:3], (0, -1, 1), strict=True))
    ]
    with count_compilations() as count:
        packed = runner.prefill(items).tokens.tolist()
        alone = [int(runner.prefill([item]).tokens[0]) for item in items]
    assert count.compilations == 0, count.names
    assert packed == alone
    # the logits themselves, through the model functions the runner jits
    g, t = 4, 16
    tokens = np.zeros((g, t), np.int32)
    for i, p in enumerate(PROMPTS[:3]):
        tokens[i, : len(p)] = p
    lengths = np.array([len(p) for p in PROMPTS[:3]] + [0], np.int32)
    slots = np.array([0, -1, 1, -1], np.int32)
    zeros = np.zeros(g, np.int32)
    steps = ModelSteps(runner.model_config, runner.backend, runner.params, runner.pools, runner.cache)
    many = steps.prefill(PrefillBatch(tokens, lengths, zeros, slots, tables, np.int32(1)))
    for i in range(3):
        want = steps.prefill_one(tokens[i], lengths[i], 0, slots[i], tables[i])
        np.testing.assert_allclose(np.asarray(many[i]), np.asarray(want), atol=1e-5)


def test_chunked_prefill_gives_the_tokens_of_whole_prompts_and_compiles_nothing(checkpoint, source) -> None:
    # prompts of 5-30 tokens in chunks of 4 (one shared budget a step) under three adapters and the base:
    # every chunk attends over the pages of the chunks before it, and the greedy text is unchanged
    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate((30, 5, 17, 11))]
    whole, _ = _run(checkpoint, source, prompts, ADAPTERS, 12)
    chunked, engine = _run(checkpoint, source, prompts, ADAPTERS, 12, prefill_chunk=4)
    assert chunked == whole and all(len(t) == 12 for t in chunked)
    assert engine.snapshot().kv_pages_used == 0
