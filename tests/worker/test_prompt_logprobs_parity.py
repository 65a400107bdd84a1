"""Prompt log-probabilities on the JaxRunner (tiny Llama, f32) against transformers' (and peft's)
log_softmax of the logits: every prompt token after the first, with its top alternatives, for the base model
and an adapter, in one packed prefill beside a request that asks nothing, in chunks (``prefill_chunk``), and
for ``prompt_only``; after warm-up nothing compiles.

Tolerance: ATOL = 1e-4 absolute, as tests/worker/test_logprobs.py (f32 logits agree within 2e-4).
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from loraserve.engine.config import EngineConfig
from loraserve.engine.engine import Engine
from loraserve.engine.request import EngineRequest, Finished, Sampling, Started
from loraserve.kernels.testing import count_compilations
from tests.engines import started_engine
from tests.worker.fake_engine import Collector

ATOL = 1e-4
PROMPT = [5, 17, 33, 100, 7, 250, 3, 91, 64, 12, 8, 140, 77]  # 13 tokens: 4 chunks of 4 at prefill_chunk=4
TOP = 3


@pytest.fixture(scope="module")
def engine(llama_dir, adapter_dirs):
    config = EngineConfig(
        max_batch_size=4,
        max_seq_len=64,
        max_loras=2,
        max_lora_rank=16,
        prefill_chunk=4,
        min_prefill_bucket=64,
    )  # one prefill bucket: a shorter warm-up (bucketing itself: test_engine.py)
    with started_engine(llama_dir, config, {"all-r4": adapter_dirs["all-r4"]}) as eng:
        yield eng


def submit(engine: Engine, adapter: str = "", prompt=PROMPT, **sampling) -> Collector:
    c = Collector()
    engine.submit(EngineRequest(uuid.uuid4().hex, adapter, list(prompt), Sampling(**sampling), c))
    return c


def hf_prompt_logprobs(llama_dir, adapter_dir, prompt: list[int]) -> np.ndarray:
    """transformers' (peft's) log_softmax [len(prompt) - 1, V] at the positions predicting prompt[1:]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter_dir)).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].double()
    return torch.log_softmax(logits, dim=-1).numpy()


def started(c: Collector) -> Started:
    assert c.done.wait(120), "request did not finish"
    assert isinstance(c.end, Finished), c.end
    return next(e for e in c.events if isinstance(e, Started))


def check(got, want: np.ndarray, prompt: list[int]) -> float:
    """The worst difference; asserts the shape, the chosen tokens and the top ids' order."""
    assert got is not None and len(got) == len(prompt) - 1
    worst = 0.0
    for i, lp in enumerate(got):
        ref = np.argsort(-want[i], kind="stable")[:TOP]
        assert list(lp.top_ids) == ref.tolist(), f"position {i + 1}"
        worst = max(
            worst,
            abs(lp.logprob - want[i, prompt[i + 1]]),
            float(np.abs(np.array(lp.top_logprobs) - want[i, ref]).max()),
        )
    return worst


def test_prompt_logprobs_match_transformers_for_base_and_adapter_chunked_and_packed(
    engine, llama_dir, adapter_dirs
) -> None:
    with count_compilations() as compiled:
        base = submit(engine, max_tokens=2, prompt_logprobs=TOP)
        tuned = submit(engine, "all-r4", max_tokens=2, prompt_logprobs=TOP)
        plain = submit(engine, "all-r4", max_tokens=2)  # the same packed prefills, scoring nothing
        got_base, got_tuned, got_plain = started(base), started(tuned), started(plain)
    assert compiled.compilations == 0, compiled
    assert got_plain.prompt_logprobs is None
    want_base = hf_prompt_logprobs(llama_dir, None, PROMPT)
    want_tuned = hf_prompt_logprobs(llama_dir, adapter_dirs["all-r4"], PROMPT)
    worst = max(
        check(got_base.prompt_logprobs, want_base, PROMPT),
        check(got_tuned.prompt_logprobs, want_tuned, PROMPT),
    )
    assert worst <= ATOL, worst
    assert np.abs(want_base - want_tuned).max() > 100 * ATOL  # the adapter matters: the check means something
    assert tuned.tokens == plain.tokens  # scoring changes nothing of the generation


def test_prompt_only_scores_the_prompt_and_generates_nothing(engine, llama_dir) -> None:
    prompt = PROMPT[:6]
    c = submit(engine, prompt=prompt, prompt_logprobs=0, prompt_only=True, max_tokens=9)
    got = started(c)
    assert c.tokens == [] and (c.end.prompt_tokens, c.end.completion_tokens) == (6, 0)
    want = hf_prompt_logprobs(llama_dir, None, prompt)
    assert got.prompt_logprobs is not None and all(lp.top_ids == () for lp in got.prompt_logprobs)
    chosen = np.array([lp.logprob for lp in got.prompt_logprobs])
    assert np.abs(chosen - want[np.arange(5), prompt[1:]]).max() <= ATOL
