"""LocateAdapter on the event loop (``registry.hot_reads``): the same answers as the threaded path, on
SQLite and PostgreSQL, no thread hop while the fleet view is fresh, and UNAVAILABLE when the database
cannot be reached. Latency itself is ``bench/registry.py``'s."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import grpc
import pytest
from sqlalchemy import insert

from loraserve.common.errors import NotFound
from loraserve.protos.v1 import placement_pb2 as pp
from loraserve.registry import catalog as catalog_mod
from loraserve.registry import placement as placement_mod
from loraserve.registry.app import open_registry
from loraserve.registry.config import RegistryConfig
from loraserve.registry.db import AdapterRow
from loraserve.registry.hot_reads import InlineReads, PsycopgReads, ThreadReads, hot_reads_for
from loraserve.registry.placement import ReportedLoad, SlotReport
from tests.registry.conftest import start_registry


def _row(name: str, version: int, state: str = "READY", base: str = "m") -> dict:
    return dict(
        name=name, version=version, base_model=base, rank=4, alpha=8.0, use_rslora=False,
        target_modules=["q_proj"], size_bytes=1, sha256=f"{hash((name, version)) & (2**256 - 1):064x}",
        uri="", config="{}", description="", labels={}, state=state,
    )  # fmt: skip


@pytest.fixture
def registry(db_url: str, tmp_path: Path):
    reg = open_registry(RegistryConfig(db=db_url, storage=str(tmp_path / "store")))
    rows = [_row("a", 1), _row("a", 2, base="m2"), _row("a", 3, state="DELETED"), _row("b", 1, "FAILED")]
    with reg.engine.begin() as conn:
        conn.execute(insert(AdapterRow), rows)
    yield reg
    reg.close()


def test_the_reads_follow_the_database(registry) -> None:
    kind = registry.engine.dialect.name
    assert isinstance(registry.catalog.hot, {"sqlite": InlineReads, "postgresql": PsycopgReads}[kind])


def test_resolve_async_answers_as_resolve(registry) -> None:
    cat = registry.catalog

    async def both(ref: str):
        cat._resolved.clear()
        got = await cat.resolve_async(ref)
        cat._resolved.clear()
        return got, cat.resolve(ref)

    async def main():
        for ref, want in (("a", ("a@2", "m2")), ("a@1", ("a@1", "m")), ("a@2", ("a@2", "m2"))):
            assert await both(ref) == (want, want)
        for ref in ("a@3", "b", "b@1", "nope", "nope@4"):  # deleted, failed, unknown
            cat._resolved.clear()
            with pytest.raises(NotFound, match="does not exist"):
                await cat.resolve_async(ref)
        # a cached answer comes back without a read, until a local write clears the cache
        assert await cat.resolve_async("a@1") == ("a@1", "m")
        with registry.engine.begin() as conn:
            conn.execute(AdapterRow.__table__.delete().where(AdapterRow.name == "a"))
        assert await cat.resolve_async("a@1") == ("a@1", "m")
        cat._changed()
        with pytest.raises(NotFound):
            await cat.resolve_async("a@1")

    asyncio.run(main())


def test_the_reads_work_from_a_second_event_loop(registry) -> None:
    """psycopg's connections belong to a loop: a call from another loop opens its own, never the old."""
    for _ in range(2):
        registry.catalog._resolved.clear()
        assert asyncio.run(registry.catalog.resolve_async("a")) == ("a@2", "m2")


def test_locate_takes_no_thread_while_the_fleet_view_is_fresh(registry, monkeypatch) -> None:
    placement = registry.placement
    wid = placement.register("10.0.0.1:1", "m2", {}, 4).id
    placement.heartbeat(wid, [SlotReport(0, "a@2", "LOADED")], ReportedLoad(free_slots=3))
    hops: list[object] = []
    real = asyncio.to_thread

    async def counted(fn, *args):
        hops.append(fn)
        return await real(fn, *args)

    for module in (asyncio, catalog_mod.asyncio, placement_mod.asyncio):
        monkeypatch.setattr(module, "to_thread", counted)
    placement.fleet.ttl_s = 3600.0
    placement.locate("a@1")  # the first locate reads the fleet view
    key, ranked = asyncio.run(placement.locate_async("a"))
    assert (key, [c.worker_id for c in ranked], ranked[0].tier) == ("a@2", [wid], "DEVICE")
    assert hops == []
    placement.fleet.ttl_s = 0.0  # due for its re-read: that part goes to a thread
    assert asyncio.run(placement.locate_async("a@2"))[0] == "a@2"
    assert len(hops) == 1


def test_other_databases_read_on_a_thread(tmp_path: Path) -> None:
    from sqlalchemy import create_engine

    engine = create_engine(f"sqlite:///{tmp_path / 'x.db'}")
    engine.dialect.name = "mysql"  # any database without an asyncio path of ours
    assert type(hot_reads_for(engine)) is ThreadReads


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_locate_is_unavailable_when_postgres_is_unreachable(tmp_path: Path) -> None:
    db = f"postgresql+psycopg://postgres@127.0.0.1:{_closed_port()}/nothing"
    config = RegistryConfig(db=db, storage=str(tmp_path / "store"), migrate=False)
    reg = open_registry(config)
    assert isinstance(reg.catalog.hot, PsycopgReads)
    reg.close()
    with start_registry(config, str(tmp_path / "store")) as env:
        with pytest.raises(grpc.RpcError) as err:
            env.client.placement.LocateAdapter(pp.LocateAdapterRequest(adapter="a"), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert err.value.details() == "registry backend unavailable: OperationalError"
