"""Router, SDK and registry-backed workers, all real servers on loopback (in-process threads).

Covers: routing to a holder, falling back to the next candidate when a worker is unreachable before the
first token, NOT_FOUND / UNAVAILABLE codes, one load for many concurrent requests of a cold adapter,
a worker that keeps serving through a registry outage and registers again, the sync and asyncio SDK,
logprobs passed through unchanged (SDK and `generate --logprobs`).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import pytest

from loraserve.client.sdk import AsyncClient, Client
from loraserve.common.errors import LoraserveError
from loraserve.engine.config import EngineConfig
from loraserve.engine.engine import Engine
from loraserve.protos.v1 import placement_pb2 as pp
from loraserve.protos.v1 import worker_admin_pb2 as wa
from loraserve.registry.config import RegistryConfig
from loraserve.router.routing import Locator, WorkerPool
from loraserve.router.server import build_server as build_router
from loraserve.worker.registration import Registration
from loraserve.worker.registry_source import RegistryAdapterSource
from loraserve.worker.server import build_server as build_worker
from loraserve.worker.tokenizer import load_tokenizer
from tests.aio_thread import aio_server_thread
from tests.e2e.procs import wait_for_workers
from tests.engines import started_engine
from tests.registry.conftest import TINY_MODEL, RegistryEnv, start_registry
from tests.waiting import settled

PROMPT = [5, 17, 33, 100, 7]


@dataclass(frozen=True)
class RouterStack:
    """A registry, one registry-backed worker (registered, heartbeating) and a router, on loopback."""

    registry: RegistryEnv
    source: RegistryAdapterSource
    engine: Engine
    registration: Registration
    registration_task: asyncio.Task
    worker_address: str
    router_address: str


@pytest.fixture(scope="module")
def stack(llama_dir, adapter_dirs, tmp_path_factory) -> Iterator[RouterStack]:
    tmp = tmp_path_factory.mktemp("router-stack")
    with ExitStack() as es:
        registry = es.enter_context(
            start_registry(
                RegistryConfig(db=f"sqlite:///{tmp / 'r.db'}", storage=str(tmp / "store"), lease_seconds=3),
                str(tmp / "store"),
            )
        )
        for name in ("all-r4", "qv-r8-rslora", "mlp-r16"):
            registry.client.push(adapter_dirs[name], name, TINY_MODEL)
        source = RegistryAdapterSource(registry.address, cache_dir=str(tmp / "cache"))
        config = EngineConfig(
            max_batch_size=4, max_seq_len=64, max_loras=2, min_prefill_bucket=64
        )  # one prefill bucket: a shorter warm-up
        engine = es.enter_context(started_engine(llama_dir, config, source=source))
        tokenizer = load_tokenizer(str(llama_dir))
        worker_side: dict[str, Any] = {}  # filled on the worker's event loop

        async def worker():
            server, port, _ = build_worker(engine, tokenizer, TINY_MODEL, "127.0.0.1:0")
            registration = Registration(engine, registry.address, f"127.0.0.1:{port}", TINY_MODEL)
            worker_side.update(
                registration=registration,
                task=asyncio.get_running_loop().create_task(registration.run()),
            )
            return server, port

        worker_port = es.enter_context(aio_server_thread(worker))
        task = worker_side["task"]  # cancelled on its own loop before that loop stops
        es.callback(lambda: task.get_loop().call_soon_threadsafe(task.cancel))

        async def router():
            server, port, _ = build_router(
                Locator(registry.address, ttl=0.2, max_candidates=3), WorkerPool(), "127.0.0.1:0"
            )
            return server, port

        router_port = es.enter_context(aio_server_thread(router))
        wait_for_workers(registry.client, 1)
        yield RouterStack(
            registry,
            source,
            engine,
            worker_side["registration"],
            task,
            f"127.0.0.1:{worker_port}",
            f"127.0.0.1:{router_port}",
        )


def test_router_streams_through_the_registered_worker(stack) -> None:
    with Client(stack.router_address) as client:
        chunks = list(client.generate(PROMPT, adapter="all-r4", max_tokens=5, ignore_eos=True))
        direct = Client(stack.worker_address).complete(
            PROMPT, adapter="all-r4@1", max_tokens=5, ignore_eos=True
        )
    assert len(chunks) == 5 and chunks[-1].finish_reason == "length" and chunks[-1].completion_tokens == 5
    assert [t for c in chunks for t in c.token_ids] == direct.token_ids
    assert {c.adapter for c in chunks} == {"all-r4@1"}


def test_router_errors(stack) -> None:
    with Client(stack.router_address) as client:
        with pytest.raises(LoraserveError) as exc:
            client.complete(PROMPT, adapter="no-such-adapter")
        assert exc.value.code_name == "NOT_FOUND"
        with pytest.raises(LoraserveError) as exc:
            client.complete([], adapter="all-r4")
        assert exc.value.code_name == "INVALID_ARGUMENT"  # the worker's answer reaches the client as-is


def test_unreachable_worker_is_skipped_before_the_first_token(stack) -> None:
    """A registered 'holder' that is down is ranked first; the router falls through to the live worker."""
    placement = stack.registry.client.placement
    dead = placement.RegisterWorker(
        pp.RegisterWorkerRequest(address="127.0.0.1:1", model_id=TINY_MODEL, slots=2)
    ).worker_id
    placement.Heartbeat(
        pp.HeartbeatRequest(
            worker_id=dead,
            slots=[wa.SlotInfo(slot=0, adapter="qv-r8-rslora@1", state=wa.SLOT_STATE_LOADED)],
            load=pp.WorkerLoad(free_slots=1),
        )
    )
    ranked = placement.LocateAdapter(pp.LocateAdapterRequest(adapter="qv-r8-rslora")).candidates
    assert ranked[0].address == "127.0.0.1:1" and ranked[0].holds_adapter
    time.sleep(0.3)  # the router's cached route expires
    with Client(stack.router_address) as client:
        out = client.complete(PROMPT, adapter="qv-r8-rslora", max_tokens=3)
    assert out.adapter == "qv-r8-rslora@1" and out.completion_tokens == 3


def test_concurrent_requests_for_a_cold_adapter_load_it_once(stack) -> None:
    loads, fetches = stack.engine.snapshot().adapter_loads, dict(stack.source.stats)
    with Client(stack.router_address) as client, ThreadPoolExecutor(6) as pool:
        outs = list(
            pool.map(
                lambda _: client.complete(PROMPT, adapter="mlp-r16", max_tokens=3, ignore_eos=True), range(6)
            )
        )
    assert len({tuple(o.token_ids) for o in outs}) == 1
    assert stack.engine.snapshot().adapter_loads - loads == 1
    fetched = sum(stack.source.stats.values()) - sum(fetches.values())
    assert fetched == 1 and stack.source.stats["direct"] > fetches["direct"]  # read straight from the store


def test_async_client(stack) -> None:
    async def main():
        async with AsyncClient(stack.router_address) as client:
            return [
                c
                async for c in client.generate("Colors: red", adapter="all-r4", max_tokens=4, ignore_eos=True)
            ]

    chunks = asyncio.run(main())
    assert chunks[-1].finish_reason == "length" and sum(len(c.token_ids) for c in chunks) == 4


def test_worker_serves_through_a_registry_outage_and_registers_again(stack, llama_dir) -> None:
    """The registry's database forgets the worker (as after a wipe): its next heartbeat re-registers it."""
    first_id = stack.registration.worker_id
    with stack.registry.registry.catalog.sessions() as s:
        from sqlalchemy import delete

        from loraserve.registry.db import WorkerRow

        s.execute(delete(WorkerRow))
        s.commit()
    # resident adapters keep serving directly from the worker meanwhile
    assert (
        Client(stack.worker_address).complete(PROMPT, adapter="all-r4@1", max_tokens=2).completion_tokens == 2
    )
    workers = settled(stack.registry.client.workers, bool, timeout=10, interval=0.1)
    assert [w.address for w in workers] == [stack.worker_address] and workers[0].worker_id != first_id


def test_generate_cli(stack, capsys) -> None:
    from loraserve.cli import main

    assert (
        main(
            [
                "generate",
                "--target",
                stack.router_address,
                "--adapter",
                "all-r4",
                "--max-tokens",
                "3",
                "Colors: red",
            ]
        )
        == 0
    )
    out = capsys.readouterr()
    assert "[all-r4@1; finish " in out.err and "3 completion tokens]" in out.err
    assert main(["generate", "--target", stack.router_address, "--adapter", "missing", "hi"]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err


def test_logprobs_through_the_router_sdk_and_cli(stack, capsys) -> None:
    """The router passes logprobs through unchanged: the SDK gets the worker's own entries, one per token."""
    from loraserve.cli import main

    kw = dict(adapter="all-r4", max_tokens=4, ignore_eos=True, logprobs=3)
    routed = Client(stack.router_address).complete(PROMPT, **kw)
    direct = Client(stack.worker_address).complete(PROMPT, **kw)
    assert routed.logprobs == direct.logprobs
    assert [lp.chosen.token_id for lp in routed.logprobs] == routed.token_ids and len(routed.token_ids) == 4
    for lp in routed.logprobs:
        assert len(lp.top) == 3 and lp.top[0] == lp.chosen and lp.chosen.logprob < 0
        assert lp.chosen.token_bytes  # the tiny model's tokenizer names every token
    assert Client(stack.router_address).complete(PROMPT, max_tokens=2).logprobs == []
    args = ["generate", "--target", stack.router_address, "--max-tokens", "3", "--logprobs", "2", "Colors"]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    for line in lines:
        token_id, token, logprob, alts = line.split("\t")
        assert int(token_id) >= 0 and float(logprob) < 0 and alts.count(", ") == 1
        assert alts.startswith(f"[{token} {logprob}, ")  # greedy: the token is the most likely one
        assert isinstance(json.loads(token), str)
    assert main([*args, "--json"]) == 0
    chunks = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [len(c["logprobs"]) for c in chunks] == [len(c["token_ids"]) for c in chunks]
    first = chunks[0]["logprobs"][0]
    assert first["chosen"]["token_id"] == chunks[0]["token_ids"][0] and len(first["top"]) == 2
    assert bytes(first["chosen"]["bytes"]).decode("utf-8", "replace") == first["chosen"]["token"]
    assert main([*args[:-3], "Colors", "--json"]) == 0  # without --logprobs: no logprobs key at all
    assert all("logprobs" not in json.loads(x) for x in capsys.readouterr().out.splitlines())


def test_router_without_workers_is_unavailable(tmp_path) -> None:
    config = RegistryConfig(db=f"sqlite:///{tmp_path / 'r.db'}", storage=str(tmp_path / "s"))
    with start_registry(config, str(tmp_path / "s")) as reg:

        async def router():
            server, port, _ = build_router(
                Locator(reg.address, ttl=0.2, max_candidates=3), WorkerPool(), "127.0.0.1:0"
            )
            return server, port

        with aio_server_thread(router) as port, Client(f"127.0.0.1:{port}") as client:
            with pytest.raises(LoraserveError) as exc:
                client.complete(PROMPT)
            assert exc.value.code_name == "UNAVAILABLE" and "no worker" in exc.value.message


def test_router_http_api(stack) -> None:
    """The router's OpenAI-compatible API: the same tokens as its gRPC, /v1/models from the registry and the
    live workers, NOT_FOUND as 404."""
    import httpx
    import openai

    from loraserve.httpapi.app import build_app
    from loraserve.router.http_backend import RouterHttpBackend
    from loraserve.router.server import RouterServicer
    from tests.aio_thread import http_server_thread

    def make():
        locator = Locator(stack.registry.address, ttl=0.2, max_candidates=3)
        return build_app(RouterHttpBackend(RouterServicer(locator, WorkerPool()), locator))

    with http_server_thread(make) as port, Client(stack.router_address) as client:
        url = f"http://127.0.0.1:{port}"
        http = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        for model, adapter in ((TINY_MODEL, ""), ("qv-r8-rslora", "qv-r8-rslora")):
            want = client.complete(PROMPT, adapter=adapter, max_tokens=6, ignore_eos=True)
            out = http.completions.create(
                model=model, prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True}
            )
            assert out.choices[0].text == want.text and out.usage.prompt_tokens == len(PROMPT)
        models = {m.id: m for m in http.models.list()}
        assert next(iter(models)) == TINY_MODEL
        assert {"all-r4", "qv-r8-rslora", "mlp-r16"} <= set(models)
        assert models["all-r4"].model_dump()["parent"] == TINY_MODEL
        assert models["all-r4"].model_dump()["root"] == "all-r4@1"
        resp = httpx.post(f"{url}/v1/completions", json={"model": "never-pushed", "prompt": "x"}, timeout=30)
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "NOT_FOUND"
        # lm-eval's log-likelihood request and several choices, through the router's HTTP port
        echoed = http.completions.create(
            model="qv-r8-rslora", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1, echo=True
        )
        scored = client.complete(PROMPT, adapter="qv-r8-rslora", max_tokens=1, prompt_logprobs=1)
        lp = echoed.choices[0].logprobs
        assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(PROMPT) + 1
        want = [e.chosen.logprob for e in scored.prompt_logprobs[1:]]
        assert lp.token_logprobs[1 : len(PROMPT)] == pytest.approx(want, abs=1e-6)
        many = http.completions.create(
            model="qv-r8-rslora", prompt=[PROMPT, PROMPT[:3]], n=2, max_tokens=3, temperature=0
        )
        assert [c.index for c in many.choices] == [0, 1, 2, 3]
        assert many.choices[0].text == many.choices[1].text and many.usage.prompt_tokens == len(PROMPT) + 3


def test_rollout_split_and_rollback_through_the_router(stack, adapter_dirs) -> None:
    """1000 requests through rollout@prod at 90/10: each reports the version it used, the share of v2 is within
    binomial bounds, a routing key pins a user to one version; then a rollback mid-stream fails nothing and
    every later request is on v1."""
    import math

    reg = stack.registry.client
    reg.push(adapter_dirs["all-r4"], "rollout", TINY_MODEL)
    reg.push(adapter_dirs["mlp-r16"], "rollout", TINY_MODEL)
    reg.set_alias("rollout", "prod", [(1, 90), (2, 10)], "test")
    n = 1000
    with Client(stack.router_address) as client, ThreadPoolExecutor(16) as pool:

        def ask(i: int, key: str = "") -> str:
            return client.complete(PROMPT, adapter="rollout@prod", max_tokens=1, routing_key=key).adapter

        used = list(pool.map(ask, range(n)))
        assert set(used) <= {"rollout@1", "rollout@2"}
        share = used.count("rollout@2") / n
        assert abs(share - 0.1) <= 4 * math.sqrt(0.1 * 0.9 / n), share  # 4 sigma: 0.062..0.138
        pinned = {key: {ask(0, key) for _ in range(5)} for key in ("alice", "bob", "carol", "dave")}
        assert all(len(v) == 1 for v in pinned.values()), pinned

        futures = [pool.submit(ask, i) for i in range(200)]
        time.sleep(0.05)
        reg.set_alias("rollout", "prod", [(1, 1)], "rollback")  # roll back while requests are in flight
        results = [f.result() for f in futures]  # none fails
        assert set(results) <= {"rollout@1", "rollout@2"}
        time.sleep(0.3)  # the router's locate TTL (0.2 s) passes
        assert set(pool.map(ask, range(100))) == {"rollout@1"}
    history = reg.alias_history("rollout", "prod")
    assert [[t.version for t in h.after] for h in history] == [[1, 2], [1]]


def test_heartbeats_report_tiers_and_a_warm_worker_is_chosen_over_a_cold_one(stack, capsys) -> None:
    """The real worker reports adapters evicted from its slots as host-tier; LocateAdapter ranks a host-tier
    worker over a cold one with free slots, and the router tries it first."""
    for name in ("all-r4", "qv-r8-rslora", "mlp-r16"):  # three adapters through two slots: one is evicted
        with Client(stack.router_address) as client:
            client.complete(PROMPT, adapter=name, max_tokens=1)

    # the heartbeat after the last load reports two adapters on the device and the evicted one on the host;
    # a report taken between two heartbeats (or just after the worker registered again, a lease having run
    # out on a loaded machine) may not show it yet: wait for it
    def tiers_now() -> dict[str, int]:
        worker = next(w for w in stack.registry.client.workers() if w.address == stack.worker_address)
        return {r.adapter: r.tier for r in worker.residency}

    def steady(tiers: dict[str, int]) -> bool:
        held = list(tiers.values())
        return held.count(pp.RESIDENCY_TIER_HOST) >= 1 and held.count(pp.RESIDENCY_TIER_DEVICE) == 2

    tiers = settled(tiers_now, steady, timeout=15, interval=0.2)
    on_host = [a for a, t in tiers.items() if t == pp.RESIDENCY_TIER_HOST]
    assert on_host and sum(t == pp.RESIDENCY_TIER_DEVICE for t in tiers.values()) == 2, tiers
    warm = on_host[0]

    # A cold worker with every slot free, registered beside the real one (it never serves: only ranked).
    placement = stack.registry.client.placement
    cold = placement.RegisterWorker(
        pp.RegisterWorkerRequest(address="127.0.0.1:9", model_id=TINY_MODEL, slots=8), timeout=5
    )
    placement.Heartbeat(
        pp.HeartbeatRequest(worker_id=cold.worker_id, load=pp.WorkerLoad(free_slots=8)), timeout=5
    )
    resp = placement.LocateAdapter(pp.LocateAdapterRequest(adapter=warm, max_candidates=3), timeout=5)
    assert [(c.address, c.tier) for c in resp.candidates] == [
        (stack.worker_address, pp.RESIDENCY_TIER_HOST),
        ("127.0.0.1:9", pp.RESIDENCY_TIER_UNSPECIFIED),
    ]

    async def order() -> list[str]:
        locator = Locator(stack.registry.address, ttl=0.2, max_candidates=3)
        try:
            return WorkerPool().order(await locator.locate(warm))
        finally:
            await locator.close()

    assert asyncio.run(order()) == [stack.worker_address, "127.0.0.1:9"]
    from loraserve.cli import main

    assert main(["workers", "ls", "--adapters", "--registry", stack.registry.address]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[1:]]
    assert [r[3] for r in rows if r[2] == warm] == ["host"]
    assert sorted(r[3] for r in rows if r[1] == stack.worker_address).count("device") == 2
    placement.Heartbeat(pp.HeartbeatRequest(worker_id=cold.worker_id), timeout=5)  # keeps ListWorkers tidy


def test_per_adapter_usage_reaches_the_registry_and_the_metrics(stack, adapter_dirs, capsys) -> None:
    """Three requests for one adapter through the router: the worker's heartbeats carry its exact totals,
    `GetAdapterStats` / `loraserve adapters stats` sum them per version with the holder and its tier, and the
    worker's per-adapter Prometheus series say the same."""
    from prometheus_client import CollectorRegistry, generate_latest

    from loraserve.cli import main
    from loraserve.engine.accounting import AccountingCollector

    reg = stack.registry.client
    # bytes no other test of this module loads: the worker's disk cache (keyed by sha256) cannot have them
    pushed = reg.push(adapter_dirs["attn-pattern"], "acct", TINY_MODEL)
    with Client(stack.router_address) as client:
        answers = [client.complete(PROMPT, adapter="acct", max_tokens=4, ignore_eos=True) for _ in range(3)]
    assert [(a.adapter, a.prompt_tokens, a.completion_tokens) for a in answers] == [("acct@1", 5, 4)] * 3
    # one heartbeat (lease 3 s / 3)
    v = settled(lambda: reg.stats("acct").versions[0], lambda v: v.usage.requests >= 3, interval=0.2)
    u = v.usage
    assert (v.version, u.requests, u.prompt_tokens, u.completion_tokens, u.loads) == (1, 3, 15, 12, 1)
    assert u.fetched_bytes == pushed.size_bytes  # the one load read the blob from the object store
    assert [(h.address, h.tier) for h in v.holders] == [(stack.worker_address, pp.RESIDENCY_TIER_DEVICE)]

    assert main(["adapters", "stats", "acct", "--registry", stack.registry.address]) == 0
    header, row = capsys.readouterr().out.splitlines()[:2]
    assert header.split()[:3] == ["VERSION", "ALIASES", "REQUESTS"]
    assert row.split() == [
        "acct@1",
        "-",
        "3",
        "15",
        "12",
        "1",
        str(pushed.size_bytes),
        f"{stack.worker_address}:device",
    ]
    assert main(["adapters", "stats", "never-pushed", "--registry", stack.registry.address]) == 1
    assert "NOT_FOUND" in capsys.readouterr().err

    registry = CollectorRegistry()
    registry.register(AccountingCollector(stack.engine.accounting))
    text = generate_latest(registry).decode()
    assert 'loraserve_adapter_requests_total{adapter="acct@1"} 3.0' in text
    assert 'loraserve_adapter_completion_tokens_total{adapter="acct@1"} 12.0' in text
    assert f'loraserve_adapter_fetched_bytes_total{{adapter="acct@1"}} {float(pushed.size_bytes)}' in text


def test_mix_route_prefers_workers_holding_more_of_the_mix() -> None:
    from loraserve.router.routing import Route, mix_route

    a = Route("a@1", ("w1", "w2", "w3"), frozenset({"w3"}), 5.0, warm=("w2",))
    b = Route("b@4", ("w2", "w1", "w4"), frozenset({"w2"}), 4.0)
    route = mix_route([(0.7, a), (-0.3, b)])
    # w2: b in a slot (2) + a in host memory (1); w3: a in a slot (2); w1, w4: nothing, in a's order
    assert route.adapter == "a@1*0.7+b@4*-0.3" and route.at == 4.0
    assert route.addresses == ("w2", "w3", "w1", "w4") and route.holders == {"w2", "w3"}
    assert WorkerPool().order(route)[:2] == ["w2", "w3"]


def test_mix_through_the_router_sdk_and_cli(stack, capsys) -> None:
    """A weighted mix through the router: its parts resolved to versions (reported back), the worker's
    tokens; refusals with their codes; the mix's slot never reaches the registry's placements. Last in the
    file: the mix takes one of the worker's two slots."""
    from loraserve.cli import main

    mix = {"all-r4": 0.7, "qv-r8-rslora": 0.3}
    with Client(stack.router_address) as client:
        out = client.complete(PROMPT, mix=mix, max_tokens=4, ignore_eos=True)
        alone = client.complete(PROMPT, adapter="all-r4", max_tokens=4, ignore_eos=True)
        negated = client.complete(
            PROMPT, mix={"all-r4": -0.7, "qv-r8-rslora": 0.3}, max_tokens=4, ignore_eos=True
        )
    assert out.adapter == "all-r4@1*0.7+qv-r8-rslora@1*0.3" and out.completion_tokens == 4
    with Client(stack.worker_address) as client:  # the worker alone, parts named by version: the same tokens
        direct = client.complete(
            PROMPT, mix=[("all-r4@1", 0.7), ("qv-r8-rslora@1", 0.3)], max_tokens=4, ignore_eos=True
        )
    assert direct.token_ids == out.token_ids and direct.adapter == out.adapter
    assert out.token_ids != alone.token_ids or out.token_ids != negated.token_ids  # the weights matter
    refusals = [
        (dict(mix=mix, adapter="all-r4"), "INVALID_ARGUMENT", "not both"),
        (dict(mix={"all-r4": 0.5, "all-r4@1": 0.5}), "INVALID_ARGUMENT", "twice"),
        (dict(mix={"all-r4": 0.5, "nope": 0.5}), "NOT_FOUND", "nope"),
        (dict(mix={"all-r4": float("nan")}), "INVALID_ARGUMENT", "finite"),
        (
            dict(mix={"all-r4": 0.5, "qv-r8-rslora": -1e16}),
            "INVALID_ARGUMENT",
            "'qv-r8-rslora' must be finite and within ±100",
        ),
        (dict(mix={"all-r4": 0.5, "mlp-r16": 0.5}), "FAILED_PRECONDITION", "rank 20"),
    ]
    with Client(stack.router_address) as client:
        for kwargs, code, words in refusals:
            with pytest.raises(LoraserveError) as err:
                client.complete(PROMPT, max_tokens=2, **kwargs)
            assert err.value.code.name == code and words in err.value.message, (kwargs, err.value)
    with (
        Client(stack.worker_address) as client,
        pytest.raises(LoraserveError) as err,
    ):  # the worker's --max-mix
        client.complete(
            PROMPT, max_tokens=2, mix={n: 1.0 for n in ("all-r4", "qv-r8-rslora", "mlp-r16", "a", "b")}
        )
    assert err.value.code.name == "INVALID_ARGUMENT" and "at most 4" in err.value.message
    with Client(stack.worker_address) as client, pytest.raises(LoraserveError) as err:
        client.complete(PROMPT, max_tokens=2, mix={"all-r4": 1e16})  # the mix ref's 1e16 is no "1e+16"
    assert err.value.code.name == "INVALID_ARGUMENT" and "within ±100, got 1e+16" in err.value.message
    argv = ["generate", "--target", stack.router_address, "--mix", "all-r4=0.7, qv-r8-rslora=0.3"]
    assert main([*argv, "--max-tokens", "3", "--ignore-eos", "--stop-token-id", "2", "Colors: red"]) == 0
    assert "[all-r4@1*0.7+qv-r8-rslora@1*0.3; finish length; " in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--target", stack.router_address, "--mix", "all-r4", "hi"])
    assert exit_.value.code == 2 and "'all-r4' is not ADAPTER=WEIGHT" in capsys.readouterr().err
    seen = stack.registration.heartbeats
    # two heartbeats since: the registry has seen the mix's slot
    settled(lambda: stack.registration.heartbeats, lambda n: n >= seen + 2, interval=0.1)
    assert any("*" in s.adapter for s in stack.engine.snapshot().slots)
    worker = next(w for w in stack.registry.client.workers() if w.address == stack.worker_address)
    assert [s.adapter for s in worker.slot_infos if "*" in s.adapter] == []
    held = {s.adapter for s in worker.slot_infos} | {r.adapter for r in worker.residency}
    assert {"all-r4@1", "qv-r8-rslora@1"} <= held
