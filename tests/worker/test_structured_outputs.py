"""Structured outputs: llguidance's token bitmasks applied per row in the batched step.

* ``models.sampling``: a masked row draws only tokens its bitmask allows (greedy and seeded); rows without a
  mask come out bit for bit as in a batch without any.
* The engine (tiny Llama and its byte-level BPE tokenizer, f32): requests constrained by a JSON schema, any
  JSON object, a regex, a choice, a Lark and a GBNF grammar, on the base and on two adapters in one batch
  beside an unconstrained request, all end with finish reason ``stop`` and their text parses and validates;
  the unconstrained request's tokens are those it has alone; nothing compiles after warm-up.
* Constraints that do not compile are INVALID_ARGUMENT with llguidance's message.
"""

from __future__ import annotations

import json
import re
import uuid

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from loraserve.common.errors import InvalidArgument
from loraserve.common.finish_reasons import FinishReason
from loraserve.engine.config import EngineConfig
from loraserve.engine.engine import Engine
from loraserve.engine.request import EngineRequest, Finished, Sampling
from loraserve.kernels.testing import count_compilations
from loraserve.models.sampling import SamplingArrays, mask_words, sample
from loraserve.protos.v1 import inference_pb2 as pb
from loraserve.worker.grammar import Grammars
from tests.engines import started_engine
from tests.worker.fake_engine import Collector

V = 100


def _bitmask(allowed: list[int], vocab: int = V) -> np.ndarray:
    bits = np.zeros(mask_words(vocab) * 32, np.uint8)
    bits[allowed] = 1
    return np.packbits(bits, bitorder="little").view(np.int32)


def test_masked_rows_draw_only_allowed_tokens_and_others_are_untouched() -> None:
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((4, V)).astype(np.float32) * 3)
    allowed = [3, 77, 98]
    draw = jax.jit(sample)
    plain = draw(logits, SamplingArrays.empty(4, V))
    for seed in range(20):
        s = SamplingArrays.empty(4, V)
        s.masked[[0, 2]] = True
        s.mask[0] = s.mask[2] = _bitmask(allowed)
        s.temperature[2:] = 1.0
        s.seed_lo[:] = seed
        out = draw(logits, s)
        tokens = np.asarray(out.tokens)
        assert tokens[0] == max(allowed, key=lambda t: float(logits[0, t]))  # greedy over the allowed
        assert tokens[2] in allowed
        assert tokens[1] == np.asarray(plain.tokens)[1]  # greedy, unmasked: as without masks
        again = SamplingArrays.empty(4, V)
        again.temperature[2:], again.seed_lo[:] = 1.0, seed
        assert tokens[3] == np.asarray(draw(logits, again).tokens)[3]  # seeded, unmasked: the same draw


# ----------------------------------------------------------------------------- the engine
SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
        "ok": {"type": "boolean"},
    },
    "required": ["colour", "count", "ok"],
    "additionalProperties": False,
}
PROMPT = [5, 17, 33, 100, 7, 250, 3, 91]


@pytest.fixture(scope="module")
def served(llama_dir, adapter_dirs):
    from transformers import AutoTokenizer

    config = EngineConfig(
        max_batch_size=8,
        max_seq_len=96,
        max_loras=2,
        max_lora_rank=16,
        prefill_chunk=4,
        min_prefill_bucket=96,
    )  # one prefill bucket: a shorter warm-up (bucketing itself: test_engine.py)
    adapters = {name: adapter_dirs[name] for name in ("all-r4", "mlp-r16")}
    tokenizer = AutoTokenizer.from_pretrained(str(llama_dir))
    with started_engine(llama_dir, config, adapters) as engine:
        cfg = engine.model_config
        yield engine, tokenizer, Grammars(tokenizer, cfg.vocab_size, tuple(cfg.eos_token_ids))


def submit(engine: Engine, grammars: Grammars | None, adapter: str, spec, **sampling) -> Collector:
    c = Collector()
    grammar = None if spec is None else grammars.matcher(spec)
    sampling = {"max_tokens": 80, **sampling}
    engine.submit(
        EngineRequest(uuid.uuid4().hex, adapter, list(PROMPT), Sampling(**sampling), c, grammar=grammar)
    )
    return c


def finished(c: Collector) -> Finished:
    assert c.done.wait(120), "request did not finish"
    assert isinstance(c.end, Finished), c.end
    return c.end


CONSTRAINTS = {
    "schema": pb.StructuredOutput(json_schema=json.dumps(SCHEMA)),
    "object": pb.StructuredOutput(json_object=True),
    "regex": pb.StructuredOutput(regex=r"[a-f]{2,4}-[0-9]{2}"),
    "choice": pb.StructuredOutput(choice=pb.Choices(choices=["yes", "no", "maybe so"])),
    "lark": pb.StructuredOutput(grammar='start: "(" NUM ("," NUM)* ")"\nNUM: /[0-9]{1,2}/'),
    "gbnf": pb.StructuredOutput(grammar='root ::= "ab" [0-9] [0-9]?'),
}


def check(name: str, text: str) -> None:
    if name == "schema":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif name == "object":
        assert isinstance(json.loads(text), dict)
    elif name == "regex":
        assert re.fullmatch(r"[a-f]{2,4}-[0-9]{2}", text), text
    elif name == "choice":
        assert text in ("yes", "no", "maybe so"), text
    elif name == "lark":
        assert re.fullmatch(r"\([0-9]{1,2}(,[0-9]{1,2})*\)", text), text
    else:
        assert re.fullmatch(r"ab[0-9][0-9]?", text), text


def test_constrained_requests_on_base_and_adapters_in_one_batch_parse_and_validate(served) -> None:
    engine, tokenizer, grammars = served
    alone = submit(engine, grammars, "all-r4", None, ignore_eos=True, max_tokens=12)
    alone_tokens = (finished(alone), alone.tokens)[1]
    with count_compilations() as compiled:
        runs = {
            (name, adapter): submit(engine, grammars, adapter, spec)
            for name, spec in CONSTRAINTS.items()
            for adapter in ("", "all-r4", "mlp-r16")
        }
        free = submit(engine, grammars, "all-r4", None, ignore_eos=True, max_tokens=12)
        ends = {key: finished(c) for key, c in runs.items()}
        finished(free)
    assert compiled.compilations == 0, compiled
    assert free.tokens == alone_tokens  # the unconstrained row is unharmed by its masked neighbours
    texts = {}
    for (name, adapter), c in runs.items():
        text = tokenizer.decode(c.tokens, skip_special_tokens=True)
        assert ends[name, adapter].reason in (FinishReason.STOP, FinishReason.EOS), (name, adapter, text)
        check(name, text)
        texts[name, adapter] = text
    # the adapters change what the model says within the constraint (so the mask is not all it obeys)
    assert (
        len(
            {texts["lark", a] for a in ("", "all-r4", "mlp-r16")}
            | {texts["regex", a] for a in ("", "all-r4", "mlp-r16")}
        )
        > 2
    )


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (pb.StructuredOutput(regex="[a-"), "unclosed character class"),
        (pb.StructuredOutput(json_schema="{nope"), "json_schema is not JSON"),
        (pb.StructuredOutput(json_schema="[1, 2]"), "must be a JSON object"),
        (pb.StructuredOutput(grammar="start: ("), "does not compile"),
        (pb.StructuredOutput(choice=pb.Choices()), "at least one string"),
        (pb.StructuredOutput(), "names no constraint"),
    ],
)
def test_constraints_that_do_not_compile_are_invalid_argument(served, spec, words) -> None:
    _, _, grammars = served
    with pytest.raises(InvalidArgument) as err:
        grammars.matcher(spec)
    assert words in err.value.message
