"""Registry latency at SaaS scale: a catalog of up to a million adapters and a fleet heartbeating.

The registry runs as its own process (``loraserve registry serve``, as deployed), on a fresh SQLite file
or a fresh PostgreSQL database. Adapter rows are inserted in bulk first; then ``--workers`` workers
register and heartbeat every ``--heartbeat-seconds`` (the worker's own period: lease / 3 = 5 s) from a
second process, 8 slots each, while this process measures over loopback gRPC:

* ``ListAdapters`` pages of 100 from random starting points (keyset pagination) and the first page;
* ``LocateAdapter`` of random adapters (a fraction of them held by some worker);
* upload MB/s of a ~16 MB adapter to the local store (first upload and dedup hits).

It also prints the database's plan of each hot query (``EXPLAIN``). Human-readable lines, then ONE
JSON object as the last line (docs/design.md §7: ListAdapters page p50 ≤ 10 ms, LocateAdapter p50 ≤ 2 ms at
1 000 000 adapters with 200 workers).

    python bench/registry.py                                  # 10 000 adapters, 50 workers, SQLite
    python bench/registry.py --adapters 1000000 --workers 200 --db postgres
    python bench/registry.py --db postgresql+psycopg://user@host/db   # an existing (empty) database
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import multiprocessing as mp
import random
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LOCAL_POSTGRES = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
SLOTS = 8


def adapter_name(i: int) -> str:
    return f"adapter-{i:07d}"


def synthetic_adapter(folder: Path, r: int = 64, dim: int = 4096, layers: int = 4) -> None:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    tensors = {}
    for n in range(layers):
        for m in ("q_proj", "v_proj"):
            p = f"base_model.model.model.layers.{n}.self_attn.{m}"
            tensors[f"{p}.lora_A.weight"] = rng.standard_normal((r, dim), dtype=np.float32) * 0.01
            tensors[f"{p}.lora_B.weight"] = rng.standard_normal((dim, r), dtype=np.float32) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": r,
                "lora_alpha": 2 * r,
                "target_modules": ["q_proj", "v_proj"],
                "bias": "none",
            }
        )
    )


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values) * 1000, q))


def fresh_postgres(base_url: str) -> tuple[str, object]:
    """A new database on the server of ``base_url``; -> (its URL, a function that drops it)."""
    from sqlalchemy import create_engine, make_url, text

    name = f"loraserve_bench_{uuid.uuid4().hex[:10]}"
    admin = create_engine(base_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(text(f'CREATE DATABASE "{name}"'))

    def drop() -> None:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()

    return make_url(base_url).set(database=name).render_as_string(hide_password=False), drop


def insert_catalog(db: str, n: int, chunk: int = 20_000) -> float:
    """Migrate ``db`` and insert ``n`` READY adapter rows in bulk; -> seconds taken."""
    from sqlalchemy import insert, text

    from loraserve.registry.db import AdapterRow, make_engine
    from loraserve.registry.migrate import upgrade

    upgrade(db)
    engine = make_engine(db)
    t = time.perf_counter()
    for lo in range(0, n, chunk):
        rows = [
            dict(
                name=adapter_name(i),
                version=1,
                base_model="bench-model",
                rank=16,
                alpha=32.0,
                use_rslora=False,
                target_modules=["q_proj", "v_proj"],
                size_bytes=1,
                sha256=f"{i:064x}",
                uri="",
                config="{}",
                description="",
                labels={},
                state="READY",
            )
            for i in range(lo, min(n, lo + chunk))
        ]
        with engine.begin() as conn:
            conn.execute(insert(AdapterRow), rows)
        print(f"\rinserted {min(n, lo + chunk):>9,d} / {n:,d} adapter rows", end="", flush=True)
    with engine.begin() as conn:  # fresh statistics for the planner, as a production database has
        conn.execute(text("ANALYZE"))
    engine.dispose()
    seconds = time.perf_counter() - t
    print(f" in {seconds:.1f}s", flush=True)
    return seconds


def explain(db: str, adapters: int) -> dict[str, str]:
    """The database's plan of the statements the hot RPCs send (captured from the registry's own code):
    a ListAdapters page after a token, LocateAdapter's adapter lookup and its fleet view's re-read."""
    from sqlalchemy import event

    from loraserve.registry.app import open_registry
    from loraserve.registry.catalog import _encode_token
    from loraserve.registry.config import RegistryConfig

    reg = open_registry(RegistryConfig(db=db, migrate=False))
    seen: dict[str, list] = {}

    def capture(label: str):
        seen[label] = []
        return lambda conn, cursor, sql, params, ctx, many: seen[label].append((sql, params))

    for label, call in (
        ("list_page", lambda: reg.catalog.list(100, _encode_token(adapter_name(adapters // 2), 1))),
        ("locate", lambda: reg.placement.locate(adapter_name(adapters // 3))),
    ):
        listener = capture(label)
        event.listen(reg.engine, "before_cursor_execute", listener)
        call()
        event.remove(reg.engine, "before_cursor_execute", listener)
    prefix = "EXPLAIN QUERY PLAN " if db.startswith("sqlite") else "EXPLAIN "
    plans = {}
    with reg.engine.connect() as conn:
        for label, statements in seen.items():
            for n, (sql, params) in enumerate(
                s for s in statements if s[0].lstrip().upper().startswith("SELECT")
            ):
                table = sql.split("FROM", 1)[1].split()[0]
                rows = conn.exec_driver_sql(prefix + sql, params).all()
                plans[f"{label}.{n}.{table}"] = " | ".join(str(r[-1]).strip() for r in rows)
    reg.close()
    return plans


def fleet_holdings(workers: int, adapters: int) -> list[list[str]]:
    """The adapters each bench worker holds in its slots (the same in both processes: seeded)."""
    rnd = random.Random(1)
    return [[adapter_name(a) for a in rnd.sample(range(adapters), SLOTS)] for _ in range(workers)]


def heartbeat_fleet(address: str, workers: int, adapters: int, period: float, stop, out) -> None:
    """In a child process: register ``workers`` workers, then heartbeat each every ``period`` seconds
    (spread evenly) with 8 held adapters until ``stop`` is set; put heartbeat latencies on ``out``."""
    import grpc

    from loraserve.protos.v1 import placement_pb2 as pp
    from loraserve.protos.v1 import placement_pb2_grpc
    from loraserve.protos.v1 import worker_admin_pb2 as wa

    rnd = random.Random(2)
    with grpc.insecure_channel(address) as channel:
        stub = placement_pb2_grpc.PlacementStub(channel)
        fleet = []
        for w, held in enumerate(fleet_holdings(workers, adapters)):
            wid = stub.RegisterWorker(
                pp.RegisterWorkerRequest(
                    address=f"10.1.{w // 200}.{w % 200}:50061", model_id="bench-model", slots=SLOTS
                )
            ).worker_id
            fleet.append((wid, held))
        out.put("registered")
        latencies, beat, start = [], 0, time.perf_counter()
        while not stop.is_set():
            wid, held = fleet[beat % workers]
            due = start + beat * period / workers
            time.sleep(max(0.0, due - time.perf_counter()))
            t = time.perf_counter()
            stub.Heartbeat(
                pp.HeartbeatRequest(
                    worker_id=wid,
                    load=pp.WorkerLoad(running=rnd.randint(0, 8), free_slots=0),
                    slots=[
                        wa.SlotInfo(slot=i, adapter=f"{a}@1", state=wa.SLOT_STATE_LOADED)
                        for i, a in enumerate(held)
                    ],
                )
            )
            latencies.append(time.perf_counter() - t)
            beat += 1
        out.put(latencies)


def measure(client, adapters: int, held: list[str], requests: int) -> tuple[dict[str, list[float]], int]:
    """ListAdapters pages and LocateAdapter calls (every other one of an adapter some worker holds, as a
    router asks for popular adapters), and a gRPC health check between them (the floor any unary RPC
    pays on this machine: loopback, HTTP/2, the server's event loop); -> latencies and how many Locates
    found a holder."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from loraserve.protos.v1 import placement_pb2 as pp
    from loraserve.protos.v1 import registry_pb2 as rp

    health = health_pb2_grpc.HealthStub(client.channel)

    stub, rnd = client.adapters, random.Random(0)
    for _ in range(20):  # warm-up: connections, the server's caches
        stub.ListAdapters(rp.ListAdaptersRequest(page_size=100))
        client.placement.LocateAdapter(pp.LocateAdapterRequest(adapter=adapter_name(rnd.randrange(adapters))))
    times: dict[str, list[float]] = {"list_page": [], "list_first_page": [], "locate": [], "health": []}
    found = 0
    for n in range(requests):
        start = adapter_name(rnd.randrange(adapters))
        token = base64.urlsafe_b64encode(json.dumps([start, 1]).encode()).decode()
        t = time.perf_counter()
        page = stub.ListAdapters(rp.ListAdaptersRequest(page_size=100, page_token=token))
        times["list_page"].append(time.perf_counter() - t)
        assert len(page.adapters) == 100 or start > adapter_name(adapters - 101), len(page.adapters)
        assert not page.adapters or page.adapters[0].name > start
        if n % 10 == 0:
            t = time.perf_counter()
            first = stub.ListAdapters(rp.ListAdaptersRequest(page_size=100))
            times["list_first_page"].append(time.perf_counter() - t)
            assert first.adapters[0].name == adapter_name(0)
        name = rnd.choice(held) if n % 2 else adapter_name(rnd.randrange(adapters))
        t = time.perf_counter()
        resp = client.placement.LocateAdapter(pp.LocateAdapterRequest(adapter=name))
        times["locate"].append(time.perf_counter() - t)
        assert len(resp.candidates) == 3
        found += any(c.holds_adapter for c in resp.candidates)
        t = time.perf_counter()
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
        times["health"].append(time.perf_counter() - t)
    return times, found


def upload_rates(client, tmp: Path) -> tuple[float, float]:
    folder = tmp / "big-adapter"
    synthetic_adapter(folder)
    size = (folder / "adapter_model.safetensors").stat().st_size
    rates = []
    for i in range(3):
        t = time.perf_counter()
        client.push(folder, f"upload-{i}", "other-model")
        rates.append(size / (time.perf_counter() - t) / 1e6)
    digest = hashlib.sha256((folder / "adapter_model.safetensors").read_bytes()).hexdigest()
    assert client.get("upload-0").sha256 == digest
    print(
        f"upload {size / 1e6:.1f} MB: {rates[0]:.1f} MB/s; dedup hits {statistics.median(rates[1:]):.1f} MB/s"
    )
    return rates[0], statistics.median(rates[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=50)
    parser.add_argument("--heartbeat-seconds", type=float, default=5.0, help="each worker's heartbeat period")
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument(
        "--db",
        default="sqlite",
        help="sqlite (a fresh file), postgres (a fresh database on the local server, dropped after) "
        "or a SQLAlchemy URL of an empty database",
    )
    args = parser.parse_args()

    from loraserve.client.registry_client import RegistryClient
    from loraserve.common.processes import die_with_parent, start_server

    tmp = Path(tempfile.mkdtemp(prefix="loraserve-bench-registry-"))
    drop = None
    if args.db == "sqlite":
        db = f"sqlite:///{tmp / 'registry.db'}"
    elif args.db == "postgres":
        db, drop = fresh_postgres(LOCAL_POSTGRES)
    else:
        db = args.db
    kind = db.split(":", 1)[0].split("+")[0]
    procs = []
    try:
        insert_seconds = insert_catalog(db, args.adapters)
        plans = explain(db, args.adapters)
        for key, plan in plans.items():
            print(f"plan {key:28s} {plan}")
        registry = start_server(
            ["registry", "serve", "--db", db, "--storage", str(tmp / "store"), "--port", "0"],
            preexec_fn=die_with_parent,
        )
        procs.append(registry)
        ctx = mp.get_context("spawn")
        stop, out = ctx.Event(), ctx.Queue()
        fleet = ctx.Process(
            target=heartbeat_fleet,
            args=(registry.address, args.workers, args.adapters, args.heartbeat_seconds, stop, out),
            daemon=True,
        )
        fleet.start()
        assert out.get(timeout=600) == "registered"
        print(
            f"{args.workers} workers registered; heartbeating every {args.heartbeat_seconds:g}s", flush=True
        )
        time.sleep(args.heartbeat_seconds)  # every worker has reported its slots once
        held = sorted({a for slots in fleet_holdings(args.workers, args.adapters) for a in slots})
        with RegistryClient(registry.address) as client:
            times, found = measure(client, args.adapters, held, args.requests)
            up, up_dedup = upload_rates(client, tmp)
        stop.set()
        beats = out.get(timeout=60)
        fleet.join(10)
        for key, label in (
            ("list_page", "ListAdapters (page 100)"),
            ("list_first_page", "ListAdapters first page"),
            ("locate", "LocateAdapter"),
            ("health", "health check (floor)"),
        ):
            print(f"{label:26s} p50 {pct(times[key], 50):6.2f} ms  p99 {pct(times[key], 99):6.2f} ms")
        print(
            f"{'Heartbeat':26s} p50 {pct(beats, 50):6.2f} ms  p99 {pct(beats, 99):6.2f} ms  ({len(beats)} beats)"
        )
    finally:
        for p in procs:
            p.stop()
        if drop is not None:
            drop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(
        json.dumps(
            {
                "bench": "registry",
                "adapters": args.adapters,
                "workers": args.workers,
                "heartbeat_seconds": args.heartbeat_seconds,
                "heartbeats": len(beats),
                "db": kind,
                "insert_s": round(insert_seconds, 1),
                "list_adapters_page_ms": {
                    "p50": round(pct(times["list_page"], 50), 3),
                    "p99": round(pct(times["list_page"], 99), 3),
                },
                "list_adapters_first_page_ms": {
                    "p50": round(pct(times["list_first_page"], 50), 3),
                    "p99": round(pct(times["list_first_page"], 99), 3),
                },
                "locate_adapter_ms": {
                    "p50": round(pct(times["locate"], 50), 3),
                    "p99": round(pct(times["locate"], 99), 3),
                },
                "health_check_ms": {
                    "p50": round(pct(times["health"], 50), 3),
                    "p99": round(pct(times["health"], 99), 3),
                },
                "heartbeat_ms": {"p50": round(pct(beats, 50), 3), "p99": round(pct(beats, 99), 3)},
                "locate_found_holder": round(found / args.requests, 3),
                "upload_mb_s": round(up, 1),
                "upload_mb_s_dedup": round(up_dedup, 1),
                "plans": plans,
                "targets": {"list_adapters_page_p50_ms": 10, "locate_adapter_p50_ms": 2},
            }
        )
    )


if __name__ == "__main__":
    main()
