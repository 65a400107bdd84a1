"""Whole-system serving benchmark (S-LoRA's workload shape): the stack as processes, Poisson arrivals, Zipf adapters.

Starts a registry (SQLite + a local folder store), one or more workers and a router as real processes,
pushes N adapters made locally with peft (ranks mixed), then drives a seeded trace per rate: Poisson
arrivals, adapters drawn Zipf(alpha), prompt and output lengths from a fixed seeded distribution, through
the router's gRPC. Per rate: throughput (requests/s, tokens/s), TTFT and inter-token latency p50/p90/p99,
SLO attainment (TTFT <= --slo-ttft and every gap <= --slo-itl), adapter loads, errors.

Peers replay the SAME trace in the same run: ``max_loras_1`` (the same stack with one adapter slot: no mixed
batching), ``no_prefix_cache`` (the stack with prefix caching off), ``no_fair_slots`` (fair sharing of
slots off: the summary's ``rare_decile_p99_ttft_s`` sets the p99 TTFT of the rarest decile of adapters beside
loraserve's at each rate) and ``peft`` (transformers + peft in one
process, batches grouped by adapter with ``set_adapter`` swaps). The summary (last line) gives each system's
largest rate whose p99 TTFT meets the SLO with no error, and loraserve's ratios to the peers (docs/design.md §7).

    python bench/serve.py --tiny                       # seconds: the smoke test's run
    python bench/serve.py                              # 100 adapters, rates 0.5..8 req/s, every peer
    python bench/serve.py --sweep adapters=10,100,1000 --rates 1   # one point per value, one plot each

A system that misses the SLO at the lowest swept rate is probed at halvings below it (down to --min-rate,
each trace long enough for --min-requests), so the summary's max rates are measured, not bounded. Workers
run with chunked prefill (--prefill-chunk) and keep every adapter prepared in host memory (--max-cpu-loras).

One JSON line per (system, rate) or sweep point, then a summary JSON object as the LAST line; a PNG plot of
p99 TTFT and throughput vs rate for every system (``--plot``). Children die with this process (even on
Ctrl-C or SIGKILL: they are started with a parent-death signal).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from loraserve.adapters.refs import NAME_RE

FULL = dict(
    model=dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
               num_key_value_heads=4, vocab_size=32000),
    adapters=100, ranks=(8, 16, 32, 64), prompt=(32, 256), output=(16, 128), rates=(0.5, 1, 2, 4, 8),
    duration=60.0, max_loras=16, max_batch_size=16, max_seq_len=512, min_requests=30,
)  # fmt: skip
TINY = dict(
    model=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=384),
    adapters=6, ranks=(2, 4, 8), prompt=(4, 16), output=(2, 8), rates=(2.0, 8.0),
    duration=2.0, max_loras=4, max_batch_size=8, max_seq_len=32, min_requests=0,
)  # fmt: skip
MODEL_ID = "bench-llama"
SYSTEMS = ("loraserve", "max_loras_1", "no_prefix_cache", "no_fair_slots", "peft")


@dataclass(frozen=True)
class Arrival:
    at: float  # seconds after the start of the run
    adapter: int  # index into the adapter list; -1 = base model
    prompt: tuple[int, ...]
    max_tokens: int


def zipf_probabilities(n: int, alpha: float) -> np.ndarray:
    """p_i ∝ 1 / i^alpha over n adapters (i = 1 the most popular)."""
    p = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** alpha
    return p / p.sum()


def make_trace(
    seed: int, rate: float, duration: float, n_adapters: int, alpha: float, w: dict
) -> list[Arrival]:
    """A seeded trace: Poisson arrivals at ``rate`` per second for ``duration`` seconds, adapters Zipf(alpha)
    (popularity order shuffled by the seed), prompt/output lengths uniform in the workload's ranges. The same
    arguments always give the same trace, and the arrivals and lengths do not depend on the adapters (their
    own random stream): a sweep over the adapter count or alpha replays the same requests."""
    rng = np.random.default_rng([seed, int(rate * 1000)])  # arrivals and lengths
    pick = np.random.default_rng([seed, int(rate * 1000), n_adapters])  # which adapter each one names
    order = pick.permutation(n_adapters)
    p = zipf_probabilities(n_adapters, alpha)
    out, t = [], 0.0
    while True:
        t += rng.exponential(1.0 / rate)
        if t >= duration:
            return out
        length = int(rng.integers(w["prompt"][0], w["prompt"][1] + 1))
        prompt = tuple(int(x) for x in rng.integers(3, w["model"]["vocab_size"], length))
        new = int(rng.integers(w["output"][0], w["output"][1] + 1))
        out.append(Arrival(t, int(order[pick.choice(n_adapters, p=p)]), prompt, new))


def adapter_name(i: int) -> str:
    name = f"bench-{i:04d}"
    assert NAME_RE.match(name)
    return name


def build_assets(workdir: Path, w: dict, n_adapters: int) -> tuple[Path, list[Path]]:
    """The random base model and ``n_adapters`` PEFT adapters on all seven modules, ranks cycling through
    ``w['ranks']``. Beyond 16 distinct ones, adapters are made by re-drawing the tensors of a peft-made
    template of the same rank (same files, same keys; peft itself would take minutes for 1000)."""
    from safetensors.numpy import load_file, save_file
    from transformers import AutoModelForCausalLM

    from loraserve.testing import build_model, make_adapter

    base = workdir / "base"
    if not base.exists():
        model = build_model("llama", seed=0, max_position_embeddings=w["max_seq_len"], **w["model"])
        model.save_pretrained(str(base), safe_serialization=True)
    out = []
    templates: dict[int, Path] = {}
    for i in range(n_adapters):
        r = w["ranks"][i % len(w["ranks"])]
        path = workdir / f"{adapter_name(i)}-r{r}"  # a kept --workdir never mixes up rank sets
        out.append(path)
        if path.exists():
            continue
        if len(templates) < len(w["ranks"]) or i < 16:
            make_adapter(
                AutoModelForCausalLM.from_pretrained(str(base)), path, r=r, alpha=2.0 * r, seed=i, scale=0.02
            )
            templates.setdefault(r, path)
            continue
        path.mkdir(parents=True)
        src = templates[r]
        (path / "adapter_config.json").write_bytes((src / "adapter_config.json").read_bytes())
        rng = np.random.default_rng(i)
        tensors = load_file(str(src / "adapter_model.safetensors"))
        save_file(
            {k: (0.02 * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in tensors.items()},
            str(path / "adapter_model.safetensors"),
        )
    return base, out


class Stack:
    """Registry, workers and router as processes; ``stop`` ends them (also on an exception or Ctrl-C)."""

    def __init__(
        self,
        workdir: Path,
        base: Path,
        w: dict,
        *,
        workers: int,
        max_loras: int,
        prefix_cache: bool,
        max_cpu_loras: int,
        prefill_chunk: int = 0,
        fair_slots: bool = True,
        http: bool = False,
        worker_args: tuple[str, ...] = (),
    ):
        from loraserve.common.processes import die_with_parent, start_server

        self.procs = []
        self.run = run = Path(tempfile.mkdtemp(dir=workdir, prefix="stack-"))
        try:
            reg = start_server(
                [
                    "registry",
                    "serve",
                    "--db",
                    f"sqlite:///{run / 'r.db'}",
                    "--storage",
                    str(run / "store"),
                    "--port",
                    "0",
                ],
                preexec_fn=die_with_parent,
            )
            self.procs.append(reg)
            self.registry = reg.address
            self.metrics: list[str] = []
            for n in range(workers):
                port = _free_port()
                argv = ["worker", "--model", str(base), "--model-id", MODEL_ID, "--registry", self.registry,
                        "--cache-dir", str(run / f"cache{n}"), "--max-loras", str(max_loras),
                        "--max-cpu-loras", str(max_cpu_loras), "--prefill-chunk", str(prefill_chunk),
                        "--max-lora-rank", str(max(w["ranks"])), "--max-batch-size", str(w["max_batch_size"]),
                        "--max-seq-len", str(w["max_seq_len"]), "--metrics-port", str(port),
                        "--enable-prefix-caching", str(prefix_cache).lower(),
                        "--fair-slots", str(fair_slots).lower(),
                        "--compilation-cache-dir", str(workdir / "jax-cache"), *worker_args]  # fmt: skip
                self.procs.append(start_server(argv, timeout=None, preexec_fn=die_with_parent))
                self.metrics.append(f"http://127.0.0.1:{port}/metrics")
            for p in self.procs[1:]:
                p.wait_ready(600)
            http_args: list[str] = []
            if http:  # the OpenAI-compatible API on the router, and its metrics (the admission histogram)
                self.http_port, self.router_metrics = _free_port(), _free_port()
                http_args = ["--http-port", str(self.http_port), "--metrics-port", str(self.router_metrics)]
            router = start_server(
                ["router", "serve", "--registry", self.registry, *http_args], preexec_fn=die_with_parent
            )
            self.procs.append(router)
            self.router = router.address
        except BaseException:
            self.stop()
            raise

    def push(self, adapters: list[Path]) -> None:
        from loraserve.client.registry_client import RegistryClient

        with RegistryClient(self.registry) as client:
            for i, path in enumerate(adapters):
                client.push(path, adapter_name(i), MODEL_ID)
            deadline = time.time() + 120
            while len(client.workers()) < len(self.procs) - 2 and time.time() < deadline:
                time.sleep(0.1)

    def adapter_loads(self) -> int:
        import urllib.request

        total = 0
        for url in self.metrics:
            for line in urllib.request.urlopen(url, timeout=10).read().decode().splitlines():
                if line.startswith("loraserve_adapter_loads_total "):
                    total += int(float(line.split()[1]))
        return total

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(30)
            except Exception:
                p.kill()
        self.procs = []
        shutil.rmtree(self.run, ignore_errors=True)  # its database, store and caches (GBs at 1000 adapters)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Record:
    ttft: float = float("nan")
    gaps: tuple[float, ...] = ()
    tokens: int = 0
    error: str = ""
    adapter: int = -1  # the arrival's adapter (its Zipf rank: higher is rarer), -1 the base model


async def _one(stub, pb, arrival: Arrival, start: float, names: list[str], progress) -> Record:
    await asyncio.sleep(max(0.0, start + arrival.at - time.perf_counter()))
    sent = time.perf_counter()
    req = pb.GenerateRequest(adapter=names[arrival.adapter] if arrival.adapter >= 0 else "")
    req.tokens.ids.extend(arrival.prompt)
    req.sampling.max_tokens, req.sampling.ignore_eos = arrival.max_tokens, True
    rec, last = Record(adapter=arrival.adapter), sent
    try:
        async for msg in stub.Generate(req, timeout=600):
            now = time.perf_counter()
            if rec.tokens == 0:
                rec.ttft = now - sent
            elif msg.token_ids:
                rec.gaps += ((now - last) / len(msg.token_ids),) * len(msg.token_ids)
            rec.tokens += len(msg.token_ids)
            last = now
    except Exception as exc:  # counted, never raised: the run goes on
        rec.error = f"{type(exc).__name__}: {getattr(exc, 'code', lambda: '')()}"
    progress()
    return rec


def drive(target: str, trace: list[Arrival], names: list[str], progress) -> tuple[list[Record], float]:
    """Replay ``trace`` against ``target``'s Inference.Generate; -> records and the run's wall seconds."""
    import grpc

    from loraserve.protos.v1 import inference_pb2 as pb
    from loraserve.protos.v1 import inference_pb2_grpc

    async def run() -> tuple[list[Record], float]:
        async with grpc.aio.insecure_channel(target) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            start = time.perf_counter()
            records = await asyncio.gather(*(_one(stub, pb, a, start, names, progress) for a in trace))
            return list(records), time.perf_counter() - start

    return asyncio.run(run())


def summarize(records: list[Record], wall: float, slo_ttft: float, slo_itl: float, adapters: int = 0) -> dict:
    """Rates and latencies of one run; ``rare_ttft_s`` (given ``adapters``): TTFT of the rarest decile, the
    tenth of the adapter requests whose adapters are the rarest (highest Zipf rank first): what fair sharing
    of slots is for."""
    ok = [r for r in records if not r.error]
    ttft = np.array([r.ttft for r in ok]) if ok else np.array([np.nan])
    gaps = np.array([g for r in ok for g in r.gaps]) if any(r.gaps for r in ok) else np.array([np.nan])
    met = [r for r in ok if r.ttft <= slo_ttft and all(g <= slo_itl for g in r.gaps)]
    by_rarity = sorted((r for r in ok if r.adapter >= 0), key=lambda r: -r.adapter)
    rare = np.array([r.ttft for r in by_rarity[: -(-len(by_rarity) // 10)]]) if adapters else np.array([])

    def q(a, p):
        return round(float(np.nanpercentile(a, p)), 4)

    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "throughput_rps": round(len(ok) / wall, 3),
        "throughput_tok_s": round(sum(r.tokens for r in ok) / wall, 1),
        "ttft_s": {"p50": q(ttft, 50), "p90": q(ttft, 90), "p99": q(ttft, 99)},
        "itl_s": {"p50": q(gaps, 50), "p90": q(gaps, 90), "p99": q(gaps, 99)},
        "slo_attainment": round(len(met) / max(1, len(records)), 3),
        **(
            {"rare_ttft_s": {"requests": len(rare), "p50": q(rare, 50), "p99": q(rare, 99)}}
            if len(rare)
            else {}
        ),
    }


class Progress:
    """``system @ rate [####....] done/total`` on the console (stderr): redrawn in place on a terminal,
    one line when done otherwise (logs stay readable)."""

    def __init__(self, label: str, total: int) -> None:
        self.label, self.total, self.done = label, total, 0
        self.live = sys.stderr.isatty()
        self.tick()

    def __call__(self) -> None:
        self.tick(1)

    def tick(self, n: int = 0) -> None:
        self.done += n
        finished = self.done >= self.total
        if not (self.live or finished):
            return
        filled = 30 * self.done // max(1, self.total)
        line = f"{self.label:34s} [{'#' * filled}{'.' * (30 - filled)}] {self.done}/{self.total}"
        sys.stderr.write(("\r" if self.live else "") + line + ("\n" if finished else ""))
        sys.stderr.flush()


def run_peft(
    base: Path, adapters: list[Path], trace: list[Arrival], batch: int, progress
) -> tuple[list[Record], float]:
    """The peer: transformers + peft in this process, every adapter loaded; a loop takes the oldest waiting
    request's adapter, batches up to ``batch`` waiting requests of that adapter (``set_adapter`` swap),
    prefills them (left-padded) and decodes them together token by token, timing each token."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(base)), str(adapters[0]), adapter_name=adapter_name(0)
    )
    for i, path in enumerate(adapters[1:], start=1):
        model.load_adapter(str(path), adapter_name=adapter_name(i))
    model.eval()
    records = [Record(adapter=a.adapter) for a in trace]
    pending = list(range(len(trace)))
    start = time.perf_counter()
    while pending:
        now = time.perf_counter() - start
        arrived = [i for i in pending if trace[i].at <= now]
        if not arrived:
            time.sleep(max(0.0, trace[pending[0]].at - now))
            continue
        head = trace[arrived[0]].adapter
        group = [i for i in arrived if trace[i].adapter == head][:batch]
        model.set_adapter(adapter_name(head))
        longest = max(len(trace[i].prompt) for i in group)
        ids = torch.tensor([[0] * (longest - len(trace[i].prompt)) + list(trace[i].prompt) for i in group])
        mask = (
            torch.arange(longest)[None, :]
            >= torch.tensor([longest - len(trace[i].prompt) for i in group])[:, None]
        ).long()
        steps = max(trace[i].max_tokens for i in group)
        last = [0.0] * len(group)
        with torch.no_grad():
            out = model(input_ids=ids, attention_mask=mask, use_cache=True)
            for step in range(steps):
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                t = time.perf_counter()
                for j, i in enumerate(group):
                    if step < trace[i].max_tokens:
                        rec = records[i]
                        if step == 0:
                            rec.ttft = t - start - trace[i].at
                        else:
                            rec.gaps += (t - last[j],)
                        rec.tokens += 1
                        last[j] = t
                if step + 1 < steps:
                    mask = torch.cat([mask, torch.ones(len(group), 1, dtype=mask.dtype)], 1)
                    out = model(
                        input_ids=nxt,
                        attention_mask=mask,
                        past_key_values=out.past_key_values,
                        use_cache=True,
                    )
        for i in group:
            pending.remove(i)
            progress()
    return records, time.perf_counter() - start


def max_rate_meeting_slo(rows: list[dict], slo_ttft: float) -> float:
    """The largest swept rate whose p99 TTFT meets the SLO with no error (0 when none does)."""
    good = [r["rate"] for r in rows if _meets(r, slo_ttft)]
    return max(good, default=0.0)


def plot(rows: list[dict], path: Path, x: str = "rate", slo_ttft: float | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for system in dict.fromkeys(r["system"] for r in rows):
        mine = sorted((r for r in rows if r["system"] == system), key=lambda r: r[x])  # probes ran last
        a.plot([r[x] for r in mine], [r["ttft_s"]["p99"] for r in mine], marker="o", label=system)
        b.plot([r[x] for r in mine], [r["throughput_tok_s"] for r in mine], marker="o", label=system)
    if slo_ttft:
        a.axhline(slo_ttft, color="grey", linestyle="--", label=f"SLO {slo_ttft:g} s")
    a.set(xlabel=x, ylabel="p99 TTFT (s)", yscale="log", title="p99 time to first token")
    b.set(xlabel=x, ylabel="tokens/s", title="throughput")
    b.set_ylim(bottom=0)  # a flat sweep looks flat
    if x in ("rate", "adapters", "max_loras"):  # doubling sweeps: even spacing on a log axis
        for ax in (a, b):
            ax.set_xscale("log", base=2 if x == "rate" else 10)
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _meets(row: dict, slo_ttft: float) -> bool:
    return row["errors"] == 0 and row["ttft_s"]["p99"] <= slo_ttft


def _saturated(row: dict, args) -> bool:
    return row["ttft_s"]["p99"] > args.saturated * args.slo_ttft


def _rates_to_run(rates: list[float], rows: list[dict], args):
    """The swept rates in order until one saturates, then, when the lowest swept rate missed
    the SLO, halvings below it down to ``--min-rate`` until one meets it: a system's max rate is measured,
    not just bounded, when the sweep starts above it. ``rows`` fills as the caller runs them."""
    for rate in rates:
        yield rate
        if _saturated(rows[-1], args):
            if rate != max(rates):  # higher rates only queue longer
                print(f"{rows[-1].get('system', '')}: saturated at {rate} req/s (p99 TTFT "
                      f"{rows[-1]['ttft_s']['p99']:.1f} s); higher rates skipped", file=sys.stderr, flush=True)  # fmt: skip
            break
    if not rows or _meets(min(rows, key=lambda r: r["rate"]), args.slo_ttft):
        return
    rate = min(rates) / 2
    while args.min_rate and rate >= args.min_rate * 0.999:
        yield rate
        if _meets(rows[-1], args.slo_ttft):
            return
        rate /= 2


def _duration(rate: float, args, w: dict) -> float:
    """Seconds of arrivals at ``rate``: the workload's, stretched so a low rate still sends
    ``--min-requests`` on average (a p99 over a handful of requests is the max of noise)."""
    wanted = w["min_requests"] if args.min_requests is None else args.min_requests
    return max(args.duration or w["duration"], wanted / rate)


def run_system(system: str, workdir, base, adapters, w, args, rates) -> list[dict]:
    """Every rate's trace through one system; one JSON line each."""
    names = [adapter_name(i) for i in range(len(adapters))]
    slots = None if system == "peft" else 1 if system == "max_loras_1" else args.max_loras or w["max_loras"]
    rows = []
    stack = None
    try:
        if system != "peft":
            stack = Stack(workdir, base, w, workers=args.workers, max_loras=slots,
                          prefix_cache=system != "no_prefix_cache", fair_slots=system != "no_fair_slots",
                          prefill_chunk=args.prefill_chunk,
                          max_cpu_loras=args.max_cpu_loras if args.max_cpu_loras is not None else min(len(adapters), 128))  # fmt: skip
            stack.push(adapters)
        for rate in _rates_to_run(rates, rows, args):
            trace = make_trace(args.seed, rate, _duration(rate, args, w), len(adapters), args.zipf, w)
            bar = Progress(f"{system} @ {rate} req/s", len(trace))
            loads = stack.adapter_loads() if stack else 0
            if stack:
                records, wall = drive(stack.router, trace, names, bar)
            else:
                records, wall = run_peft(base, adapters, trace, w["max_batch_size"], bar)
            row = {"system": system, "rate": rate, "adapters": len(adapters), "zipf": args.zipf, "max_loras": slots,
                   **summarize(records, wall, args.slo_ttft, args.slo_itl, len(adapters)),
                   "adapter_loads": (stack.adapter_loads() - loads) if stack else None}  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
    finally:
        if stack:
            stack.stop()
    return rows


OVERLOAD = dict(clients=(1, 8, 32), storm=512, factor=4.0, prompt=64, output=16, max_waiting=16)


def _admission_samples(url: str, kind: str) -> list[tuple[dict[str, str], float]]:
    """The ``loraserve_admission_seconds_<kind>`` samples (``bucket`` or ``count``) of a server's /metrics:
    (labels, value) each."""
    import re
    import urllib.request

    text = urllib.request.urlopen(url, timeout=10).read().decode()
    pattern = rf"^loraserve_admission_seconds_{kind}\{{(.*)\}} (\S+)$"
    return [
        (dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))), float(m.group(2)))
        for m in re.finditer(pattern, text, re.M)
    ]


def _admission_p99(url: str, role: str, outcome: str) -> float | None:
    """The p99 of ``loraserve_admission_seconds{role, outcome}`` from a server's /metrics: the upper bound
    of the first histogram bucket holding 99 % of the decisions (None: no decision counted)."""
    buckets = sorted(
        (float(labels["le"]), value)
        for labels, value in _admission_samples(url, "bucket")
        if labels.get("role") == role and labels.get("outcome") == outcome
    )
    if not buckets or buckets[-1][1] == 0:
        return None
    total = buckets[-1][1]
    return next(le for le, count in buckets if count >= 0.99 * total)


def _admission_counts(url: str, role: str) -> dict[str, int]:
    """``loraserve_admission_seconds{role}`` decisions so far, by outcome, from a server's /metrics."""
    return {
        labels["outcome"]: int(value)
        for labels, value in _admission_samples(url, "count")
        if labels.get("role") == role
    }


def overload(workdir: Path, base: Path, w: dict, seconds: float, seed: int) -> list[dict]:
    """Overload, as guidellm's sweep meets it: the stack with the router's HTTP API (/v1/completions,
    ``prompt`` tokens, ``output`` new ones), a worker of ``max_batch_size`` rows and ``max_waiting`` queued.

    * peak: closed-loop clients (each sends again as soon as answered) at each of ``clients``; the best
      served requests/s is the sustainable load;
    * open loop: Poisson arrivals at ``factor`` x the peak for ``seconds``: served ÷ peak is the goodput
      held under overload, with the refusals' latency p50/p99 as the client saw it;
    * storm: ``storm`` closed-loop clients that ignore Retry-After (guidellm's throughput step).

    Each row adds the server's own view: the router's and worker's p99 time to refuse
    (``loraserve_admission_seconds``, upper bucket bound). The load generator is ``bench/http_load.py``
    (raw asyncio; httpx would take a core of this machine itself)."""
    from http_load import Target, closed_loop, open_loop, summarize

    o = OVERLOAD
    rng = np.random.default_rng(seed)
    prompt, output = min(o["prompt"], w["max_seq_len"] // 2), min(o["output"], w["max_seq_len"] // 4)
    body = dict(model=MODEL_ID, prompt=rng.integers(3, w["model"]["vocab_size"], prompt).tolist(),
                max_tokens=output, ignore_eos=True, stream=True)  # fmt: skip
    stack = Stack(workdir, base, w, workers=1, max_loras=w["max_loras"], prefix_cache=True, max_cpu_loras=0,
                  http=True, worker_args=("--max-waiting", str(o["max_waiting"])))  # fmt: skip
    rows: list[dict] = []
    try:
        target = Target("127.0.0.1", stack.http_port, "/v1/completions", body)
        router_url = f"http://127.0.0.1:{stack.router_metrics}/metrics"
        asyncio.run(closed_loop(target, 2, 2.0))  # warm: the first requests compile nothing but connect

        before = [_admission_counts(router_url, "router")]

        def row(kind: str, load: float, results) -> dict:
            now = _admission_counts(router_url, "router")  # the router's decisions during this row
            decided = {k: n - before[0].get(k, 0) for k, n in now.items() if n > before[0].get(k, 0)}
            before[0] = now
            r = {"bench": "serve", "overload": kind, "offered": load, **summarize(results, seconds),
                 "router_refusal_p99_s": _admission_p99(router_url, "router", "refused"),
                 "worker_refusal_p99_s": _admission_p99(stack.metrics[0], "worker", "refused"),
                 "router_decisions": decided}  # fmt: skip
            print(json.dumps(r), flush=True)
            rows.append(r)
            return r

        peak = max(
            row("closed", c, asyncio.run(closed_loop(target, c, seconds)))["served_rps"] for c in o["clients"]
        )
        rate = o["factor"] * peak
        row("open", round(rate, 1), asyncio.run(open_loop(target, rate, seconds, seed)))
        row("closed", o["storm"], asyncio.run(closed_loop(target, o["storm"], seconds)))
    finally:
        stack.stop()
    for r in rows:
        r["served_vs_peak"] = round(r["served_rps"] / peak, 3) if peak else None
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a seconds-long smoke run")
    parser.add_argument("--adapters", type=int, help="adapters in the registry (default 100; --tiny 6)")
    parser.add_argument("--rates", help="comma-separated arrival rates, requests/s")
    parser.add_argument(
        "--ranks", help="comma-separated adapter ranks, cycled (default 8,16,32,64; --tiny 2,4,8)"
    )
    parser.add_argument("--duration", type=float, help="seconds of arrivals per rate")
    parser.add_argument("--zipf", type=float, default=1.0, help="Zipf alpha of adapter popularity")
    parser.add_argument("--max-loras", type=int, help="adapter slots per worker (default: the workload's)")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--systems", default=",".join(SYSTEMS), help=f"any of {', '.join(SYSTEMS)}")
    parser.add_argument(
        "--sweep", help="adapters=10,100,1000 | zipf=0.5,1,1.5 | max_loras=4,16,64 (loraserve only)"
    )
    parser.add_argument("--slo-ttft", type=float, default=2.0, help="seconds")
    parser.add_argument("--slo-itl", type=float, default=0.2, help="seconds between two tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--saturated",
        type=float,
        default=5.0,
        help="skip a system's higher rates once its p99 TTFT passes this many times the SLO",
    )
    parser.add_argument(
        "--min-rate",
        type=float,
        default=1 / 16,
        help="when a system misses the SLO at the lowest swept rate, halve it down to this (0 = never)",
    )
    parser.add_argument(
        "--min-requests",
        type=int,
        help="a rate's trace lasts long enough for this many (default 30; --tiny 0)",
    )
    parser.add_argument(
        "--max-cpu-loras",
        type=int,
        help="adapters a worker keeps prepared in host memory (default: every adapter, at most 128)",
    )
    parser.add_argument(
        "--prefill-chunk",
        type=int,
        default=64,
        help="workers' --prefill-chunk: prompt tokens a step, so a prompt stalls the running rows for one chunk at most (0 = off)",
    )
    parser.add_argument(
        "--overload",
        action="store_true",
        help="the overload rows instead (HTTP: peak, 4x the peak open-loop, 512 closed-loop clients)",
    )
    parser.add_argument("--plot", default="serve.png", help="PNG path ('' = no plot)")
    parser.add_argument(
        "--workdir", help="keep models and adapters here between runs (default: a temp folder)"
    )
    args = parser.parse_args()
    w = dict(TINY if args.tiny else FULL)
    if args.ranks:
        w["ranks"] = tuple(int(r) for r in args.ranks.split(","))
    rates = [float(r) for r in args.rates.split(",")] if args.rates else list(w["rates"])
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        if args.overload:
            base, _ = build_assets(workdir, w, 0)
            rows = overload(workdir, base, w, args.duration or (2.0 if args.tiny else 10.0), args.seed)
            by = {(r["overload"], r["offered"]): r for r in rows}
            opened = next(r for r in rows if r["overload"] == "open")
            storm = rows[-1]
            print(json.dumps({"bench": "serve", "overload": "summary", "peak_rps": max(r["served_rps"] for r in rows[:-2]),
                              "open_4x": {k: opened[k] for k in ("offered", "served_vs_peak", "refused_p50_ms", "refused_p99_ms", "router_refusal_p99_s")},
                              "closed_512": {k: storm[k] for k in ("served_vs_peak", "refused", "refused_p50_ms", "refused_p99_ms", "router_refusal_p99_s")},
                              "rows": len(by), "failed": sum(r["failed"] for r in rows)}))  # fmt: skip
            return
        if args.sweep:
            key, _, values = args.sweep.partition("=")
            rows = []
            for value in values.split(","):
                n = int(value) if key == "adapters" else (args.adapters or w["adapters"])
                base, adapters = build_assets(workdir, w, n)
                point = argparse.Namespace(**{**vars(args), "zipf": float(value) if key == "zipf" else args.zipf,
                                              "max_loras": int(value) if key == "max_loras" else args.max_loras,
                                              "min_rate": 0})  # fmt: skip
                for row in run_system("loraserve", workdir, base, adapters, w, point, rates[:1]):
                    rows.append(
                        {
                            **row,
                            key: float(value) if key == "zipf" else int(value),
                            "system": f"loraserve ({key})",
                        }
                    )
            if args.plot:
                plot(rows, Path(args.plot), x=key, slo_ttft=args.slo_ttft)
            first, last = rows[0]["throughput_tok_s"], rows[-1]["throughput_tok_s"]
            print(json.dumps({"bench": "serve", "sweep": key, "points": [r[key] for r in rows],
                              "throughput_tok_s": [r["throughput_tok_s"] for r in rows],
                              "last_vs_first_throughput": round(last / first, 3) if first else None,
                              "errors": sum(r["errors"] for r in rows)}))  # fmt: skip
            return
        base, adapters = build_assets(workdir, w, args.adapters or w["adapters"])
        rows = []
        for system in args.systems.split(","):
            rows += run_system(system, workdir, base, adapters, w, args, rates)
    if args.plot:
        plot(rows, Path(args.plot), slo_ttft=args.slo_ttft)
    best = {s: max_rate_meeting_slo([r for r in rows if r["system"] == s], args.slo_ttft)
            for s in dict.fromkeys(r["system"] for r in rows)}  # fmt: skip
    peak = {s: max(r["throughput_tok_s"] for r in rows if r["system"] == s) for s in best}
    tried = {s: min(r["rate"] for r in rows if r["system"] == s) for s in best}
    summary = {
        "bench": "serve",
        "workload": {"adapters": len(adapters), "zipf": args.zipf, "rates": rates, "ranks": list(w["ranks"]),
                     "duration_s": args.duration or w["duration"], "slo_ttft_s": args.slo_ttft, "slo_itl_s": args.slo_itl},
        "max_rate_meeting_slo": best,
        "ratios": {f"loraserve_vs_{s}": round(best["loraserve"] / best[s], 2) if best.get(s) else None
                   for s in best if s != "loraserve" and "loraserve" in best},
        # a peer that met the SLO at no rate tried, down to --min-rate: the ratio is at least this
        "ratio_lower_bounds": {f"loraserve_vs_{s}": round(best["loraserve"] / tried[s], 2)
                               for s in best if s != "loraserve" and not best[s] and best.get("loraserve")},
        # the most tokens/s each system served at any swept rate (past saturation: its capacity); defined
        # even where a peer meets the SLO at no swept rate
        "peak_throughput_tok_s": peak,
        "peak_throughput_ratios": {f"loraserve_vs_{s}": round(peak["loraserve"] / peak[s], 2) if peak.get(s) else None
                                   for s in peak if s != "loraserve" and "loraserve" in peak},
        "errors": sum(r["errors"] for r in rows),
        "requests": sum(r["requests"] for r in rows),
    }  # fmt: skip
    # fair sharing of slots: the rarest decile's p99 TTFT without it ÷ with it, per rate both ran
    fair = {r["rate"]: r for r in rows if r["system"] == "loraserve" and "rare_ttft_s" in r}
    unfair = {r["rate"]: r for r in rows if r["system"] == "no_fair_slots" and "rare_ttft_s" in r}
    summary["rare_decile_p99_ttft_s"] = {
        str(rate): {
            "fair": fair[rate]["rare_ttft_s"]["p99"],
            "no_fair_slots": unfair[rate]["rare_ttft_s"]["p99"],
        }
        for rate in sorted(set(fair) & set(unfair))
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
