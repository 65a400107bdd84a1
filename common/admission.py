"""Admission: refuse at once what a server cannot take, say how long to wait, and time every decision.

Under overload most requests are refused, so a refusal must cost next to nothing and come back in
milliseconds: a client told "429" a second late has waited as long as a served one, and the work of refusing
then crowds out the work of serving. Both roles decide as early as they can:

* the **worker** refuses a request when its queue is full (``--max-waiting``), before tokenising it;
  over HTTP, at the ASGI edge, before its body is read (``httpapi.app.Edge``);
* the **router** learns from its workers' refusals when they are full (:class:`FullWorkers`) and then
  parks what arrives in a bounded first-come-first-served queue (:class:`WaitQueue`, ``--max-queued``,
  ``--max-queue-wait``): each of its streams that ends hands its place to the oldest waiter for that
  worker. It refuses when it is at ``--max-concurrency`` requests, when that queue is full, or when every
  worker it would try is full of streams it cannot see end (another router's); over HTTP again at the edge,
  before the body is read. Clients that resend the moment they are refused (load generators' closed loops)
  then wait their turn instead of turning the router into a refusal loop.

The wait a refusal announces comes from the drain rate (:class:`DrainRate`: requests leaving the queue or
finishing, per second, over the last seconds): the time until the requests ahead of the caller have left
(:func:`retry_after`). It travels as HTTP ``Retry-After`` (whole seconds) and ``retry-after-ms`` (what the
OpenAI SDKs read first), and as gRPC trailing metadata ``retry-after`` and ``grpc-retry-pushback-ms``
(``common.errors``). ``loraserve_admission_seconds`` times each decision from the request's arrival (at the
HTTP edge, or the gRPC handler) to the verdict.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable

from prometheus_client import Gauge, Histogram

MIN_RETRY_S = 0.05  # never announce less: the client's next try would only be refused again
MAX_RETRY_S = 60.0
UNMEASURED_RETRY_S = 1.0  # nothing has left yet (a server just started): no rate to divide by
DRAIN_WINDOW_S = 10.0
PROBE_S = 1.0  # how often a waiter of a router's queue looks again without being woken

ADMISSION_SECONDS = Histogram(
    "loraserve_admission_seconds",
    "Time from a request's arrival to its admission decision (admitted: this server took it; refused: "
    "the refusal was sent), by role and outcome",
    ["role", "outcome"],
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
)

QUEUED = Gauge("loraserve_router_queued", "Requests waiting in the router's queue for a place at a worker")
QUEUE_SECONDS = Histogram(
    "loraserve_router_queue_seconds",
    "Time a request waited in the router's queue, by how the wait ended (served: it went to a worker; "
    "refused: the wait's bound passed; left: the client went away)",
    ["outcome"],
    buckets=(0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0),
)

# when this request arrived, where an earlier layer saw it first (the HTTP edge sets it; the task the app
# runs the request in inherits it): the decision's clock starts there, not at the servicer's handler
ARRIVED: contextvars.ContextVar[float | None] = contextvars.ContextVar("loraserve_arrived", default=None)


def arrived() -> float:
    """The current request's arrival (``time.perf_counter``): the edge's, else now."""
    t = ARRIVED.get()
    return time.perf_counter() if t is None else t


def observe(role: str, outcome: str, since: float) -> None:
    """One decision (``admitted`` or ``refused``) of ``role``, taken ``since`` (perf_counter) ago."""
    ADMISSION_SECONDS.labels(role, outcome).observe(max(0.0, time.perf_counter() - since))


class DrainRate:
    """Events per second (requests leaving a queue, streams ending) over the last ``window`` seconds, or since
    the first event when that is shorter (at least one second). Thread-safe: the engine thread notes, the
    event loop reads."""

    def __init__(self, window: float = DRAIN_WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.window, self.clock = window, clock
        self._times: deque[float] = deque()
        self._lock = threading.Lock()
        self._first: float | None = None

    def note(self, n: int = 1) -> None:
        now = self.clock()
        with self._lock:
            if self._first is None:
                self._first = now
            self._times.extend([now] * n)
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._times and self._times[0] <= now - self.window:
            self._times.popleft()

    def rate(self) -> float:
        """Events per second; 0.0 when none happened within the window."""
        now = self.clock()
        with self._lock:
            self._trim(now)
            if not self._times or self._first is None:
                return 0.0
            span = min(self.window, max(1.0, now - self._first))
            return len(self._times) / span


def retry_after(ahead: int, rate: float) -> float:
    """Seconds until ``ahead`` requests have left at ``rate`` per second, within [MIN_RETRY_S, MAX_RETRY_S];
    UNMEASURED_RETRY_S while nothing has left (no rate yet)."""
    if rate <= 0.0:
        return UNMEASURED_RETRY_S
    return min(MAX_RETRY_S, max(MIN_RETRY_S, max(1, ahead) / rate))


class FullWorkers:
    """What a router learned from its workers' refusals: a worker that answered RESOURCE_EXHAUSTED while this
    router had ``n`` streams on it is taken as full while the router still has ``n`` or more there (one of
    its streams ending frees a place), for at most ``max_memory`` seconds (other routers' streams end too,
    unseen from here). The wait announced meanwhile is the worker's own. A worker this router sends nothing
    to is never marked, so a new or idle one is always tried."""

    def __init__(
        self, max_memory: float = 1.0, learned_for: float = 10.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_memory, self.learned_for, self.clock = max_memory, learned_for, clock
        self._marks: dict[str, tuple[int, float, float]] = {}  # address -> (streams, until, hint)
        self._learned: dict[str, tuple[int, float]] = {}  # address -> (streams it held at most, when learned)

    def refused(self, address: str, streams: int, hint: float | None) -> None:
        wait = hint if hint is not None else MIN_RETRY_S
        now = self.clock()
        self._marks[address] = (streams, now + self.max_memory, wait)
        if streams > 0:  # full without any of ours (other routers' streams): says nothing of our share
            self._learned[address] = (streams, now)

    def capacity(self, addresses: Iterable[str]) -> int | None:
        """How many streams ``addresses`` (at least one) take from this router at once, as their refusals of the
        last ``learned_for`` seconds said (each: the streams it held when it refused); None when one of
        them has not refused lately (its room is unknown: it is tried)."""
        now, total, seen = self.clock(), 0, False
        for address in addresses:
            learned = self._learned.get(address)
            if learned is None or now - learned[1] > self.learned_for:
                return None
            total, seen = total + learned[0], True
        return total if seen else None

    def hint(self, address: str, streams: int) -> float | None:
        """The wait left for ``address`` when it is full now (``streams``: this router's streams there), else
        None (and a stale mark is dropped)."""
        mark = self._marks.get(address)
        if mark is None:
            return None
        at, until, wait = mark
        now = self.clock()
        if now >= until or streams < at:
            del self._marks[address]
            return None
        return wait

    def all_full(self, streams: dict[str, int], addresses: Iterable[str]) -> float | None:
        """The smallest wait when every one of ``addresses`` (at least one) is full, else None."""
        hints = []
        for address in addresses:
            h = self.hint(address, streams.get(address, 0))
            if h is None:
                return None
            hints.append(h)
        return min(hints) if hints else None


class Waiter:
    """One request in a :class:`WaitQueue`: the workers it may go to, and the place it was given (an address
    whose stream ended, reserved for it) once woken."""

    __slots__ = ("_event", "addresses", "place")

    def __init__(self, addresses: Iterable[str]) -> None:
        self.addresses = frozenset(addresses)
        self.place: str | None = None
        self._event = asyncio.Event()

    async def wait(self, timeout: float) -> bool:
        """True when given a place within ``timeout`` seconds, False when the time passed first."""
        if self.place is not None:
            return True
        try:
            async with asyncio.timeout(max(0.0, timeout)):
                await self._event.wait()
        except TimeoutError:
            return False
        return True


class WaitQueue:
    """Requests waiting, first come first served, for a place at a worker that is full of this router's
    streams; at most ``limit`` of them (memory: each holds its request). One event loop's: not thread-safe.

    A stream that ends at a worker gives its place to the oldest waiter that may go there (:meth:`wake`); the
    router counts the place as taken (reserved) until that waiter's call starts, so a newcomer cannot take it
    first. Every waiter also looks again each ``PROBE_S`` (a dict lookup or two): the oldest goes when room
    appeared that no stream end announced (another router's streams ending), and any waiter gives up once this
    router holds no stream at its workers (no end will come to free a place)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._waiters: list[Waiter] = []  # oldest first; a few hundred at most

    def __len__(self) -> int:
        return len(self._waiters)

    def has_room(self) -> bool:
        return len(self._waiters) < self.limit

    def join(self, addresses: Iterable[str], front: bool = False) -> Waiter:
        """A new waiter at the back, or at the front (one that waited already and was refused upstream)."""
        waiter = Waiter(addresses)
        if front:
            self._waiters.insert(0, waiter)
        else:
            self._waiters.append(waiter)
        QUEUED.set(len(self._waiters))
        return waiter

    def leave(self, waiter: Waiter) -> None:
        if waiter in self._waiters:
            self._waiters.remove(waiter)
            QUEUED.set(len(self._waiters))

    def first(self) -> Waiter | None:
        return self._waiters[0] if self._waiters else None

    def ahead(self, addresses: Iterable[str]) -> bool:
        """Whether a waiter not yet given a place may go to one of ``addresses`` (a newcomer then queues
        behind it)."""
        wanted = set(addresses)
        return any(w.place is None and not w.addresses.isdisjoint(wanted) for w in self._waiters)

    def wake(self, address: str) -> Waiter | None:
        """Give the place freed at ``address`` to the oldest waiter that may go there and has none yet."""
        for waiter in self._waiters:
            if waiter.place is None and address in waiter.addresses:
                waiter.place = address
                waiter._event.set()
                return waiter
        return None
