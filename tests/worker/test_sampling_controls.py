"""The logits controls (logit_bias, min_tokens, repetition / frequency / presence penalties) against
transformers' logits processors.

* ``models.sampling``: a row history written by ``seed_row`` (prompt + generated, in several chunks) and the
  batch's own draws, then ``apply_controls``: equal to transformers' ``SequenceBiasLogitsProcessor``,
  ``MinNewTokensLengthLogitsProcessor``, ``RepetitionPenaltyLogitsProcessor`` and OpenAI's presence /
  frequency definition (``OpenAIPenalties`` below, a transformers ``LogitsProcessor``) applied in that order
  to the same logits, within 1e-5; rows without controls come out bit for bit as they went in.
* The engine (tiny Llama, f32, chunked prefill): greedy requests with controls, on the base and on an
  adapter, in one batch beside requests without any, give exactly the greedy tokens of transformers' (peft's)
  model with those processors; the requests without controls are bit-for-bit what they are alone; every
  control moves the tokens (so parity cannot pass by accident); after warm-up nothing compiles.
"""

from __future__ import annotations

import math
import uuid

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from loraserve.common.errors import InvalidArgument
from loraserve.engine.config import EngineConfig
from loraserve.engine.engine import Engine
from loraserve.engine.request import EngineRequest, Finished, Sampling
from loraserve.kernels.testing import count_compilations
from loraserve.models.sampling import (
    BIAS_ENTRIES,
    HISTORY_CHUNK,
    NO_ROW,
    RowHistory,
    SamplingArrays,
    apply_controls,
    record,
    sample,
    seed_row,
)
from tests.engines import started_engine
from tests.worker.fake_engine import Collector

V = 64
ATOL = 1e-5


class OpenAIPenalties(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the completion (the ids after ``prompt_len``)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        out = input_ids[:, self.prompt_len :]
        counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
        return scores - counts * self.frequency - (counts > 0).to(scores.dtype) * self.presence


def processors(s: Sampling, prompt_len: int, eos_ids: tuple[int, ...]) -> LogitsProcessorList:
    """transformers' processors for ``s``, in the order loraserve applies the controls."""
    out = LogitsProcessorList()
    if s.logit_bias:
        out.append(SequenceBiasLogitsProcessor({(t,): v for t, v in s.logit_bias}))
    if s.min_tokens:
        stops = sorted(set(s.stop_token_ids) | (set() if s.ignore_eos else set(eos_ids)))
        out.append(MinNewTokensLengthLogitsProcessor(prompt_len, s.min_tokens, stops))
    if s.repetition_penalty != 1.0:
        out.append(RepetitionPenaltyLogitsProcessor(s.repetition_penalty))
    if s.presence_penalty or s.frequency_penalty:
        out.append(OpenAIPenalties(prompt_len, s.presence_penalty, s.frequency_penalty))
    return out


# ----------------------------------------------------------------------------- the sampler alone
CASES = [  # (sampling, prompt, generated)
    (Sampling(repetition_penalty=1.7), [3, 9, 9, 40], [5, 3]),
    (Sampling(presence_penalty=0.8, frequency_penalty=-0.6), [1, 2], [7, 7, 7, 2, 11]),
    (Sampling(logit_bias=((4, 30.0), (60, -100.0), (9, 2.5))), [4, 4], []),
    (Sampling(min_tokens=6, stop_token_ids=(13, 21)), [13], [8, 8]),  # step 2 < 6: stops and EOS banned
    (Sampling(min_tokens=2, stop_token_ids=(13,)), [13], [8, 8]),  # step 2: the bans are over
    (  # every control at once, over a prompt of several seed_row chunks
        Sampling(
            repetition_penalty=0.6,
            presence_penalty=-1.5,
            frequency_penalty=2.0,
            logit_bias=((0, 100.0), (63, -7.25)),
            min_tokens=9,
            ignore_eos=True,
            stop_token_ids=(50,),
        ),
        [int(t) for t in np.random.default_rng(1).integers(0, V, 2 * HISTORY_CHUNK + 7)],
        [50, 50, 1],
    ),
]
EOS = (2, 62)


def _host_history(rows: int):
    seed = jax.jit(seed_row)

    def write(history: RowHistory, row: int, s: Sampling, prompt: list[int], generated: list[int]):
        bias = s.bias_entries(EOS)
        ids, values, until = (
            np.full(BIAS_ENTRIES, -1, np.int32),
            np.zeros(BIAS_ENTRIES, np.float32),
            np.zeros(BIAS_ENTRIES, np.int32),
        )
        for e, (t, v, u) in enumerate(bias):
            ids[e], values[e], until[e] = t, v, u
        tokens = prompt + generated
        for k in range(0, len(tokens), HISTORY_CHUNK):
            part = tokens[k : k + HISTORY_CHUNK]
            chunk = np.full(HISTORY_CHUNK, -1, np.int32)
            chunk[: len(part)] = part
            flags = np.zeros(HISTORY_CHUNK, np.bool_)
            flags[: len(part)] = [k + j >= len(prompt) for j in range(len(part))]
            history = seed(history, np.int32(row), chunk, flags, ids, values, until, np.bool_(k == 0))
        return history

    return RowHistory.zeros(rows, V), write


def test_controls_equal_transformers_processors_row_by_row() -> None:
    rows = len(CASES) + 1  # the last row has no controls
    history, write = _host_history(rows)
    # row 0 first held another request's history: seeding must forget it
    history = write(history, 0, Sampling(logit_bias=((1, 50.0),)), [1, 1, 1], [1])
    for i, (s, prompt, generated) in enumerate(CASES):
        history = write(history, i, s, prompt, generated)
    logits = np.random.default_rng(0).standard_normal((rows, V)).astype(np.float32) * 3
    arrays = SamplingArrays.empty(rows)
    for i, (s, _, generated) in enumerate(CASES):
        arrays.presence[i], arrays.frequency[i] = s.presence_penalty, s.frequency_penalty
        arrays.repetition[i], arrays.history_row[i], arrays.step[i] = s.repetition_penalty, i, len(generated)
    got = np.asarray(jax.jit(apply_controls)(jnp.asarray(logits), arrays, history))
    for i, (s, prompt, generated) in enumerate(CASES):
        ids = torch.tensor([prompt + generated])
        want = processors(s, len(prompt), EOS)(ids, torch.tensor(logits[i : i + 1]))[0].numpy()
        assert np.array_equal(np.isinf(got[i]), np.isinf(want)), i
        finite = np.isfinite(want)
        assert np.abs(got[i][finite] - want[finite]).max() <= ATOL, (i, s)
        if i != 4:  # the case whose bans are over moves nothing; every other control moved something
            assert not np.allclose(got[i], logits[i]), i
        else:
            assert np.array_equal(got[i], logits[i])
    assert np.array_equal(got[-1], logits[-1])  # no controls: bit for bit


def test_the_step_records_each_drawn_token_in_its_row() -> None:
    history, write = _host_history(3)
    s = Sampling(frequency_penalty=1.0)
    history = write(history, 1, s, [5, 6], [7])
    arrays = SamplingArrays.empty(3)
    arrays.history_row[:] = [NO_ROW, 1, NO_ROW]
    arrays.frequency[1] = 1.0
    logits = np.zeros((3, V), np.float32)
    logits[:, 7] = 0.5  # greedy picks 7 everywhere unless row 1's penalty (count 1) pushes it below 0
    logits[:, 8] = 0.25
    out = jax.jit(sample)(jnp.asarray(logits), arrays, history)
    assert np.asarray(out.tokens).tolist() == [7, 8, 7]
    counts = np.asarray(out.history.counts)
    assert counts[1, 7] == 1 and counts[1, 8] == 1 and counts[1].sum() == 2  # 7 generated before, 8 now
    assert counts[0].sum() == 0 and counts[2].sum() == 0  # rows without controls record nothing
    seen = np.asarray(out.history.seen)
    assert sorted(np.flatnonzero(seen[1]).tolist()) == [5, 6, 7, 8]
    again = record(out.history, arrays, jnp.array([0, 8, 0], jnp.int32))
    assert int(np.asarray(again.counts)[1, 8]) == 2


# ----------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(presence_penalty=2.5), "presence_penalty must be in [-2.0, 2.0]"),
        (dict(frequency_penalty=math.nan), "frequency_penalty must be in"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be in [0.01, 100.0]"),
        (dict(repetition_penalty=math.inf), "repetition_penalty must be in"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens (5) must be at most max_tokens (4)"),
        (dict(logit_bias=((V, 1.0),)), f"logit_bias token ids [{V}] are outside the vocabulary"),
        (dict(logit_bias=((-1, 1.0),)), "logit_bias token ids [-1] are outside"),
        (dict(logit_bias=((3, 101.0),)), "logit_bias values must be in [-100, 100]"),
        (dict(logit_bias=((3, math.nan),)), "logit_bias values must be in"),
        (dict(logit_bias=((3, 1.0), (3, 2.0))), "logit_bias names a token id twice"),
        (dict(logit_bias=tuple((t, 1.0) for t in range(301))), "logit_bias has 301 entries; at most 300"),
    ],
)
def test_bad_controls_are_invalid_argument(kwargs, message) -> None:
    with pytest.raises(InvalidArgument) as err:
        Sampling(**kwargs).validate(V)
    assert message in err.value.message


# ----------------------------------------------------------------------------- the engine
PROMPT = [5, 17, 33, 100, 7, 250, 3, 91, 64, 12]  # 3 chunks at prefill_chunk=4
STEPS = 8


@pytest.fixture(scope="module")
def engine(llama_dir, adapter_dirs):
    config = EngineConfig(
        max_batch_size=8,
        max_seq_len=64,
        max_loras=2,
        max_lora_rank=16,
        prefill_chunk=4,
        min_prefill_bucket=64,
    )  # one prefill bucket: a shorter warm-up (bucketing itself: test_engine.py)
    with started_engine(llama_dir, config, {"all-r4": adapter_dirs["all-r4"]}) as eng:
        yield eng


def submit(engine: Engine, adapter: str, sampling: Sampling) -> Collector:
    c = Collector()
    engine.submit(EngineRequest(uuid.uuid4().hex, adapter, list(PROMPT), sampling, c))
    return c


def finished(c: Collector) -> list[int]:
    assert c.done.wait(120), "request did not finish"
    assert isinstance(c.end, Finished), c.end
    return c.tokens


def logprobs(c: Collector) -> list:
    return [e.logprobs for e in c.events if getattr(e, "token_id", None) is not None]


def hf_greedy(model, s: Sampling, eos_ids: tuple[int, ...]) -> list[int]:
    """transformers' greedy tokens with ``s``'s processors, ending at EOS (unless ignore_eos) or STEPS."""
    procs = processors(s, len(PROMPT), eos_ids)
    ids = torch.tensor([PROMPT])
    out: list[int] = []
    with torch.no_grad():
        for _ in range(STEPS):
            scores = procs(ids, model(ids).logits[:, -1].float())
            token = int(scores.argmax(-1))
            out.append(token)
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
            if token in eos_ids and not s.ignore_eos:
                break
    return out


def test_engine_greedy_with_controls_equals_transformers(engine, llama_dir, adapter_dirs) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    eos = tuple(engine.model_config.eos_token_ids)
    assert eos, "the tiny model has an EOS id"
    common = dict(max_tokens=STEPS, ignore_eos=True)
    cases = {  # name -> (adapter, sampling)
        "repetition": ("", Sampling(repetition_penalty=1.8, **common)),
        "presence-frequency": ("all-r4", Sampling(presence_penalty=1.5, frequency_penalty=0.9, **common)),
        "bias": ("", Sampling(logit_bias=((11, 60.0), (12, 59.0)), **common)),
        # EOS pushed to the top; min_tokens holds it back for 3 tokens, then it ends the request
        "min-tokens": ("all-r4", Sampling(max_tokens=STEPS, min_tokens=3, logit_bias=((eos[0], 100.0),))),
        "plain-base": ("", Sampling(**common)),
        "plain-adapter": ("all-r4", Sampling(logprobs=2, **common)),
    }
    with count_compilations() as compiled:
        collectors = {name: submit(engine, adapter, s) for name, (adapter, s) in cases.items()}
        got = {name: finished(c) for name, c in collectors.items()}
    assert compiled.compilations == 0, compiled

    base = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32).eval()
    tuned = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32), str(adapter_dirs["all-r4"])
    ).eval()
    for name, (adapter, s) in cases.items():
        model = tuned if adapter else base
        assert got[name] == hf_greedy(model, s, eos), name
        if not name.startswith("plain"):
            plain = Sampling(max_tokens=s.max_tokens, ignore_eos=s.ignore_eos)
            assert got[name] != hf_greedy(model, plain, eos), f"{name}: the control changed nothing"
    assert len(got["min-tokens"]) == 4 and got["min-tokens"][-1] == eos[0]
    assert collectors["min-tokens"].end.reason.name == "EOS"


def test_min_tokens_holds_back_stop_strings_and_stop_ids(engine) -> None:
    first = finished(submit(engine, "", Sampling(max_tokens=6, ignore_eos=True)))
    stop = first[0]  # the first greedy token
    held = finished(
        submit(engine, "", Sampling(max_tokens=6, ignore_eos=True, stop_token_ids=(stop,), min_tokens=4))
    )
    free = finished(submit(engine, "", Sampling(max_tokens=6, ignore_eos=True, stop_token_ids=(stop,))))
    assert free == first[:1]  # the stop id ends it at once
    assert stop not in held[:4] and len(held) >= 4


def test_rows_without_controls_are_bit_for_bit_unharmed_by_rows_with_them(engine) -> None:
    common = dict(max_tokens=STEPS, ignore_eos=True)
    controls = [
        ("", dict(repetition_penalty=1.8)),
        ("all-r4", dict(presence_penalty=1.5, frequency_penalty=0.9)),
        ("", dict(logit_bias=((11, 60.0), (12, 59.0)), min_tokens=2)),
    ]

    def batch(with_controls: bool) -> tuple[list[list[int]], list]:
        others = [
            submit(engine, a, Sampling(**common, **(kw if with_controls else {}))) for a, kw in controls
        ]
        watched = [submit(engine, a, Sampling(logprobs=2, **common)) for a in ("", "all-r4")]
        for c in others:
            finished(c)
        return [finished(c) for c in watched], [logprobs(c) for c in watched]

    batch(with_controls=False)  # both compared batches then find the prompt in the prefix cache alike
    (tokens_on, lps_on), (tokens_off, lps_off) = batch(with_controls=True), batch(with_controls=False)
    assert tokens_on == tokens_off
    assert lps_on == lps_off  # every LoRA backend is batch-invariant (tests/kernels/test_row_isolation.py)
