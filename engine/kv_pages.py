"""The host side of the paged KV cache (docs/design.md §10.3): free pages, per-sequence pages, the prefix cache.

The pool holds ``num_pages`` pages of ``page_size`` tokens; page 0 is the reserved null page and is never
handed out. A sequence's pages are a ``SeqPages`` (entry ``i`` holds positions ``i*page_size ..``).

**Prefix cache keyed by adapter.** A full page whose keys/values are computed gets a chained hash
``h_i = sha256(h_{i-1} || adapter_key || token ids of page i)``, ``adapter_key`` being the adapter's content
sha256 (so an adapter reloaded into another slot still hits) or ``"base"``; a page computed under one
adapter is therefore never found for another or for the base. Pages are reference counted: a lookup
shares the cached pages of the longest matching chain, capped so that the sequence's last token is always
recomputed into a private page (a prefill never writes into a shared page). A page whose count drops to
0 and that holds a hash stays cached, in LRU order, and is reclaimed (least recently released first) when
no free page is left. With prefix caching off nothing is hashed and released pages are free at once.

Engine thread only; no JAX, no numpy.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from loraserve.engine.kv_events import BlockRemoved, BlockStored

BASE_KEY = "base"  # the adapter key of the base model's pages


def _runs(indices: list[int]) -> list[list[int]]:
    """Consecutive runs of ascending ``indices``: [0, 1, 2, 5, 6] -> [[0, 1, 2], [5, 6]]."""
    out: list[list[int]] = []
    for i in indices:
        if out and out[-1][-1] == i - 1:
            out[-1].append(i)
        else:
            out.append([i])
    return out


class OutOfPagesError(RuntimeError):
    """More pages were asked for than are free or reclaimable (callers check ``available`` first)."""


def page_hash(prev: bytes, adapter_key: str, tokens: list[int] | tuple[int, ...]) -> bytes:
    """``sha256(prev || adapter_key || tokens)``; the key is length-prefixed, tokens are int32 LE."""
    key = adapter_key.encode()
    body = struct.pack(f"<I{len(key)}s{len(tokens)}i", len(key), key, *tokens)
    return hashlib.sha256(prev + body).digest()


@dataclass
class SeqPages:
    """One sequence's pages: ``pages[i]`` holds its positions ``i*page_size ..``; ``hashes[i]`` is the
    chained hash of page ``i`` for its first ``len(hashes)`` full, computed pages (empty when caching is off)."""

    adapter_key: str
    pages: list[int] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)
    hit_pages: int = 0  # pages shared from the cache at admission
    lora_name: str | None = None  # the adapter's name@version (or mix ref) for KV events; None = base


@dataclass(frozen=True)
class Lookup:
    """What a sequence would get at admission: the cached pages it hits and the new pages it needs."""

    hit_pages: tuple[int, ...]
    hit_hashes: tuple[bytes, ...]
    new_pages: int

    @property
    def hits(self) -> int:
        return len(self.hit_pages)


class KVCache:
    """``events``: a list the cache appends ``engine.kv_events`` events to as pages are registered
    (``BlockStored``) and as cached pages are reclaimed or forgotten (``BlockRemoved``); None = none."""

    def __init__(
        self, num_pages: int, page_size: int, enable_prefix_caching: bool = True, events: list | None = None
    ) -> None:
        if num_pages < 2 or page_size < 1:
            raise ValueError("the KV pool needs >= 2 pages (page 0 is the null page) of >= 1 token")
        self.num_pages, self.page_size, self.prefix_caching = num_pages, page_size, enable_prefix_caching
        self._free: deque[int] = deque(range(1, num_pages))  # no hash, refcount 0
        self._refs = [0] * num_pages
        self._hash_of: dict[int, bytes] = {}  # page -> its registered hash
        self._page_of: dict[bytes, int] = {}  # registered hash -> page
        self._lru: OrderedDict[int, None] = OrderedDict()  # refcount 0 with a hash, least recent first
        self.hit_tokens = self.query_tokens = 0
        self.events = events

    # ----------------------------------------------------------------- counts
    @property
    def total(self) -> int:
        """Usable pages (the null page excluded)."""
        return self.num_pages - 1

    @property
    def free(self) -> int:
        return len(self._free)

    @property
    def cached(self) -> int:
        """Pages nobody references that keep a hash (reusable by a hit, reclaimable LRU-first)."""
        return len(self._lru)

    @property
    def used(self) -> int:
        """Pages referenced by at least one sequence."""
        return self.total - self.free - self.cached

    @property
    def available(self) -> int:
        """Pages an allocation can take: free plus reclaimable cached ones."""
        return self.free + self.cached

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def lru_order(self) -> tuple[int, ...]:
        """Cached unreferenced pages, the next one reclaimed first."""
        return tuple(self._lru)

    def pages_for(self, positions: int) -> int:
        """Pages holding positions ``0 .. positions-1``."""
        return -(-positions // self.page_size)

    # ----------------------------------------------------------------- lookup / admission
    def lookup(self, adapter_key: str, tokens: list[int], reserve: int = 0, cached: bool = True) -> Lookup:
        """Cached pages for ``tokens`` under ``adapter_key`` (at most ``(len-1)//page_size``, so the last
        token is recomputed) and how many new pages holding positions ``0 .. len(tokens)-1+reserve`` need.
        ``cached=False``: no hits, every position is computed (a request scoring its whole prompt). Takes
        nothing and counts nothing."""
        pages: list[int] = []
        hashes: list[bytes] = []
        if self.prefix_caching and cached:
            prev, p = b"", self.page_size
            for i in range((len(tokens) - 1) // p):
                h = page_hash(prev, adapter_key, tokens[i * p : (i + 1) * p])
                page = self._page_of.get(h)
                if page is None:
                    break
                pages.append(page)
                hashes.append(h)
                prev = h
        return Lookup(tuple(pages), tuple(hashes), self.pages_for(len(tokens) + reserve) - len(pages))

    def can_take(self, lookup: Lookup, spare: int = 0) -> bool:
        """Whether ``lookup``'s new pages can be had once its hits are taken (hits idle in the LRU list
        stop being reclaimable), leaving ``spare`` pages over."""
        idle_hits = sum(1 for page in lookup.hit_pages if self._refs[page] == 0)
        return lookup.new_pages + spare <= self.available - idle_hits

    def admit(
        self, adapter_key: str, tokens: list[int], lookup: Lookup, lora_name: str | None = None
    ) -> SeqPages:
        """Take ``lookup``'s hits and allocate its new pages; counts the query and hit tokens."""
        if not self.can_take(lookup):
            raise OutOfPagesError(f"{lookup.new_pages} pages wanted, {self.available} available")
        for page in lookup.hit_pages:
            self._ref(page)
        seq = SeqPages(adapter_key, list(lookup.hit_pages), list(lookup.hit_hashes), lookup.hits, lora_name)
        seq.pages += self.allocate(lookup.new_pages)
        if self.prefix_caching:
            self.query_tokens += len(tokens)
            self.hit_tokens += lookup.hits * self.page_size
        return seq

    # ----------------------------------------------------------------- pages
    def allocate(self, n: int) -> list[int]:
        """``n`` private pages: free ones first, then cached ones reclaimed least recently used first."""
        if n > self.available:
            raise OutOfPagesError(f"{n} pages wanted, {self.available} available")
        out = []
        for _ in range(n):
            if self._free:
                page = self._free.popleft()
            else:
                page, _ = self._lru.popitem(last=False)
                gone = self._hash_of.pop(page)
                del self._page_of[gone]
                self._event(BlockRemoved((gone,)))
            self._refs[page] = 1
            out.append(page)
        return out

    def grow(self, seq: SeqPages, positions: int) -> bool:
        """Give ``seq`` the pages it lacks to hold positions ``0 .. positions-1``; False if too few are
        available (nothing taken then)."""
        n = self.pages_for(positions) - len(seq.pages)
        if n <= 0:
            return True
        if n > self.available:
            return False
        seq.pages += self.allocate(n)
        return True

    def release(self, seq: SeqPages) -> None:
        """Drop ``seq``'s references: hashed pages nobody else holds go to the LRU list's recent end,
        the others are free at once. ``seq`` holds nothing afterwards."""
        for page in reversed(seq.pages):  # a chain's tail is reclaimed before its head
            self._refs[page] -= 1
            assert self._refs[page] >= 0, f"page {page} released twice"
            if self._refs[page] == 0:
                if page in self._hash_of:
                    self._lru[page] = None
                else:
                    self._free.append(page)
        seq.pages, seq.hashes = [], []

    def register(self, seq: SeqPages, tokens: list[int], computed: int) -> None:
        """Hash ``seq``'s full pages among its first ``computed`` positions (``tokens`` = its token ids,
        at least ``computed`` of them) that are not hashed yet. A page whose hash is already cached on
        another page stays private (freed at release); the chain goes on with the hash either way."""
        if not self.prefix_caching:
            return
        p = self.page_size
        stored: list[int] = []  # the pages registered now (a run of them is one BlockStored)
        for i in range(len(seq.hashes), min(computed // p, len(seq.pages))):
            prev = seq.hashes[-1] if seq.hashes else b""
            h = page_hash(prev, seq.adapter_key, tokens[i * p : (i + 1) * p])
            seq.hashes.append(h)
            page = seq.pages[i]
            if h not in self._page_of and page not in self._hash_of:
                self._page_of[h] = page
                self._hash_of[page] = h
                stored.append(i)
        if self.events is not None:
            for run in _runs(stored):
                parent = seq.hashes[run[0] - 1] if run[0] else None
                toks = tuple(tokens[run[0] * p : (run[-1] + 1) * p])
                hashes = tuple(seq.hashes[i] for i in run)
                self.events.append(BlockStored(hashes, parent, toks, p, seq.lora_name))

    def forget(self, seq: SeqPages) -> None:
        """Drop the hashes ``seq`` registered (its pages' content is not what they say: a failed prefill)."""
        for h in seq.hashes:
            page = self._page_of.get(h)
            if page is not None and page in seq.pages:
                del self._page_of[h]
                del self._hash_of[page]
                self._event(BlockRemoved((h,)))

    def _event(self, event: object) -> None:
        if self.events is not None:
            self.events.append(event)

    def registered(self) -> frozenset[bytes]:
        """The hashes the prefix cache holds now (what the KV events stored and did not remove)."""
        return frozenset(self._page_of)

    def _ref(self, page: int) -> None:
        if self._refs[page] == 0:
            del self._lru[page]
        self._refs[page] += 1
