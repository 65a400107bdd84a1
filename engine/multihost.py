"""Multi-host workers: one process per host over ``jax.distributed``, process 0 leading (docs/worker.md).

A slice larger than one host runs one ``loraserve worker`` per host, all with the same model and flags plus
``--coordinator HOST:PORT --num-processes P --process-id I`` (on GKE read from the LeaderWorkerSet's
``LWS_LEADER_ADDRESS`` / ``LWS_GROUP_SIZE`` / ``LWS_WORKER_INDEX``). ``jax.devices()`` then lists every
host's devices and the tensor-parallel mesh spans them all.

**The leader** (process 0) is the whole worker as on one host: scheduler, gRPC/HTTP, registry. **Followers**
serve nothing: they hold their devices' shards of the weights, KV pages and slot pools and run the same
compiled programs in the same order. Before each device call the leader's runner sends it down the *step
channel* (``engine.jax_runner.JaxRunner._send_to_followers``): an operation name and the call's host arrays (tokens,
positions, page tables, the LoRA slots, the sampling arrays; a slot write's values) — no Python objects,
only named arrays in the safetensors format (:func:`encode`). Followers replay it through the same runner
methods (:func:`follow`), so programs are compiled and called identically everywhere (warm-up included:
followers warm up when the leader does) and nothing compiles after it.

The step channel is one TCP connection per follower to the leader's ``coordinator port + 1``. It comes up
*before* ``jax.distributed`` (whose client aborts the process when a peer never answers): the handshake checks
process ids, the process count, a digest of the checkpoint (:func:`checkpoint_digest`) and the flags that shape
the compiled programs (``settings``: the engine's, ``--quantization``, ``--quantize-lm-head``), and refuses with
FAILED_PRECONDITION / INVALID_ARGUMENT naming what differs. After it, both sides send a ping every
``timeout / 4`` seconds; a peer that closes its connection or stays silent for ``--multihost-timeout``
seconds is lost: the leader reports NOT_SERVING and exits :data:`EXIT_PEER_LOST` (the LeaderWorkerSet
restarts the group; the registry drops its placements when the lease lapses), a follower exits the same.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import socket
import struct
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from loraserve.common.errors import FailedPrecondition, InvalidArgument, LoraserveError
from loraserve.engine.named_arrays import dataclass_from, slot_values_from

log = logging.getLogger("loraserve.engine.multihost")

DEFAULT_COORDINATOR_PORT = 8476  # jax.distributed's own default
EXIT_PEER_LOST = 3  # a process of the group died or hung: the whole group restarts
MAGIC = b"LSMH"
HEADER = struct.Struct("!4sQ")  # magic, payload bytes
MAX_MESSAGE_BYTES = 1 << 34  # a slot write of a large model's adapter is ~100s of MB
LWS_ENV = ("LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX")
PING = "ping"
STOP = "stop"
HELLO_BYTES = 1 << 16  # a hello is a few hundred bytes
HELLO_WAIT_S = 10.0  # a connection gets this long to say hello
# sends and receives give up after this many --multihost-timeouts: the watch (a silent peer after one
# timeout) normally speaks first, but a send into a full buffer (a hung peer) never blocks for good
SOCKET_TIMEOUT_FACTOR = 2


@dataclass(frozen=True)
class Cluster:
    """Where this process stands in a multi-host worker."""

    coordinator: str  # host:port of jax.distributed's coordinator (process 0)
    num_processes: int
    process_id: int
    timeout_s: float  # start-up waits and a silent peer's allowance

    @property
    def leader(self) -> bool:
        return self.process_id == 0

    @property
    def step_address(self) -> tuple[str, int]:
        """The leader's step channel: the coordinator's host, the coordinator's port + 1."""
        host, port = split_address(self.coordinator)
        return host, port + 1


def split_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65535:
        raise InvalidArgument(f"coordinator {address!r} is not host:port (a port below 65535)")
    return host.strip("[]"), int(port)


def cluster_from(
    coordinator: str,
    num_processes: int,
    process_id: int,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
) -> Cluster | None:
    """The flags' cluster, or a LeaderWorkerSet's (its environment) where ``coordinator`` is empty; None
    for a one-host worker. INVALID_ARGUMENT for counts and ids that cannot be."""
    env = os.environ if env is None else env
    if not coordinator and env.get("LWS_LEADER_ADDRESS"):
        coordinator = f"{env['LWS_LEADER_ADDRESS']}:{DEFAULT_COORDINATOR_PORT}"
        num_processes = int(env.get("LWS_GROUP_SIZE", num_processes))
        process_id = int(env.get("LWS_WORKER_INDEX", process_id))
    if not coordinator:
        if num_processes != 1 or process_id != 0:
            raise InvalidArgument(
                f"--num-processes {num_processes} / --process-id {process_id} need --coordinator HOST:PORT"
            )
        return None
    split_address(coordinator)
    if num_processes < 1:
        raise InvalidArgument(f"--num-processes must be >= 1, got {num_processes}")
    if not 0 <= process_id < num_processes:
        raise InvalidArgument(
            f"--process-id {process_id} is not in 0 .. {num_processes - 1} (--num-processes)"
        )
    if timeout_s <= 0:
        raise InvalidArgument(f"--multihost-timeout must be > 0, got {timeout_s}")
    return Cluster(coordinator, num_processes, process_id, timeout_s)


def initialize(cluster: Cluster) -> None:
    """Start ``jax.distributed`` (after the step channel's handshake: every process is known to be up); on
    CPU, collectives over gloo. Must run before anything else touches JAX's devices."""
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # the CPU client's (tests); TPUs: ICI
    timeout = max(1, int(cluster.timeout_s))
    jax.distributed.initialize(
        cluster.coordinator,
        num_processes=cluster.num_processes,
        process_id=cluster.process_id,
        initialization_timeout=timeout,
        heartbeat_timeout_seconds=max(10, 2 * timeout),
        shutdown_timeout_seconds=timeout,
    )
    log.info(
        "jax.distributed: process %d of %d, %d local of %d devices",
        cluster.process_id,
        cluster.num_processes,
        jax.local_device_count(),
        jax.device_count(),
    )


# ------------------------------------------------------------------------------- the checkpoint's digest


def checkpoint_digest(url: str, samples: int = 16, sample_bytes: int = 1 << 16) -> str:
    """A sha256 over ``config.json`` and, per weight file, its name, size, safetensors header and ``samples``
    slices of ``sample_bytes`` spread evenly over its data: hosts that loaded different checkpoints (another
    model, a fine-tune of the same shapes, another version) disagree, from a few MiB of reads."""
    import fsspec

    fs, root = fsspec.core.url_to_fs(url)
    root = root.rstrip("/")
    h = hashlib.sha256()
    with fs.open(f"{root}/config.json", "rb") as f:
        h.update(f.read())
    for path in sorted(p for p in fs.ls(root, detail=False) if str(p).endswith(".safetensors")):
        size = fs.size(path)
        with fs.open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            h.update(os.path.basename(path).encode() + struct.pack("<QQ", size, n))
            h.update(f.read(n))
            data = size - 8 - n
            for k in range(samples):
                f.seek(8 + n + data * k // samples)
                h.update(f.read(sample_bytes))
    return h.hexdigest()


# -------------------------------------------------------------------------------------- messages


def encode(op: str, arrays: Mapping[str, Any], meta: Mapping[str, str] | None = None) -> bytes:
    """One message: the operation and string fields as safetensors metadata, the arrays as its tensors."""
    tensors = {name: np.asarray(a) for name, a in arrays.items()}
    tensors = {name: a if a.flags.c_contiguous else a.copy(order="C") for name, a in tensors.items()}
    payload = st_save(tensors, metadata={"op": op, **(meta or {})})
    return HEADER.pack(MAGIC, len(payload)) + payload


def decode_payload(payload: bytes) -> tuple[str, dict[str, np.ndarray], dict[str, str]]:
    n = struct.unpack("<Q", payload[:8])[0]
    meta = json.loads(payload[8 : 8 + n]).get("__metadata__", {})
    arrays = st_load(payload)
    op = meta.pop("op", "")
    return op, arrays, meta


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 22))
        if not chunk:
            raise ConnectionError("the peer closed the step channel")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def recv_message(
    sock: socket.socket, limit: int = MAX_MESSAGE_BYTES
) -> tuple[str, dict[str, np.ndarray], dict[str, str]]:
    """The next message; ConnectionError for anything else than one of at most ``limit`` bytes."""
    magic, size = HEADER.unpack(_recv_exact(sock, HEADER.size))
    if magic != MAGIC or size > limit:
        raise ConnectionError(f"not a loraserve step channel message ({magic!r}, {size} bytes)")
    return decode_payload(_recv_exact(sock, size))


# ------------------------------------------------------------------------------------- the channel


class _Peer:
    """One connection and the time its last message came."""

    def __init__(self, sock: socket.socket, name: str) -> None:
        self.sock, self.name = sock, name
        self.seen = time.monotonic()
        self.lock = threading.Lock()  # one writer at a time (the engine thread, the pinger)

    def send(self, data: bytes) -> None:
        with self.lock:
            self.sock.sendall(data)


class _Watch:
    """Pings every peer every ``timeout / 4`` s and calls ``lost(reason)`` once when a peer falls silent
    for ``timeout`` s or its connection breaks (reader threads note each message's arrival)."""

    def __init__(self, peers: list[_Peer], timeout: float, lost: Callable[[str], None]) -> None:
        self.peers, self.timeout, self._lost = peers, timeout, lost
        self._fired = threading.Event()
        self.closed = threading.Event()
        self._ping = encode(PING, {})
        threading.Thread(target=self._run, name="multihost-watch", daemon=True).start()

    def lost(self, reason: str) -> None:
        if not self.closed.is_set() and not self._fired.is_set():
            self._fired.set()
            log.error("multi-host: %s", reason)
            self._lost(reason)

    def _run(self) -> None:
        while not self.closed.wait(self.timeout / 4):
            now = time.monotonic()
            for peer in self.peers:
                if now - peer.seen > self.timeout:
                    self.lost(f"{peer.name} sent nothing for {now - peer.seen:.1f} s (--multihost-timeout)")
                    return
                try:
                    peer.send(self._ping)
                except OSError as exc:
                    self.lost(f"{peer.name}'s step channel broke: {exc}")
                    return


class LeaderChannel:
    """The leader's end: accepts every follower, checks them, then broadcasts each device call."""

    def __init__(
        self,
        cluster: Cluster,
        digest: str,
        lost: Callable[[str], None],
        settings: Mapping[str, str] | None = None,
    ) -> None:
        self.cluster, self.settings = cluster, dict(settings or {})
        port = cluster.step_address[1]
        server = socket.create_server(("", port), reuse_port=False)
        server.settimeout(cluster.timeout_s)
        peers: dict[int, _Peer] = {}
        deadline = time.monotonic() + cluster.timeout_s
        try:
            while len(peers) < cluster.num_processes - 1:
                server.settimeout(max(0.01, deadline - time.monotonic()))
                try:
                    sock, addr = server.accept()
                except TimeoutError:
                    missing = sorted(set(range(1, cluster.num_processes)) - set(peers))
                    raise FailedPrecondition(
                        f"multi-host: processes {missing} did not connect to the step channel on port {port}"
                        f" within {cluster.timeout_s:g} s (--multihost-timeout)"
                    ) from None
                sock.settimeout(max(0.01, min(HELLO_WAIT_S, deadline - time.monotonic())))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                try:  # whatever else reaches the port (a scanner, a health check) is dropped, not fatal
                    op, _, meta = recv_message(sock, HELLO_BYTES)
                except Exception as exc:  # untrusted bytes: any failure drops the connection
                    log.warning(
                        "multi-host: dropped a connection from %s that sent no hello: %s", addr[0], exc
                    )
                    sock.close()
                    continue
                why = self._check_hello(op, meta, digest, peers)
                if why:
                    sock.sendall(encode("refuse", {}, {"reason": why}))
                    sock.close()
                    raise FailedPrecondition(f"multi-host: {why}")
                pid = int(meta["process_id"])
                peers[pid] = _Peer(sock, f"process {pid} ({addr[0]})")
        except BaseException:
            for p in peers.values():
                p.sock.close()
            raise
        finally:
            server.close()
        self.peers = [peers[i] for i in sorted(peers)]
        for p in self.peers:  # a send to a peer that stopped reading gives up, so the watch stays awake
            p.sock.settimeout(SOCKET_TIMEOUT_FACTOR * cluster.timeout_s)
            p.send(encode("welcome", {}))
        self.watch = _Watch(self.peers, cluster.timeout_s, lost)
        for p in self.peers:
            threading.Thread(target=self._read, args=(p,), name=f"multihost-{p.name}", daemon=True).start()
        log.info("multi-host leader: %d followers connected", len(self.peers))

    def _check_hello(self, op: str, meta: dict[str, str], digest: str, peers: dict[int, _Peer]) -> str:
        if op != "hello":
            return f"expected a hello, got {op!r}"
        try:
            pid, count = int(meta.get("process_id", "")), int(meta.get("num_processes", ""))
        except ValueError:
            return f"a hello without a process id and count ({sorted(meta)[:4]})"
        if count != self.cluster.num_processes:
            return f"process {pid} was started with --num-processes {count}, the leader with {self.cluster.num_processes}"
        if not 0 < pid < count or pid in peers:
            return f"process id {pid} is taken or not a follower's (1 .. {count - 1})"
        if meta.get("digest") != digest:
            return (
                f"process {pid} loaded a different checkpoint (digest {meta.get('digest', '')[:12]}, the"
                f" leader's {digest[:12]}): every host must serve the same --model"
            )
        try:
            theirs = json.loads(meta.get("settings", "{}"))
        except ValueError:
            theirs = None
        if not isinstance(theirs, dict):
            return f"process {pid} sent settings that are not a JSON object of flags"
        for key in sorted(set(theirs) | set(self.settings)):
            if theirs.get(key) != self.settings.get(key):
                flag = "--" + key.replace("_", "-")
                return (
                    f"process {pid} was started with {flag} {theirs.get(key, '(unset)')}, the leader with"
                    f" {self.settings.get(key, '(unset)')}: every host must serve with the same flags"
                )
        return ""

    def _read(self, peer: _Peer) -> None:
        try:
            while True:
                recv_message(peer.sock)
                peer.seen = time.monotonic()
        except (OSError, ConnectionError) as exc:
            self.watch.lost(f"{peer.name} left the step channel: {exc}")

    def broadcast(self, op: str, arrays: Mapping[str, Any]) -> None:
        data = encode(op, arrays)
        for p in self.peers:
            try:
                p.send(data)
            except OSError as exc:
                self.watch.lost(f"{p.name}'s step channel broke: {exc}")
                raise FailedPrecondition(f"multi-host: {p.name} is gone") from exc

    def close(self) -> None:
        """Tell the followers to stop (they exit 0) and close."""
        if self.watch.closed.is_set():
            return
        self.watch.closed.set()
        for p in self.peers:
            try:
                p.send(encode(STOP, {}))
                p.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass


class FollowerChannel:
    """A follower's end: connects (retrying until the timeout), says hello, then yields the leader's calls."""

    def __init__(
        self,
        cluster: Cluster,
        digest: str,
        lost: Callable[[str], None] | None = None,
        settings: Mapping[str, str] | None = None,
    ) -> None:
        host, port = cluster.step_address
        deadline = time.monotonic() + cluster.timeout_s
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
                break
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise FailedPrecondition(
                        f"multi-host: the leader's step channel {host}:{port} did not answer within"
                        f" {cluster.timeout_s:g} s (--coordinator, --multihost-timeout): {exc}"
                    ) from None
                time.sleep(0.2)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(cluster.timeout_s)
        hello = {"process_id": str(cluster.process_id), "num_processes": str(cluster.num_processes)}
        hello["settings"] = json.dumps(dict(settings or {}), sort_keys=True)
        sock.sendall(encode("hello", {}, {**hello, "digest": digest}))
        try:
            op, _, meta = recv_message(sock)
        except (OSError, ConnectionError) as exc:
            raise FailedPrecondition(
                f"multi-host: the leader did not welcome process {cluster.process_id}: {exc}"
            ) from None
        if op != "welcome":
            raise FailedPrecondition(f"multi-host: the leader refused: {meta.get('reason', op)}")
        sock.settimeout(SOCKET_TIMEOUT_FACTOR * cluster.timeout_s)
        self.cluster, self.peer, self._on_lost = cluster, _Peer(sock, "the leader"), lost
        self.calls: queue.Queue = queue.Queue()
        self.watch = _Watch([self.peer], cluster.timeout_s, self._lost)
        threading.Thread(target=self._read, name="multihost-leader", daemon=True).start()

    def _lost(self, reason: str) -> None:
        self.calls.put(("lost", reason))
        if self._on_lost is not None:  # the worker exits: this process may be stuck inside a device call
            self._on_lost(reason)

    def _read(self) -> None:
        try:
            while True:
                op, arrays, _ = recv_message(self.peer.sock)
                self.peer.seen = time.monotonic()
                if op != PING:
                    self.calls.put((op, arrays))
                if op == STOP:
                    self.watch.closed.set()
                    return
        except (OSError, ConnectionError) as exc:
            self.watch.lost(f"the leader left the step channel: {exc}")

    def next_call(self) -> tuple[str, Any]:
        return self.calls.get()


def follow(runner: Any, channel: FollowerChannel) -> int:
    """Replay the leader's device calls on ``runner`` (a ``JaxRunner``) until it says stop; returns the calls
    replayed. Raises :class:`PeerLost` when the leader is gone (the channel's ``lost`` callback has been
    called first)."""
    from loraserve.models.sampling import SamplingArrays
    from loraserve.models.step import PrefillBatch

    calls = 0
    while True:
        op, arrays = channel.next_call()
        if op == STOP:
            log.info("multi-host follower: the leader stopped after %d calls", calls)
            return calls
        if op == "lost":
            raise PeerLost(f"multi-host: {arrays}")
        if op == "decode":
            runner.decode_arrays(
                arrays["tokens"],
                arrays["positions"],
                arrays["slots"],
                arrays["page_tables"],
                dataclass_from("sampling", SamplingArrays, arrays),
            )
        elif op == "prefill":
            runner.prefill_arrays(
                dataclass_from("batch", PrefillBatch, arrays),
                dataclass_from("sampling", SamplingArrays, arrays),
            )
        elif op == "seed":
            runner.seed_arrays(**arrays)
        elif op == "write":
            try:
                runner.write_slot(int(arrays["index"]), slot_values_from(arrays))
            except LoraserveError as exc:  # refused on the leader too (the same scales): the slot is empty
                log.info(
                    "multi-host follower: slot %d refused as on the leader: %s", int(arrays["index"]), exc
                )
        elif op == "zero":
            runner.zero_slot(int(arrays["index"]))
        elif op == "warmup":
            runner.warmup()
        elif op == "init":
            runner.init_state()
        else:
            raise PeerLost(f"multi-host: the leader sent an unknown call {op!r}")
        calls += 1


class PeerLost(FailedPrecondition):
    """A process of the group died, hung or broke the protocol."""
