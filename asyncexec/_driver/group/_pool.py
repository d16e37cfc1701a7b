"""WorkerPool: warm worker processes that executors lease and give back.

A pool owns one placement group of ``size`` bundles and keeps one started, described worker in
each. An executor built with ``pool=`` leases its workers instead of starting processes: a lease
health-checks the workers it takes (a ping each, at once), and the executor gives them their
ranks, devices, init hook and backend as it would fresh ones. When the executor closes (or
replaces its group) it gives them back: a worker whose function stopped in time and whose reset
succeeded goes back to the idle list; any other (failed, dead, still running, past
``max_leases``) is killed, and its bundle gets a new process in the background, so the pool
refills (a refill that fails through its backoff is tried again at the next lease or
give-back). An idle worker that dies is noticed at once (its one pending ``wait_closed`` call,
which its groups await too, fails) and replaced the same way.

A lease for more workers than are idle starts fresh workers for the rest, outside the pool's
placement group, that are killed when given back (``when_short="start"``, the default), or waits
until enough are given back (``when_short="wait"``; one that needs more workers than the pool
can hold while a bundle's refill has given up fails at once, with the refill's error).
"""

from __future__ import annotations

import collections
import contextlib
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import anyio
import anyio.abc

from ..._errors import (
    ConfigurationError,
    ExecutorStateError,
    StartupError,
    StartupTimeoutError,
    describe,
)
from ..._logging import get_logger
from .._config import (
    POOL_LEGACY_OPTIONS,
    ExecutorConfig,
    PlacementStrategy,
    Timeouts,
    check_count,
    grouped_options,
)
from .._taskgroups import task_group
from ..cluster import Cluster, Handle, checked_cluster, rays_by_default
from ._reservation import Claim, Reservation
from ._stock import PoolWorker, Stock

__all__ = ["PoolStatistics", "PoolWorker", "WorkerPool"]

_D = ExecutorConfig


@dataclass(frozen=True)
class PoolStatistics:
    """Counters of a pool, from :meth:`WorkerPool.statistics`."""

    size: int
    idle: int
    leased: int
    starting: int
    leases: int
    returned: int
    replaced: int
    fresh_for_leases: int


class WorkerPool:
    """Warm worker processes of one shape, leased by executors.

    Use it as an async context manager and pass it to executors::

        async with asyncexec.WorkerPool(8, resources_per_worker={"CPU": 1}) as pool:
            async with asyncexec.Executor(4, pool=pool) as ex:   # a lease, not a process start
                async for step in ex.run(fn):
                    ...

    What carries over from one lease to the next: nothing of asyncexec's (the run's session and
    reports, the worker's context, environment variables set for the lease, the torch process
    group: the environment is reset to the one the process started with). The user's
    module-level state does carry over, as in Ray's reused task workers; ``reset_hook`` runs on
    the worker at the end of every lease to clear it.

    Args:
        size: how many warm workers the pool keeps.
        resources_per_worker: Ray resources of each worker (``{"CPU": 1}`` by default); an
            executor that leases must ask for the same, or leave it out.
        runtime_env: Ray runtime environment of the workers (an executor must match it).
        placement_strategy: how the pool's placement group spreads its bundles.
        max_leases: a worker is replaced by a fresh process after this many leases (``None``:
            no bound).
        reset_hook: called on a worker at the end of each lease; a worker whose hook fails is
            replaced.
        when_short: what a lease for more workers than are idle does: ``"start"`` fresh workers
            for the rest (killed when given back), or ``"wait"`` for workers to be given back
            (up to ``timeouts.placement_s``; the leases that wait are served in the order they
            came, each taking all its workers at once; one that needs a bundle whose refill
            gave up fails at once with its error).
        timeouts: the :class:`Timeouts` the pool uses: ``placement_s`` for its placement
            group, ``start_s`` for starting its workers (and each refill), ``shutdown_s`` for
            closing it.
        address: the Ray cluster to join when Ray is not initialized.
        name: a name for logs.
        reservation: a :class:`Reservation` to keep the workers on (worker j on its bundle j,
            claimed while the pool is open) instead of a placement group of the pool's own. An
            executor that leases from it gets ranks in the reservation's bundle order, its
            lowest idle bundles first, so its rank i is on bundle i when those are idle.
        cluster: the cluster the workers run on, such as an
            :class:`asyncexec.testing.SimCluster`; ``None``: the reservation's, else Ray's (or,
            inside :func:`asyncexec.testing.simulated`, that block's). The executors that lease
            from the pool run on it.

    Raises:
        ConfigurationError: an argument is invalid, or the pool would hold Ray's workers while
            ``ASYNCEXEC_LOCAL=1`` makes executors local (local mode starts no Ray).
    """

    def __init__(
        self,
        size: int,
        *,
        resources_per_worker: Mapping[str, float] | None = None,
        runtime_env: Mapping[str, Any] | None = None,
        placement_strategy: PlacementStrategy = _D.placement_strategy,
        max_leases: int | None = None,
        reset_hook: Callable[[], object] | None = None,
        when_short: Literal["start", "wait"] = "start",
        timeouts: Timeouts | None = None,
        address: str | None = None,
        name: str = "pool",
        reservation: Reservation | None = None,
        cluster: Cluster | None = None,
        **legacy: Any,
    ) -> None:
        timeouts, _ = grouped_options(
            timeouts, None, legacy, owner="WorkerPool", accepted=POOL_LEGACY_OPTIONS
        )
        self.config = ExecutorConfig.build(
            size,
            resources_per_worker=resources_per_worker,
            runtime_env=runtime_env,
            placement_strategy=placement_strategy,
            placement_timeout_s=timeouts.placement_s,
            start_timeout_s=timeouts.start_s,
            shutdown_timeout_s=timeouts.shutdown_s,
            address=address,
            name=name,
        )
        check_count("max_leases", max_leases, allow_none=True)
        if reset_hook is not None and not callable(reset_hook):
            raise ConfigurationError(f"reset_hook must be callable, got {reset_hook!r}")
        if when_short not in ("start", "wait"):
            raise ConfigurationError(f'when_short must be "start" or "wait", got {when_short!r}')
        if reservation is not None and not isinstance(reservation, Reservation):
            raise ConfigurationError(
                f"reservation must be an asyncexec.Reservation, got {reservation!r}"
            )
        self.size = size
        self.reservation = reservation
        self._claim: Claim | None = None
        self.max_leases = max_leases
        self.reset_hook = reset_hook
        self.when_short = when_short
        self.log = get_logger(pool=f"{name}-{os.urandom(4).hex()}")
        handed = None if cluster is None else checked_cluster(cluster)
        sides: list[tuple[str, Cluster | None]] = [(f"the pool {name!r} (cluster=)", handed)]
        if reservation is not None:
            sides.append((f"its reservation {reservation.name!r}", reservation.cluster))
        #: Where the workers run (a local executor takes no pool).
        self.cluster = rays_by_default(sides, "a WorkerPool")
        self._counts = {"leases": 0, "returned": 0, "replaced": 0, "fresh_for_leases": 0}
        #: Leases waiting for workers to be given back (``when_short="wait"``), in the order
        #: they came: the first takes its workers when they are all idle (see ``lease``).
        self._queue: collections.deque[object] = collections.deque()
        self._stock = Stock(self.cluster, self.config, self.log, self._counts)
        self._tg: anyio.abc.TaskGroup | None = None
        self._stack: contextlib.AsyncExitStack | None = None  # holds ``_tg`` open
        self._closed = False

    def __repr__(self) -> str:
        state = "open" if self._stock.open else ("closed" if self._closed else "new")
        return (
            f"<WorkerPool {self.config.name} {state} size={self.size} idle={len(self._stock.idle)} "
            f"leased={len(self._stock.leased)}>"
        )

    # Lifecycle --------------------------------------------------------------------------------

    async def __aenter__(self) -> WorkerPool:
        if self._stock.open or self._closed:
            raise ExecutorStateError("a WorkerPool is entered once")
        await self.cluster.connect(self.config.address)
        if self.reservation is not None:  # refused before anything starts
            self._claim = self.reservation.claim(
                f"pool {self.config.name!r}", self.size, self.config.resources_per_worker
            )
        stock = self._stock
        t0 = time.perf_counter()
        try:
            async with contextlib.AsyncExitStack() as stack:
                self._tg = await stack.enter_async_context(task_group())
                stock.tg, stock.open = self._tg, True
                try:
                    await stock.fill_all(self.reservation, self.size)
                except BaseException:
                    # bounded by the seam: aclose() is a kill without patience
                    with anyio.CancelScope(shield=True):
                        await self.aclose()
                    self._tg = None
                    raise  # (the group's scope left by the stack: the innermost one)
                self._stack = stack.pop_all()  # left in __aexit__, with the body's exception
        except TimeoutError as exc:
            raise StartupTimeoutError(
                "starting the pool's workers", self.config.start_timeout_s
            ) from exc
        self.log.info("pool_ready", size=self.size, seconds=round(time.perf_counter() - t0, 3))
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            await self.aclose()
        finally:
            stack, self._stack = self._stack, None
            self._tg = None
            if stack is not None:
                await stack.__aexit__(exc_type, exc, tb)

    async def aclose(self) -> None:
        """Kill every worker of the pool, leased ones included (their executors' runs fail
        with a crashed worker, and cannot lease again), and remove the placement group.
        Shielded, bounded, idempotent."""
        if self._closed:
            return
        self._closed = True
        stock = self._stock
        stock.open = False
        # bounded by the seam: a kill without patience or deaths (see Cluster's bounds)
        with anyio.CancelScope(shield=True):
            # The refills and idle watches go (not the task group's own scope: the task that
            # entered the pool runs inside it), and every process.
            handles = stock.handles()
            stock.empty()
            await self.cluster.kill(handles, stock.placement)
        if self._claim is not None and self.reservation is not None:
            self.reservation.release(self._claim)
            self._claim = None
        self.log.info("pool_closed")

    # Leases -----------------------------------------------------------------------------------

    def statistics(self) -> PoolStatistics:
        """A snapshot of the pool's counters."""
        stock = self._stock
        now = {"idle": len(stock.idle), "leased": len(stock.leased)}
        now["starting"] = len(stock.starting)
        return PoolStatistics(size=self.size, **now, **self._counts)

    def check_shape(self, config: ExecutorConfig) -> None:
        """Refuse an executor whose workers are not of this pool's shape.

        Raises:
            ConfigurationError: naming what differs.
        """
        for field in ("resources_per_worker", "runtime_env"):
            mine, theirs = getattr(self.config, field), getattr(config, field)
            if dict(mine or {}) != dict(theirs or {}):
                raise ConfigurationError(
                    f"the executor's {field} {theirs!r} differs from its pool's {mine!r}: "
                    "leave it out to use the pool's"
                )
        if self.when_short == "wait" and config.num_workers + config.spares > self.size:
            raise ConfigurationError(
                f"the executor needs {config.num_workers + config.spares} workers and the pool "
                f"holds {self.size}, and the pool waits (when_short='wait'): it would wait forever"
            )

    async def lease(self, n: int) -> list[PoolWorker]:
        """Take ``n`` live workers: idle ones first (each answers a ping, at once), fresh ones
        or a wait for the rest, as ``when_short`` says.

        Raises:
            ExecutorStateError: the pool is not open, or closed while the lease was made.
            StartupTimeoutError: waiting for given-back workers, or starting fresh ones, overran
                its bound.
            StartupError: the lease waits (``when_short="wait"``) for more workers than the
                pool can hold while the refill of a bundle has given up (its error is the
                cause); it fails then, not at its bound.
        """
        taken: list[PoolWorker] = []
        checking: list[PoolWorker] = []  # pinged now: this lease's, given back if it is cancelled
        stock = self._stock
        turn = object()  # this lease's place in the queue, once it waits
        stock.refill_vacant()  # a bundle whose refill gave up: the cluster may have room now
        try:
            deadline = anyio.current_time() + self.config.placement_timeout_s
            while len(taken) < n:
                self._check_open()
                if self.when_short == "wait" and not self._may_take(turn, n - len(taken)):
                    # Workers given back one at a time would go to each lease that waits in
                    # turn, and leases holding some while each waits for the rest could all
                    # wait until their bound: the first in the queue takes all it needs at once.
                    self._check_refills(n)
                    if turn not in self._queue:
                        self._queue.append(turn)
                    await self._wait_for_workers(deadline, n - len(taken))
                    continue
                if self.reservation is not None:  # the lowest bundles first: rank i on bundle i
                    stock.idle.sort(key=lambda w: self.size if w.bundle is None else w.bundle)
                candidates = stock.idle[: n - len(taken)]
                del stock.idle[: len(candidates)]
                for w in candidates:
                    stock.leased[w.handle.key] = w
                if candidates:
                    checking = candidates
                    taken += await stock.alive(candidates)
                    checking = []
                    continue
                taken += await stock.fresh(n - len(taken))  # none idle: "start" (see above)
                break
            self._check_open()  # closed meanwhile: what was taken is dead (no await from here)
        except BaseException:
            # What it took, and those it was pinging (they stay leased until they answer; the
            # dead among them are out already).
            back = taken + [w for w in checking if w.handle.key in stock.leased]
            # bounded by the seam: give_back() kills without patience (refills in the background)
            with anyio.CancelScope(shield=True):
                await self.give_back([(w.handle, True) for w in back])
            raise
        finally:
            if turn in self._queue:
                self._queue.remove(turn)
                stock.wake()  # the next in the queue may take its workers now
        self._counts["leases"] += 1
        return taken

    def _check_refills(self, n: int) -> None:
        """Fail a lease of ``n`` that waits for workers the pool cannot hold: bundles whose
        refill gave up (it is tried again at the next lease or give-back) leave fewer than ``n``
        workers, leased ones included, to be given back.

        Raises:
            StartupError: naming the bundles and the last refill error (its cause).
        """
        vacant = self._stock.vacant
        if not vacant or n <= self.size - len(vacant):
            return
        bundles = sorted(vacant)
        error = vacant[bundles[-1]]
        raise StartupError(
            f"the pool {self.config.name!r} cannot hold the {n} workers the lease waits for: "
            f"the refill of its bundle(s) {bundles} gave up ({describe(error)})"
        ) from error

    def _may_take(self, turn: object, need: int) -> bool:
        """Whether a lease that waits (``when_short="wait"``) takes idle workers now: ``need``
        of them are idle, and no lease that came before it waits."""
        return len(self._stock.idle) >= need and (not self._queue or self._queue[0] is turn)

    async def _wait_for_workers(self, deadline: float, need: int) -> None:
        """Wait until a worker is given back (or the queue moves), up to ``deadline``. No await
        since the caller looked: a worker given back from now on sets this event (one read
        after an await could be the next one, never set).

        Raises:
            StartupTimeoutError: the deadline passed.
        """
        changed = self._stock.changed
        with anyio.move_on_after(deadline - anyio.current_time()):
            await changed.wait()
            return
        raise StartupTimeoutError(
            f"waiting for {need} workers of the pool to be given back",
            self.config.placement_timeout_s,
        )

    async def give_back(self, returned: Sequence[tuple[Handle, bool]]) -> None:
        """Take back leased workers; ``True`` with a worker says it was reset and may be
        leased again. Any other is killed and its bundle refilled in the background."""
        await self._stock.take_back(returned, self.max_leases)

    # Inside -----------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if not self._stock.open:
            what = "closed" if self._closed else "not entered (use `async with WorkerPool(...)`)"
            raise ExecutorStateError(f"the worker pool {self.config.name} is {what}")
