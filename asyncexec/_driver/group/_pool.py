"""WorkerPool: warm worker processes that executors lease and give back.

A pool owns one placement group of ``size`` bundles and keeps one started, described worker in
each. An executor built with ``pool=`` leases its workers instead of starting processes: a lease
health-checks the workers it takes (a ping each, at once), and the executor gives them their
ranks, devices, init hook and backend as it would fresh ones. When the executor closes (or
replaces its group) it gives them back: a worker whose function stopped in time and whose reset
succeeded goes back to the idle list; any other (failed, dead, still running, past
``max_leases``) is killed, and its bundle gets a new process in the background, so the pool
refills. An idle worker that dies is noticed at once (its one pending ``wait_closed`` call, which
its groups await too, fails) and replaced the same way.

A lease for more workers than are idle starts fresh workers for the rest, outside the pool's
placement group, that are killed when given back (``when_short="start"``, the default), or waits
until enough are given back (``when_short="wait"``).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import anyio
import anyio.abc

from ..._config import ExecutorConfig, PlacementStrategy, check_count
from ..._errors import (
    ConfigurationError,
    ExecutorStateError,
    StartupTimeoutError,
    describe,
)
from ..._protocol import WorkerMetadata
from .._logging import get_logger
from ..cluster import Handle, Placement, cluster_for
from ._reservation import Claim, Reservation

__all__ = ["PoolStatistics", "PoolWorker", "WorkerPool"]

_D = ExecutorConfig
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
            (up to ``placement_timeout_s``).
        placement_timeout_s: how long the pool's placement group may take to be ready.
        start_timeout_s: bound on starting the pool's workers (and each refill).
        shutdown_timeout_s: bound on closing the pool.
        address: the Ray cluster to join when Ray is not initialized.
        name: a name for logs.
        reservation: a :class:`Reservation` to keep the workers on (worker j on its bundle j,
            claimed while the pool is open) instead of a placement group of the pool's own. An
            executor that leases from it gets ranks in the reservation's bundle order, its
            lowest idle bundles first, so its rank i is on bundle i when those are idle.
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
        placement_timeout_s: float = _D.placement_timeout_s,
        start_timeout_s: float = _D.start_timeout_s,
        shutdown_timeout_s: float = _D.shutdown_timeout_s,
        address: str | None = None,
        name: str = "pool",
        reservation: Reservation | None = None,
    ) -> None:
        self.config = ExecutorConfig.build(
            size,
            resources_per_worker=resources_per_worker,
            runtime_env=runtime_env,
            placement_strategy=placement_strategy,
            placement_timeout_s=placement_timeout_s,
            start_timeout_s=start_timeout_s,
            shutdown_timeout_s=shutdown_timeout_s,
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
        #: Pools hold Ray actors (a local executor takes none).
        self.cluster = cluster_for(local=False)
        self._placement: Placement | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._idle: list[PoolWorker] = []
        self._leased: dict[str, PoolWorker] = {}
        self._starting: dict[int, list[Handle]] = {}  # bundle -> actor being started
        self._changed = anyio.Event()  # set (and replaced) when a worker becomes idle
        self._open = False
        self._closed = False
        self._background: set[anyio.CancelScope] = set()
        self._counts = {"leases": 0, "returned": 0, "replaced": 0, "fresh_for_leases": 0}

    def __repr__(self) -> str:
        state = "open" if self._open else ("closed" if self._closed else "new")
        return (
            f"<WorkerPool {self.config.name} {state} size={self.size} idle={len(self._idle)} "
            f"leased={len(self._leased)}>"
        )

    # Lifecycle --------------------------------------------------------------------------------

    async def __aenter__(self) -> WorkerPool:
        if self._open or self._closed:
            raise ExecutorStateError("a WorkerPool is entered once")
        await self.cluster.connect(self.config.address)
        if self.reservation is not None:  # refused before anything starts
            self._claim = self.reservation.claim(
                f"pool {self.config.name!r}", self.size, self.config.resources_per_worker
            )
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._open = True
        t0 = time.perf_counter()
        try:
            placement: Placement | None
            if self.reservation is not None:
                placement = self.reservation.placement(self.config.bundles)
                self._placement = placement
            else:
                with anyio.CancelScope(shield=True):
                    placement = await anyio.to_thread.run_sync(
                        self.cluster.place,
                        self.config.bundles,
                        self.config.placement_strategy,
                        None,
                        self.log,
                    )
                    self._placement = placement
            await self.cluster.wait_placed(placement, self.config.placement_timeout_s)
            with anyio.fail_after(self.config.start_timeout_s):
                async with anyio.create_task_group() as tg:
                    for bundle in range(self.size):
                        tg.start_soon(self._fill, bundle)
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await self.aclose()
            # Not inside the shield: anyio requires the group's scope to be the innermost one.
            await self._exit_tg()
            if isinstance(exc, TimeoutError):
                raise StartupTimeoutError(
                    "starting the pool's workers", self.config.start_timeout_s
                ) from exc
            raise
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
            await self._exit_tg()

    async def _exit_tg(self) -> None:
        if self._tg is not None:
            tg, self._tg = self._tg, None
            await tg.__aexit__(None, None, None)

    async def aclose(self) -> None:
        """Kill every worker of the pool, leased ones included (their executors' runs fail
        with a crashed worker, and cannot lease again), and remove the placement group.
        Shielded, bounded, idempotent."""
        if self._closed:
            return
        self._closed = True
        self._open = False
        with anyio.CancelScope(shield=True):
            # The refills and idle watches (not the task group's own scope: the task that
            # entered the pool runs inside it).
            for scope in self._background:
                scope.cancel()
            actors = [w.handle for w in self._idle] + [w.handle for w in self._leased.values()]
            actors += [a for starting in self._starting.values() for a in starting]
            self._idle.clear()
            self._leased.clear()
            self._starting.clear()
            self._wake()
            await self.cluster.kill(actors, self._placement)
        if self._claim is not None and self.reservation is not None:
            self.reservation.release(self._claim)
            self._claim = None
        self.log.info("pool_closed")

    # Leases -----------------------------------------------------------------------------------

    def statistics(self) -> PoolStatistics:
        """A snapshot of the pool's counters."""
        return PoolStatistics(
            size=self.size,
            idle=len(self._idle),
            leased=len(self._leased),
            starting=len(self._starting),
            **self._counts,
        )

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
            ExecutorStateError: the pool is not open.
            StartupTimeoutError: waiting for given-back workers, or starting fresh ones, overran
                its bound.
        """
        taken: list[PoolWorker] = []
        try:
            deadline = anyio.current_time() + self.config.placement_timeout_s
            while len(taken) < n:
                self._check_open()
                if self.reservation is not None:  # the lowest bundles first: rank i on bundle i
                    self._idle.sort(key=lambda w: w.bundle if w.bundle is not None else self.size)
                candidates = self._idle[: n - len(taken)]
                del self._idle[: len(candidates)]
                for w in candidates:
                    self._leased[w.handle.key] = w
                taken += await self._alive(candidates)
                if len(taken) == n or candidates:
                    continue
                if self.when_short == "start":
                    taken += await self._fresh(n - len(taken))
                    break
                changed = self._changed
                with anyio.move_on_after(deadline - anyio.current_time()):
                    await changed.wait()
                    continue
                raise StartupTimeoutError(
                    f"waiting for {n - len(taken)} workers of the pool to be given back",
                    self.config.placement_timeout_s,
                )
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.give_back([(w.handle, True) for w in taken])
            raise
        self._counts["leases"] += 1
        return taken

    async def give_back(self, returned: Sequence[tuple[Handle, bool]]) -> None:
        """Take back leased workers; ``True`` with a worker says it was reset and may be
        leased again. Any other is killed and its bundle refilled in the background."""
        doomed: list[PoolWorker] = []
        for actor, clean in returned:
            worker = self._leased.pop(actor.key, None)
            if worker is None:
                continue  # the pool closed, or it was already given back
            worker.leases += 1
            self._counts["returned"] += 1
            reusable = (
                clean
                and self._open
                and worker.bundle is not None
                and (self.max_leases is None or worker.leases < self.max_leases)
            )
            if reusable:
                self._make_idle(worker)
            else:
                doomed.append(worker)
        await self._replace(doomed)

    # Inside -----------------------------------------------------------------------------------

    def _check_open(self) -> None:
        if not self._open:
            what = "closed" if self._closed else "not entered (use `async with WorkerPool(...)`)"
            raise ExecutorStateError(f"the worker pool {self.config.name} is {what}")

    async def _alive(self, workers: list[PoolWorker]) -> list[PoolWorker]:
        """The workers that answer a ping in time; the others are replaced."""
        answered: list[PoolWorker] = []

        async def ping(w: PoolWorker) -> None:
            with anyio.move_on_after(LEASE_PING_TIMEOUT_S), contextlib.suppress(Exception):
                await w.handle.call("ping")
                answered.append(w)

        async with anyio.create_task_group() as tg:
            for w in workers:
                tg.start_soon(ping, w)
        dead = [w for w in workers if w not in answered]
        if dead:
            self.log.warning("pool_worker_dead_at_lease", pids=[w.metadata.pid for w in dead])
            for w in dead:
                self._leased.pop(w.handle.key, None)
            await self._replace(dead)
        return [w for w in workers if w in answered]

    async def _fresh(self, n: int) -> list[PoolWorker]:
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
            worker = PoolWorker(handle, meta, None, death=handle.call("wait_closed"))
            self._leased[handle.key] = worker
            fresh.append(worker)
        self._counts["fresh_for_leases"] += n
        self.log.info("pool_short", fresh=n)
        return fresh

    def _make_idle(self, worker: PoolWorker) -> None:
        self._idle.append(worker)
        self._wake()

    def _wake(self) -> None:
        """Wake every lease waiting for a worker (each waits on the event of its time)."""
        changed, self._changed = self._changed, anyio.Event()
        changed.set()

    def _spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` in the background, cancelled when the pool closes."""

        async def background() -> None:
            with anyio.CancelScope() as scope:
                self._background.add(scope)
                try:
                    await fn(*args)
                finally:
                    self._background.discard(scope)

        if self._tg is not None:
            self._tg.start_soon(background)

    async def _watch(self, worker: PoolWorker) -> None:
        """Replace an idle worker the moment its process dies (a leased one is its group's to
        notice; it is replaced when given back)."""
        try:
            await worker.death
        except Exception:
            if worker in self._idle:
                self._idle.remove(worker)
                self.log.warning("pool_worker_died", pid=worker.metadata.pid)
                await self._replace([worker])

    async def _replace(self, workers: Sequence[PoolWorker]) -> None:
        """Kill these workers; refill the pool's bundles they held, in the background."""
        if not workers:
            return
        await self.cluster.kill([w.handle for w in workers])
        for w in workers:
            if w.bundle is not None and self._open:
                self._counts["replaced"] += 1
                self._starting[w.bundle] = []
                self._spawn(self._refill, w.bundle)

    async def _refill(self, bundle: int) -> None:
        for wait in (0.0, *_REFILL_BACKOFF_S):
            await anyio.sleep(wait)
            try:
                await self._fill(bundle)
                return
            except Exception as exc:
                self.log.warning("pool_refill_failed", bundle=bundle, error=describe(exc))
        self._starting.pop(bundle, None)
        self.log.error("pool_refill_gave_up", bundle=bundle)

    async def _fill(self, bundle: int) -> None:
        """Start a worker in ``bundle`` and make it idle."""
        assert self._placement is not None
        starting = self._starting[bundle] = []
        try:
            [(handle, meta)] = await self.cluster.start_workers(
                self.config, self._placement, [bundle], self.config.start_timeout_s, track=starting
            )
        finally:
            self._starting.pop(bundle, None)
        if not self._open:
            with anyio.CancelScope(shield=True):
                await self.cluster.kill([handle])
            return
        worker = PoolWorker(handle, meta, bundle, death=handle.call("wait_closed"))
        self._spawn(self._watch, worker)
        self._make_idle(worker)

