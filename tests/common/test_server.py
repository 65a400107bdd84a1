"""common.server.run_server: NOT_SERVING through warm-up, SERVING after, the ready line, background tasks that
get the address served on and are cancelled at drain, cleanup callbacks in order, and the StatusInterceptor
on; unix-domain sockets: stale files replaced, live ones refused, the file removed at stop."""

from __future__ import annotations

import asyncio
import socket
import stat
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import REGISTRY

from loraserve.common.errors import NotFound, Unavailable
from loraserve.common.security import ServerSecurity
from loraserve.common.server import Services, build_server, run_server
from tests.e2e.compose_local import free_port
from tests.e2e.procs import unix_socket_dir

SERVICE = "loraserve.test.Lifecycle"
NOT_SERVING, SERVING = health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING


async def _missing(request: bytes, context) -> bytes:
    raise NotFound(f"no {request.decode()}")


def _add(server: grpc.aio.Server) -> None:
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                SERVICE, {"Get": grpc.unary_unary_rpc_method_handler(_missing)}
            ),
        )
    )


async def _status(address: str, service: str = "") -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        resp = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5
        )
        return resp.status


def test_run_server_lifecycle(capsys) -> None:
    events: list[str] = []

    async def scenario() -> None:
        warming, release, stop, bound = asyncio.Event(), asyncio.Event(), asyncio.Event(), asyncio.Future()

        async def warmup() -> None:
            warming.set()
            await release.wait()
            events.append("warmed up")

        async def heartbeat(address: str) -> None:
            bound.set_result(address)
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                events.append("background cancelled")
                raise

        async def close_async() -> None:
            events.append("cleanup 2 (async)")

        services = Services("lifecycle-test", _add, (SERVICE,))
        serving = asyncio.create_task(
            run_server(
                services,
                "127.0.0.1:0",
                ServerSecurity(),
                warmup=warmup,
                background=[heartbeat],
                cleanup=[lambda: events.append("cleanup 1"), close_async],
                grace=1,
                stop=stop,
            )
        )
        await warming.wait()
        out = capsys.readouterr().out
        assert "serving on" not in out  # no ready line before warm-up ends
        release.set()
        address = await asyncio.wait_for(bound, 10)  # what the ready line prints: the port bound
        host, port = address.rsplit(":", 1)
        assert host == "127.0.0.1" and 0 < int(port) < 65536
        assert capsys.readouterr().out == f"loraserve lifecycle-test serving on {address}\n"
        assert await _status(address) == SERVING and await _status(address, SERVICE) == SERVING
        async with grpc.aio.insecure_channel(address) as channel:
            try:
                await channel.unary_unary(f"/{SERVICE}/Get")(b"thing", timeout=5)
            except grpc.aio.AioRpcError as exc:
                assert (exc.code(), exc.details()) == (grpc.StatusCode.NOT_FOUND, "no thing")
            else:
                raise AssertionError("Get answered")
        stop.set()
        await asyncio.wait_for(serving, 10)

    asyncio.run(scenario())
    assert events == ["warmed up", "background cancelled", "cleanup 1", "cleanup 2 (async)"]
    assert (
        REGISTRY.get_sample_value(
            "loraserve_rpc_requests_total", {"server": "lifecycle-test", "method": "Get", "code": "NOT_FOUND"}
        )
        == 1
    )


def test_health_is_not_serving_during_warm_up() -> None:
    port = free_port()
    address = f"127.0.0.1:{port}"

    async def scenario() -> list[int]:
        stop, seen = asyncio.Event(), []

        async def warmup() -> None:  # the server is bound and started before warm-up: probe it from here
            seen.append(await _status(address))

        task = asyncio.create_task(
            run_server(
                Services("warmup-test", _add, (SERVICE,)),
                f"127.0.0.1:{port}",
                ServerSecurity(),
                warmup=warmup,
                stop=stop,
                grace=1,
            )
        )
        while len(seen) < 1:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # let the warm-up return and the server turn SERVING
        seen.append(await _status(address))
        stop.set()
        await asyncio.wait_for(task, 10)
        return seen

    assert asyncio.run(scenario()) == [NOT_SERVING, SERVING]


def test_stop_during_warm_up_drains_without_ever_serving(capsys) -> None:
    events: list[str] = []

    async def scenario() -> None:
        stop = asyncio.Event()

        async def warmup() -> None:
            stop.set()  # e.g. SIGTERM while the worker compiles
            events.append("warmed up")

        async def never(address: str) -> None:
            events.append("background started")

        await asyncio.wait_for(
            run_server(
                Services("stopped-test", _add, (SERVICE,)),
                "127.0.0.1:0",
                ServerSecurity(),
                warmup=warmup,
                background=[never],
                cleanup=[lambda: events.append("cleanup")],
                stop=stop,
                grace=1,
            ),
            10,
        )

    asyncio.run(scenario())
    assert events == ["warmed up", "cleanup"]
    assert "serving on" not in capsys.readouterr().out


def test_a_background_task_that_dies_is_logged_with_its_traceback(caplog) -> None:
    """A crashed background task (e.g. a worker's registration loop) must never vanish silently."""

    async def scenario() -> None:
        stop = asyncio.Event()

        async def crashes(address: str) -> None:
            raise ValueError(f"bad field in the request to register {address}")

        async def stop_soon(address: str) -> None:
            await asyncio.sleep(0.2)
            stop.set()

        await asyncio.wait_for(
            run_server(
                Services("crash-test", _add, (SERVICE,)),
                "127.0.0.1:0",
                ServerSecurity(),
                background=[crashes, stop_soon],
                stop=stop,
                grace=1,
            ),
            10,
        )

    with caplog.at_level("ERROR", logger="loraserve.server"):
        asyncio.run(scenario())
    (record,) = [r for r in caplog.records if r.getMessage().startswith("background task")]
    assert record.exc_info[0] is ValueError
    assert "bad field in the request to register 127.0.0.1:" in str(record.exc_info[1])


def _stale_socket(path: Path) -> None:
    """A socket file as a process killed with SIGKILL leaves it: bound, then closed, never unlinked."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    sock.close()


def test_serving_on_a_unix_socket(capsys, monkeypatch) -> None:
    """A relative unix:PATH is served at its absolute path (the ready line and background tasks say which); a
    stale socket file there is replaced; a second server on a live one is refused, and the first serves on;
    the file is gone after a clean stop."""
    with unix_socket_dir() as folder:
        monkeypatch.chdir(folder)
        path = folder / "lifecycle.sock"
        _stale_socket(path)
        address = f"unix:{path}"

        async def scenario() -> None:
            stop, served = asyncio.Event(), asyncio.Future()

            async def advertise(address: str) -> None:
                served.set_result(address)

            task = asyncio.create_task(
                run_server(
                    Services("unix-test", _add, (SERVICE,)),
                    "unix:lifecycle.sock",
                    ServerSecurity(),
                    background=[advertise],
                    stop=stop,
                    grace=1,
                )
            )
            assert await asyncio.wait_for(served, 10) == address
            assert capsys.readouterr().out == f"loraserve unix-test serving on {address}\n"
            assert await _status(address) == SERVING and stat.S_ISSOCK(path.stat().st_mode)
            with pytest.raises(Unavailable) as exc:
                build_server(Services("second", _add, (SERVICE,)), address)
            assert exc.value.message == f"cannot bind {address}: another process is serving on it"
            assert await _status(address) == SERVING  # still the first server's socket
            stop.set()
            await asyncio.wait_for(task, 10)

        asyncio.run(scenario())
        assert not path.exists()


def test_a_unix_socket_path_that_cannot_be_claimed_is_unavailable() -> None:
    with unix_socket_dir() as folder:
        kept = folder / "notes.txt"
        kept.write_text("not a socket")
        for path, why in [
            (kept, f"{kept} exists and is not a socket"),
            (folder / "absent" / "w.sock", f"no folder {folder / 'absent'}"),
        ]:

            async def build(path: Path = path) -> None:  # a grpc.aio server is made in an event loop
                build_server(Services("refused", _add, (SERVICE,)), f"unix:{path}")

            with pytest.raises(Unavailable) as exc:
                asyncio.run(build())
            assert exc.value.message == f"cannot bind unix:{path}: {why}"
        assert kept.read_text() == "not a socket"
