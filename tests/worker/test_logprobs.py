"""Per-token logprobs through the engine on the tiny Llama (JaxRunner, f32): greedy generation with
logprobs=5 matches transformers' (and peft's) log_softmax of the logits for the same prefix, with and
without an adapter; sampled tokens report the raw (untempered) logprob; in a mixed batch only the rows
that asked get logprobs, each with its own N; after warm-up nothing compiles with logprobs on and off.

Tolerance: ATOL = 1e-4 absolute on logprobs (f32 logits agree within 2e-4 in test_model_parity, observed
<= 2.2e-6; the log-softmax of both sides then differs by at most twice that). Observed: <= 1.5e-6.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from loraserve.engine.config import EngineConfig
from loraserve.engine.engine import Engine
from loraserve.engine.request import EngineRequest, Finished, Sampling, Token, TokenLogprobs
from loraserve.kernels.testing import count_compilations
from tests.engines import started_engine
from tests.worker.fake_engine import Collector

ATOL = 1e-4
PROMPT = [5, 17, 33, 100, 7]
STEPS = 8


@pytest.fixture(scope="module")
def engine(llama_dir, adapter_dirs):
    config = EngineConfig(
        max_batch_size=4, max_seq_len=64, max_loras=2, max_lora_rank=16, min_prefill_bucket=64
    )  # one prefill bucket: a shorter warm-up (bucketing itself: test_engine.py)
    adapters = {name: adapter_dirs[name] for name in ("all-r4", "mlp-r16")}
    with started_engine(llama_dir, config, adapters) as eng:
        yield eng


def submit(engine: Engine, adapter: str = "", prompt=PROMPT, **sampling) -> Collector:
    c = Collector()
    engine.submit(EngineRequest(uuid.uuid4().hex, adapter, list(prompt), Sampling(**sampling), c))
    return c


def wait(*collectors: Collector) -> None:
    for c in collectors:
        assert c.done.wait(120), "request did not finish"
        assert isinstance(c.end, Finished), c.end


def logprobs_of(c: Collector) -> list[TokenLogprobs | None]:
    """One entry per generated token, in order (Token events and the Finished that carries the last)."""
    return [e.logprobs for e in c.events if isinstance(e, Token | Finished) and e.token_id is not None]


def hf_logprobs(llama_dir, adapter_dir, prompt: list[int], generated: list[int]) -> np.ndarray:
    """transformers' (peft's with an adapter) log_softmax [len(generated), V] at the positions that
    predict each generated token, in float64 from f32 logits."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    seq = prompt + generated[:-1]
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0, len(prompt) - 1 :].double()
    return torch.log_softmax(logits, dim=-1).numpy()


@pytest.mark.parametrize("adapter", ["", "all-r4"])
def test_greedy_logprobs_match_transformers(engine, llama_dir, adapter_dirs, adapter: str) -> None:
    c = submit(engine, adapter, max_tokens=STEPS, ignore_eos=True, logprobs=5)
    wait(c)
    tokens, lps = c.tokens, logprobs_of(c)
    assert len(tokens) == len(lps) == STEPS
    want = hf_logprobs(llama_dir, adapter_dirs[adapter] if adapter else None, PROMPT, tokens)
    worst = 0.0
    for step, (token, lp) in enumerate(zip(tokens, lps, strict=True)):
        assert lp is not None and len(lp.top_ids) == len(lp.top_logprobs) == 5
        assert lp.top_ids[0] == token and lp.logprob == lp.top_logprobs[0]  # greedy: the token is top[0]
        assert list(lp.top_logprobs) == sorted(lp.top_logprobs, reverse=True)
        ref_ids = np.argsort(-want[step], kind="stable")[:5]
        assert list(lp.top_ids) == ref_ids.tolist(), f"step {step}"
        worst = max(
            worst,
            abs(lp.logprob - want[step, token]),
            float(np.abs(np.array(lp.top_logprobs) - want[step, ref_ids]).max()),
        )
    assert worst <= ATOL, worst
    if adapter:  # the adapter moves the logprobs well beyond the tolerance: the comparison means something
        base = hf_logprobs(llama_dir, None, PROMPT, tokens)
        assert np.abs(base - want).max() > 100 * ATOL


def test_sampled_tokens_report_the_raw_logprob(engine, llama_dir) -> None:
    c = submit(engine, temperature=2.0, seed=3, max_tokens=STEPS, ignore_eos=True, logprobs=2)
    wait(c)
    tokens, lps = c.tokens, logprobs_of(c)
    want = hf_logprobs(llama_dir, None, PROMPT, tokens)
    got = np.array([lp.logprob for lp in lps])
    raw = want[np.arange(STEPS), tokens]
    np.testing.assert_allclose(got, raw, atol=ATOL)
    tempered = torch.log_softmax(torch.tensor(want) / 2.0, dim=-1).numpy()[np.arange(STEPS), tokens]
    assert np.abs(tempered - raw).max() > 100 * ATOL  # temperature 2 changes them: raw is what we report
    assert any(lp.top_ids[0] != t for lp, t in zip(lps, tokens, strict=True))  # some draws were not argmax


def test_mixed_batch_only_rows_that_asked(engine) -> None:
    kinds = [None, 0, 3, 20]
    cs = [
        submit(engine, "mlp-r16" if n == 0 else "", max_tokens=STEPS, ignore_eos=True, logprobs=n)
        for n in kinds
    ]
    wait(*cs)
    assert all(lp is None for lp in logprobs_of(cs[0]))
    for n, c in zip(kinds[1:], cs[1:], strict=True):
        lps = logprobs_of(c)
        assert len(lps) == STEPS and all(lp is not None and len(lp.top_ids) == n for lp in lps)
    # the same request with N = 3 and N = 20 (rows of one batch): the same tokens and the same numbers
    assert cs[0].tokens == cs[2].tokens == cs[3].tokens
    for a, b in zip(logprobs_of(cs[2]), logprobs_of(cs[3]), strict=True):
        assert a.top_ids == b.top_ids[:3]
        np.testing.assert_allclose(a.top_logprobs, b.top_logprobs[:3], atol=1e-6)
        np.testing.assert_allclose(a.logprob, b.logprob, atol=1e-6)


def test_no_compilation_with_logprobs_on_and_off(engine) -> None:
    with count_compilations() as count:
        cs = []
        for i in range(12):
            cs.append(
                submit(
                    engine,
                    ("", "all-r4", "mlp-r16")[i % 3],
                    prompt=PROMPT[: 1 + i % 5] + [i + 3] * (i % 7),
                    max_tokens=1 + i % 5,
                    temperature=0.7 if i % 2 else 0.0,
                    logprobs=None if i % 4 == 0 else i % 21,
                )
            )
        wait(*cs)
    assert count.compilations == 0, count.names
    for i, c in enumerate(cs):
        assert all((lp is None) == (i % 4 == 0) for lp in logprobs_of(c))
