"""The router's own bookkeeping, apart from any executor: each server's record (its process,
whether it takes requests, its requests in flight, its failed health checks), the choice of a
server (the least in flight under the cap, the lowest rank on ties; a session's server first),
the sessions' servers (a bounded LRU), the hand-over of a freed slot to the request waiting
for it longest (the dispatcher's :class:`~asyncexec._driver._loads.Handoff`: a session's
request waits for its own server's slot), and the counters.

A server's count of requests in flight changes in one place, :meth:`Balance._count`, which
tells the router each new count (its ``asyncexec_router_in_flight`` gauge): a slot freed on
any path (given back, refused, dropped by a waiter whose caller went) sets the gauge.

Pure bookkeeping on one event loop: nothing here talks to a worker
(``tests/pipeline/test_router_units.py`` tests it without Ray).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from ..._dispatch._targets import fewest
from .._loads import Handoff

__all__ = ["Balance", "Pacer", "PauseOrder", "RouterStatistics", "ServerRecord", "Sessions"]

#: How long the requests sent in one turn of the event loop may keep it, before the rest wait
#: for the next turn.
SEND_BUDGET_S = 0.002


@dataclass(frozen=True)
class RouterStatistics:
    """Counters of a :class:`~asyncexec.Router`, from ``router.statistics()``."""

    #: Requests given to ``generate()``.
    requests: int = 0
    #: Requests answered (a sample returned to the caller).
    answered: int = 0
    #: Requests sent again to another server (its server died or was taken out, or the
    #: attempt's deadline passed).
    retries: int = 0
    #: Second answers of a request already answered, dropped (each request is answered once).
    duplicates_dropped: int = 0
    #: Answers that came after their request had given up (its deadline passed), dropped.
    late_dropped: int = 0
    #: Requests that gave up on their deadline (``TimeoutError``).
    timeouts: int = 0
    #: Servers taken out by the health watch (no new requests; in-flight ones retried).
    taken_out: int = 0
    #: Servers that came back in a fresh process (taken out and killed, or died) and took
    #: requests again, at the channel's current version.
    replaced: int = 0
    #: Requests in flight on each server now, in rank order.
    in_flight: tuple[int, ...] = ()
    #: The most requests each server held at once, in rank order.
    in_flight_max: tuple[int, ...] = ()
    #: Whether each server takes new requests now, in rank order.
    serving: tuple[bool, ...] = ()


@dataclass(eq=False)
class ServerRecord:
    """What the router knows of one server (rank)."""

    rank: int
    worker: str | None = None  # the worker (its key) it last verified: another is a replacement
    serving: bool = True  # takes new requests (False: taken out, dead, or rejoining)
    in_flight: int = 0  # (changed by ``Balance._count`` alone: it tells the router)
    peak: int = 0
    failures: int = 0  # health checks failed in a row
    since: float = 0.0  # when it (re)joined: its health grace counts from here
    rejoining: bool = False  # a task brings it back (one at a time)
    #: The attempts of requests it holds (each with a ``cancel()``: called when it is taken
    #: out).
    scopes: set[Any] = field(default_factory=set)


class PauseOrder(NamedTuple):
    """The latest pause or resume a router began: what a server that joins is brought to. A
    rejoin that sees another begin while it brings its server so applies that one too (a pause
    or a resume began meanwhile skipped the server: it did not serve yet)."""

    number: int  # pauses and resumes begun so far
    mode: Literal["keep", "abort"] | None  # the pause's mode; None: a resume


class Sessions:
    """The server each session key went to, as ``(rank, worker)`` (the worker's key): the
    least recently used key is forgotten past ``limit`` keys (memory stays bounded however many
    sessions come)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._servers: OrderedDict[Hashable, tuple[int, str | None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._servers)

    def get(self, key: Hashable) -> tuple[int, str | None] | None:
        found = self._servers.get(key)
        if found is not None:
            self._servers.move_to_end(key)
        return found

    def pin(self, key: Hashable, rank: int, worker: str | None) -> None:
        self._servers[key] = (rank, worker)
        self._servers.move_to_end(key)
        while len(self._servers) > self.limit:
            self._servers.popitem(last=False)


class Balance:
    """The servers' records and the choice of one (see the module's docstring). ``on_load``
    is called with a server's rank and its new count each time its requests in flight
    change."""

    def __init__(
        self,
        workers: list[str | None],
        max_in_flight: int,
        now: float = 0.0,
        on_load: Callable[[int, int], None] | None = None,
    ) -> None:
        self.servers = [ServerRecord(r, w, since=now) for r, w in enumerate(workers)]
        self.max_in_flight = max_in_flight
        self._on_load = on_load
        #: The requests waiting for a slot: a freed one is handed to one of them, still counted.
        self._waiting: Handoff[int] = Handoff(self.release)

    def live(self, rank: int, worker: str | None) -> bool:
        """Whether ``rank`` serves, in the worker ``worker`` (not a replacement since)."""
        server = self.servers[rank]
        return server.serving and server.worker == worker

    def choose(
        self, exclude: Collection[int] = (), pinned: tuple[int, str | None] | None = None
    ) -> int | None:
        """The server for a request, or None when it must wait: a session's server while it
        serves in the same worker (under the cap: else None, the request waits for it);
        otherwise the serving server with the fewest requests in flight under the cap, the
        lowest rank on ties, leaving out ``exclude`` while another has room."""
        if pinned is not None and self.live(*pinned):
            rank = pinned[0]
            return rank if self.servers[rank].in_flight < self.max_in_flight else None
        counts = [s.in_flight for s in self.servers]
        out = {s.rank for s in self.servers if not s.serving}
        chosen = fewest(counts, self.max_in_flight, out.union(exclude)) if exclude else None
        return chosen if chosen is not None else fewest(counts, self.max_in_flight, out)

    async def acquire(
        self,
        tried: Collection[int] = (),
        session: Callable[[], tuple[int, str | None] | None] | None = None,
        check: Callable[[], None] | None = None,
    ) -> int:
        """A server for a request under the cap, counted as holding one more (give it back
        with :meth:`release`), waiting for one when none has room: the server :meth:`choose`
        picks, leaving ``tried`` out while another has room, the one ``session()`` names first
        (its session's, while it serves in the same worker). A request that waits is handed a
        freed slot in its turn (the longest waiting first: one that did not wait never takes
        it first), on its session's server or on any. ``check()`` runs before each look
        (raising: the router closed or failed)."""
        handed: int | None = None
        while True:
            try:
                if check is not None:
                    check()
            except BaseException:
                if handed is not None:
                    self.release(handed)
                raise
            pinned = None if session is None else session()
            if handed is not None:
                if self._usable(handed, pinned):
                    return handed
                self.refuse(handed)
                handed = None
            r = self.choose(tried, pinned)
            if r is not None:
                self.take(r)
                return r
            own = pinned is not None and self.live(*pinned)
            handed = await self._waiting.wait(pinned[0] if own and pinned is not None else None)

    def _usable(self, rank: int, pinned: tuple[int, str | None] | None) -> bool:
        """Whether a request may use a slot on ``rank`` handed to it: the server serves, and
        it is the session's server when that one serves."""
        if not self.servers[rank].serving:
            return False
        return pinned is None or pinned[0] == rank or not self.live(*pinned)

    def _count(self, rank: int, change: int) -> None:
        """The one place a server's count of requests in flight changes; ``on_load`` hears
        the new count (a slot handed on from one request to another changes nothing)."""
        server = self.servers[rank]
        server.in_flight += change
        server.peak = max(server.peak, server.in_flight)
        if self._on_load is not None:
            self._on_load(rank, server.in_flight)

    def take(self, rank: int) -> None:
        self._count(rank, 1)

    def release(self, rank: int) -> None:
        """A request's slot on ``rank`` is given back: handed to the request that has waited
        longest for any server or for this one (still counted, now for it), else free."""
        if self.servers[rank].serving:
            if not self._waiting.hand(rank, rank):
                self._count(rank, -1)
        else:  # out: the requests waiting for it (its sessions') look elsewhere
            self._count(rank, -1)
            self.wake()

    def refuse(self, rank: int) -> None:
        """Give back a slot handed to a request that cannot use it (its server no longer
        serves, or it is not its session's server): it is free, and every waiting request
        looks again."""
        self._count(rank, -1)
        self.wake()

    def out(self, rank: int) -> None:
        """``rank`` takes no new request (taken out, lost, or being replaced): the requests
        waiting for it (its sessions') look again, elsewhere."""
        self.servers[rank].serving = False
        self.wake()

    def wake(self) -> None:
        """Wake every request waiting for a server, without a slot, to look again (a server
        came back or was replaced, the router closed or failed)."""
        self._waiting.wake_all()

    @property
    def in_flight(self) -> dict[int, int]:
        return {s.rank: s.in_flight for s in self.servers}


class Pacer:
    """Spreads a burst of sends over turns of the event loop.

    Requests that start together (a pipeline admitting 256 prompts) would each submit its call
    in the same turn of the loop, and the loop would answer nothing else meanwhile. A send
    waits here until its turn's budget allows it: the
    sends of one turn take at most ``budget_s`` (and one more send), the others go on in the
    next turns, with the timers and callbacks due in between served first.

    The sends left waiting queue (first come, first sent) and sleep: each turn wakes as many of
    them as went in the turn before (at least one), and a woken one that finds the budget spent
    goes back to the head of the queue. A busy wait instead (each waiting send stepped again
    every turn) would cost the loop, with hundreds waiting, more a turn than the budget itself.
    """

    def __init__(self, budget_s: float = SEND_BUDGET_S) -> None:
        self.budget_s = budget_s
        self._start: float | None = None  # when this turn's first send began
        self._sent = 0  # sends in this turn's window
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._front = 0  # where a woken send that must wait again goes back in the queue
        self._ticking = False  # a _next_turn is scheduled
        self.waits = 0  # sends moved to a later turn

    def _tick(self) -> None:
        if not self._ticking:
            self._ticking = True
            asyncio.get_running_loop().call_soon(self._next_turn)

    def _next_turn(self) -> None:
        """The turn after a window: close it, and wake as many waiting sends as went in it."""
        self._ticking = False
        self._start = None
        wake, self._sent, self._front = max(1, self._sent), 0, 0
        while wake and self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():  # (a cancelled send's is)
                waiter.set_result(None)
                wake -= 1

    def _may_send(self) -> bool:
        now = time.perf_counter()
        if self._start is None:  # the first send of this turn opens its window
            self._start = now
            self._tick()
        elif now - self._start >= self.budget_s:
            return False
        self._sent += 1
        return True

    async def wait_turn(self) -> None:
        """Return when a send may go in this turn of the loop."""
        if not self._waiting and self._may_send():
            return
        self.waits += 1
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        self._tick()
        while True:
            try:
                await waiter
            except BaseException:
                if waiter.done() and not waiter.cancelled():
                    self._tick()  # woken, and cancelled before it ran: the next ones go
                raise
            if self._may_send():
                return
            waiter = asyncio.get_running_loop().create_future()
            self._waiting.insert(self._front, waiter)
            self._front += 1
