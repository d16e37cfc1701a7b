"""A pool's stock of worker processes: idle ones, leased ones, and the ones being started in
its bundles; what is killed is replaced in the background, and an idle worker that dies is
noticed at once (its pending death call fails) and replaced the same way. A bundle whose refill
gave up (the cluster had no room through its backoff) is tried again at the next lease or
give-back, so the pool returns to its size when the cluster allows."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc

from ..._errors import AsyncExecError, StartupTimeoutError, describe
from ..._wire._protocol import WorkerMetadata
from .._config import ExecutorConfig
from .._taskgroups import task_group
from ..cluster import Cluster, Handle, Placement, Unranked, at_attempt, death_of, proxy

__all__ = ["PoolWorker", "Stock"]

#: How long a leased worker may take to answer the health check of its lease.
LEASE_PING_TIMEOUT_S = 2.0
#: Waits between attempts to refill a bundle whose new process failed to start.
_REFILL_BACKOFF_S = (0.5, 1.0, 2.0, 5.0)


@dataclass(eq=False)
class PoolWorker:
    """One warm process of a pool (or a fresh one started for a lease the pool could not
    fill: ``bundle`` is None, and it is killed when given back)."""

    handle: Handle
    metadata: WorkerMetadata
    bundle: int | None
    leases: int = 0
    #: Its one pending ``wait_closed`` call: fails when the process dies. The pool and every
    #: group that leases the worker await this same reference (no call per lease).
    death: Any = None


class Stock:
    """The processes of one pool (see the module's docstring)."""

    def __init__(
        self, cluster: Cluster, config: ExecutorConfig, log: Any, counts: dict[str, int]
    ) -> None:
        self.cluster = cluster
        self.config = config
        self.log = log
        self.counts = counts
        self.placement: Placement | None = None
        #: Where the background work runs: the pool's task group.
        self.tg: anyio.abc.TaskGroup | None = None
        self.open = False
        self.idle: list[PoolWorker] = []
        self.leased: dict[str, PoolWorker] = {}
        self.starting: dict[int, list[Handle]] = {}  # bundle -> worker being started
        #: The bundles whose refill gave up, each with its last error: refilled again at the
        #: next lease or give-back.
        self.vacant: dict[int, Exception] = {}
        #: Set (and replaced) when a worker becomes idle or a refill gives up.
        self.changed = anyio.Event()
        self.background: set[anyio.CancelScope] = set()

    async def fill_all(self, reservation: Any, size: int) -> None:
        """Place the pool's ``size`` bundles (on ``reservation``, or in a placement group of the
        pool's own) and start a worker in each."""
        config = self.config
        if reservation is not None:
            self.placement = reservation.placement(config.bundles)
        else:
            # bounded by the seam: placing is a request (see Cluster's bounds)
            with anyio.CancelScope(shield=True):  # once made, it must be known to be removed
                self.placement = await self.cluster.place(
                    config.bundles, config.placement_strategy, None, self.log
                )
        await self.cluster.wait_placed(self.placement, config.placement_timeout_s)
        with anyio.fail_after(config.start_timeout_s):
            async with task_group() as tg:
                for bundle in range(size):
                    tg.start_soon(self.fill, bundle)

    async def take_back(
        self, returned: Sequence[tuple[Handle, bool]], max_leases: int | None
    ) -> None:
        """Leased workers back: a clean one (reset) of a bundle of the pool that has served
        fewer than ``max_leases`` leases goes idle; any other is replaced."""
        doomed: list[PoolWorker] = []
        for handle, clean in returned:
            worker = self.leased.pop(handle.key, None)
            if worker is None:
                continue  # the pool closed, or it was already given back
            worker.leases += 1
            self.counts["returned"] += 1
            reusable = (
                clean
                and self.open
                and worker.bundle is not None
                and (max_leases is None or worker.leases < max_leases)
            )
            if reusable:
                self.make_idle(worker)
            else:
                doomed.append(worker)
        await self.replace(doomed)
        self.refill_vacant()

    def handles(self) -> list[Handle]:
        """Every process of the stock: idle, leased, being started."""
        found = [w.handle for w in self.idle] + [w.handle for w in self.leased.values()]
        return found + [h for starting in self.starting.values() for h in starting]

    def empty(self) -> None:
        """Forget every process and stop the background work (the pool is closing)."""
        for scope in self.background:
            scope.cancel()
        self.idle.clear()
        self.leased.clear()
        self.starting.clear()
        self.vacant.clear()
        self.wake()

    def make_idle(self, worker: PoolWorker) -> None:
        self.idle.append(worker)
        self.wake()

    def wake(self) -> None:
        """Wake every lease waiting for a worker (each waits on the event of its time)."""
        changed, self.changed = self.changed, anyio.Event()
        changed.set()

    def spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` in the background, cancelled when the pool closes."""

        async def background() -> None:
            with anyio.CancelScope() as scope:
                self.background.add(scope)
                try:
                    await fn(*args)
                finally:
                    self.background.discard(scope)

        if self.tg is not None:
            self.tg.start_soon(background)

    async def _watch(self, worker: PoolWorker) -> None:
        """Replace an idle worker the moment its process dies (a leased one is its group's to
        notice; it is replaced when given back)."""
        try:
            await worker.death
        except Exception:
            if worker in self.idle:
                self.idle.remove(worker)
                self.log.warning("pool_worker_died", pid=worker.metadata.pid)
                await self.replace([worker])

    async def replace(self, workers: Sequence[PoolWorker]) -> None:
        """Kill these workers; refill the pool's bundles they held, in the background."""
        if not workers:
            return
        await self.cluster.kill([w.handle for w in workers])
        for w in workers:
            if w.bundle is not None and self.open:
                self.counts["replaced"] += 1
                self._start_refill(w.bundle)

    def refill_vacant(self) -> None:
        """Try again to refill the bundles whose refill gave up (in the background)."""
        for bundle in sorted(self.vacant):
            if self.open and bundle not in self.starting:
                self._start_refill(bundle)

    def _start_refill(self, bundle: int) -> None:
        self.vacant.pop(bundle, None)
        self.starting[bundle] = []
        self.spawn(self._refill, bundle)

    async def _refill(self, bundle: int) -> None:
        error: Exception | None = None
        for wait in (0.0, *_REFILL_BACKOFF_S):
            await anyio.sleep(wait)
            try:
                await self.fill(bundle)
                return
            except Exception as exc:
                error = exc
                self.log.warning("pool_refill_failed", bundle=bundle, error=describe(exc))
                if self.open:  # still being started through the backoff (``statistics()``)
                    self.starting[bundle] = []
        self.starting.pop(bundle, None)
        if self.open and error is not None:
            # Tried again at the next lease or give-back (see ``refill_vacant``); a lease that
            # waits for this bundle's worker learns that it will not come (see WorkerPool.lease).
            self.vacant[bundle] = error
            self.wake()
        self.log.error("pool_refill_gave_up", bundle=bundle)

    async def fill(self, bundle: int) -> None:
        """Start a worker in ``bundle`` and make it idle."""
        starting = self.starting[bundle] = []
        try:
            [(handle, meta)] = await self.cluster.start_workers(
                self.config, self.placement, [bundle], self.config.start_timeout_s, track=starting
            )
        finally:
            self.starting.pop(bundle, None)
        if not self.open:
            # bounded by the seam: a kill without patience or deaths (see Cluster's bounds)
            with anyio.CancelScope(shield=True):
                await self.cluster.kill([handle])
            return
        worker = PoolWorker(handle, meta, bundle, death=death_of(handle))
        self.spawn(self._watch, worker)
        self.make_idle(worker)

    async def alive(self, workers: list[PoolWorker]) -> list[PoolWorker]:
        """The workers that answer a ping in time; the others are replaced."""
        answered: list[PoolWorker] = []

        async def ping(w: PoolWorker) -> None:
            idle = Unranked(w.handle, w.metadata)
            with anyio.move_on_after(LEASE_PING_TIMEOUT_S), contextlib.suppress(AsyncExecError):
                await proxy(at_attempt(self.cluster, 0), idle).ping()
                answered.append(w)

        async with task_group() as tg:
            for w in workers:
                tg.start_soon(ping, w)
        dead = [w for w in workers if w not in answered]
        if dead:
            self.log.warning("pool_worker_dead_at_lease", pids=[w.metadata.pid for w in dead])
            for w in dead:
                self.leased.pop(w.handle.key, None)
            await self.replace(dead)
        return [w for w in workers if w in answered]

    async def fresh(self, n: int) -> list[PoolWorker]:
        """Start ``n`` workers outside the pool for a lease it could not fill."""
        try:
            # Outside the pool's placement group: anywhere the cluster has room.
            started = await self.cluster.start_workers(
                self.config, None, [None] * n, self.config.start_timeout_s
            )
        except TimeoutError as exc:
            raise StartupTimeoutError(
                f"starting {n} workers beyond the pool", self.config.start_timeout_s
            ) from exc
        fresh: list[PoolWorker] = []
        for handle, meta in started:
            worker = PoolWorker(handle, meta, None, death=death_of(handle))
            self.leased[handle.key] = worker
            fresh.append(worker)
        self.counts["fresh_for_leases"] += n
        self.log.info("pool_short", fresh=n)
        return fresh
