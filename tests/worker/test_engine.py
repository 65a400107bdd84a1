"""The engine without gRPC: sampling, EOS, slot policy (LRU, pinning, host tier), swaps, compilations."""

from __future__ import annotations

import uuid
from dataclasses import replace

import grpc
import pytest

from loraserve import kernels
from loraserve.adapters.sources import LocalAdapterSource
from loraserve.common.errors import LoraserveError
from loraserve.engine.config import EngineConfig
from loraserve.engine.engine import Engine
from loraserve.engine.request import EngineRequest, Failed, Finished, Sampling, Started
from loraserve.kernels.testing import count_compilations
from loraserve.models.checkpoint import load_checkpoint
from tests.engines import local_source, started_engine
from tests.platform import NATIVE_BACKEND
from tests.worker.fake_engine import Collector

PROMPT = [5, 17, 33, 100, 7]


def submit(engine: Engine, adapter: str = "", prompt=PROMPT, **sampling) -> Collector:
    c = Collector()
    engine.submit(EngineRequest(uuid.uuid4().hex, adapter, list(prompt), Sampling(**sampling), c))
    return c


def wait(*collectors: Collector, timeout: float = 60) -> None:
    for c in collectors:
        assert c.done.wait(timeout), "request did not finish"


@pytest.fixture(scope="module")
def source(adapter_dirs) -> LocalAdapterSource:
    return local_source(adapter_dirs)


@pytest.fixture(scope="module")
def engine(llama_dir, source):
    config = EngineConfig(max_batch_size=4, max_seq_len=64, max_loras=2, max_lora_rank=16, max_cpu_loras=1)
    # no warm-up: these tests compile the shapes they run (the zero-compilation test below warms its own)
    with started_engine(llama_dir, config, source=source, warmup=False) as eng:
        yield eng


def test_seeded_sampling_is_reproducible_and_batch_independent(engine) -> None:
    a = submit(engine, temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    noise = [
        submit(engine, "all-r4", temperature=0.7, max_tokens=5) for _ in range(3)
    ]  # other rows in the batch
    b = submit(engine, temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    c = submit(engine, temperature=1.0, seed=99, max_tokens=12, ignore_eos=True)
    wait(a, b, c, *noise)
    assert a.tokens == b.tokens and len(a.tokens) == 12
    assert a.tokens != c.tokens
    greedy = submit(engine, max_tokens=12, ignore_eos=True)
    top1 = submit(engine, temperature=5.0, top_k=1, seed=7, max_tokens=12, ignore_eos=True)
    tiny_p = submit(engine, temperature=5.0, top_p=1e-6, seed=8, max_tokens=12, ignore_eos=True)
    wait(greedy, top1, tiny_p)
    assert (
        top1.tokens == greedy.tokens == tiny_p.tokens
    )  # top-k 1 and a vanishing top-p both reduce to argmax


def test_eos_ends_generation_unless_ignored(engine, llama_dir, source) -> None:
    free = submit(engine, max_tokens=12, ignore_eos=True)
    wait(free)
    eos = free.tokens[4]  # an engine of its own whose EOS is the 5th greedy token
    checkpoint = load_checkpoint(str(llama_dir))
    eos_config = replace(checkpoint.config, eos_token_ids=(eos,))
    with started_engine(
        checkpoint, engine.config, source=source, model_config=eos_config, warmup=False
    ) as eng:
        stopped = submit(eng, max_tokens=12)
        ignored = submit(eng, max_tokens=12, ignore_eos=True)
        wait(stopped, ignored)
    first = free.tokens.index(eos)  # <= 4: the id may come earlier too
    assert stopped.tokens == free.tokens[: first + 1]
    assert stopped.end == Finished("eos", len(PROMPT), first + 1, token_id=eos)
    assert ignored.tokens == free.tokens and ignored.end.reason == "length"


def test_max_tokens_capped_by_context(engine) -> None:
    c = submit(engine, prompt=[5] * 60, max_tokens=50, ignore_eos=True)
    wait(c)
    assert len(c.tokens) == 4 and c.end.reason == "length"  # 64 - 60


def test_immediate_rejections(engine) -> None:
    for kwargs in [dict(prompt=[]), dict(prompt=[1] * 64)]:
        with pytest.raises(LoraserveError) as exc:
            submit(engine, **kwargs)
        assert exc.value.code == grpc.StatusCode.INVALID_ARGUMENT
    unknown = submit(engine, "no-such")
    wait(unknown)
    assert unknown.end == Failed(grpc.StatusCode.NOT_FOUND, "adapter 'no-such' is not known to this worker")


def test_lru_eviction_pinning_and_host_tier(engine) -> None:
    for slot in engine.snapshot().slots:  # start from empty slots, whatever ran before
        if slot.adapter:
            engine.unload_adapter(slot.adapter, force=True).result(10)
    before = engine.snapshot()
    assert before.free_slots == 2
    pinned = engine.load_adapter("all-r4", pin=True).result(30)
    assert (pinned.index, pinned.adapter, pinned.pinned) == (0, "all-r4", True)
    for name in ("qv-r8-rslora", "mlp-r16", "attn-pattern", "qv-r8-rslora"):
        c = submit(engine, name, max_tokens=2)
        wait(c)
        assert isinstance(c.end, Finished), c.end
        assert c.events[0] == Started(name)
    after = engine.snapshot()
    assert [(s.index, s.adapter, s.pinned) for s in after.slots] == [
        (0, "all-r4", True),  # never evicted
        (1, "qv-r8-rslora", False),  # the other slot went round LRU
    ]
    assert after.adapter_loads - before.adapter_loads == 5  # all-r4 once, then slot 1 four times
    # max_cpu_loras=1: only the most recently fetched adapter stays in host memory
    assert after.host_tier == ("qv-r8-rslora",)
    engine.unload_adapter("all-r4").result(10)


def test_too_large_adapter_fails_precondition(llama_dir, adapter_dirs) -> None:
    config = EngineConfig(max_batch_size=2, max_seq_len=32, max_loras=1, max_lora_rank=8)
    with started_engine(llama_dir, config, {"big": adapter_dirs["mlp-r16"]}, warmup=False) as eng:
        c = submit(eng, "big", max_tokens=2)
        wait(c)
        assert c.end.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "above the largest slot rank 8" in c.end.message
        ok = submit(eng, max_tokens=2)
        wait(ok)
        assert isinstance(ok.end, Finished)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "lora_dtype"),
    [("auto", ""), ("xla", ""), (NATIVE_BACKEND, "bfloat16")],
    ids=["auto", "xla-grouped", f"{NATIVE_BACKEND}-bf16-pools"],
)
def test_no_compilation_after_warmup_over_200_requests_20_adapters_4_slots(
    llama_dir, adapter_dirs, tmp_path, backend: str, lora_dtype: str
) -> None:
    names = list(adapter_dirs)
    adapters = {f"a{i}": adapter_dirs[names[i % len(names)]] for i in range(20)}
    config = EngineConfig(
        max_batch_size=8,
        max_seq_len=64,
        max_loras=4,
        max_lora_rank=16,
        max_cpu_loras=0,
        kernel_backend=backend,
        lora_dtype=lora_dtype,
    )
    with started_engine(llama_dir, config, adapters) as eng:
        assert eng.backend == kernels.resolve_backend(backend)
        with count_compilations() as count:
            collectors = []
            for i in range(200):
                prompt = PROMPT[: 1 + i % 5] + [i % 300 + 3] * (i % 40)
                collectors.append(
                    submit(
                        eng,
                        f"a{i % 20}" if i % 7 else "",
                        prompt=prompt,
                        max_tokens=1 + i % 6,
                        temperature=0.0 if i % 2 else 0.8,
                        top_k=i % 3,
                        top_p=0.9 if i % 5 == 0 else 0.0,
                    )
                )
            wait(*collectors, timeout=300)
        assert all(isinstance(c.end, Finished) for c in collectors)
        assert eng.snapshot().adapter_loads >= 20  # 20 adapters through 4 slots: swaps really happened
        assert count.compilations == 0, count.names
