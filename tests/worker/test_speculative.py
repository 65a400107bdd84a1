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

from loraserve.engine.speculative import (
    MAX_REST,
    PRIOR_RATE,
    RATE_WEIGHT,
    AdapterRates,
    DraftState,
    NgramDrafter,
    StepCosts,
    predicted,
)
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


class PinnedCosts(StepCosts):
    """Step costs fixed at a verify ÷ decode ratio (the rule's input), not measured: what a test of the
    verify step's tokens needs (on a CPU the measured ratio depends on the machine and its load)."""

    def __init__(self, ratio: float) -> None:
        super().__init__()
        for kind, seconds in (("decode", 1.0), ("verify", ratio), ("verify", ratio)):
            super().observe(kind, seconds)

    def observe(self, kind: str, seconds: float) -> None:
        self.since_verify = 0 if kind == "verify" else self.since_verify + 1


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
            if method == "ngram":
                engine.scheduler.costs = PinnedCosts(1.0)  # verify whenever a draft is expected to be kept
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
        if method == "ngram":
            h.scheduler.costs = PinnedCosts(1.0)
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


def test_a_prediction_drafts_from_where_the_output_has_reached() -> None:
    pred = [10, 11, 12, 13, 14, 15, 11, 12, 16]
    assert predicted(pred, [], 3).tolist() == [10, 11, 12]  # nothing generated: its start
    assert predicted(pred, [10, 11], 3).tolist() == [12, 13, 14]  # copying it
    # an edit: 99 replaced 12; the output resynchronises on its last token ... [11] ends at 2 and 7: 2 is
    # nearer to the output's length (3) -> what follows it
    assert predicted(pred, [10, 11, 99, 13], 2).tolist() == [14, 15]  # [13] matches at 3
    assert predicted(pred, [5, 11, 12], 2).tolist() == [13, 14]  # [11, 12] ends at 3 and 8: 3 is nearer
    assert predicted(pred, [1, 2, 3, 4, 5, 6, 7, 11, 12], 2).tolist() == [16]  # 8 is nearer to 9
    assert predicted(pred, [42], 3).tolist() == []  # nothing like it
    assert predicted(pred, [16], 3).tolist() == [] and predicted(pred, [10], 0).tolist() == []


def test_a_row_adapts_k_to_what_it_keeps_and_rests_after_rejections() -> None:
    state = DraftState(limit=4)
    assert state.k == 4 and state.wanted() == 4
    assert state.expected(2) == pytest.approx(0.5 + 0.25)  # the prior: a draft kept with chance 0.5
    state.update(4, 4)  # all kept: k stays at its limit, the estimate rises
    assert state.k == 4 and state.rate == pytest.approx(0.5 + 0.3 * 0.5)
    state.update(4, 1)  # one kept: propose two next time
    assert state.k == 2 and state.rest == 0
    rests = []
    for _ in range(9):  # nothing kept, again and again: k halves, rests double up to MAX_REST
        state.update(state.k, 0)
        rests.append(state.rest)
        assert [state.wanted() for _ in range(state.rest)] == [0] * rests[-1]
    assert state.k == 1 and rests == [1, 2, 4, 8, 16, 32, 64, 64, 64] and MAX_REST == 64
    assert state.wanted() == 1  # rested: it drafts again
    state.update(1, 1)
    assert state._rests == 0 and state.k == 2  # a kept draft ends the backoff
    assert DraftState(limit=0).wanted() == 0  # a request that turned speculation off


def test_a_verify_step_runs_when_its_expected_kept_tokens_pay_for_it() -> None:
    costs = StepCosts()
    assert not costs.worth(3.0, 4)  # nothing timed yet: a decode step first
    costs.observe("decode", 0.010)
    assert costs.worth(3.0, 4) and costs.ratio is None  # then verify steps, to time them
    assert not costs.worth(0.0, 4)  # no draft expected to be kept: never
    costs.observe("verify", 0.500)  # the first paid for a compilation
    assert costs.ratio is None and costs.worth(0.1, 4)  # one more
    costs.observe("verify", 0.015)
    assert costs.ratio == pytest.approx(1.5)  # the lower median: the slow step does not count
    # 4 rows at ratio 1.5: a verify step costs 2 rows' decode tokens more
    assert costs.worth(2.01, 4) and not costs.worth(1.99, 4)
    # the rule says no: decode steps; after (1.5 - 1) / PROBE_SHARE = 25 of them, one verify step re-measures
    said = []
    for _ in range(30):
        said.append(costs.worth(1.0, 4))
        costs.observe("verify" if said[-1] else "decode", 0.015 if said[-1] else 0.010)
    assert said.index(True) == 25 and costs.probes == 1
    for seconds in (0.020, 0.030, 0.012):  # a window of the last 5: 0.010, 0.010, 0.020, 0.030, 0.012
        costs.observe("decode", seconds)
    assert costs.seconds("decode") == pytest.approx(0.012)
    for _ in range(3):  # three slow verify steps in the last five move it; one would not have
        costs.observe("verify", 0.100)
    assert costs.seconds("verify") == pytest.approx(0.100)


class _WrongDrafter(NgramDrafter):
    """Proposes what the fake runner never draws after the row's last token (its base chain is last + 1 mod
    the vocabulary): every draft is rejected."""

    def propose(self, tokens, k):
        return np.full(max(k, 0), (int(tokens[-1]) + 2) % 50, np.int32)


def _fake_harness(ratio: float, drafter=None, **config):
    import dataclasses

    from tests.worker.fake_engine import Harness, source_of
    from tests.worker.test_scheduler import CFG

    cfg = dataclasses.replace(
        CFG, speculative="ngram", num_speculative_tokens=4, max_seq_len=256, max_batch_size=2, **config
    )
    h = Harness(cfg, source_of("a"))
    h.scheduler.costs = PinnedCosts(ratio)
    if drafter is not None:
        h.scheduler.drafter = drafter
    return h


def test_drafts_that_are_always_rejected_cost_a_few_verify_steps() -> None:
    """A row whose every draft is rejected (a hostile pattern: here a drafter that proposes token 0) rests
    1, 2, 4 ... 64 steps between tries, and the engine waits 1, 3, 7, 15 and then 16 steps after each look
    for drafts that found none (a look reads the step in flight): 200 tokens take 5 verify steps, not 200,
    and are plain decoding's."""
    h = _fake_harness(1.0, _WrongDrafter())
    c = h.submit(prompt=[1, 2], max_tokens=200, ignore_eos=True)
    h.run(c, limit=400)
    assert c.tokens == [(3 + i) % 50 for i in range(200)]  # the fake's chain: last + 1 mod its vocabulary
    # the row's rests and the engine's waits together leave 5 verify steps, proposing 4, 2, then 1 token
    # (k halves on each rejection)
    assert h.scheduler.spec_steps == h.runner.verify_steps == 5
    assert h.scheduler.spec_accepted == 0 and h.scheduler.spec_proposed == 4 + 2 + 1 * 3


def test_adapter_rates_average_what_drafts_kept_and_forget_the_least_recent() -> None:
    rates = AdapterRates(limit=2)
    assert rates.get("a") == PRIOR_RATE
    rates.update("a", 4, 4)
    assert rates.get("a") == pytest.approx(PRIOR_RATE + RATE_WEIGHT * (1 - PRIOR_RATE))
    rates.update("b", 4, 0)
    rates.update("a", 2, 1)  # a is the most recent again
    rates.update("c", 1, 1)  # over the limit: b, the least recently updated, goes
    assert (len(rates), rates.get("b")) == (2, PRIOR_RATE)
    assert rates.get("c") > PRIOR_RATE and rates.get("a") != PRIOR_RATE


def test_an_adapter_whose_drafts_were_kept_drafts_from_its_next_row_s_first_step() -> None:
    """At a verify ÷ decode ratio of 3 a row at the prior (0.5: 0.94 expected kept tokens of 4 drafts) does
    not verify (the test below); a row of an adapter whose n-gram drafts were all kept before starts from that
    adapter's rate and verifies without a probe, with plain decoding's tokens, and its verify steps move the
    rate. Rows with a prediction leave the adapter's rate alone."""
    h = _fake_harness(3.0)
    for _ in range(8):
        h.scheduler.adapter_rates.update("", 4, 4)  # the base model's n-gram drafts: all kept so far
    before = h.scheduler.adapter_rates.get("")
    c = h.submit(prompt=[1, 2, 3, 4, 5, 1, 2], max_tokens=12, ignore_eos=True)
    h.run(c, limit=100)
    assert c.tokens == [(3 + i) % 50 for i in range(12)]
    assert h.runner.verify_steps >= 1 and h.scheduler.spec_accepted > 0 and h.scheduler.costs.probes == 0
    assert h.scheduler.adapter_rates.get("") != before  # its verify steps moved the adapter's rate
    fresh = _fake_harness(1.0)
    p = fresh.submit(prompt=[1, 2], max_tokens=12, ignore_eos=True, prediction=list(range(3, 15)))
    fresh.run(p, limit=100)
    assert fresh.scheduler.spec_accepted > 0 and len(fresh.scheduler.adapter_rates) == 0


def test_a_compute_bound_verify_step_is_not_chosen_but_probed() -> None:
    """At a verify ÷ decode ratio of 3 (a large batch on a CPU), a single row's drafts (expected to keep
    0.94 tokens at the prior) do not pay for the 2 extra decode steps' worth: decode steps, with one probe
    after (3 - 1) / 0.02 = 100 of them; the tokens are plain decoding's."""
    h = _fake_harness(3.0)
    c = h.submit(prompt=[1, 2, 3, 4, 5, 1, 2], max_tokens=120, ignore_eos=True)
    h.run(c, limit=400)
    assert c.tokens == [(3 + i) % 50 for i in range(120)]
    assert h.runner.verify_steps == 1 and h.scheduler.costs.probes == 1


def test_per_request_speculation_and_k() -> None:
    """On a server that drafts 4 tokens: a request that turns speculation off never drafts, one that asks
    for 2 drafts at most 2 a step, and both get plain decoding's tokens; a request with a prediction (its
    exact answer, or one with a wrong stretch) drafts from it, with the same tokens; out-of-range settings
    and a prediction outside the vocabulary are refused."""
    from loraserve.common.errors import InvalidArgument
    from loraserve.engine.request import Sampling

    h = _fake_harness(1.0)
    prompt = [1, 2, 3, 4, 5, 1, 2]
    off = h.submit(prompt=prompt, max_tokens=20, speculative="off")
    two = h.submit(prompt=prompt, max_tokens=20, num_speculative_tokens=2)
    h.run(off, two)
    assert off.tokens == two.tokens == list(range(3, 23))
    assert h.scheduler.spec_steps > 0
    assert h.scheduler.spec_proposed <= 2 * h.scheduler.spec_steps  # only the k=2 request drafted
    # a prediction: the fake's exact answer (its chain), then one with a wrong stretch; same tokens, and the
    # exact one keeps every draft
    h = _fake_harness(1.0)
    c = h.submit(prompt=[1, 2], max_tokens=30, ignore_eos=True, prediction=[(3 + i) % 50 for i in range(30)])
    h.run(c)
    assert c.tokens == [(3 + i) % 50 for i in range(30)]
    assert h.scheduler.spec_proposed == h.scheduler.spec_accepted > 20  # every draft kept
    edited = [(3 + i) % 50 if not 2 <= i < 5 else 0 for i in range(30)]  # 5, 6, 7 edited out
    h = _fake_harness(1.0)
    c = h.submit(prompt=[1, 2], max_tokens=30, ignore_eos=True, prediction=edited)
    h.run(c)
    assert c.tokens == [(3 + i) % 50 for i in range(30)]
    assert h.scheduler.spec_proposed > h.scheduler.spec_accepted > 15
    with pytest.raises(InvalidArgument, match="prediction token ids"):
        h.submit(prompt=[1], prediction=[50])

    from loraserve.client.sdk import build_request

    sent = build_request([1, 2], speculative="off", num_speculative_tokens=2).sampling.speculative
    assert (sent.method, sent.num_tokens) == ("off", 2)  # the SDK's (and `loraserve generate`'s) fields
    for bad, message in (
        (dict(speculative="medusa"), "speculative must be one of off, ngram"),
        (dict(num_speculative_tokens=9), "num_speculative_tokens must be in [0, 8]"),
    ):
        with pytest.raises(InvalidArgument, match=message.replace("[", r"\[").replace("]", r"\]")):
            Sampling(**bad).validate(100)


def test_the_worker_takes_speculation_per_request_and_reports_drafts(llama_dir, adapter_dirs) -> None:
    """Through the worker's gRPC Generate: a request with speculation on and one with it turned off get the
    same greedy tokens; the first reports its drafts in its usage (what the scheduler counted), the second
    none; the adapter's accounting (the loraserve_adapter_draft_tokens series) sums them; a k out of range is
    INVALID_ARGUMENT. Through the OpenAI-compatible API (the official SDK): the ``speculative`` extra field, and
    OpenAI's ``completion_tokens_details`` (accepted / rejected prediction tokens) in the usage; a bad method is
    400."""
    import grpc

    from loraserve.engine.config import EngineConfig
    from loraserve.protos.v1 import inference_pb2 as pb
    from loraserve.protos.v1 import inference_pb2_grpc
    from tests.worker.serving import running_worker

    cfg = EngineConfig(
        max_batch_size=2, max_seq_len=64, max_loras=1, max_lora_rank=8, speculative="ngram",
        num_speculative_tokens=4,
    )  # fmt: skip
    with running_worker(llama_dir, cfg, {"all-r4": adapter_dirs["all-r4"]}, warmup=False) as w:
        w.engine.scheduler.costs = PinnedCosts(1.0)
        stub = inference_pb2_grpc.InferenceStub(w.channel)

        def generate(method: str, k: int = 0) -> list:
            sampling = pb.SamplingParams(max_tokens=24, ignore_eos=True)
            sampling.speculative.method, sampling.speculative.num_tokens = method, k
            req = pb.GenerateRequest(adapter="all-r4", sampling=sampling)
            req.tokens.ids.extend(COPY_PROMPT)
            return list(stub.Generate(req, timeout=120))

        on = generate("", 3)  # the server's method, 3 drafts a step at most
        proposed, kept = w.engine.scheduler.spec_proposed, w.engine.scheduler.spec_accepted
        off = generate("off")
        assert [t for m in on for t in m.token_ids] == [t for m in off for t in m.token_ids]
        assert proposed >= kept > 0 and w.engine.scheduler.spec_proposed == proposed  # "off" drafted nothing
        assert (on[-1].usage.draft_tokens, on[-1].usage.accepted_draft_tokens) == (proposed, kept)
        assert (off[-1].usage.draft_tokens, off[-1].usage.accepted_draft_tokens) == (0, 0)
        (usage,) = w.engine.accounting.totals().values()  # the adapter as the worker resolved it
        assert (usage.requests, usage.draft_tokens, usage.accepted_draft_tokens) == (2, proposed, kept)
        from loraserve.worker.metrics import EngineCollector

        exported = {f.name: f.samples[0].value for f in EngineCollector(w.engine).collect() if f.samples}
        assert exported["loraserve_speculative_draft_tokens"] == proposed
        assert exported["loraserve_speculative_accepted_tokens"] == kept
        assert exported["loraserve_speculative_verify_steps"] == w.engine.scheduler.spec_steps > 0
        assert exported["loraserve_speculative_verify_cost_ratio"] == 1.0  # the pinned costs
        with pytest.raises(grpc.RpcError) as err:
            generate("ngram", 9)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "num_speculative_tokens must be in [0, 8]" in err.value.details()

        import openai

        from loraserve.httpapi.app import build_app
        from loraserve.worker.http_backend import WorkerHttpBackend
        from loraserve.worker.server import InferenceServicer
        from tests.aio_thread import http_server_thread

        def app():
            return build_app(WorkerHttpBackend(InferenceServicer(w.engine, w.tokenizer), "tiny-llama"))

        with http_server_thread(app) as port:
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
            before = w.engine.scheduler.spec_proposed, w.engine.scheduler.spec_accepted
            done = client.completions.create(
                model="all-r4", prompt=COPY_PROMPT, max_tokens=24, temperature=0,
                extra_body={"ignore_eos": True, "speculative": {"method": "ngram", "num_tokens": 3}},
            )  # fmt: skip
            proposed = w.engine.scheduler.spec_proposed - before[0]
            kept = w.engine.scheduler.spec_accepted - before[1]
            assert done.choices[0].text == "".join(m.text for m in on)
            details = done.usage.completion_tokens_details
            assert proposed > 0 and details is not None
            assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) == (
                kept,
                proposed - kept,
            )
            plain = client.completions.create(
                model="all-r4", prompt=COPY_PROMPT, max_tokens=24, temperature=0,
                extra_body={"ignore_eos": True, "speculative": {"method": "off"}},
            )  # fmt: skip
            assert (
                plain.choices[0].text == done.choices[0].text
                and plain.usage.completion_tokens_details is None
            )
            with pytest.raises(openai.BadRequestError, match="speculative"):
                client.completions.create(
                    model="all-r4",
                    prompt=COPY_PROMPT,
                    max_tokens=4,
                    extra_body={"speculative": {"method": "eagle"}},
                )
