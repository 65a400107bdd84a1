"""``loraserve adapters {push,ls,show,rm,alias,unalias,history,limits}`` and ``loraserve workers ls``: registry
administration.

Tables by default, ``--json`` for machines. The registry address comes from ``--registry`` or
``LORASERVE_REGISTRY_ADDRESS`` (default 127.0.0.1:50051): ``host:port`` or ``unix:PATH``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from google.protobuf.json_format import MessageToDict

from loraserve.client.connection_flags import add_connection_flags, connection_kwargs

DEFAULT_REGISTRY = "127.0.0.1:50051"


def _tier_word(value: int) -> str:
    """A ResidencyTier wire value as the tables print it."""
    from loraserve.common.slots import Tier

    tier = Tier.of_proto(value)
    return tier.word if tier else "?"


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--registry",
        default=None,
        help="registry address, host:port or unix:PATH"
        f" (env LORASERVE_REGISTRY_ADDRESS; default {DEFAULT_REGISTRY})",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_connection_flags(parser)


def add_adapter_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="adapters_command", metavar="ACTION")
    sub.required = True
    push = sub.add_parser("push", help="upload a PEFT adapter folder")
    push.add_argument("folder", help="folder with adapter_config.json and adapter_model.safetensors")
    push.add_argument("--name", required=True, help="adapter name (a new version is created)")
    push.add_argument("--base-model", required=True, help="base model id the adapter was trained for")
    push.add_argument("--description", default="")
    push.add_argument("--label", action="append", default=[], metavar="KEY=VALUE")
    push.add_argument("--version", type=int, default=0, help="explicit version (default: next)")
    push.add_argument("--alias", default="", help="then point this alias (e.g. prod) at the pushed version")
    push.add_argument(
        "--allow-base-mismatch",
        action="store_true",
        help="accept an adapter_config.json that names another base model (recorded in its labels)",
    )
    push.set_defaults(adapters_action=_push)
    _common(push)
    ls = sub.add_parser("ls", help="list adapters")
    ls.add_argument("--base-model", default="")
    ls.add_argument("--prefix", default="", help="only names starting with this")
    ls.set_defaults(adapters_action=_ls)
    _common(ls)
    show = sub.add_parser("show", help="show one adapter (name or name@version)")
    show.add_argument("adapter")
    show.set_defaults(adapters_action=_show)
    _common(show)
    rm = sub.add_parser("rm", help="delete one version (name@3) or every version (name)")
    rm.add_argument("adapter")
    rm.set_defaults(adapters_action=_rm)
    _common(rm)
    alias = sub.add_parser(
        "alias", help="point NAME@ALIAS at a version (3) or a weighted split (3=90 4=10); one transaction"
    )
    alias.add_argument("name")
    alias.add_argument("alias")
    alias.add_argument("targets", nargs="+", metavar="VERSION[=WEIGHT]")
    alias.add_argument("--actor", default="", help="who is moving it (default: $USER)")
    alias.set_defaults(adapters_action=_alias)
    _common(alias)
    unalias = sub.add_parser("unalias", help="remove NAME@ALIAS (its history stays)")
    unalias.add_argument("name")
    unalias.add_argument("alias")
    unalias.add_argument("--actor", default="", help="who is removing it (default: $USER)")
    unalias.set_defaults(adapters_action=_unalias)
    _common(unalias)
    base = sub.add_parser(
        "base", help="show a base model's other names (e.g. its Hugging Face repo id); change them"
    )
    base.add_argument("model_id")
    base.add_argument("--alias", action="append", default=[], help="add this name (repeatable)")
    base.add_argument("--remove", action="append", default=[], help="remove this name (repeatable)")
    base.set_defaults(adapters_action=_base)
    _common(base)
    stats = sub.add_parser(
        "stats",
        help="per version of NAME: requests, tokens, loads, bytes fetched (live workers), holders, aliases",
    )
    stats.add_argument("name")
    stats.set_defaults(adapters_action=_stats)
    _common(stats)
    limits = sub.add_parser(
        "limits",
        help="cap the requests of adapter NAME (or --tenant T) each worker runs at once; "
        "with no --max-running/--clear: list the caps",
    )
    limits.add_argument("name", nargs="?", default="", help="an adapter name (every version)")
    limits.add_argument("--tenant", default="", help="a tenant: adapters whose label tenant=T")
    how = limits.add_mutually_exclusive_group()
    how.add_argument("--max-running", type=_running_count, metavar="K", help="at most K at once per worker")
    how.add_argument("--clear", action="store_true", help="remove the cap")
    limits.add_argument("--actor", default="", help="who is changing it (default: $USER)")
    limits.set_defaults(adapters_action=_limits)
    _common(limits)
    history = sub.add_parser("history", help="every alias change of NAME: who, when, from, to")
    history.add_argument("name")
    history.add_argument("--alias", default="", help="only this alias")
    history.set_defaults(adapters_action=_history)
    _common(history)


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="workers_command", metavar="ACTION")
    sub.required = True
    ls = sub.add_parser("ls", help="list registered workers and their slots")
    ls.add_argument("--model-id", default="")
    ls.add_argument("--all", action="store_true", help="include workers whose lease expired")
    ls.add_argument(
        "--adapters",
        action="store_true",
        help="one row per adapter held: its tier (device, host, disk) and pin",
    )
    ls.set_defaults(workers_action=_workers_ls)
    _common(ls)


def _client(args: argparse.Namespace):
    from loraserve.client.registry_client import RegistryClient

    return RegistryClient(
        args.registry or os.environ.get("LORASERVE_REGISTRY_ADDRESS", DEFAULT_REGISTRY),
        **connection_kwargs(args),
    )


def _dict(msg) -> dict:
    return MessageToDict(msg, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)


def _table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    for row in [header, *rows]:
        print("  ".join(str(x).ljust(w) for x, w in zip(row, widths, strict=True)).rstrip())


def _progress(sent: int, total: int) -> None:
    width = 30
    done = int(width * sent / max(total, 1))
    sys.stderr.write(f"\r[{'#' * done}{'.' * (width - done)}] {sent / 1e6:7.2f}/{total / 1e6:.2f} MB")
    if sent >= total:
        sys.stderr.write("\n")
    sys.stderr.flush()


def parse_targets(items: list[str]) -> list[tuple[int, float]]:
    """``["3"]`` or ``["3=90", "4=10"]`` -> [(version, weight)]; INVALID_ARGUMENT for anything else."""
    from loraserve.common.errors import InvalidArgument

    out = []
    for item in items:
        version, sep, weight = item.partition("=")
        try:
            out.append((int(version), float(weight) if sep else 1.0))
        except ValueError:
            raise InvalidArgument(f"alias target {item!r}: expected VERSION or VERSION=WEIGHT") from None
    return out


def _split(targets) -> str:
    if len(targets) == 1:
        return str(targets[0].version)
    return " ".join(f"{t.version}={t.weight:g}" for t in targets)


def _actor(args: argparse.Namespace) -> str:
    return getattr(args, "actor", "") or os.environ.get("USER", "")


def _push(client, args: argparse.Namespace) -> None:
    labels = dict(item.split("=", 1) for item in args.label)
    a = client.push(
        args.folder,
        args.name,
        args.base_model,
        description=args.description,
        labels=labels,
        version=args.version,
        progress=None if args.json else _progress,
        allow_base_mismatch=args.allow_base_mismatch,
    )
    for warning in a.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    moved = client.set_alias(a.name, args.alias, [(a.version, 1.0)], _actor(args)) if args.alias else None
    if args.json:
        print(json.dumps({**_dict(a), **({"alias": _dict(moved)} if moved else {})}))
    else:
        print(f"pushed {a.name}@{a.version} ({a.size_bytes} bytes, sha256 {a.sha256[:12]}…)")
        if moved:
            print(f"{a.name}@{moved.alias} -> {_split(moved.targets)}")


def _ls(client, args: argparse.Namespace) -> None:
    adapters = list(client.list(base_model=args.base_model, name_prefix=args.prefix))
    if args.json:
        print(json.dumps([_dict(a) for a in adapters]))
        return
    _table(
        [
            [
                f"{a.name}@{a.version}",
                a.base_model,
                a.rank,
                f"{a.alpha:g}",
                ",".join(a.target_modules),
                a.size_bytes,
                ",".join(al.alias for al in a.aliases),
            ]
            for a in adapters
        ],
        ["ADAPTER", "BASE MODEL", "RANK", "ALPHA", "TARGETS", "BYTES", "ALIASES"],
    )


def _show(client, args: argparse.Namespace) -> None:
    d = _dict(client.get(args.adapter))
    print(json.dumps(d) if args.json else "\n".join(f"{k:15s} {v}" for k, v in d.items()))


def _print_alias(args: argparse.Namespace, view, verb: str) -> None:
    print(json.dumps(_dict(view)) if args.json else f"{view.name}@{view.alias} {verb} {_split(view.targets)}")


def _alias(client, args: argparse.Namespace) -> None:
    view = client.set_alias(args.name, args.alias, parse_targets(args.targets), _actor(args))
    _print_alias(args, view, "->")


def _unalias(client, args: argparse.Namespace) -> None:
    view = client.delete_alias(args.name, args.alias, _actor(args))
    _print_alias(args, view, "removed; it pointed at")


def _base(client, args: argparse.Namespace) -> None:
    if args.alias or args.remove:
        model = client.set_base_model_aliases(args.model_id, args.alias, args.remove)
    else:
        model = client.base_model(args.model_id)
    if args.json:
        print(json.dumps(_dict(model)))
    else:
        print(f"{model.id}  also known as: {', '.join(model.aliases) or '(no other names)'}")


def _stats(client, args: argparse.Namespace) -> None:
    resp = client.stats(args.name)
    if args.json:
        print(json.dumps(_dict(resp)))
        return
    _table(
        [
            [
                f"{resp.name}@{v.version}",
                ",".join(v.aliases) or "-",
                v.usage.requests,
                v.usage.prompt_tokens,
                v.usage.completion_tokens,
                v.usage.loads,
                v.usage.fetched_bytes,
                " ".join(f"{h.address}:{_tier_word(h.tier)}" for h in v.holders) or "-",
            ]
            for v in resp.versions
        ],
        ["VERSION", "ALIASES", "REQUESTS", "PROMPT TOK", "OUTPUT TOK", "LOADS", "FETCHED B", "HELD BY"],
    )


def _history(client, args: argparse.Namespace) -> None:
    changes = client.alias_history(args.name, args.alias)
    if args.json:
        print(json.dumps([_dict(c) for c in changes]))
        return
    _table(
        [
            [
                c.at.ToDatetime().strftime("%Y-%m-%d %H:%M:%S"),
                f"{c.name}@{c.alias}",
                _split(c.before) if c.before else "(new)",
                _split(c.after) if c.after else "(deleted)",
                c.actor,
            ]
            for c in changes
        ],
        ["WHEN (UTC)", "ALIAS", "FROM", "TO", "BY"],
    )


def _running_count(text: str) -> int:
    """``--max-running``: a whole number from 1 (argparse names the flag and exits 2 on anything else)."""
    try:
        value = int(text, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is below 1 (use --clear to remove a cap)")
    return value


def _limits(client, args: argparse.Namespace) -> None:
    from loraserve.common.errors import InvalidArgument

    if args.name and args.tenant:
        raise InvalidArgument("give an adapter NAME or --tenant, not both")
    target = {"adapter": args.name, "tenant": args.tenant}
    if args.max_running is not None or args.clear:
        if not (args.name or args.tenant):
            raise InvalidArgument("--max-running and --clear need an adapter NAME or --tenant")
        if args.clear:
            views = [client.clear_running_limit(**target, actor=_actor(args))]
        else:
            views = [client.set_running_limit(args.max_running, **target, actor=_actor(args))]
    else:  # list, or one name's / tenant's cap
        kind, key = ("adapter", args.name) if args.name else ("tenant", args.tenant)
        views = [v for v in client.running_limits() if not key or (v.kind, v.key) == (kind, key)]
    if args.json:
        print(json.dumps([_dict(v) for v in views]))
        return
    _table(
        [
            [v.kind, v.key, v.max_running or "(cleared)", v.updated_by, v.updated_at.ToDatetime().isoformat()]
            for v in views
        ],
        ["KIND", "KEY", "MAX RUNNING", "BY", "SET AT (UTC)"],
    )


def _rm(client, args: argparse.Namespace) -> None:
    resp = client.delete(args.adapter)
    if args.json:
        print(json.dumps(_dict(resp)))
    else:
        deleted = ", ".join(f"{a.name}@{a.version}" for a in resp.deleted)
        print(f"deleted {deleted}; {resp.unload_orders} unload order(s) sent")


def run_adapters(args: argparse.Namespace) -> int:
    """Run the ``adapters`` action argparse chose (``set_defaults(adapters_action=...)``)."""
    with _client(args) as client:
        args.adapters_action(client, args)
    return 0


def _workers_residency_table(workers) -> None:
    _table(
        [
            [w.worker_id[:12], w.address, r.adapter, _tier_word(r.tier), "yes" if r.pinned else ""]
            for w in workers
            for r in w.residency
        ],
        ["WORKER", "ADDRESS", "ADAPTER", "TIER", "PINNED"],
    )


def _workers_table(workers) -> None:
    _table(
        [
            [
                w.worker_id[:12],
                w.address,
                w.model_id,
                f"{len(w.slot_infos)}/{w.slots}",
                w.tensor_parallel_size,
                ",".join(s.adapter for s in w.slot_infos) or "-",
                w.load.running,
                w.load.waiting,
            ]
            for w in workers
        ],
        ["WORKER", "ADDRESS", "MODEL", "SLOTS", "TP", "ADAPTERS", "RUNNING", "WAITING"],
    )


def _workers_ls(args: argparse.Namespace) -> None:
    with _client(args) as client:
        workers = client.workers(model_id=args.model_id, include_expired=args.all)
    if args.json:
        print(json.dumps([_dict(w) for w in workers]))
    elif args.adapters:
        _workers_residency_table(workers)
    else:
        _workers_table(workers)


def run_workers(args: argparse.Namespace) -> int:
    """Run the ``workers`` action argparse chose (``set_defaults(workers_action=...)``)."""
    args.workers_action(args)
    return 0
