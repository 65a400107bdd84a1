"""``loraserve generate [--adapter NAME | --mix A=W,B=W] "prompt"``: stream an answer to the terminal.

Every ``SamplingParams`` field has a flag (``--max-tokens``, ``--temperature``, ``--top-p``, ``--top-k``,
``--seed``, ``--stop``, ``--stop-token-id``, ``--ignore-eos``, ``--logprobs``).

With ``--logprobs N`` the answer is printed one token a line instead: ``id  token  logprob``, then the N most
likely alternatives as ``token logprob`` pairs (tokens JSON-quoted, so spaces and newlines show).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from loraserve.client.connection_flags import add_connection_flags, connection_kwargs

DEFAULT_TARGET = "127.0.0.1:50071"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="prompt text")
    parser.add_argument(
        "--adapter", default="", help="adapter name, name@version or name@alias (default: the base model)"
    )
    parser.add_argument(
        "--mix",
        type=parse_mix_flag,
        default=(),
        metavar="A=W,B=W",
        help="a weighted mix of adapters instead of --adapter, e.g. 'sql-helper=0.7,polite@prod=0.3' "
        "(weights may be negative; the server allows a few adapters, see --max-mix of loraserve worker)",
    )
    parser.add_argument(
        "--routing-key",
        default="",
        help="for an alias with a weighted split: the same key always gets the same version (e.g. a user id)",
    )
    parser.add_argument(
        "--target",
        default=None,
        help="router or worker address, host:port or unix:PATH"
        f" (env LORASERVE_TARGET; default {DEFAULT_TARGET})",
    )
    parser.add_argument("--max-tokens", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument(
        "--stop-token-id",
        type=int,
        action="append",
        default=[],
        help="token id that ends generation (repeatable)",
    )
    parser.add_argument(
        "--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token"
    )
    parser.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="N",
        help="print one line per token with its logprob and the N (0-20) most likely alternatives",
    )
    parser.add_argument(
        "--speculative",
        choices=("off", "ngram"),
        default="",
        help="speculative decoding for this request (default: the worker's; docs/speculative.md)",
    )
    parser.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=0,
        metavar="K",
        help="tokens drafted per step at most (1-8, capped by the worker's; default: the worker's)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per chunk")
    add_connection_flags(parser)


def parse_mix_flag(value: str) -> tuple[tuple[str, float], ...]:
    """``"a=0.7,b@2=0.3"`` -> ``(("a", 0.7), ("b@2", 0.3))``; a usage error (exit 2) when malformed."""
    parts = []
    for item in value.split(","):
        name, sep, weight = item.strip().rpartition("=")
        try:
            if not sep or not name:
                raise ValueError
            parts.append((name.strip(), float(weight)))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item.strip()!r} is not ADAPTER=WEIGHT") from None
    return tuple(parts)


def chunk_json(chunk) -> dict:
    """A chunk as JSON-able fields; ``logprobs`` only when the chunk has some (token_bytes as a byte list)."""
    out = dict(chunk.__dict__)
    logprobs = out.pop("logprobs")
    if logprobs:

        def one(p):
            return {
                "token_id": p.token_id,
                "logprob": p.logprob,
                "token": p.token,
                "bytes": list(p.token_bytes),
            }

        out["logprobs"] = [{"chosen": one(t.chosen), "top": [one(x) for x in t.top]} for t in logprobs]
    return out


def logprob_lines(chunk) -> list[str]:
    """``id  token  logprob`` per token of ``chunk``, followed by its alternatives."""
    lines = []
    for lp in chunk.logprobs:
        c = lp.chosen
        line = f"{c.token_id}\t{json.dumps(c.token, ensure_ascii=False)}\t{c.logprob:.4f}"
        if lp.top:
            alts = ", ".join(f"{json.dumps(t.token, ensure_ascii=False)} {t.logprob:.4f}" for t in lp.top)
            line += f"\t[{alts}]"
        lines.append(line)
    return lines


def run(args: argparse.Namespace) -> int:
    from loraserve.client.sdk import Client

    target = args.target or os.environ.get("LORASERVE_TARGET", DEFAULT_TARGET)
    last, finished = None, False
    try:
        with Client(target, **connection_kwargs(args)) as client:
            for chunk in client.generate(
                args.prompt,
                adapter=args.adapter,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                seed=args.seed,
                stop=args.stop,
                stop_token_ids=args.stop_token_id,
                ignore_eos=args.ignore_eos,
                logprobs=args.logprobs,
                routing_key=args.routing_key,
                mix=args.mix,
                speculative=args.speculative,
                num_speculative_tokens=args.num_speculative_tokens,
            ):
                last = chunk
                if args.json:
                    print(json.dumps(chunk_json(chunk)), flush=True)
                elif args.logprobs is not None:
                    for line in logprob_lines(chunk):
                        print(line, flush=True)
                else:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
        finished = True
    finally:
        streaming_text = not args.json and args.logprobs is None
        if streaming_text and last is not None and not finished:
            sys.stdout.write("\n")  # a stream cut short: the CLI's error line starts on a line of its own
    if not args.json and last is not None:
        if streaming_text:
            sys.stdout.write("\n")
        print(
            f"[{last.adapter or 'base model'}; finish {last.finish_reason}; {last.prompt_tokens} prompt + "
            f"{last.completion_tokens} completion tokens"
            + (
                f", {last.accepted_draft_tokens} of {last.draft_tokens} drafted kept"
                if last.draft_tokens
                else ""
            )
            + "]",
            file=sys.stderr,
        )
    return 0
