"""The registry's hot queries at fleet scale: what SQL they send and how the database runs it.

Latency itself is measured by ``bench/registry.py`` (1 000 000 adapters); these tests pin the causes: a
ListAdapters page after a token is an index range search (with the bare OR, SQLite scanned the whole
index from its start: 40 ms a page at 1M rows), and LocateAdapter reads only the adapter's row while the
fleet view is fresh.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import event, insert

from loraserve.registry.app import open_registry
from loraserve.registry.catalog import _encode_token
from loraserve.registry.config import RegistryConfig
from loraserve.registry.db import AdapterRow
from loraserve.registry.placement import ReportedLoad, SlotReport


def _registry(tmp_path: Path, adapters: int = 2000):
    reg = open_registry(RegistryConfig(db=f"sqlite:///{tmp_path / 'r.db'}", storage=str(tmp_path / "store")))
    rows = [
        dict(
            name=f"a-{i:05d}",
            version=1,
            base_model="m",
            rank=4,
            alpha=8.0,
            use_rslora=False,
            target_modules=["q_proj"],
            size_bytes=1,
            sha256=f"{i:064x}",
            uri="",
            config="{}",
            description="",
            labels={},
            state="READY",
        )
        for i in range(adapters)
    ]
    with reg.engine.begin() as conn:
        conn.execute(insert(AdapterRow), rows)
    return reg


def _capture(engine) -> list[tuple[str, object]]:
    seen: list[tuple[str, object]] = []
    event.listen(
        engine, "before_cursor_execute", lambda c, cur, sql, params, ctx, many: seen.append((sql, params))
    )
    return seen


def test_a_page_after_a_token_is_an_index_range_search(tmp_path) -> None:
    reg = _registry(tmp_path)
    try:
        seen = _capture(reg.engine)
        rows, token = reg.catalog.list(100, _encode_token("a-01000", 1))
        assert [r.name for r in rows] == [f"a-{i:05d}" for i in range(1001, 1101)] and token
        sql, params = seen[-1]
        with reg.engine.connect() as conn:
            plan = [r[-1] for r in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql, params)]
        assert plan == ["SEARCH adapters USING INDEX sqlite_autoindex_adapters_1 (name>?)"], plan
        # the next page starts after the token's (name, version), other versions of the name included
        with reg.engine.begin() as conn:
            conn.execute(
                insert(AdapterRow),
                [
                    dict(
                        name="a-01000",
                        version=2,
                        base_model="m",
                        rank=4,
                        alpha=8.0,
                        use_rslora=False,
                        target_modules=["q_proj"],
                        size_bytes=1,
                        sha256="f" * 64,
                        uri="",
                        config="{}",
                        description="",
                        labels={},
                        state="READY",
                    )
                ],
            )
        rows, _ = reg.catalog.list(3, _encode_token("a-01000", 1))
        assert [(r.name, r.version) for r in rows] == [("a-01000", 2), ("a-01001", 1), ("a-01002", 1)]
    finally:
        reg.close()


def test_locate_reads_only_the_adapter_while_the_fleet_view_is_fresh(tmp_path) -> None:
    import pytest

    from loraserve.common.errors import NotFound

    reg = _registry(tmp_path)
    try:
        placement = reg.placement
        workers = [placement.register(f"10.0.0.{i}:1", "m", {}, 4).id for i in range(50)]
        for i, wid in enumerate(workers):
            placement.heartbeat(wid, [SlotReport(0, f"a-{i:05d}@1", "LOADED")], ReportedLoad(free_slots=3))
        placement.fleet.ttl_s = 3600.0
        placement.locate("a-00007")  # the first locate reads the fleet
        seen = _capture(reg.engine)
        key, ranked = placement.locate("a-00008")
        assert key == "a-00008@1" and ranked[0].worker_id == workers[8] and ranked[0].holds_adapter
        selects = [sql for sql, _ in seen if sql.lstrip().upper().startswith("SELECT")]
        assert len(selects) == 1 and "FROM adapters" in selects[0], selects
        # the same name again within the resolve TTL: no read at all
        seen.clear()
        assert placement.locate("a-00008")[0] == "a-00008@1" and seen == []
        # a delete here is seen at once (another replica's within RESOLVE_TTL_S)
        reg.catalog.delete("a-00008")
        with pytest.raises(NotFound):
            placement.locate("a-00008")
    finally:
        reg.close()
