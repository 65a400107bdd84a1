"""KV-cache events in vLLM's format (``--kv-events``, engine.kv_events): what the prefix cache stores and
reclaims, as a subscriber of the worker's ZMQ socket sees it, is exactly what the cache holds; each block
names its adapter (``lora_name``), and the wire format is vLLM's (multipart ``[topic, seq, msgpack]``,
msgspec's tagged arrays)."""

from __future__ import annotations

import time
import uuid

import msgpack
import pytest

from loraserve.engine.config import EngineConfig
from loraserve.engine.kv_events import BlockRemoved, BlockStored, lora_int_id
from loraserve.engine.request import EngineRequest, Finished, Sampling
from tests.engines import started_engine
from tests.worker.fake_engine import Collector, Harness, source_of


def _held(events: list) -> set[bytes]:
    """The hashes stored and not removed since, in the events' order."""
    held: set[bytes] = set()
    for e in events:
        if isinstance(e, BlockStored):
            held |= set(e.block_hashes)
        elif isinstance(e, BlockRemoved):
            held -= set(e.block_hashes)
    return held


def test_the_events_follow_the_prefix_cache_through_reclaims() -> None:
    """A pool of 6 pages of 4 tokens, prompts of 9 tokens (two full pages each) for the base and two
    adapters: every registration is one BlockStored run (parent = the hash before it, the pages' tokens,
    the adapter's name), every reclaimed page a BlockRemoved, and after each step the hashes stored and
    not removed are exactly the cache's."""
    config = EngineConfig(
        max_batch_size=2, max_seq_len=16, max_loras=2, max_lora_rank=4, kv_page_size=4, kv_pages=7,
        kv_events="inproc://unused",
    )  # fmt: skip
    h = Harness(config, source_of("a", "b"))
    events = h.scheduler.kv_events
    for n, adapter in enumerate(["", "a", "b", "", "a"]):
        prompt = tuple(range(10 * n, 10 * n + 9))
        c = h.submit(adapter, prompt=prompt, max_tokens=2)
        h.run(c)
        assert _held(events) == h.scheduler.kv.registered()
    stored = [e for e in events if isinstance(e, BlockStored)]
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert len(stored) == 5 and len(removed) >= 4  # 5 prompts x 2 pages in a pool of 6: reclaims
    assert [e.lora_name for e in stored] == [None, "a", "b", None, "a"]
    for e, n in zip(stored, range(5), strict=True):
        assert len(e.block_hashes) == 2 and e.parent_block_hash is None and e.block_size == 4
        assert e.token_ids == tuple(range(10 * n, 10 * n + 8))
    wire = stored[1].wire()
    assert wire[:5] == ["BlockStored", list(stored[1].block_hashes), None, list(range(10, 18)), 4]
    assert wire[5:] == [lora_int_id("a"), "GPU", "a", None, None]


@pytest.mark.parametrize("topic", ["", "kv@worker-0@tiny"])
def test_a_subscriber_sees_every_event_in_vllms_format(llama_dir, adapter_dirs, topic) -> None:
    """A real engine publishing on tcp: a ZMQ SUB socket receives ``[topic, seq, msgpack]`` frames with
    consecutive sequence numbers; each batch is ``[ts, events]``; decoding them gives blocks for the base
    and the adapter (named), and what they store is what the engine's prefix cache holds."""
    import zmq

    config = EngineConfig(
        max_batch_size=2, max_seq_len=64, max_loras=1, max_lora_rank=16, kv_page_size=16,
        kv_events="tcp://127.0.0.1:*", kv_events_topic=topic,
    )  # fmt: skip
    adapter = next(iter(adapter_dirs))
    with started_engine(llama_dir, config, {adapter: adapter_dirs[adapter]}, warmup=False) as engine:
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        sub.connect(engine.kv_publisher.address)
        time.sleep(0.3)  # ZMQ's slow joiner: the subscription reaches the publisher first
        prompt = list(range(3, 40))  # two full pages of 16
        for name in ("", adapter, ""):
            c = Collector()
            engine.submit(EngineRequest(uuid.uuid4().hex, name, prompt, Sampling(max_tokens=2), c))
            assert c.done.wait(120) and isinstance(c.end, Finished), c.end
        frames = []
        while sub.poll(500):
            frames.append(sub.recv_multipart())
        cached = engine.scheduler.kv.registered()
        sub.close(0)
    assert frames and all(len(f) == 3 and f[0] == topic.encode() for f in frames)
    assert [int.from_bytes(f[1], "big") for f in frames] == list(range(len(frames)))
    events = []
    for f in frames:
        ts, batch = msgpack.unpackb(f[2])
        assert abs(ts - time.time()) < 600 and batch
        events += batch
    stored = [e for e in events if e[0] == "BlockStored"]
    assert [e[7] for e in stored] == [None, adapter]  # the second base prompt hits the first's pages
    assert all(e[4] == 16 and len(e[3]) == 16 * len(e[1]) and all(len(h) == 32 for h in e[1]) for e in stored)
    assert stored[0][3] == prompt[:32] and stored[0][5] is None and stored[1][5] == lora_int_id(adapter)
    held = set()
    for e in events:
        if e[0] == "BlockStored":
            held |= set(e[1])
        elif e[0] == "BlockRemoved":
            held -= set(e[1])
    assert held == cached and len(cached) == 4
