"""Async decode (``--async-decode``, ``EngineConfig.async_decode``): each decode step is dispatched before the
step before it is read, its tokens taken from that step's output where it lies. A request's events must be
exactly those of the synchronous scheduler, whatever happens to the batch meanwhile: requests ending by
length, EOS and stop tokens, cancels and deadlines, preemption for pages, structured output, adapters, and
newcomers joining. Over the FakeRunner (exact tokens, its simulated cache checks every read) and over the
real JAX runner (greedy and seeded tokens, no compilation after warm-up)."""

from __future__ import annotations

import dataclasses

import pytest

from loraserve.engine.config import EngineConfig
from loraserve.engine.scheduler import Cancel
from tests.worker.fake_engine import Harness, source_of

# test_tensor_parallel_same_tokens_and_no_compilation's child never opens the chip (JAX_PLATFORMS=cpu): on a TPU
# host it would only repeat the CPU run
TP_ON_CPU = (
    "its child process (JAX_PLATFORMS=cpu) serves on a mesh of two forced CPU devices through the C++ kernels:"
    " nothing of it runs on the chip"
)

CFG = EngineConfig(max_batch_size=3, max_seq_len=32, max_loras=2, max_lora_rank=4, max_cpu_loras=2)


def _harness(config: EngineConfig, on: bool) -> Harness:
    return Harness(dataclasses.replace(config, async_decode=on), source_of("a", "b", "c"))


def _script(h: Harness) -> list:
    """A batch that changes under the steps: lengths, EOS, a stop token, adapters, a cancel, a deadline and
    newcomers arriving mid-stream. Returns the collectors (in submission order)."""
    out = [
        h.submit(max_tokens=9),
        h.submit("a", max_tokens=12),
        h.submit(prompt=(44,), max_tokens=10),  # 45 .. 49 = EOS of TINY: ends by EOS
    ]
    h.step(4)
    out.append(h.submit("b", prompt=(3, 5), max_tokens=7, stop_token_ids=(17,)))  # 8, 11, 14, 17: a stop
    h.step(3)
    victim = h.submit("a", prompt=(9,), max_tokens=20)
    out.append(victim)
    h.step(2)
    h.post(Cancel(victim.request_id))
    late = h.submit(prompt=(2, 3, 4), max_tokens=6, deadline=h.now + 5)
    out.append(late)
    h.step(2)
    h.now += 10  # its deadline passes mid-stream
    out.append(h.submit("c", max_tokens=8))
    h.run(*out)
    return out


def _preempting(h: Harness) -> list:
    """Two rows that outgrow a 5-page pool: the newest is preempted, then resumes (test_scheduler's case)."""
    out = [h.submit(prompt=(1, 2, 3), max_tokens=12), h.submit("a", prompt=(10, 11, 12), max_tokens=12)]
    h.run(*out)
    return out


PAGED = EngineConfig(
    max_batch_size=2, max_seq_len=16, max_loras=2, max_lora_rank=4, kv_page_size=4, kv_pages=6
)


@pytest.mark.parametrize(
    ("config", "script"),
    [(CFG, _script), (dataclasses.replace(CFG, max_batch_size=1), _script), (PAGED, _preempting)],
    ids=["3 rows", "1 row", "preemption"],
)
def test_the_same_events_as_one_step_at_a_time(config: EngineConfig, script) -> None:
    sync, chained = _harness(config, False), _harness(config, True)
    want, got = script(sync), script(chained)
    assert [c.events for c in got] == [c.events for c in want]
    assert chained.scheduler.chained > 0 and sync.scheduler.chained == 0
    for h in (sync, chained):  # every page back: none leaked by a step whose row ended while it ran
        assert h.scheduler.kv.used == 0
    assert chained.scheduler.snapshot().requests_done == sync.scheduler.snapshot().requests_done
    if script is _preempting:  # the case it is there for, both ways
        assert sync.scheduler.preemptions > 0 and chained.scheduler.preemptions > 0


def test_a_step_in_flight_is_read_before_a_command_and_when_the_batch_empties() -> None:
    h = _harness(CFG, True)
    a = h.submit(max_tokens=6)
    h.step(3)  # prefill (+ first decode dispatched), then chained steps
    assert h.scheduler._inflight is not None
    seen = list(a.tokens)
    h.post(Cancel("nobody"))  # any command reads the step in flight first
    h.step()
    assert len(a.tokens) >= len(seen) + 1
    h.run(a)
    assert a.tokens == [6, 7, 8, 9, 10, 11] and a.end.reason == "length"
    h.step(2)
    assert h.scheduler._inflight is None  # nothing left in flight once the batch is empty


def test_no_chaining_for_structured_output_or_a_last_step() -> None:
    """A row under a grammar needs its last token for the next mask; a row whose step in flight is its last by
    length needs no next step: the scheduler reads first there."""
    h = _harness(CFG, True)
    one = h.submit(max_tokens=1)  # its first token (the prefill's) is its last: no decode step at all
    two = h.submit(max_tokens=2)
    h.run(one, two)
    assert h.scheduler.chained == 0 and two.tokens == [6, 7]


def test_the_flag_and_its_environment_twin() -> None:
    import argparse

    from loraserve.common.config import config_from_args
    from loraserve.worker.cli import add_arguments
    from loraserve.worker.config import ENV_PREFIX, WorkerConfig

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    flag = config_from_args(WorkerConfig, ENV_PREFIX, parser.parse_args(["--async-decode", "false"]))
    assert flag.engine_config().async_decode is False
    assert (
        WorkerConfig.from_env({"LORASERVE_WORKER_ASYNC_DECODE": "true"}).engine_config().async_decode is True
    )
    assert WorkerConfig.from_env({}).engine_config().async_decode is True  # on in the worker process
    assert (
        WorkerConfig.from_env({"LORASERVE_WORKER_ASYNC_DECODE": "false"}).engine_config().async_decode
        is False
    )
    assert EngineConfig().async_decode is False  # one step at a time where built in code


def test_real_runner_same_tokens_and_no_compilation(llama_dir, adapter_dirs) -> None:
    """The JAX runner: a step's tokens read from the device output of the step before, greedy and seeded
    rows, adapters and the base in one batch, requests of different lengths: the tokens of the synchronous
    engine, and no compilation after warm-up."""
    from loraserve.kernels.testing import count_compilations
    from tests.engines import started_engine
    from tests.worker.test_engine import submit, wait

    plans = [
        ("", [5, 17, 33], dict(max_tokens=12)),
        ("all-r4", [9, 8, 7, 6], dict(max_tokens=7)),
        ("qv-r8-rslora", [100, 7], dict(max_tokens=10, temperature=0.8, seed=5)),
        ("all-r4", [3], dict(max_tokens=15, top_p=0.9, temperature=1.0, seed=9)),
    ]

    def run(on: bool) -> tuple[list[list[int]], int, int]:
        config = EngineConfig(
            max_batch_size=4,
            max_seq_len=64,
            max_loras=2,
            max_lora_rank=16,
            async_decode=on,
            min_prefill_bucket=64,
        )  # one prefill bucket: a shorter warm-up (bucketing itself: test_engine.py)
        with started_engine(llama_dir, config, adapter_dirs) as engine:
            with count_compilations() as count:
                collectors = [submit(engine, a, p, ignore_eos=True, **kw) for a, p, kw in plans]
                wait(*collectors)
            return [c.tokens for c in collectors], count.compilations, engine.scheduler.chained

    (want, _, none), (got, compiled, chained) = run(False), run(True)
    assert got == want and none == 0 and chained > 0
    assert compiled == 0
    assert [len(t) for t in got] == [12, 7, 10, 15]


_TP_CHILD = """
import json, sys
from loraserve.kernels.testing import count_compilations
from loraserve.engine.config import EngineConfig
from tests.engines import started_engine
from tests.worker.test_engine import submit, wait

def run(on):
    config = EngineConfig(max_batch_size=4, max_seq_len=64, max_loras=2, max_lora_rank=8, tensor_parallel_size=2,
                          kernel_backend="cpu", async_decode=on)
    with started_engine(sys.argv[1], config) as engine:
        with count_compilations() as count:
            rows = [submit(engine, "", [5, 6, 7 + i], max_tokens=9 + i, ignore_eos=True,
                           temperature=0.7 if i % 2 else 0.0, seed=i) for i in range(4)]
            wait(*rows)
        return [r.tokens for r in rows], count.compilations + count.backend_compiles, engine.scheduler.chained

print(json.dumps([run(False), run(True)]))
"""


@pytest.mark.cpu_only(TP_ON_CPU)
def test_tensor_parallel_same_tokens_and_no_compilation(tmp_path) -> None:
    """On a mesh (TP = 2 over two forced CPU devices) the step before's draw is replicated over it, as the
    steps pin their output: a chained step is the same compiled program, and the tokens are the same."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from loraserve.testing import save_model
    from tests.conftest import with_test_xla_flags

    model = save_model(tmp_path / "llama", "llama", seed=3, num_attention_heads=4, num_key_value_heads=2)
    flags = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"
    env = with_test_xla_flags({"XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"})
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, "-c", _TP_CHILD, str(model)],
        cwd=root, env={**os.environ, **env}, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (want, _, none), (got, compiled, chained) = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == want and [len(t) for t in got] == [9, 10, 11, 12]
    assert (none, compiled) == (0, 0) and chained > 0
