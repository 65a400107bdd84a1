"""EleutherAI lm-evaluation-harness against a router's OpenAI-compatible HTTP port (issue #32 item 1).

A registry, one registry-backed worker (tiny random Llama, adapters "all-r4" and "qv-r8-rslora") and the
router's HTTP API run in-process. lm-eval's ``local-completions`` model (tokenizer: the model folder's HF
tokenizer, requests sent as token ids, one at a time) scores two tasks defined by YAML over local JSON files,
for both adapters and the base model:

* ``lsv_mc``, multiple choice: each choice's log-likelihood comes from an ``echo: true, logprobs: 1,
  max_tokens: 1`` completion (the prompt's token logprobs). They equal transformers (+peft) in float32 on
  the same token ids lm-eval split into context and continuation, within 1e-3 (observed: at most 2.5e-6
  over the 33 scores, 11 choices x 3 models); ``acc`` is what their argmax implies.
* ``lsv_gen``, generate-until (``until: ["\\n"]``): the outputs are the router's greedy completions of the
  same token ids, cut at the first newline, and they differ between the adapters and the base.

25-40 s on a shared 2-core machine, nearly all of it building the tiny models and compiling the engine's
programs; the three lm-eval runs take about 3 s.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from loraserve.engine.config import EngineConfig
from loraserve.registry.config import RegistryConfig
from loraserve.router.routing import Locator, WorkerPool
from loraserve.worker.registration import Registration
from loraserve.worker.registry_source import RegistryAdapterSource
from loraserve.worker.server import build_server as build_worker
from loraserve.worker.tokenizer import load_tokenizer
from tests.aio_thread import aio_server_thread, http_server_thread
from tests.e2e.procs import wait_for_workers
from tests.engines import started_engine
from tests.registry.conftest import TINY_MODEL, start_registry

pytestmark = pytest.mark.slow

ADAPTERS = ("all-r4", "qv-r8-rslora")
MODELS = (TINY_MODEL, *ADAPTERS)  # the base model's id, then the adapters'
MAX_GEN = 8
TOLERANCE = 1e-3  # float32 JAX vs float32 torch, summed over a continuation's tokens

MC_DOCS = [
    {"question": "What is the capital of France?", "choices": ["Paris", "Berlin", "Rome"], "answer": 0},
    {"question": "Who wrote the book?", "choices": ["the cat", "the answer is simple"], "answer": 1},
    {"question": "Which color is the sky?", "choices": ["red", "green", "blue", "brown"], "answer": 2},
    {"question": "What jumps over the lazy dog?", "choices": ["the quick brown fox", "one"], "answer": 0},
]
GEN_DOCS = [
    {"prompt": "The quick brown fox", "target": " jumps"},
    {"prompt": "Numbers: one two three", "target": " four"},
    {"prompt": "Adapters make one base model", "target": " speak"},
]

MC_YAML = """\
task: lsv_mc
dataset_path: json
dataset_kwargs:
  data_files: {{test: {data}}}
  cache_dir: {cache}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
"""
GEN_YAML = """\
task: lsv_gen
dataset_path: json
dataset_kwargs:
  data_files: {{test: {data}}}
  cache_dir: {cache}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {max_gen}
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
"""


@pytest.fixture(scope="module")
def router_url(llama_dir, adapter_dirs, tmp_path_factory) -> Iterator[str]:
    """``http://127.0.0.1:PORT``: the router's HTTP API over a registry and one registered worker."""
    from loraserve.httpapi.app import build_app
    from loraserve.router.http_backend import RouterHttpBackend
    from loraserve.router.server import RouterServicer

    tmp = tmp_path_factory.mktemp("lm-eval-stack")
    with ExitStack() as es:
        registry = es.enter_context(
            start_registry(
                RegistryConfig(db=f"sqlite:///{tmp / 'r.db'}", storage=str(tmp / "store"), lease_seconds=3),
                str(tmp / "store"),
            )
        )
        for name in ADAPTERS:
            registry.client.push(adapter_dirs[name], name, TINY_MODEL)
        source = RegistryAdapterSource(registry.address, cache_dir=str(tmp / "cache"))
        config = EngineConfig(max_batch_size=4, max_seq_len=128, max_loras=2, max_lora_rank=8)
        # no warm-up: only the programs these requests use get compiled (about 15 s less than warming up all)
        engine = es.enter_context(started_engine(llama_dir, config, source=source, warmup=False))
        tokenizer = load_tokenizer(str(llama_dir))
        tasks: list[asyncio.Task] = []

        async def worker():
            server, port, _ = build_worker(engine, tokenizer, TINY_MODEL, "127.0.0.1:0")
            registration = Registration(engine, registry.address, f"127.0.0.1:{port}", TINY_MODEL)
            tasks.append(asyncio.get_running_loop().create_task(registration.run()))
            return server, port

        es.enter_context(aio_server_thread(worker))
        es.callback(lambda: tasks[0].get_loop().call_soon_threadsafe(tasks[0].cancel))
        wait_for_workers(registry.client, 1)

        def app():
            locator = Locator(registry.address, ttl=0.2, max_candidates=3)
            return build_app(RouterHttpBackend(RouterServicer(locator, WorkerPool()), locator))

        port = es.enter_context(http_server_thread(app))
        yield f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def evaluated(router_url, llama_dir, tmp_path_factory) -> dict[str, dict[str, Any]]:
    """``model id -> lm_eval.simple_evaluate(...)``'s results (with samples) for both tasks."""
    tmp = tmp_path_factory.mktemp("lm-eval-tasks")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TOKENIZERS_PARALLELISM", "false")
        import datasets
        import lm_eval
        from lm_eval.tasks import TaskManager

        mp.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)  # read at import: maybe imported before
        mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        for name, docs, yaml in (("mc", MC_DOCS, MC_YAML), ("gen", GEN_DOCS, GEN_YAML)):
            data = tmp / f"{name}.jsonl"
            data.write_text("".join(json.dumps(d) + "\n" for d in docs))
            text = yaml.format(data=json.dumps(str(data)), cache=json.dumps(str(tmp / "hf")), max_gen=MAX_GEN)
            (tmp / f"{name}.yaml").write_text(text)
        manager = TaskManager(include_path=str(tmp), include_defaults=False)
        out = {}
        for model in MODELS:
            out[model] = lm_eval.simple_evaluate(
                model="local-completions",
                model_args={
                    "base_url": f"{router_url}/v1/completions",
                    "model": model,
                    "tokenizer": str(llama_dir),
                    "tokenizer_backend": "huggingface",
                    "num_concurrent": 1,
                    "max_retries": 1,
                    "max_length": 128,
                    "timeout": 60,
                },
                tasks=["lsv_mc", "lsv_gen"],
                task_manager=manager,
                limit=len(MC_DOCS),
                log_samples=True,
                bootstrap_iters=0,
            )
        return out


def _samples(results: dict[str, Any], task: str) -> list[dict[str, Any]]:
    return sorted(results["samples"][task], key=lambda s: s["doc_id"])


def _arguments(sample: dict[str, Any]) -> list[tuple[str, ...]]:
    """The request arguments of a logged sample: ``[(context, continuation), ...]`` or ``[(context, kw)]``."""
    args = sample["arguments"]
    if isinstance(args, dict):  # lm-eval 0.4.x logs {"gen_args_0": {"arg_0": ..., "arg_1": ...}, ...}
        return [tuple(a[f"arg_{i}"] for i in range(len(a))) for a in args.values()]
    return [tuple(a) for a in args]


def _encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split (TemplateLM._encode_pair, causal): trailing spaces move to the continuation; the
    whole text is encoded (no BOS: ``add_bos_token`` is off) and cut after the context's own tokens."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    ctx = tokenizer(context, add_special_tokens=False).input_ids
    return ctx, whole[len(ctx) :]


def _reference(llama_dir: Path, adapter_dir: Path | None, pairs: list[tuple[list[int], list[int]]]):
    """transformers (+peft), float32: ``[(sum of the continuation's logprobs, is greedy), ...]``."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch.float32)
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir))
    model.eval()
    out = []
    with torch.no_grad():
        for ctx, cont in pairs:
            ids = torch.tensor([ctx + cont])
            logprobs = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
            rows = logprobs[len(ctx) - 1 : -1]  # row i predicts token i + 1
            chosen = rows[torch.arange(len(cont)), torch.tensor(cont)]
            out.append((float(chosen.sum()), bool((rows.argmax(-1) == torch.tensor(cont)).all())))
    return out


def test_choice_loglikelihoods_equal_transformers_and_peft(evaluated, llama_dir, adapter_dirs) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(llama_dir))
    worst = 0.0
    per_model = {}
    for model in MODELS:
        samples = _samples(evaluated[model], "lsv_mc")
        assert [s["doc_id"] for s in samples] == list(range(len(MC_DOCS)))
        pairs, got = [], []
        for sample in samples:
            args = _arguments(sample)
            assert [a[1] for a in args] == [" " + c for c in sample["doc"]["choices"]]
            pairs += [_encode_pair(tokenizer, ctx, cont) for ctx, cont in args]
            # resps: one [(loglikelihood, is_greedy)] per choice; filtered_resps: the same, unwrapped
            assert [r[0] for r in sample["resps"]] == sample["filtered_resps"]
            got += [(float(f[0]), bool(f[1])) for f in sample["filtered_resps"]]
        want = _reference(llama_dir, None if model == TINY_MODEL else adapter_dirs[model], pairs)
        for (g, g_greedy), (w, w_greedy) in zip(got, want, strict=True):
            assert math.isfinite(g) and g < 0
            assert g == pytest.approx(w, abs=TOLERANCE), (model, got, want)
            assert g_greedy == w_greedy
            worst = max(worst, abs(g - w))
        per_model[model] = [g for g, _ in got]
    print(f"max |lm-eval - transformers| loglikelihood: {worst:.2e}")
    base = per_model[TINY_MODEL]
    for adapter in ADAPTERS:  # the adapter is applied: its scores are not the base's
        assert max(abs(a - b) for a, b in zip(per_model[adapter], base, strict=True)) > 10 * TOLERANCE


def test_accuracy_is_the_argmax_of_the_loglikelihoods(evaluated) -> None:
    for model in MODELS:
        samples = _samples(evaluated[model], "lsv_mc")
        hits = []
        for sample in samples:
            lls = [float(f[0]) for f in sample["filtered_resps"]]
            hit = float(max(range(len(lls)), key=lls.__getitem__) == sample["doc"]["answer"])
            assert sample["target"] == sample["doc"]["answer"] and sample["acc"] == hit
            hits.append(hit)
        metrics = evaluated[model]["results"]["lsv_mc"]
        assert metrics["acc,none"] == pytest.approx(sum(hits) / len(hits), abs=1e-12)
        assert evaluated[model]["config"]["model"] == "local-completions"


def test_generate_until_outputs_are_the_greedy_completions(evaluated, router_url, llama_dir) -> None:
    import openai
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(llama_dir))
    client = openai.OpenAI(base_url=f"{router_url}/v1", api_key="unused", max_retries=0)
    outputs = {}
    for model in MODELS:
        samples = _samples(evaluated[model], "lsv_gen")
        assert [s["doc_id"] for s in samples] == list(range(len(GEN_DOCS)))
        texts = []
        for sample, doc in zip(samples, GEN_DOCS, strict=True):
            ((context, kwargs),) = _arguments(sample)
            assert context == doc["prompt"] and kwargs["until"] == ["\n"]
            ids = tokenizer(context, add_special_tokens=False).input_ids
            greedy = client.completions.create(model=model, prompt=ids, max_tokens=MAX_GEN, temperature=0)
            want = greedy.choices[0].text.split("\n")[0]
            assert sample["resps"] == [[want]] and sample["filtered_resps"] == [want], (model, greedy)
            assert sample["exact_match"] == float(want == doc["target"])
            texts.append(want)
        outputs[model] = texts
        metrics = evaluated[model]["results"]["lsv_gen"]
        hits = [float(t == d["target"]) for t, d in zip(texts, GEN_DOCS, strict=True)]
        assert metrics["exact_match,none"] == pytest.approx(sum(hits) / len(hits), abs=1e-12)
    assert any(t for texts in outputs.values() for t in texts)  # not all empty
    base = outputs[TINY_MODEL]
    assert outputs[ADAPTERS[0]] != base and outputs[ADAPTERS[1]] != base
    assert outputs[ADAPTERS[0]] != outputs[ADAPTERS[1]]
