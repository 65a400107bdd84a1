"""The multi-host pieces that need no second process: the cluster settings (flags and a LeaderWorkerSet's
environment), the step channel's messages, its handshake and refusals, the checkpoint digest. The processes
themselves: tests/e2e/test_multihost.py."""

from __future__ import annotations

import shutil
import socket
import threading
import time

import numpy as np
import pytest

from loraserve.common.errors import FailedPrecondition, InvalidArgument
from loraserve.engine import multihost as mh
from loraserve.engine import named_arrays
from loraserve.engine.multihost import Cluster, FollowerChannel, LeaderChannel
from loraserve.models.sampling import SamplingArrays
from loraserve.models.step import PrefillBatch
from tests.e2e.procs import free_port_pair


def test_cluster_from_flags_and_from_a_leaderworkerset() -> None:
    assert mh.cluster_from("", 1, 0, 60.0, env={}) is None
    c = mh.cluster_from("10.0.0.2:9000", 4, 3, 30.0, env={})
    assert c == Cluster("10.0.0.2:9000", 4, 3, 30.0) and not c.leader and c.step_address == ("10.0.0.2", 9001)
    lws = {"LWS_LEADER_ADDRESS": "w-0.w.ns", "LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": "2"}
    assert mh.cluster_from("", 1, 0, 60.0, env=lws) == Cluster("w-0.w.ns:8476", 4, 2, 60.0)
    assert mh.cluster_from("h:1", 2, 0, 60.0, env=lws) == Cluster("h:1", 2, 0, 60.0)  # flags win
    assert mh.cluster_from("[::1]:8476", 2, 0, 1.0, env={}).step_address == ("::1", 8477)


@pytest.mark.parametrize(
    "args, words",
    [
        (("h:1", 2, 2), "--process-id 2 is not in 0 .. 1"),
        (("h:1", 2, -1), "--process-id -1"),
        (("h:1", 0, 0), "--num-processes must be >= 1"),
        (("", 2, 0), "need --coordinator"),
        (("", 1, 1), "need --coordinator"),
        (("nohost", 2, 0), "is not host:port"),
        (("h:99999", 2, 0), "is not host:port"),
    ],
)
def test_impossible_clusters_are_refused(args, words) -> None:
    with pytest.raises(InvalidArgument, match=words):
        mh.cluster_from(*args, 60.0, env={})


def test_messages_carry_named_arrays_exactly() -> None:
    sampling = SamplingArrays.empty(3, 70)
    batch = PrefillBatch.single([1, 2, 3], 3, 0, -1, np.arange(4), 1)
    arrays = {
        **named_arrays.fields_of("batch", batch),
        **named_arrays.fields_of("sampling", sampling),
        **named_arrays.slot_values_arrays(
            [{"A_qkv": np.ones((2, 3), np.float32)}, {"B_o": np.eye(2)[:, :1]}]
        ),
        "index": np.asarray(5, np.int32),
        "reset": np.asarray(True),
    }
    data = mh.encode("write", arrays)
    op, got, _ = mh.decode_payload(data[mh.HEADER.size :])
    assert op == "write" and set(got) == set(arrays)
    for name, a in arrays.items():  # dtype, shape (0-d and [B, 0] included) and bytes
        assert got[name].dtype == np.asarray(a).dtype and got[name].shape == np.shape(a), name
        np.testing.assert_array_equal(got[name], a)
    back = named_arrays.dataclass_from("batch", PrefillBatch, got)
    assert back.targets is None and back.key_blocks.shape == () and int(back.key_blocks) == 1
    assert named_arrays.slot_values_from(got)[1]["B_o"].shape == (2, 1)


def _cluster(port: int, pid: int, n: int = 2, timeout: float = 5.0) -> Cluster:
    return Cluster(f"127.0.0.1:{port}", n, pid, timeout)


def _lead(cluster: Cluster, digest: str, out: dict, settings: dict | None = None) -> threading.Thread:
    def run() -> None:
        try:
            out["leader"] = LeaderChannel(
                cluster, digest, lambda reason: out.setdefault("lost", reason), settings
            )
        except Exception as exc:  # the test reads it
            out["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    return t


def test_the_channel_broadcasts_and_a_stop_ends_the_follower() -> None:
    port, out = free_port_pair(), {}
    t = _lead(_cluster(port, 0), "d1", out)
    follower = FollowerChannel(_cluster(port, 1), "d1")
    t.join(10)
    leader = out["leader"]
    leader.broadcast("zero", {"index": np.asarray(1, np.int32)})
    op, arrays = follower.next_call()
    assert op == "zero" and int(arrays["index"]) == 1

    class Runner:
        def __init__(self) -> None:
            self.calls: list[int] = []

        def zero_slot(self, index: int) -> None:
            self.calls.append(index)

    leader.broadcast("zero", {"index": np.asarray(3, np.int32)})
    leader.close()
    runner = Runner()
    assert mh.follow(runner, follower) == 1 and runner.calls == [3]
    assert "lost" not in out


def test_a_follower_of_another_checkpoint_is_refused_by_name() -> None:
    port, out = free_port_pair(), {}
    t = _lead(_cluster(port, 0), "a" * 64, out)
    with pytest.raises(FailedPrecondition, match="different checkpoint"):
        FollowerChannel(_cluster(port, 1), "b" * 64)
    t.join(10)
    assert isinstance(out["error"], FailedPrecondition) and "process 1 loaded a different checkpoint" in str(
        out["error"]
    )


def test_a_follower_started_with_other_flags_is_refused_by_name() -> None:
    """The flags that shape the compiled programs (worker.cli.serving_settings) must match on every host: a
    follower quantizing the base differently would compile other programs than the leader's it replays."""
    from loraserve.worker.cli import serving_settings
    from loraserve.worker.config import WorkerConfig

    leader_config = WorkerConfig(quantization="int8")
    settings = serving_settings(leader_config, leader_config.engine_config())
    assert settings["quantization"] == "int8" and settings["quantize_lm_head"] == "False"
    assert settings["max_batch_size"] == str(leader_config.engine_config().max_batch_size)
    port, out = free_port_pair(), {}
    t = _lead(_cluster(port, 0), "d", out, settings)
    theirs = {**settings, "quantize_lm_head": "True"}
    with pytest.raises(FailedPrecondition, match="--quantize-lm-head True, the leader with False"):
        FollowerChannel(_cluster(port, 1), "d", settings=theirs)
    t.join(10)
    assert "every host must serve with the same flags" in str(out["error"])


def test_a_follower_started_for_another_group_size_is_refused() -> None:
    port, out = free_port_pair(), {}
    t = _lead(_cluster(port, 0, n=2), "d", out)
    with pytest.raises(FailedPrecondition, match="--num-processes 3, the leader with 2"):
        FollowerChannel(_cluster(port, 2, n=3), "d")
    t.join(10)
    assert "--num-processes 3" in str(out["error"])


def test_a_leader_that_never_answers_is_a_clear_refusal_not_a_hang() -> None:
    port = free_port_pair()
    start = time.monotonic()
    with pytest.raises(FailedPrecondition, match=rf"127.0.0.1:{port + 1} did not answer within 0.5 s"):
        FollowerChannel(_cluster(port, 1, timeout=0.5), "d")
    assert time.monotonic() - start < 5


def test_followers_that_never_come_are_named() -> None:
    port = free_port_pair()
    with pytest.raises(FailedPrecondition, match=r"processes \[1, 2\] did not connect .* within 0.5 s"):
        LeaderChannel(_cluster(port, 0, n=3, timeout=0.5), "d", lambda reason: None)


def test_a_silent_follower_is_lost_after_the_timeout() -> None:
    port, out = free_port_pair(), {}
    t = _lead(_cluster(port, 0, timeout=1.0), "d", out)
    follower = FollowerChannel(_cluster(port, 1, timeout=1.0), "d")
    t.join(10)
    follower.watch.closed.set()  # it stops pinging (a hung process)
    deadline = time.monotonic() + 10
    while "lost" not in out and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "process 1" in out["lost"] and "sent nothing for" in out["lost"]


def test_a_follower_whose_leader_goes_away_is_told() -> None:
    port, out = free_port_pair(), {}
    t = _lead(_cluster(port, 0), "d", out)
    lost: list[str] = []
    follower = FollowerChannel(_cluster(port, 1), "d", lost=lost.append)
    t.join(10)
    out["leader"].peers[0].sock.close()  # the leader process died
    with pytest.raises(mh.PeerLost, match="the leader left the step channel"):
        mh.follow(object(), follower)
    assert lost and "the leader" in lost[0]


def test_the_checkpoint_digest_tells_checkpoints_apart(llama_dir, model_dirs, tmp_path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(llama_dir, copy)
    assert mh.checkpoint_digest(str(llama_dir)) == mh.checkpoint_digest(str(copy))
    assert mh.checkpoint_digest(str(llama_dir)) != mh.checkpoint_digest(str(model_dirs["qwen2"]))
    (weights,) = copy.glob("*.safetensors")
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 1  # one bit of one weight in the middle (a sampled slice), the size unchanged
    weights.write_bytes(bytes(data))
    assert mh.checkpoint_digest(str(llama_dir)) != mh.checkpoint_digest(str(copy))


@pytest.mark.parametrize(
    "dtype, quantization", [("float32", "none"), ("bfloat16", "int8"), ("float32", "int4")]
)
def test_a_split_model_is_loaded_to_the_host_only(llama_dir, dtype, quantization) -> None:
    """``load_checkpoint(place=False)`` (a worker whose model is split over devices or hosts): the same values,
    all host arrays, so the runner puts each device's shards there and no device holds the whole model."""
    import jax

    from loraserve.models.checkpoint import load_checkpoint

    placed = load_checkpoint(str(llama_dir), dtype=dtype, quantization=quantization)
    host = load_checkpoint(str(llama_dir), dtype=dtype, quantization=quantization, place=False)
    leaves, want = jax.tree.leaves(host.params), jax.tree.leaves(placed.params)
    assert len(leaves) == len(want) > 10
    assert all(type(a) is np.ndarray for a in leaves)
    assert all(isinstance(a, jax.Array) for a in want)
    for a, b in zip(leaves, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, np.asarray(b))


def test_a_follower_that_dies_is_lost_at_once() -> None:
    port, out = free_port_pair(), {}
    t = _lead(_cluster(port, 0, timeout=60.0), "d", out)
    follower = FollowerChannel(_cluster(port, 1, timeout=60.0), "d")
    t.join(10)
    start = time.monotonic()
    follower.peer.sock.shutdown(socket.SHUT_RDWR)  # the process died: its connection closes
    while "lost" not in out and time.monotonic() - start < 10:
        time.sleep(0.01)
    assert "process 1 (127.0.0.1) left the step channel" in out["lost"]
    assert time.monotonic() - start < 5  # the closed connection, not the 60 s timeout
    with pytest.raises(FailedPrecondition, match=r"process 1 .* is gone"):
        for _ in range(100):  # the kernel may take a send or two before it reports the reset
            out["leader"].broadcast("zero", {"index": np.asarray(0, np.int32)})
            time.sleep(0.01)


def test_strangers_on_the_step_port_are_dropped_not_fatal() -> None:
    """A scanner, a probe or garbage on the port during start-up is dropped; the follower then joins. A
    stranger's header claiming a huge message reads nothing more."""
    port, out = free_port_pair(), {}
    t = _lead(_cluster(port, 0, timeout=10.0), "d", out)
    time.sleep(0.2)
    for payload in (b"GET / HTTP/1.1\r\n\r\n", mh.HEADER.pack(mh.MAGIC, 1 << 40), b""):
        with socket.create_connection(("127.0.0.1", port + 1)) as stranger:
            try:
                stranger.sendall(payload)
                stranger.shutdown(socket.SHUT_WR)
                answer = stranger.recv(16)
            except OSError:  # reset or already closed by the leader: dropped all the same
                answer = b""
            assert answer == b""  # closed without an answer
    follower = FollowerChannel(_cluster(port, 1, timeout=10.0), "d")
    t.join(10)
    assert "error" not in out and [p.name for p in out["leader"].peers] == ["process 1 (127.0.0.1)"]
    out["leader"].close()
    assert follower.next_call()[0] == mh.STOP


@pytest.mark.parametrize(
    "meta, words",
    [
        ({"process_id": "1", "num_processes": "x"}, "a hello without a process id and count"),
        ({"process_id": "0", "num_processes": "2"}, "process id 0 is taken or not a follower's"),
        ({"process_id": "5", "num_processes": "2"}, "process id 5 is taken or not a follower's"),
        ({"process_id": "1", "num_processes": "2"}, "process 1 loaded a different checkpoint"),
        (
            {"process_id": "1", "num_processes": "2", "digest": "d", "settings": "[1]"},
            "not a JSON object of flags",
        ),
        (
            {"process_id": "1", "num_processes": "2", "digest": "d", "settings": "{"},
            "not a JSON object of flags",
        ),
    ],
)
def test_a_hello_the_leader_cannot_take_is_refused_by_name(meta, words) -> None:
    port, out = free_port_pair(), {}
    t = _lead(_cluster(port, 0), "d", out)
    time.sleep(0.1)
    with socket.create_connection(("127.0.0.1", port + 1)) as sock:
        sock.sendall(
            mh.encode("hello", {}, meta)
        )  # no digest ("d"): a different checkpoint if it gets that far
        op, _, answer = mh.recv_message(sock)
    t.join(10)
    assert op == "refuse" and words in answer["reason"] and words in str(out["error"])
