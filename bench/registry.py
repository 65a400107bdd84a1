"""Registry latency and throughput over loopback gRPC, with a fleet-sized catalog.

10 000 adapters (rows inserted in bulk) and 50 workers with 8 slots each (registered and heartbeating
through the RPCs): ListAdapters page (100) and LocateAdapter p50/p99, and upload MB/s of a ~16 MB
adapter to the local store. Prints human-readable lines, then ONE JSON object as the last line.

    python bench/registry.py [--adapters 10000] [--workers 50] [--db URL]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=50)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--db", default="", help="SQLAlchemy URL (default: a fresh SQLite file)")
    args = parser.parse_args()

    from sqlalchemy import insert

    from loraserve.protos.v1 import placement_pb2 as pp
    from loraserve.protos.v1 import registry_pb2 as rp
    from loraserve.protos.v1 import worker_admin_pb2 as wa
    from loraserve.registry.config import RegistryConfig
    from loraserve.registry.db import AdapterRow
    from tests.registry.conftest import start_registry

    tmp = Path(tempfile.mkdtemp(prefix="loraserve-bench-registry-"))
    db = args.db or f"sqlite:///{tmp / 'registry.db'}"
    config = RegistryConfig(db=db, storage=str(tmp / "store"), lease_seconds=600, max_upload_bytes=1 << 30)
    with start_registry(config, str(tmp / "store")) as env:
        t = time.perf_counter()
        rows = [
            dict(
                name=f"adapter-{i:05d}",
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
            for i in range(args.adapters)
        ]
        with env.registry.catalog.sessions() as s:
            s.execute(insert(AdapterRow), rows)
            s.commit()
        print(f"inserted {args.adapters} adapter rows in {time.perf_counter() - t:.1f}s", flush=True)
        rnd = random.Random(0)
        for w in range(args.workers):
            wid = env.client.placement.RegisterWorker(
                pp.RegisterWorkerRequest(
                    address=f"10.1.{w // 200}.{w % 200}:50061", model_id="bench-model", slots=8
                )
            ).worker_id
            held = rnd.sample(range(args.adapters), 8)
            env.client.placement.Heartbeat(
                pp.HeartbeatRequest(
                    worker_id=wid,
                    load=pp.WorkerLoad(running=rnd.randint(0, 8), free_slots=0),
                    slots=[
                        wa.SlotInfo(slot=i, adapter=f"adapter-{a:05d}@1", state=wa.SLOT_STATE_LOADED)
                        for i, a in enumerate(held)
                    ],
                )
            )
        stub = env.client.adapters
        for _ in range(20):  # warm-up
            stub.ListAdapters(rp.ListAdaptersRequest(page_size=100))
        list_times, locate_times = [], []
        for _ in range(args.requests):
            start = f"adapter-{rnd.randrange(args.adapters):05d}"
            token = __import__("base64").urlsafe_b64encode(json.dumps([start, 1]).encode()).decode()
            t = time.perf_counter()
            page = stub.ListAdapters(rp.ListAdaptersRequest(page_size=100, page_token=token))
            list_times.append(time.perf_counter() - t)
            assert len(page.adapters) == 100 or start > f"adapter-{args.adapters - 101:05d}"
            t = time.perf_counter()
            resp = env.client.placement.LocateAdapter(
                pp.LocateAdapterRequest(adapter=f"adapter-{rnd.randrange(args.adapters):05d}")
            )
            locate_times.append(time.perf_counter() - t)
            assert len(resp.candidates) == 3
        print(
            f"ListAdapters (page 100)  p50 {pct(list_times, 50):6.2f} ms  p99 {pct(list_times, 99):6.2f} ms",
            flush=True,
        )
        print(
            f"LocateAdapter            p50 {pct(locate_times, 50):6.2f} ms  p99 {pct(locate_times, 99):6.2f} ms",
            flush=True,
        )
        folder = tmp / "big-adapter"
        synthetic_adapter(folder)
        size = (folder / "adapter_model.safetensors").stat().st_size
        rates = []
        for i in range(3):
            (folder / "adapter_model.safetensors").write_bytes(
                (folder / "adapter_model.safetensors").read_bytes()
            )
            t = time.perf_counter()
            env.client.push(folder, f"upload-{i}", "other-model")
            rates.append(size / (time.perf_counter() - t) / 1e6)
        print(
            f"upload {size / 1e6:.1f} MB: {statistics.median(rates):.1f} MB/s (median of 3; 2nd and 3rd are dedup hits)",
            flush=True,
        )
        digest = hashlib.sha256((folder / "adapter_model.safetensors").read_bytes()).hexdigest()
        assert env.client.get("upload-0").sha256 == digest
    print(
        json.dumps(
            {
                "bench": "registry",
                "adapters": args.adapters,
                "workers": args.workers,
                "db": db.split(":", 1)[0],
                "list_adapters_page_ms": {
                    "p50": round(pct(list_times, 50), 3),
                    "p99": round(pct(list_times, 99), 3),
                },
                "locate_adapter_ms": {
                    "p50": round(pct(locate_times, 50), 3),
                    "p99": round(pct(locate_times, 99), 3),
                },
                "upload_mb_s": round(rates[0], 1),
                "upload_mb_s_dedup": round(statistics.median(rates[1:]), 1),
                "targets": {"list_adapters_page_p50_ms": 10, "locate_adapter_p50_ms": 5},
            }
        )
    )


if __name__ == "__main__":
    main()
