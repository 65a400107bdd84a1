"""Speculative decoding's parts (docs/speculative.md): the n-gram drafter (``engine.speculative``), the verify
rule (``models.speculative``) and the model's verify forward (``models.decoder.verify_logits``).

* The drafter proposes what followed the latest earlier occurrence of the row's longest repeated suffix, at
  most k tokens, nothing without a match, and looks no further back than its window.
* Greedy rows keep exactly the drafts equal to the target's argmax, then the argmax after them.
* Sampled rows: each emitted token is distributed as the target's (a chi-square test over 40 000 seeded rows at
  a 1e-4 significance level: the seeds are fixed, so the test is deterministic, and a wrong rule fails it by
  far), whatever the draft; a draft the target gives probability 1 is always kept.
* The verify forward of a row's last token and drafts, continuing its cached context with its adapter, gives
  the logits sequential decode steps give at those positions (f32, 2e-5: the prefill and decode paths add
  in different orders), and drafts equal to the greedy continuation are all kept.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from loraserve.engine.speculative import NgramDrafter
from loraserve.models import decoder
from loraserve.models.speculative import verify
from loraserve.models.step import DecodeBatch, PrefillBatch


def test_the_drafter_copies_what_followed_the_latest_match() -> None:
    drafter = NgramDrafter(max_ngram=3)
    #          0  1  2  3  4  5  6  7  8  9  10 11 12
    tokens = [5, 6, 7, 8, 9, 1, 6, 7, 2, 3, 5, 6, 7]
    # suffix [5, 6, 7] occurs at 0: 8, 9, 1 followed it
    assert drafter.propose(tokens, 3).tolist() == [8, 9, 1]
    assert drafter.propose(tokens, 10).tolist() == [8, 9, 1, 6, 7, 2, 3, 5, 6, 7]  # never past the end
    assert drafter.propose(tokens, 0).tolist() == []
    # only [6, 7] repeats (twice): the latest earlier occurrence, at 6, wins
    assert drafter.propose([1, 6, 7, 4, 2, 6, 7, 9, 3, 6, 7], 2).tolist() == [9, 3]
    assert drafter.propose([1, 2, 3, 4], 4).tolist() == []  # nothing repeats
    assert (
        NgramDrafter(max_ngram=2, min_ngram=2).propose([4, 1, 2, 4], 2).tolist() == []
    )  # one token is too short
    assert NgramDrafter(max_ngram=2, min_ngram=1).propose([4, 1, 2, 4], 2).tolist() == [1, 2]


def test_the_drafter_searches_a_bounded_window() -> None:
    """A tenant's 100k-token prompt costs the same as the window's tokens: matches before it are not seen."""
    drafter = NgramDrafter(max_ngram=2, window=64)
    tokens = [7, 8, 9] + [1] * 10 + list(range(100, 200)) + [7, 8]
    assert drafter.propose(tokens, 2).tolist() == []
    assert NgramDrafter(max_ngram=2, window=4096).propose(tokens, 2).tolist() == [9, 1]
    with pytest.raises(ValueError):
        NgramDrafter(max_ngram=1, min_ngram=2)


def _params(g: int, temperature: float = 0.0) -> dict:
    return dict(
        temperature=jnp.full(g, temperature, jnp.float32),
        top_k=jnp.zeros(g, jnp.int32),
        top_p=jnp.ones(g, jnp.float32),
        seed_lo=jnp.arange(g, dtype=jnp.uint32),
        seed_hi=jnp.full(g, 7, jnp.uint32),
        step=jnp.zeros(g, jnp.int32),
    )


def test_greedy_rows_keep_the_drafts_the_target_agrees_with() -> None:
    vocab = 10
    target = np.array([[3, 4, 5, 6], [3, 4, 5, 6], [3, 4, 5, 6], [1, 2, 3, 4]])  # argmax at each position
    logits = jax.nn.one_hot(target, vocab) * 5.0
    drafts = jnp.array([[3, 4, 5], [3, 9, 5], [8, 4, 5], [1, 2, 3]], jnp.int32)
    lens = jnp.array([3, 3, 3, 1], jnp.int32)  # the last row proposed one token only
    out = verify(logits, drafts, lens, **_params(4))
    assert out.accepted.tolist() == [3, 1, 0, 1]
    emitted = [row[: n + 1] for row, n in zip(out.tokens.tolist(), out.accepted.tolist(), strict=True)]
    assert emitted == [[3, 4, 5, 6], [3, 4], [3], [1, 2]]


def test_sampled_rows_emit_the_targets_distribution() -> None:
    """Two positions with different target distributions and a draft at each: the first emitted token
    follows p_0; where it is the draft, the second follows p_1 (the target at position 1 saw the draft)."""
    p0 = np.array([0.05, 0.4, 0.1, 0.25, 0.2])
    p1 = np.array([0.3, 0.1, 0.05, 0.05, 0.5])
    g = 40_000
    logits = jnp.broadcast_to(jnp.log(jnp.array(np.stack([p0, p1, p1]), jnp.float32)), (g, 3, 5))
    for draft in ([1, 4], [0, 2]):  # a likely and an unlikely draft
        drafts = jnp.broadcast_to(jnp.array(draft, jnp.int32), (g, 2))
        out = jax.jit(verify)(logits, drafts, jnp.full(g, 2, jnp.int32), **_params(g, 1.0))
        tokens, accepted = np.asarray(out.tokens), np.asarray(out.accepted)
        first = np.bincount(tokens[:, 0], minlength=5)
        assert stats.chisquare(first, p0 * g).pvalue > 1e-4, (draft, first / g)
        kept = accepted >= 1
        assert (tokens[kept, 0] == draft[0]).all() and (tokens[~kept, 0] != draft[0]).all()
        second = np.bincount(tokens[kept, 1], minlength=5)
        assert stats.chisquare(second, p1 * kept.sum()).pvalue > 1e-4, (draft, second / kept.sum())
    # a draft with all the target's mass is kept by every row
    sure = jnp.broadcast_to(jnp.where(jnp.arange(5) == 2, 0.0, -jnp.inf), (64, 3, 5))
    out = verify(sure, jnp.full((64, 2), 2, jnp.int32), jnp.full(64, 2, jnp.int32), **_params(64, 0.7))
    assert out.accepted.tolist() == [2] * 64 and (np.asarray(out.tokens) == 2).all()


def test_the_verify_forward_gives_the_decode_steps_logits(llama_dir, adapter_dirs) -> None:
    from loraserve.adapters.files import read_adapter_files
    from loraserve.adapters.peft import parse_adapter
    from loraserve.engine.config import EngineConfig
    from loraserve.engine.jax_runner import JaxRunner
    from loraserve.models.checkpoint import load_checkpoint

    ck = load_checkpoint(str(llama_dir))
    config = EngineConfig(
        max_batch_size=2, max_seq_len=64, max_loras=2, max_lora_rank=8, kernel_backend="xla-grouped"
    )
    runner = JaxRunner(ck, config)
    cfg = ck.config
    weights = parse_adapter(
        *read_adapter_files(str(adapter_dirs["all-r4"])),
        module_shapes=cfg.module_shapes(),
        num_layers=cfg.num_layers,
        max_rank=8,
    )
    runner.write_slot(1, runner.prepare(weights))
    backend, page = runner.backend, runner.page_size
    table = np.zeros(config.pages_per_row, np.int32)
    table[:] = np.arange(1, table.size + 1)  # a row's pages: 1, 2, ...
    blocks = decoder.whole_row_key_blocks(page, config.pages_per_row)
    prompt = [5, 17, 33, 100, 7, 9]
    prefill = jax.jit(partial(decoder.prefill_packed, cfg, backend))
    step = jax.jit(partial(decoder.decode, cfg, backend))
    check = jax.jit(partial(decoder.verify_logits, cfg, backend))
    state = runner.state()
    last, cache = prefill(state, PrefillBatch.single(prompt, len(prompt), 0, 1, table, blocks))
    after_prompt = cache
    tokens, want = [int(jnp.argmax(last[0]))], []
    plan = backend.plan(np.array([1, -1]), config.max_loras)
    for i in range(4):  # sequential decode: the greedy continuation and the logits at each position
        batch = DecodeBatch(
            np.array([tokens[-1], 0], np.int32),
            np.array([len(prompt) + i, 0], np.int32),
            np.stack([table, np.zeros_like(table)]),
            plan,
        )
        logits, cache = step(dataclass_replace(state, cache=cache), batch)
        want.append(np.asarray(logits[0]))
        tokens.append(int(np.argmax(logits[0])))
    # one verify of the first token and the next three as drafts, from the cache after the prompt
    batch = PrefillBatch.single(tokens[:4], 4, len(prompt), 1, table, blocks)
    got, _ = check(dataclass_replace(state, cache=after_prompt), batch)
    np.testing.assert_allclose(np.asarray(got[0]), np.stack(want), rtol=0, atol=2e-5)
    out = verify(got, jnp.array([tokens[1:4]], jnp.int32), jnp.array([3], jnp.int32), **_params(1))
    assert out.accepted.tolist() == [3] and out.tokens[0].tolist() == tokens[1:5]


def dataclass_replace(state, **changes):
    import dataclasses

    return dataclasses.replace(state, **changes)


COPY_PROMPT = [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 40, 41, 42, 43]  # a text that repeats itself


@pytest.mark.parametrize("adapter", [None, "all-r4"])
def test_the_engine_speculates_and_serves_the_same_greedy_tokens(llama_dir, adapter_dirs, adapter) -> None:
    """An engine with --speculative ngram gives each request the tokens an engine without gives (greedy), with
    verify steps that keep drafts and no compilation after warm-up; a sampled request beside it gets its
    tokens too (no controls)."""
    from loraserve.engine.config import EngineConfig
    from loraserve.engine.request import EngineRequest, Sampling
    from loraserve.kernels.testing import count_compilations
    from tests.engines import started_engine
    from tests.worker.fake_engine import Collector

    adapters = {"all-r4": adapter_dirs["all-r4"]}
    prompts = [COPY_PROMPT, [7, 8, 9, 10, 7, 8, 9], [3, 3, 3, 3, 3]]
    got = {}
    for method in ("off", "ngram"):
        config = EngineConfig(
            max_batch_size=4, max_seq_len=64, max_loras=2, max_lora_rank=8, speculative=method,
            num_speculative_tokens=4,
        )  # fmt: skip
        with started_engine(llama_dir, config, adapters) as engine, count_compilations() as count:
            collectors = []
            for n, prompt in enumerate(prompts):
                c = Collector()
                engine.submit(
                    EngineRequest(f"r{n}", adapter or "", prompt, Sampling(max_tokens=24, ignore_eos=True), c)
                )
                collectors.append(c)
            sampled = Collector()
            sampling = Sampling(max_tokens=12, ignore_eos=True, temperature=0.8, seed=5)
            engine.submit(EngineRequest("s", adapter or "", COPY_PROMPT, sampling, sampled))
            for c in [*collectors, sampled]:
                assert c.done.wait(120), "request did not finish"
            got[method] = [c.tokens for c in collectors]
            assert len(sampled.tokens) == 12
            scheduler = engine.scheduler
            if method == "ngram":
                assert scheduler.spec_steps > 0 and scheduler.spec_accepted > 0, (
                    scheduler.spec_steps,
                    scheduler.spec_accepted,
                )
                assert scheduler.steps < 24 * 2  # fewer steps than tokens: drafts were kept
            # the verify step's one shape was compiled at warm-up (the adapter's load writes its slot only)
            assert count.compilations == 0, count.names
    assert got["ngram"] == got["off"]


def test_the_scheduler_takes_kept_drafts_one_at_a_time_on_the_fake_runner() -> None:
    """FakeRunner tokens: next = last + 1 on the base model. After the prompt [1, 2, 3, 4, 5, 1, 2] the row
    draws 3; the drafter then proposes 4, 5, 1, 2 (what followed [1, 2, 3]), the runner keeps 4 and 5 and
    gives 6: three tokens in one step. The tokens are plain decoding's; a stop token among the kept drafts ends
    the row there, the rest dropped; every page comes back."""
    import dataclasses

    from tests.worker.fake_engine import Harness, source_of
    from tests.worker.test_scheduler import CFG

    prompt = [1, 2, 3, 4, 5, 1, 2]
    runs = {}
    for method in ("off", "ngram"):
        h = Harness(dataclasses.replace(CFG, speculative=method, num_speculative_tokens=4), source_of("a"))
        free = h.scheduler.kv.available
        long, stopped = h.submit(prompt=prompt, max_tokens=12), h.submit(prompt=prompt, stop_token_ids=[5])
        h.run(long, stopped)
        runs[method] = (long.tokens, stopped.tokens, h.runner.verify_steps, h.scheduler.steps)
        assert h.scheduler.kv.available == free
        if method == "ngram":
            assert h.scheduler.spec_proposed > h.scheduler.spec_accepted > 0
    (long_off, stop_off, none, steps_off), (long_on, stop_on, verifies, steps_on) = runs.values()
    assert long_on == long_off == list(range(3, 15)) and stop_on == stop_off == [3, 4, 5]
    assert none == 0 and verifies > 0 and steps_on < steps_off
