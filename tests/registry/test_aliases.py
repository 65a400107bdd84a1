"""Aliases over real gRPC on SQLite and PostgreSQL: ``name@prod`` -> a version or a weighted split, moved in one
transaction with its history, refusals with clear statuses and nothing half-done, deterministic routing keys,
and the migration from the previous schema with data in it."""

from __future__ import annotations

import itertools
import math
import threading

import pytest
import sqlalchemy as sa

from loraserve.common.errors import LoraserveError
from loraserve.protos.v1 import placement_pb2 as pp
from loraserve.protos.v1 import placement_pb2_grpc
from loraserve.registry import migrate
from tests.registry.conftest import TINY_MODEL


@pytest.fixture
def three(reg, adapter_dirs):
    """support-bot@1..3 and other@1."""
    for name in ("all-r4", "qv-r8-rslora", "mlp-r16"):
        reg.client.push(adapter_dirs[name], "support-bot", TINY_MODEL)
    reg.client.push(adapter_dirs["all-r4"], "other", TINY_MODEL)
    return reg


def _code(fn, *args) -> str:
    with pytest.raises(LoraserveError) as err:
        fn(*args)
    return err.value.code_name


def _alias_rows(reg) -> list[tuple]:
    with reg.registry.catalog.sessions() as s:
        return [
            tuple(r) for r in s.execute(sa.text("SELECT name, alias, targets FROM adapter_aliases")).all()
        ]


def test_alias_to_one_version_and_a_split(three) -> None:
    c = three.client
    a = c.set_alias("support-bot", "prod", [(2, 1)], "alice")
    assert (a.name, a.alias, [(t.version, t.weight) for t in a.targets], a.updated_by) == (
        "support-bot",
        "prod",
        [(2, 1.0)],
        "alice",
    )
    assert c.get("support-bot@prod").version == 2
    assert [al.alias for al in c.get("support-bot@2").aliases] == ["prod"]
    assert c.get("support-bot@3").aliases == []
    listed = {f"{x.name}@{x.version}": [al.alias for al in x.aliases] for x in c.list()}
    assert listed["support-bot@2"] == ["prod"] and listed["support-bot@1"] == []

    c.set_alias("support-bot", "prod", [(2, 90), (3, 10)], "bob")
    # a routing key always lands on the same version; the share over many keys follows the weights
    picks = [c.get("support-bot@prod", routing_key=f"user-{i}").version for i in range(400)]
    assert picks == [c.get("support-bot@prod", routing_key=f"user-{i}").version for i in range(400)]
    share = picks.count(3) / len(picks)
    assert abs(share - 0.1) < 4 * math.sqrt(0.1 * 0.9 / 400), share  # binomial, 4 sigma
    both = {al.alias for al in c.get("support-bot@3").aliases} & {
        al.alias for al in c.get("support-bot@2").aliases
    }
    assert both == {"prod"}


def test_history_delete_and_refusals(three) -> None:
    c = three.client
    c.set_alias("support-bot", "prod", [(1, 1)], "alice")
    c.set_alias("support-bot", "prod", [(1, 50), (2, 50)], "bob")
    c.set_alias("support-bot", "canary", [(3, 1)], "carol")
    assert _code(c.delete, "support-bot@3") == "FAILED_PRECONDITION"  # canary points at it
    assert _code(c.delete, "support-bot") == "FAILED_PRECONDITION"  # so does prod, at 1 and 2
    assert [(n, v, s) for n, v, s in three.adapter_rows() if s != "READY"] == []  # nothing deleted
    removed = c.delete_alias("support-bot", "canary", "carol")
    assert [t.version for t in removed.targets] == [3]
    assert [a.version for a in c.delete("support-bot@3").deleted] == [3]
    history = c.alias_history("support-bot")
    assert [
        (h.alias, [t.version for t in h.before], [t.version for t in h.after], h.actor) for h in history
    ] == [
        ("prod", [], [1], "alice"),
        ("prod", [1], [1, 2], "bob"),
        ("canary", [], [3], "carol"),
        ("canary", [3], [], "carol"),
    ]
    assert [h.alias for h in c.alias_history("support-bot", "canary")] == ["canary", "canary"]
    assert history[0].at.seconds <= history[-1].at.seconds

    before = _alias_rows(three)
    bad = [
        (("support-bot", "3", [(1, 1)]), "INVALID_ARGUMENT"),  # named like a version
        (("support-bot", "Prod", [(1, 1)]), "INVALID_ARGUMENT"),
        (("support-bot", "prod", []), "INVALID_ARGUMENT"),
        (("support-bot", "prod", [(1, -1), (2, 2)]), "INVALID_ARGUMENT"),
        (("support-bot", "prod", [(1, float("nan")), (2, 1)]), "INVALID_ARGUMENT"),
        (("support-bot", "prod", [(1, float("inf")), (2, 1)]), "INVALID_ARGUMENT"),
        (("support-bot", "prod", [(1, 0), (2, 0)]), "INVALID_ARGUMENT"),
        (("support-bot", "prod", [(1, 1), (1, 2)]), "INVALID_ARGUMENT"),
        (("support-bot", "prod", [(3, 1)]), "NOT_FOUND"),  # deleted
        (("support-bot", "prod", [(9, 1)]), "NOT_FOUND"),  # never existed
        (("other", "prod", [(2, 1)]), "NOT_FOUND"),  # support-bot has a 2; other does not
        (("no-such", "prod", [(1, 1)]), "NOT_FOUND"),
    ]
    for args, code in bad:
        assert _code(c.set_alias, *args) == code, args
    assert _alias_rows(three) == before  # nothing half-done
    assert len(c.alias_history("support-bot")) == 4
    assert _code(c.get, "support-bot@staging") == "NOT_FOUND"
    assert _code(c.delete_alias, "support-bot", "staging") == "NOT_FOUND"
    assert _code(c.delete, "support-bot@prod") == "INVALID_ARGUMENT"  # delete versions by number


def test_concurrent_moves_one_wins_and_history_has_all(three) -> None:
    c, errors = three.client, []

    def move(version: int) -> None:
        try:
            c.set_alias("support-bot", "prod", [(version, 1)], f"mover-{version}")
        except LoraserveError as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=move, args=(v,)) for v in (1, 2, 3) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    history = c.alias_history("support-bot", "prod")
    assert len(history) == 9 and not history[0].before  # created once, then moved 8 times
    for prev, nxt in itertools.pairwise(history):  # each change starts where the last ended
        assert [t.version for t in nxt.before] == [t.version for t in prev.after]
    assert c.get("support-bot@prod").version == history[-1].after[0].version


def test_locate_returns_the_split(three) -> None:
    three.client.set_alias("support-bot", "prod", [(1, 3), (2, 1)], "alice")
    stub = placement_pb2_grpc.PlacementStub(three.channel)
    resp = stub.LocateAdapter(pp.LocateAdapterRequest(adapter="support-bot@prod", routing_key="u1"))
    assert [(t.version, t.weight) for t in resp.split] == [(1, 3.0), (2, 1.0)]
    again = stub.LocateAdapter(pp.LocateAdapterRequest(adapter="support-bot@prod", routing_key="u1"))
    assert resp.adapter == again.adapter and resp.adapter in ("support-bot@1", "support-bot@2")
    assert not stub.LocateAdapter(pp.LocateAdapterRequest(adapter="support-bot@1")).split


def test_migration_from_wave_1_keeps_data_and_the_registry_serves_it(db_url, tmp_path) -> None:
    """A wave-1 database (revision 0001) with an adapter, a base model and a worker holding it is upgraded to
    the head: the rows stay, the new columns take their defaults, and the registry works on it (an alias set
    on the old version, a heartbeat). Then back down to 0002."""
    from loraserve.registry.config import RegistryConfig
    from tests.registry.conftest import start_registry

    url = db_url
    migrate.upgrade(url, "0001")
    engine = sa.create_engine(url)
    t = "'2026-06-01 00:00:00+00'"
    far = "'2099-01-01 00:00:00+00'"
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "INSERT INTO adapters (name, version, base_model, rank, alpha, use_rslora, target_modules,"
                f" size_bytes, sha256, uri, config, description, labels, state, created_at) VALUES ('a', 1,"
                f" '{TINY_MODEL}', 4, 8.0, false, '[\"q_proj\"]', 10, '{'0' * 64}', 'file:///x', '{{}}', '',"
                f" '{{}}', 'READY', {t})"
            )
        )
        conn.execute(
            sa.text(
                "INSERT INTO workers (id, address, model_id, slots, max_lora_rank, max_batch_size, state,"
                " lease_expires_at, last_heartbeat, running, waiting, free_slots, utilization, registered_at)"
                f" VALUES ('w1', 'h:1', '{TINY_MODEL}', 4, 16, 8, 'READY', {far}, {t}, 0, 0, 3, 0.0, {t})"
            )
        )
    migrate.upgrade(url)
    assert migrate.current_revision(url) == "0005"
    assert {"adapter_aliases", "alias_history"} <= set(sa.inspect(engine).get_table_names())
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT name, version, retired FROM adapters")).all() == [("a", 1, False)]
        row = conn.execute(sa.text("SELECT tensor_parallel_size, cached, usage FROM workers")).one()
        assert (row[0], _json(row[1]), _json(row[2])) == (1, {}, {})
    store = str(tmp_path / "store")
    with start_registry(RegistryConfig(db=url, storage=store, lease_seconds=60), store) as reg:
        assert reg.client.set_alias("a", "prod", [(1, 1)], "ops").targets[0].version == 1
        assert reg.client.get("a@prod").version == 1
        beat = reg.client.placement.Heartbeat(pp.HeartbeatRequest(worker_id="w1", load=pp.WorkerLoad()))
        assert not beat.unload
    migrate.command.downgrade(migrate.alembic_config(url), "0002")
    assert "adapter_aliases" not in set(sa.inspect(sa.create_engine(url)).get_table_names())
    engine.dispose()


def _json(value):
    import json

    return json.loads(value) if isinstance(value, str) else value


def _retired(reg) -> dict[int, bool]:
    with reg.registry.catalog.sessions() as s:
        rows = s.execute(sa.text("SELECT version, retired FROM adapters WHERE name = 'support-bot'")).all()
    return {v: bool(r) for v, r in rows}


def test_alias_moves_retire_versions_and_heartbeats_drain_them(three, tiny_shapes) -> None:
    """A version taken out of every alias (and not the latest) is retired in the move's transaction; pointing
    an alias at it again un-retires it. A worker reporting a retired version is told to drain it (unload once
    idle); a deleted one, to unload at once; anything else is left alone."""
    from tests.registry.test_placement_rpc import _beat, _register

    c = three.client
    c.set_alias("support-bot", "prod", [(1, 1)], "ci")
    c.set_alias("support-bot", "canary", [(2, 1)], "ci")
    assert _retired(three) == {1: False, 2: False, 3: False}
    c.set_alias("support-bot", "prod", [(2, 1)], "ci")  # v1: no alias, not the latest -> retired
    assert _retired(three) == {1: True, 2: False, 3: False}
    c.set_alias("support-bot", "canary", [(3, 1)], "ci")  # v2: prod still points at it
    assert _retired(three) == {1: True, 2: False, 3: False}
    c.set_alias("support-bot", "prod", [(1, 9), (2, 1)], "ci")  # rollback to v1 (90 %) un-retires it
    assert _retired(three) == {1: False, 2: False, 3: False}
    c.set_alias("support-bot", "prod", [(1, 1)], "ci")  # v2 leaves the split
    assert _retired(three) == {1: False, 2: True, 3: False}
    c.delete_alias("support-bot", "canary", "ci")  # v3 is the latest: a bare name reaches it
    assert _retired(three) == {1: False, 2: True, 3: False}

    worker = _register(three, "10.0.0.1:1", tiny_shapes)
    c.delete("other@1")
    resp = _beat(three, worker, ["support-bot@1", "support-bot@2", "support-bot@3", "other@1"])
    orders = {o.adapter: o.drain for o in resp.unload}
    assert orders == {"support-bot@2": True, "other@1": False}
    assert "retired" in next(o.reason for o in resp.unload if o.adapter == "support-bot@2")
    again = _beat(three, worker, ["support-bot@1", "support-bot@2"])  # still held (in use): asked again
    assert [(o.adapter, o.drain) for o in again.unload] == [("support-bot@2", True)]
    assert not _beat(three, worker, ["support-bot@1"]).unload  # drained
