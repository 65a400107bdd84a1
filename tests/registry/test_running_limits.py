"""Running caps over real gRPC on SQLite and PostgreSQL: set, list, clear per adapter name and per tenant
(the adapters' ``tenant`` label); GetAdapter and heartbeat replies carry the caps of what a worker asks for
or holds; bad limits are refused with a clear status and nothing stored; the CLI refuses them before any
call."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa

from loraserve.cli import main
from loraserve.common.errors import LoraserveError
from loraserve.protos.v1 import placement_pb2 as pp
from loraserve.protos.v1 import registry_pb2 as rp
from loraserve.protos.v1 import worker_admin_pb2 as wa
from loraserve.registry.placement import MAX_CACHED
from tests.registry.conftest import TINY_MODEL
from tests.registry.test_placement_rpc import _register


@pytest.fixture
def tenants(reg, adapter_dirs):
    """bot@1, bot@2 and helper@1 labelled tenant=acme; solo@1 unlabelled."""
    for name, labels in (
        ("bot", {"tenant": "acme"}),
        ("bot", {"tenant": "acme"}),
        ("helper", {"tenant": "acme"}),
    ):
        reg.client.push(adapter_dirs["all-r4"], name, TINY_MODEL, labels=labels)
    reg.client.push(adapter_dirs["all-r4"], "solo", TINY_MODEL)
    return reg


def _rows(reg) -> list[tuple]:
    with reg.registry.catalog.sessions() as s:
        rows = s.execute(sa.text("SELECT kind, key, max_running, updated_by FROM running_limits ORDER BY id"))
        return [tuple(r) for r in rows]


def _code(fn, *args, **kw) -> str:
    with pytest.raises(LoraserveError) as err:
        fn(*args, **kw)
    return err.value.code_name


def test_set_list_clear_and_what_workers_are_told(tenants, tiny_shapes) -> None:
    c = tenants.client
    lim = c.set_running_limit(2, adapter="bot", actor="alice")
    assert (lim.kind, lim.key, lim.max_running, lim.updated_by) == ("adapter", "bot", 2, "alice")
    c.set_running_limit(3, tenant="acme", actor="alice")
    c.set_running_limit(1, adapter="bot", actor="bob")  # a change updates the one row
    assert _rows(tenants) == [("adapter", "bot", 1, "bob"), ("tenant", "acme", 3, "alice")]
    assert [(v.kind, v.key, v.max_running) for v in c.running_limits()] == [
        ("adapter", "bot", 1),
        ("tenant", "acme", 3),
    ]

    # GetAdapter: the worker resolving a name learns its caps from the first request on
    got = {ref: c.get(ref) for ref in ("bot", "bot@1", "helper", "solo")}
    assert [(g.max_running, g.tenant_max_running, g.labels.get("tenant", "")) for g in got.values()] == [
        (1, 3, "acme"),
        (1, 3, "acme"),
        (0, 3, "acme"),
        (0, 0, ""),
    ]

    # heartbeats: the caps of every name the worker holds (slots and caches), no others
    worker = _register(tenants, "10.0.0.1:1", tiny_shapes)
    beat = tenants.client.placement.Heartbeat(
        pp.HeartbeatRequest(
            worker_id=worker,
            slots=[wa.SlotInfo(slot=0, adapter="bot@2", state=wa.SLOT_STATE_LOADED)],
            cached=[
                pp.AdapterResidency(adapter=a, tier=pp.RESIDENCY_TIER_HOST)
                for a in ("helper@1", "solo@1", "/local")
            ],
            load=pp.WorkerLoad(free_slots=3),
        )
    )
    assert [(x.adapter, x.max_running, x.tenant, x.tenant_max_running) for x in beat.caps] == [
        ("bot", 1, "acme", 3),
        ("helper", 0, "acme", 3),
    ]

    cleared = c.clear_running_limit(adapter="bot", actor="bob")
    assert (cleared.kind, cleared.key, cleared.max_running) == ("adapter", "bot", 0)
    c.clear_running_limit(tenant="acme")
    assert _rows(tenants) == [] and c.get("bot").max_running == 0
    beat = tenants.client.placement.Heartbeat(
        pp.HeartbeatRequest(
            worker_id=worker,
            slots=[wa.SlotInfo(slot=0, adapter="bot@2", state=wa.SLOT_STATE_LOADED)],
            load=pp.WorkerLoad(free_slots=3),
        )
    )
    assert list(beat.caps) == []


BAD = [
    (dict(adapter="bot", max_running=-1), "INVALID_ARGUMENT"),
    (dict(adapter="bot", max_running=0), "INVALID_ARGUMENT"),
    (dict(adapter="bot", max_running=(1 << 20) + 1), "INVALID_ARGUMENT"),
    (dict(adapter="bot", max_running=2, clear=True), "INVALID_ARGUMENT"),
    (dict(max_running=2), "INVALID_ARGUMENT"),
    (dict(adapter="bot", tenant="acme", max_running=2), "INVALID_ARGUMENT"),
    (dict(adapter="bot@1", max_running=2), "INVALID_ARGUMENT"),
    (dict(adapter="bot@prod", max_running=2), "INVALID_ARGUMENT"),
    (dict(adapter="Bad Name", max_running=2), "INVALID_ARGUMENT"),
    (dict(tenant="a" * 200, max_running=2), "INVALID_ARGUMENT"),
    (dict(tenant="acme\n", max_running=2), "INVALID_ARGUMENT"),
    (dict(adapter="nobody", max_running=2), "NOT_FOUND"),
    (dict(adapter="bot", clear=True), "NOT_FOUND"),
    (dict(tenant="acme", clear=True), "NOT_FOUND"),
]


def test_bad_limits_are_refused_and_store_nothing(tenants, capsys) -> None:
    c = tenants.client
    codes = [_code(c._call, c.adapters.SetRunningLimit, rp.SetRunningLimitRequest(**kw)) for kw, _ in BAD]
    assert codes == [code for _, code in BAD]
    assert _rows(tenants) == []
    # the CLI refuses what is no count before any call: argparse names the flag, exit status 2
    for value in ["-1", "0", "1.5", "abc", "1e3", ""]:
        with pytest.raises(SystemExit) as exit_:
            main(["adapters", "limits", "bot", "--max-running", value, "--registry", tenants.address])
        assert exit_.value.code == 2
        assert "--max-running" in capsys.readouterr().err
    assert _rows(tenants) == []


def test_the_cli_sets_lists_and_clears(tenants, capsys) -> None:
    args = ["--registry", tenants.address]
    assert main(["adapters", "limits", "bot", "--max-running", "4", "--actor", "ops", *args]) in (0, None)
    assert main(["adapters", "limits", "--tenant", "acme", "--max-running", "8", *args]) in (0, None)
    capsys.readouterr()
    assert main(["adapters", "limits", "--json", *args]) in (0, None)
    listed = json.loads(capsys.readouterr().out)
    assert [(x["kind"], x["key"], x["max_running"]) for x in listed] == [
        ("adapter", "bot", 4),
        ("tenant", "acme", 8),
    ]
    assert main(["adapters", "limits", "bot", *args]) in (0, None)
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:3] == ["KIND", "KEY", "MAX"] and table[1].split()[:4] == [
        "adapter",
        "bot",
        "4",
        "ops",
    ]
    assert len(table) == 2
    assert main(["adapters", "limits", "bot", "--clear", *args]) in (0, None)
    assert _rows(tenants) == [("tenant", "acme", 8, _rows(tenants)[0][3])]
    code = main(["adapters", "limits", "nobody", "--max-running", "1", *args])
    assert code not in (0, None)
    assert "nobody" in capsys.readouterr().err


def test_a_heartbeat_holding_tens_of_thousands_of_adapters_gets_its_caps(tenants, tiny_shapes) -> None:
    """A report of more cached adapters than PostgreSQL takes bound parameters in one statement (65 535):
    the registry keeps the first MAX_CACHED of them (registry.placement), reads their tenant labels in
    chunks, and answers with their caps (and unload orders for the unknown ones) instead of failing."""
    tenants.client.set_running_limit(2, tenant="acme")
    worker = _register(tenants, "10.0.0.2:1", tiny_shapes)
    ghosts = [pp.AdapterResidency(adapter=f"ghost-{i}@1", tier=pp.RESIDENCY_TIER_DISK) for i in range(70_000)]
    beat = tenants.client.placement.Heartbeat(
        pp.HeartbeatRequest(
            worker_id=worker,
            cached=[pp.AdapterResidency(adapter="helper@1", tier=pp.RESIDENCY_TIER_HOST), *ghosts],
            load=pp.WorkerLoad(free_slots=4),
        )
    )
    assert [(x.adapter, x.max_running, x.tenant, x.tenant_max_running) for x in beat.caps] == [
        ("helper", 0, "acme", 2)
    ]
    assert len(beat.unload) == MAX_CACHED - 1  # the kept ghosts: the registry knows none of them
