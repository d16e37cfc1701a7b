"""The dispatcher's own bookkeeping, apart from any executor: the calls chosen by load that are in
flight on each group (every group its own record, so that a caller of a replaced group never
touches the live one's), the callers waiting for a rank under the cap, the renewals of dead
workers (one per worker, however many calls saw it die; one at a time; a call to a worker under
renewal waits for its end). What the executor's statistics count of its calls comes from its
observer (``_sinks.ExecutorCounts``).

A call that ends hands its slot to the caller that has waited longest (the slot stays counted,
now for that caller), as a semaphore hands a permit over: one waiter wakes per ended call, and
a caller that did not wait cannot take the slot first. Waking every waiter on each ended call,
as a plain event does, cost each of them a look at the loads: with 32 callers waiting, most of
the driver's time per call. That hand-over is :class:`Handoff`, the one of the package: the
router's requests wait in one too (a session's request for its own server's slot).

Pure bookkeeping on one event loop: nothing here talks to a worker.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections import deque
from collections.abc import Awaitable, Callable, Collection, Hashable, Iterable, Sequence
from typing import Any, Generic, Protocol, TypeVar

import anyio
import anyio.abc

from .._dispatch._targets import Load

__all__ = ["Handoff", "Loads"]


class _Sized(Protocol):
    """What a load record is kept for: a group (its ranks are its workers)."""

    @property
    def workers(self) -> Sequence[Any]: ...


#: A slot taken by load: the group's load record, and the rank.
Slot = tuple[Load, int]


T = TypeVar("T")


class _Waiter(Generic[T]):
    """A caller waiting for a slot: woken with one handed to it, or with none (look again)."""

    __slots__ = ("event", "order", "slot", "target")

    def __init__(self, order: int, target: int | None) -> None:
        self.event = anyio.Event()
        self.order = order  # when it came: the lower, the longer it has waited
        self.target = target
        self.slot: T | None = None


class Handoff(Generic[T]):
    """Callers waiting for a slot under a cap, each for a slot on any rank or on one rank of
    its own (a session's server): a freed slot is handed to the caller that has waited longest
    among those that may take it (counted still, now for that caller), and only that caller
    wakes; with no such caller the slot is free. ``give_back`` frees a slot handed to a caller
    that was cancelled before it took it (which hands it on in turn).

    Pure bookkeeping on one event loop."""

    __slots__ = ("_any", "_give_back", "_on", "_order")

    def __init__(self, give_back: Callable[[T], None]) -> None:
        self._give_back = give_back
        self._any: deque[_Waiter[T]] = deque()  # waiting for any rank
        self._on: dict[int, deque[_Waiter[T]]] = {}  # waiting for one rank
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._any) + sum(len(q) for q in self._on.values())

    def hand(self, slot: T, rank: int) -> bool:
        """Hand ``slot`` (on ``rank``) to the caller that has waited longest for any rank or
        for ``rank``; False when none waits (the slot is the caller's to free)."""
        first = _head(self._any)
        mine = self._on.get(rank)
        own = None if mine is None else _head(mine)
        if own is not None and (first is None or own.order < first.order):
            assert mine is not None
            first, queue = own, mine
        else:
            queue = self._any
        if first is None:
            return False
        queue.popleft()
        first.slot = slot
        first.event.set()
        return True

    async def wait(self, target: int | None = None) -> T | None:
        """Wait until a slot is handed to this caller (on ``target``, or on any rank: None)
        and return it, counted as this caller's; None when woken without one (look again)."""
        waiter: _Waiter[T] = _Waiter(next(self._order), target)
        queue = self._any if target is None else self._on.setdefault(target, deque())
        queue.append(waiter)
        try:
            await waiter.event.wait()
        except BaseException:  # cancelled: a slot handed meanwhile goes to the next waiter
            if waiter.slot is not None:
                self._give_back(waiter.slot)
            else:
                with contextlib.suppress(ValueError):
                    queue.remove(waiter)
            raise
        return waiter.slot

    def wake_all(self) -> None:
        """Wake every waiting caller without a slot: each looks again (a slot refused, a rank
        that came back, the owner closing)."""
        queues = [self._any, *self._on.values()]
        self._any, self._on = deque(), {}
        for queue in queues:
            for waiter in queue:
                waiter.event.set()


def _head(queue: deque[_Waiter[T]]) -> _Waiter[T] | None:
    """The first caller still waiting in ``queue`` (those woken already dropped)."""
    while queue:
        if not queue[0].event.is_set():
            return queue[0]
        queue.popleft()
    return None


class Loads:
    """Calls in flight per group, the wake-up of waiters, and renewals (see the module's
    docstring)."""

    def __init__(self) -> None:
        # Keyed by the group itself, weakly: a dropped group's record goes with it.
        self._records: weakref.WeakKeyDictionary[Any, Load] = weakref.WeakKeyDictionary()
        self._waiting: Handoff[Slot] = Handoff(lambda slot: self.release(*slot))
        self._renewals: dict[Hashable, anyio.Event] = {}
        self._renewing = anyio.Lock()

    def of(self, group: _Sized) -> Load:
        """``group``'s load record (a new group, or one whose size changed, starts from no
        call in flight)."""
        load = self._records.get(group)
        if load is None or len(load.counts) != len(group.workers):
            load = self._records[group] = Load(len(group.workers))
        return load

    def take(
        self, group: _Sized, max_in_flight: int | None, *, exclude: Collection[int] = ()
    ) -> tuple[Load, int] | None:
        """The least-loaded rank of ``group`` under the cap, leaving out ``exclude``, counted
        as having one more call in flight (give it back with :meth:`release`); None when every
        rank is at the cap or excluded."""
        load = self.of(group)
        r = load.choose(max_in_flight, exclude=exclude)
        if r is None:
            return None
        load.started(r)
        return load, r

    def release(self, load: Load, r: int) -> None:
        """The call taken on rank ``r`` of ``load`` ended: its slot goes to the caller that has
        waited longest in :meth:`wait_slot` (still counted, now for that caller), else it is
        free."""
        if not self._waiting.hand((load, r), r):
            load.finished(r)

    def wait_slot(self) -> Awaitable[Slot | None]:
        """Wait until a call taken by load ends (on any group) and return its slot, handed to
        this caller (counted as its own: use it, or give it back with :meth:`refuse`); None
        when woken without one (a slot was refused: look again)."""
        return self._waiting.wait()

    def refuse(self, slot: Slot) -> None:
        """Give back a slot handed by :meth:`wait_slot` that the caller cannot use (another
        group's, a rank it leaves out, over its cap): it is free, and every waiter looks
        again (handing it on could pass it round the waiters for ever)."""
        load, r = slot
        load.finished(r)
        self._waiting.wake_all()

    def release_when_done(
        self, call: Awaitable[Any], load: Load, r: int, tg: anyio.abc.TaskGroup | None
    ) -> None:
        """Give rank ``r``'s slot back once ``call`` ends (however it ends), waiting in ``tg``
        (the executor's task group: cancelled, and the slot given back, when the executor
        closes); at once without one. For a call whose caller stopped waiting for it."""
        if tg is None:
            self.release(load, r)
        else:
            tg.start_soon(self._release_when_done, call, load, r)

    async def _release_when_done(self, call: Awaitable[Any], load: Load, r: int) -> None:
        try:
            await call
        except Exception:
            pass  # how the call ended is for its caller, who stopped waiting for it
        finally:
            self.release(load, r)

    async def renew_once(
        self,
        key: Hashable,
        renew: Callable[[], Awaitable[None]],
        tg: anyio.abc.TaskGroup | None = None,
    ) -> None:
        """Start ``renew()`` for the dead worker ``key`` unless it is under way already, one
        renewal at a time. With ``tg`` (the executor's task group) it runs there and this
        returns at once: the calls that saw the worker die raise without waiting for a fresh
        process (an engine's start is tens of seconds), and a call sent to it meanwhile waits
        for its end (:meth:`renewing`). Without ``tg``, it is awaited here."""
        if key in self._renewals:
            return
        done = self._renewals[key] = anyio.Event()
        if tg is None:
            await self._renew(key, renew, done)
        else:
            tg.start_soon(self._renew, key, renew, done)

    def renewing(self, workers: Sequence[Any], ranks: Iterable[int]) -> anyio.Event | None:
        """The end of a renewal under way for the worker of one of ``ranks`` (of ``workers``,
        a group's), or None; without a look when none is under way (a call's hot path)."""
        if self._renewals:
            for r in ranks:
                done = self._renewals.get(workers[r].handle.key) if r < len(workers) else None
                if done is not None:
                    return done
        return None

    def any_renewal(self) -> anyio.Event | None:
        """The end of a renewal under way, any (or None)."""
        return next(iter(self._renewals.values()), None)

    def renewing_ranks(self, workers: Sequence[Any]) -> list[int]:
        """The ranks of ``workers`` (a group's) whose worker is being renewed."""
        if not self._renewals:
            return []
        return [r for r, worker in enumerate(workers) if worker.handle.key in self._renewals]

    async def _renew(
        self, key: Hashable, renew: Callable[[], Awaitable[None]], done: anyio.Event
    ) -> None:
        try:
            async with self._renewing:
                await renew()
        finally:
            del self._renewals[key]
            done.set()

    def in_flight(self, group: _Sized | None = None) -> tuple[int, ...]:
        """The calls chosen by load in flight on each rank of ``group`` (the live one), in rank
        order; none without."""
        load = None if group is None else self._records.get(group)
        counts = () if group is None else (0,) * len(group.workers)
        if load is not None and len(load.counts) == len(counts):
            counts = load.counts
        return tuple(counts)

    def __repr__(self) -> str:
        return f"<Loads of {len(self._records)} group(s), {len(self._waiting)} waiting>"
