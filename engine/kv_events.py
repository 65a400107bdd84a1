"""KV-cache events in vLLM's format, published over ZMQ (``--kv-events tcp://*:5557``): precise
prefix-cache routing (llm-d's KV-cache indexer, the Inference Gateway) reads them to know which worker holds
which prompt prefix under which adapter.

The prefix cache (``engine.kv_pages``) appends an event each time a full computed page gets its hash
(:class:`BlockStored`: the pages' chained sha256 hashes, the hash before them, their token ids, the page
size and the adapter: ``lora_name`` ``name@version`` or a mix's ref, ``lora_id`` a stable integer of its
content; both None for the base model) and each time a cached page is reclaimed or forgotten
(:class:`BlockRemoved`). After each engine step the engine hands that step's events to :class:`Publisher`
as one batch, which a thread of its own (ZMQ sockets belong to one thread) sends as vLLM's
``ZmqEventPublisher`` does: a multipart message ``[topic, sequence number (8 bytes, big-endian),
msgpack(batch)]``, the batch ``[ts, [event, ...]]`` and each event an array whose first element is its
type's name (msgspec's ``array_like`` tagged structs): ``["BlockStored", block_hashes, parent_block_hash,
token_ids, block_size, lora_id, medium, lora_name, extra_keys, group_idx]``, ``["BlockRemoved",
block_hashes, medium, group_idx]``, ``["AllBlocksCleared"]``. ``medium`` is ``"GPU"`` (vLLM's name for the
accelerator's memory). At most ``MAX_QUEUED`` batches wait for the socket; past that the oldest are dropped
and counted (a subscriber that sees a gap in the sequence numbers resynchronises).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("loraserve.engine.kv_events")

MEDIUM = "GPU"
MAX_QUEUED = 10_000


@dataclass(frozen=True)
class BlockStored:
    block_hashes: tuple[bytes, ...]
    parent_block_hash: bytes | None
    token_ids: tuple[int, ...]
    block_size: int
    lora_name: str | None

    def wire(self) -> list[Any]:
        lora_id = None if self.lora_name is None else lora_int_id(self.lora_name)
        return [
            "BlockStored", list(self.block_hashes), self.parent_block_hash, list(self.token_ids),
            self.block_size, lora_id, MEDIUM, self.lora_name, None, None,
        ]  # fmt: skip


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[bytes, ...]

    def wire(self) -> list[Any]:
        return ["BlockRemoved", list(self.block_hashes), MEDIUM, None]


@dataclass(frozen=True)
class AllBlocksCleared:
    def wire(self) -> list[Any]:
        return ["AllBlocksCleared"]


Event = BlockStored | BlockRemoved | AllBlocksCleared


def lora_int_id(lora_name: str) -> int:
    """A stable positive integer for an adapter (vLLM's ``lora_id``): 56 bits of sha256 of its name."""
    import hashlib

    return 1 + int.from_bytes(hashlib.sha256(lora_name.encode()).digest()[:7], "big")


def encode(ts: float, events: list[Event]) -> bytes:
    import msgpack

    return msgpack.packb([ts, [e.wire() for e in events]], use_bin_type=True)


class Publisher:
    """A ZMQ PUB socket bound at ``endpoint`` on a thread of its own; :meth:`publish` queues one step's
    events (never blocks the engine thread)."""

    def __init__(self, endpoint: str, topic: str = "") -> None:
        import zmq

        self.endpoint, self.topic = endpoint, topic.encode()
        self.dropped = 0
        self._queue: queue.Queue[tuple[float, list[Event]] | None] = queue.Queue()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(endpoint)  # a bad endpoint or a port in use fails here, at start-up
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._seq = 0
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[Event]) -> None:
        if not events:
            return
        while self._queue.qsize() >= MAX_QUEUED:
            try:
                self._queue.get_nowait()
                self.dropped += 1
            except queue.Empty:
                break
        self._queue.put((time.time(), list(events)))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            ts, events = item
            try:
                self._socket.send_multipart([self.topic, self._seq.to_bytes(8, "big"), encode(ts, events)])
            except Exception:  # a send that fails drops this batch, never the engine
                log.exception("could not publish %d KV events", len(events))
            self._seq += 1

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
        self._socket.close(0)
        self._context.term()
