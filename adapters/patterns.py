"""PEFT's ``rank_pattern`` / ``alpha_pattern`` keys, matched in time linear in the module path.

**What it matches.** PEFT (``peft.utils.other.get_pattern_key``, which ``LoraModel._create_and_replace``
uses) gives a module the value of the *first* key, in the dict's order (``json`` keeps the file's order;
PEFT saves ``adapter_config.json`` with sorted keys, so a saved adapter's order is the sorted one), for
which ``re.match(rf"(.*\\.)?({key})$", path)`` succeeds, and the default (``r`` / ``lora_alpha``) when no
key does. So a key is a regular expression that must match a whole dotted suffix of the path: ``q_proj``
matches ``model.layers.3.self_attn.q_proj``, ``layers\\.[0-3]\\..*`` matches the first four layers' modules,
``layers.0.self_attn.q_proj`` matches one module, ``proj`` matches nothing (``q_proj`` is one name). This
module gives exactly that answer: the same wrapped expression, the same first-key-wins order.

**Why not Python's ``re``.** ``re`` backtracks: a key such as ``(.*){20}x`` or ``(.|.)*x`` takes minutes
against ``model.layers.3.self_attn.q_proj``, holding the GIL all the while (a registry's health checks and
heartbeats stop, worker leases run out). Keys are compiled by RE2 (``google-re2``, a dependency of the
``registry`` and ``worker`` extras; the base install never parses adapters and does not need it): an
automaton, so a match costs time linear in the path whatever the key.

**Same meaning in both engines.** Python's own parser reads the wrapped expression first, warnings as errors:
a key PEFT could not compile (``(``, ``\\1`` …) or whose meaning Python flags as ambiguous (``[[:digit:]]``)
is refused. RE2 then refuses what it cannot do in linear time or does not know (backreferences,
lookarounds, atomic groups, possessive repeats, ``\\Z``, ``\\u``, comments, ``(?x)``) and what compiles to more
than :data:`MAX_MEM_PER_KEY` bytes. ``{,n}`` means ``{0,n}`` to Python and a literal to RE2, so a ``{``
followed by ``,`` is refused (write ``{0,n}``). What both accept means the same on a module path: paths are
ASCII names, digits, ``_`` and ``.`` (where Python's Unicode ``\\d``/``\\w`` and RE2's ASCII ones agree) and
hold no newline (where Python's ``$`` would also match before a final ``\\n``); match versus no match does not
depend on greediness.

**Bounds.** At most :data:`MAX_KEYS` (1024) keys per dict, each at most :data:`MAX_KEY_CHARS` (256)
characters and compiling within :data:`MAX_MEM_PER_KEY` of RE2 memory, and a dict's keys together at most
:data:`MAX_PROGRAM` RE2 instructions. A dict's keys are matched together in one pass over the path (an RE2
set): at the bounds it compiles in about half a second and answers a path in about a millisecond the first
time, microseconds after. Anything over a bound, or refused above, is an ``AdapterError`` (INVALID_ARGUMENT)
naming the field and the key. The compiled keys of the last few dicts are kept (a parse looks up every module
of every layer).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping
from re import _parser  # Python's own regular-expression parser: parses, never matches
from typing import Any

from loraserve.adapters.errors import AdapterError

MAX_KEYS = 1024  # keys per rank_pattern / alpha_pattern
MAX_KEY_CHARS = 256  # characters per key
MAX_MEM_PER_KEY = 64 << 10  # RE2's memory budget per compiled key (its program and its DFA cache)
MAX_PROGRAM = 1 << 17  # RE2 instructions over all keys of one dict (~16 bytes each)
MAX_SET_MEM = 8 << 20  # RE2's memory budget for one dict's keys matched together (program and DFA cache)


def _wrapped(key: str) -> str:
    """PEFT's expression for ``key`` (``peft.utils.other.get_pattern_key``)."""
    return rf"(.*\.)?({key})$"


@functools.cache
def _re2() -> Any:
    try:
        import re2
    except ImportError as exc:  # a base install: adapters are parsed by the registry and workers only
        raise ImportError(
            "rank_pattern / alpha_pattern need google-re2: install loraserve[registry] or loraserve[worker]"
        ) from exc
    return re2


def _options() -> Any:
    options = _re2().Options()
    options.max_mem = MAX_MEM_PER_KEY
    options.log_errors = False
    options.never_capture = True  # match or no match is all that counts: the DFA answers alone
    return options


class _Refused(Exception):
    """Why a dict or one of its keys is refused; :func:`_compiled` names the field."""

    def __init__(self, reason: str, key: object = None) -> None:
        super().__init__(reason)
        self.reason, self.key = reason, key


def _compile(key: str) -> Any:
    """``key`` as an RE2 expression with PEFT's meaning, or :class:`_Refused`."""
    if not isinstance(key, str):
        raise _Refused("keys must be strings", key)
    if len(key) > MAX_KEY_CHARS:
        raise _Refused(f"the key is {len(key)} characters long; at most {MAX_KEY_CHARS} are allowed", key)
    wrapped = _wrapped(key)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # FutureWarning: "possible nested set" ([[:digit:]] and the like)
            _parser.parse(wrapped)
    except (Exception, RecursionError) as exc:  # re.error, a FutureWarning, OverflowError
        raise _Refused(f"not a regular expression PEFT accepts ({exc})", key) from None
    if "{," in key:
        raise _Refused("write a repetition as {0,n}, not {,n} (RE2 reads {,n} as text)", key)
    re2 = _re2()
    try:
        return re2.compile(wrapped, _options())
    except (re2.error, UnicodeError) as exc:
        reason = exc.args[0].decode(errors="replace") if exc.args and isinstance(exc.args[0], bytes) else exc
        raise _Refused(
            f"cannot be matched in linear time (RE2: {reason}); backreferences, lookarounds, atomic groups, "
            "possessive repeats and very large repetitions are refused",
            key,
        ) from None


class _Compiled:
    """One dict's keys compiled: each key alone (in order), and all of them in one RE2 set whose single pass
    over a path reports every key that matches (one pass, not one match per key: docs/performance.md).
    The set also holds an empty expression, which every path matches: a set that answers nothing has run out
    of DFA memory, and the keys are then tried one by one (as linear, only slower)."""

    def __init__(self, keys: tuple[str, ...]) -> None:
        if len(keys) > MAX_KEYS:
            raise _Refused(f"{len(keys)} keys; at most {MAX_KEYS} are allowed")
        regexps, program = [], 0
        for key in keys:
            regexp = _compile(key)
            program += regexp.programsize
            if program > MAX_PROGRAM:
                raise _Refused(
                    f"the keys up to this one compile to more than {MAX_PROGRAM} RE2 instructions", key
                )
            regexps.append(regexp)
        self.regexps = tuple(regexps)
        self.set = self._set(keys) if len(keys) > 1 else None

    @staticmethod
    def _set(keys: tuple[str, ...]) -> Any:
        re2 = _re2()
        options = _options()
        options.max_mem = MAX_SET_MEM
        try:
            one = re2.Set.MatchSet(options)  # anchored at the start, like re.match
            for key in keys:
                one.Add(_wrapped(key))
            one.Add("")  # the sentinel: matches every path
            one.Compile()
        except re2.error:  # over MAX_SET_MEM: the keys one by one
            return None
        return one

    def first(self, path: str) -> int | None:
        """The index of the first key that matches ``path``, else None."""
        if self.set is not None:
            hits = self.set.Match(path)
            if hits:  # else out of DFA memory (the sentinel always matches)
                first = min(hits)
                return first if first < len(self.regexps) else None
        for i, regexp in enumerate(self.regexps):
            if regexp.match(path) is not None:
                return i
        return None


@functools.lru_cache(maxsize=8)
def _compile_all(keys: tuple[str, ...]) -> _Compiled:
    """Kept for the next lookups of the same dict (a parse looks up every module of every layer)."""
    return _Compiled(keys)


def _compiled(pattern: Mapping[str, Any], field: str) -> _Compiled:
    try:
        return _compile_all(tuple(pattern))
    except _Refused as exc:
        if exc.key is None:
            raise AdapterError(f"{field}: {exc.reason}") from None
        shown = exc.key if not isinstance(exc.key, str) or len(exc.key) <= 64 else f"{exc.key[:48]}…"
        raise AdapterError(f"{field}[{shown!r}]: {exc.reason}") from None


def check_patterns(field: str, pattern: Mapping[str, Any]) -> None:
    """Refuse a ``rank_pattern`` / ``alpha_pattern`` dict over the bounds or with a key this module refuses
    (``AdapterError``, INVALID_ARGUMENT, naming ``field`` and the key)."""
    _compiled(pattern, field)


def pattern_key(pattern: Mapping[str, Any], path: str, field: str = "pattern") -> str | None:
    """The key of ``pattern`` whose value PEFT gives the module at ``path``: the first that matches, else None."""
    if not pattern:
        return None
    first = _compiled(pattern, field).first(path)
    return None if first is None else list(pattern)[first]
