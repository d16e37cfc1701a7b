"""The live group of actors: calls on all of them, replacing one rank, closing.

Every call awaits its ObjectRefs (no ``ray.get``) in tasks of an anyio task group; the first
failure stops the wait, and every rank that had failed by then is kept (the first is raised, the
others are attached to it as notes). Closing is shielded from cancellation, bounded in time and
idempotent; when it returns, the actors are dead and the placement group is removed.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

import anyio
import ray
from ray.actor import ActorHandle

from .._config import ExecutorConfig
from .._errors import AsyncExecError, ConfigurationError, describe
from .._protocol import Outcome, WorkerContext, WorkerMetadata
from .._worker._actor import WorkerActor
from ..backends._base import Backend
from ._boundary import backend_error, call_error, outcome_error
from ._interrupt import hurried_away
from ._local import LocalWorker, is_local
from ._logging import get_logger
from ._placement import Placement
from ._workers import Standby, WorkerInfo

__all__ = [
    "CREATING",
    "WorkerGroup",
    "actor_options",
    "device_envs",
    "driver_data_context",
    "kill_all",
    "spawn",
    "start_workers",
]

T = TypeVar("T")
#: Held while worker actors are created, by every thread of the process: Ray checks whether the
#: actor class is exported without a lock, so executors starting at once each exported it again
#: (about 15 ms of the GIL each, stalling the event loop in the first round of a service).
CREATING = threading.Lock()
#: Where the failures of teardown calls are logged (they never raise: teardown goes on).
_log = get_logger(component="cluster")


def actor_options(config: ExecutorConfig) -> dict[str, Any]:
    """Ray actor options for one worker of ``config``."""
    resources = dict(config.resources_per_worker)
    options: dict[str, Any] = {
        "num_cpus": resources.pop("CPU", 0),
        "num_gpus": resources.pop("GPU", 0),
        "resources": resources,
    }
    memory = resources.pop("memory", 0)
    if memory:
        options["memory"] = memory
    if config.runtime_env is not None:
        options["runtime_env"] = dict(config.runtime_env)
    return options


def device_envs(metas: Sequence[WorkerMetadata], config: ExecutorConfig) -> list[dict[str, str]]:
    """Each worker's environment for seeing its node's devices, in the order of ``metas``."""
    from .._devices import shared_device_env

    return shared_device_env(
        [m.node_id for m in metas],
        [m.accelerator_ids for m in metas],
        sorted(config.share_devices),
    )


def driver_data_context() -> Any:
    """The driver's Ray Data context, when the driver uses Ray Data (never imported otherwise:
    it is heavy, and workers that do not need it must not pay for it)."""
    import sys

    if "ray.data" not in sys.modules:
        return None
    from ray.data import DataContext

    return DataContext.get_current()


def with_others(errors: Sequence[AsyncExecError]) -> AsyncExecError:
    """The first error, with every other one attached as a note (several ranks failed at once)."""
    first = errors[0]
    for other in errors[1:]:
        if other is not first:
            first.add_note(f"also failed at the same time: {describe(other)}")
    return first


class WorkerGroup:
    """N actors in one placement group, in rank order."""

    def __init__(
        self,
        config: ExecutorConfig,
        backend: Backend | None,
        placement: Placement | None,
        workers: list[WorkerInfo],
        attempt: int,
        log: Any,
        *,
        pool: Any = None,
        spares: Sequence[Standby] = (),
    ) -> None:
        self.config = config
        self.backend = backend
        #: The group's own placement group; None when its workers are leased from ``pool``
        #: (a :class:`~._pool.WorkerPool`), which they go back to when the group closes.
        self.placement = placement
        self.pool = pool
        self.workers = workers
        #: Started workers kept beside the group, to take a failed rank's place.
        self.spares = list(spares)
        self.attempt = attempt
        self.log = log
        #: One pending ``wait_closed`` call per rank: it fails the moment the process dies.
        self.deaths: list[Any] = [
            w.death if w.death is not None else w.actor.wait_closed.remote() for w in workers
        ]
        self._closed = False
        self._starting: list[ActorHandle] = []  # spares being started

    def __repr__(self) -> str:
        state = "closed" if self._closed else "live"
        return f"<WorkerGroup {len(self.workers)} workers, attempt {self.attempt}, {state}>"

    @property
    def contexts(self) -> list[WorkerContext]:
        return [w.context for w in self.workers]

    @property
    def closed(self) -> bool:
        return self._closed

    # Calls ------------------------------------------------------------------------------------

    async def gather(self, refs: Sequence[Any], workers: Sequence[WorkerInfo]) -> list[Any]:
        """Await one call per worker; results in the order given.

        Raises:
            AsyncExecError: the first failure, mapped (the wait stops there); the failures of
                other ranks seen by then are attached to it as notes.
        """
        results: list[Any] = [None] * len(refs)
        errors: list[AsyncExecError] = []

        async def one(i: int) -> None:
            try:
                results[i] = await refs[i]
            except Exception as exc:
                with anyio.CancelScope(shield=True):
                    errors.append(await call_error(exc, workers[i], self.attempt))
                tg.cancel_scope.cancel()

        async with anyio.create_task_group() as tg:
            for i in range(len(refs)):
                tg.start_soon(one, i)
        if errors:
            raise with_others(errors)
        return results

    def _values(self, outcomes: Sequence[Outcome], workers: Sequence[WorkerInfo]) -> list[Any]:
        failed = [
            outcome_error(o, w, self.attempt)
            for o, w in zip(outcomes, workers, strict=True)
            if o.kind != "ok"
        ]
        if failed:
            raise with_others(failed)  # the lowest failing rank first
        return [o.value for o in outcomes]

    async def execute(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> list[T]:
        """Run ``fn`` on every worker concurrently; results in rank order."""
        refs = [w.actor.execute.remote(fn, *args, **kwargs) for w in self.workers]
        return self._values(await self.gather(refs, self.workers), self.workers)

    async def execute_single(
        self, rank: int, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> T:
        """Run ``fn`` on one rank."""
        if not 0 <= rank < len(self.workers):
            raise ConfigurationError(f"rank must be in 0..{len(self.workers) - 1}, got {rank!r}")
        worker = self.workers[rank]
        refs = [worker.actor.execute.remote(fn, *args, **kwargs)]
        values: list[T] = self._values(await self.gather(refs, [worker]), [worker])
        return values[0]

    async def call_each(self, method: str, args_per_rank: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Call actor ``method`` on every worker with its own arguments; results in rank order."""
        refs = [
            getattr(w.actor, method).remote(*args)
            for w, args in zip(self.workers, args_per_rank, strict=True)
        ]
        return await self.gather(refs, self.workers)

    async def setup(self, envs: Sequence[dict[str, str]], workers: Sequence[WorkerInfo]) -> None:
        """Give ``workers`` their device environment, context, data context and init hook."""
        data_context = None if self.config.local else driver_data_context()
        refs = [
            w.actor.setup.remote(env, w.context, self.config.init_hook, data_context)
            for w, env in zip(workers, envs, strict=True)
        ]
        self._values(await self.gather(refs, workers), workers)

    async def run_backend_hook(self, hook: str) -> None:
        """Run a backend hook; a failure becomes a BackendError naming backend, hook and rank."""
        if self.backend is None:
            return
        name = getattr(self.backend, "name", type(self.backend).__name__)
        try:
            await getattr(self.backend, hook)(self)
        except Exception as exc:
            raise backend_error(exc, name, hook) from exc

    async def stop_functions(self, workers: Sequence[WorkerInfo], timeout_s: float) -> bool:
        """Stop the run's function on ``workers``; whether all ended within ``timeout_s``."""
        refs = [w.actor.stop_run.remote(timeout_s) for w in workers]
        with anyio.move_on_after(timeout_s + STOP_MARGIN_S):
            try:
                return all(await self.gather(refs, workers))
            except AsyncExecError:
                return False
        return False

    async def stop_each(self, workers: Sequence[WorkerInfo], timeout_s: float) -> list[int]:
        """Stop the run's function on ``workers``; the ranks whose function did not end within
        ``timeout_s`` (or whose worker did not answer, or failed), waiting for every rank."""
        refs = [w.actor.stop_run.remote(timeout_s) for w in workers]
        stopped = await _answers(refs, timeout_s + STOP_MARGIN_S)
        return [w.rank for w, ok in zip(workers, stopped, strict=True) if ok is not True]

    async def replace_rank(self, rank: int) -> bool:
        """Replace one failed rank with a fresh process in its bundle, keeping the others.

        The survivors' functions are stopped first (bounded by ``stop_timeout_s``); when one does
        not stop (stuck in a collective, say), or the new process lands on another node, nothing
        is kept and False is returned: the caller then replaces the whole group.
        """
        if (
            self._closed
            or self.backend is not None
            or self.placement is None
            or not self.placement.owned
            or self.workers[rank].bundle is None
        ):
            return False
        failed = self.workers[rank]
        assert failed.bundle is not None
        await kill_all([failed.actor], None)
        survivors = [w for w in self.workers if w.rank != rank]
        if not await self.stop_functions(survivors, self.config.stop_timeout_s):
            return False
        options = {"scheduling_strategy": self.placement.strategy(failed.bundle)}
        [(actor, meta)] = await start_workers(
            actor_options(self.config) | options, 1, self.config.start_timeout_s
        )
        try:
            with anyio.fail_after(self.config.start_timeout_s):
                if meta.node_id != failed.metadata.node_id:
                    raise RuntimeError("the replacement landed on another node")
                metas = [meta if w.rank == rank else w.metadata for w in self.workers]
                context = replace(
                    failed.context, pid=meta.pid, accelerator_ids=meta.accelerator_ids
                )
                fresh = WorkerInfo(actor, meta, context, failed.bundle)
                await self.setup([device_envs(metas, self.config)[rank]], [fresh])
        except BaseException:
            with anyio.CancelScope(shield=True):
                await kill_all([actor], None)
            raise
        self.workers[rank] = fresh
        self.deaths[rank] = actor.wait_closed.remote()
        self.log.info("rank_replaced", rank=rank, pid=meta.pid)
        return True

    async def renew_rank(self, rank: int) -> Standby | None:
        """Independent ranks: put a standby spare, or else a fresh process in the rank's
        bundle, in the failed ``rank``'s place while the other ranks' functions keep running.
        Returns the failed worker's record (a used spare's bundle is free for a new one), or
        None when neither is possible (no fitting spare, and no bundle of its own: a pooled
        group, or a parent placement group).

        Raises:
            AsyncExecError, TimeoutError, RuntimeError: the new process failed to start or
                landed on another node (the caller's restart policy decides what next).
        """
        if self._closed:
            return None
        failed = self.workers[rank]
        found = self._spare_for(rank)
        if found is not None:
            spare, env = found
            self.spares.remove(spare)
            actor, meta, bundle, death = spare.actor, spare.metadata, spare.bundle, spare.death
        elif self.config.local:
            bundle, death, env = None, None, {}
            await self._drop([failed.actor])
            actor = LocalWorker(self.config.name)
            meta = await actor.describe.remote()
        elif (
            self.placement is not None
            and (self.placement.owned or self.placement.slots is not None)
            and failed.bundle is not None
        ):
            bundle, death, env = failed.bundle, None, None
            options = {"scheduling_strategy": self.placement.strategy(bundle)}
            await self._drop([failed.actor])  # its bundle's resources, for the new process
            [(actor, meta)] = await start_workers(
                actor_options(self.config) | options, 1, self.config.start_timeout_s
            )
        else:
            return None
        context = replace(failed.context, pid=meta.pid, accelerator_ids=meta.accelerator_ids)
        fresh = WorkerInfo(actor, meta, context, bundle, death)
        try:
            with anyio.fail_after(self.config.start_timeout_s):
                if meta.node_id != failed.metadata.node_id:
                    raise RuntimeError("the replacement landed on another node")
                if env is None:
                    metas = [meta if w.rank == rank else w.metadata for w in self.workers]
                    env = device_envs(metas, self.config)[rank]
                async with anyio.create_task_group() as tg:
                    tg.start_soon(self._drop, [failed.actor])
                    await self.setup([env], [fresh])
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._drop([actor])
            raise
        self.workers[rank] = fresh
        self.deaths[rank] = death if death is not None else actor.wait_closed.remote()
        self.log.info("rank_renewed", rank=rank, pid=meta.pid, spare=found is not None)
        return Standby(failed.actor, failed.metadata, failed.bundle)

    async def shrink(
        self, config: ExecutorConfig, keep: Sequence[WorkerInfo], contexts: Sequence[WorkerContext]
    ) -> None:
        """Go on with the workers ``keep`` alone (an elastic group whose other workers' node was
        lost), in that order, with their new ``contexts`` and ``config`` (its ``num_workers``
        their number). Their functions must have stopped. They are set up anew (device
        environment, context, init hook); the others' actors are killed. The placement group
        stays: Ray places the lost bundles again when a node can hold them."""
        fresh = [replace(w, context=c) for w, c in zip(keep, contexts, strict=True)]
        deaths = [self.deaths[w.rank] for w in keep]
        gone = [w.actor for w in self.workers if all(w is not k for k in keep)]
        await kill_all(gone, None)
        metas = [w.metadata for w in fresh]
        self.config = config
        await self.setup(device_envs(metas, config), fresh)
        self.workers, self.deaths = fresh, deaths
        self.log.info("group_shrunk", workers=len(fresh), ranks_lost=len(gone))

    # Standby spares ---------------------------------------------------------------------------

    def _spare_for(self, rank: int) -> tuple[Standby, dict[str, str]] | None:
        """A spare that can take ``rank``'s place, and its device environment: one on the rank's
        node whose devices leave the survivors' device environment as it is."""
        failed = self.workers[rank]
        before = device_envs([w.metadata for w in self.workers], self.config)
        for spare in self.spares:
            if spare.metadata.node_id != failed.metadata.node_id:
                continue
            metas = [spare.metadata if w.rank == rank else w.metadata for w in self.workers]
            after = device_envs(metas, self.config)
            if all(after[i] == before[i] for i in range(len(metas)) if i != rank):
                return spare, after[rank]
        return None

    async def take_spare(self, rank: int) -> Standby | None:
        """Put a standby spare in the place of the failed ``rank`` and keep the other ranks, whose
        functions are stopped first. Returns the failed worker's record (its bundle is free for a
        new spare), or None when no spare fits (none left, none on the rank's node, or one would
        change the survivors' devices) or a survivor's function did not stop: the caller then
        replaces the whole group. With a backend, its group is formed anew (``on_shutdown``,
        then ``on_start``) around the new member."""
        found = None if self._closed else self._spare_for(rank)
        if found is None:
            return None
        spare, env = found
        failed = self.workers[rank]
        survivors = [w for w in self.workers if w.rank != rank]
        self.spares.remove(spare)
        context = replace(
            failed.context, pid=spare.metadata.pid, accelerator_ids=spare.metadata.accelerator_ids
        )
        fresh = WorkerInfo(spare.actor, spare.metadata, context, spare.bundle, spare.death)
        stopped = [False]

        async def stop_survivors() -> None:
            stopped[0] = await self.stop_functions(survivors, self.config.stop_timeout_s)

        # The survivors' functions stop, the spare is set up and the failed worker goes, at once.
        try:
            with anyio.fail_after(self.config.start_timeout_s + self.config.stop_timeout_s):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(stop_survivors)
                    tg.start_soon(self._drop, [failed.actor])
                    await self.setup([env], [fresh])
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._drop([spare.actor])  # set up (or half): not a clean spare
            raise
        if not stopped[0]:
            await self._drop([spare.actor])
            return None
        self.workers[rank] = fresh
        self.deaths[rank] = (
            spare.death if spare.death is not None else spare.actor.wait_closed.remote()
        )
        if self.backend is not None:
            with anyio.fail_after(self.config.start_timeout_s):
                await self.run_backend_hook("on_shutdown")
                await self.run_backend_hook("on_start")
        self.log.info("spare_took_rank", rank=rank, pid=spare.metadata.pid)
        return Standby(failed.actor, failed.metadata, failed.bundle)

    async def refill_spare(self, bundle: int | None) -> None:
        """Start (or lease) a new spare, in the background after one took a rank's place. A
        failure is logged: the group runs on with one spare less."""
        try:
            if self.pool is not None:
                [leased] = await self.pool.lease(1)
                spare = Standby(leased.actor, leased.metadata, leased.bundle, leased.death)
            elif self.placement is not None and self.placement.owned and bundle is not None:
                options = {"scheduling_strategy": self.placement.strategy(bundle)}
                [(actor, meta)] = await start_workers(
                    actor_options(self.config) | options,
                    1,
                    self.config.start_timeout_s,
                    track=self._starting,
                )
                spare = Standby(actor, meta, bundle)
            else:
                return
        except Exception as exc:
            self.log.warning("spare_refill_failed", error=describe(exc))
            return
        if self._closed:
            await self._drop([spare.actor], clean=True)
        else:
            self.spares.append(spare)

    async def _drop(self, actors: Sequence[ActorHandle], *, clean: bool = False) -> None:
        """Let go of workers outside a close: back to the pool (``clean``: reusable), or
        killed."""
        with anyio.CancelScope(shield=True):
            if self.pool is not None:
                await self.pool.give_back([(a, clean) for a in actors])
            else:
                await kill_all(actors, None)

    # Shutdown ---------------------------------------------------------------------------------

    async def close(self, *, force: bool = False) -> None:
        """Stop the group: backend ``on_shutdown``, graceful exit with a patience bound, then kill,
        then remove the placement group. ``force`` skips the graceful part (used after a failure:
        survivors may be stuck in a collective). Shielded, bounded, idempotent."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            t0 = time.perf_counter()
            if self.pool is not None:
                await self._give_back(force)
                self.log.info("group_returned", seconds=round(time.perf_counter() - t0, 3))
                return
            actors = [w.actor for w in self.workers] + [s.actor for s in self.spares]
            actors += self._starting
            try:
                if not force:
                    with hurried_away():
                        await self._close_gracefully(actors)
            finally:
                # Whatever happened above, nothing of the group may be left behind.
                await kill_all(actors, self.placement, self.deaths, self.config.shutdown_timeout_s)
            self.log.info("group_closed", force=force, seconds=round(time.perf_counter() - t0, 3))

    async def _give_back(self, force: bool) -> None:
        """Return leased workers to their pool. A worker is reusable when its function stopped
        in time and its reset (asyncexec's state dropped, the pool's reset hook) succeeded; after
        a failure (``force``), a backend's workers are not reused (their framework's state may be
        broken). The others are killed by the pool, which refills."""
        clean = [False] * len(self.workers)
        timeout = self.config.stop_timeout_s
        with anyio.move_on_after(self.config.shutdown_timeout_s + timeout), hurried_away():
            if self.backend is None or not force:
                try:
                    await self.run_backend_hook("on_shutdown")
                    hook = self.pool.reset_hook
                    resets = [w.actor.reset.remote(timeout, hook) for w in self.workers]
                    bound = timeout + STOP_MARGIN_S + self.config.shutdown_timeout_s
                    outcomes = await _answers(resets, bound)
                    clean = [isinstance(o, Outcome) and o.kind == "ok" for o in outcomes]
                    failed = [o.error for o in outcomes if isinstance(o, Outcome) and o.error]
                    if failed:
                        self.log.warning("pool_reset_failed", error=describe(failed[0]))
                except Exception as exc:
                    self.log.warning("pool_return_failed", error=describe(exc))
        returned = [(w.actor, ok) for w, ok in zip(self.workers, clean, strict=True)]
        await self.pool.give_back(returned + [(s.actor, True) for s in self.spares])

    async def _close_gracefully(self, actors: list[ActorHandle]) -> None:
        with anyio.move_on_after(self.config.shutdown_timeout_s):
            try:
                await self.run_backend_hook("on_shutdown")
            except Exception as exc:
                self.log.warning("backend_shutdown_failed", error=describe(exc))
            with anyio.move_on_after(self.config.graceful_patience_s):
                await _settle([a.close.remote() for a in actors])
                await _settle([a.__ray_terminate__.remote() for a in actors])


#: Extra time a stop call gets beyond the worker-side bound it was given (the call's own trip).
STOP_MARGIN_S = 1.0


async def _answers(refs: Sequence[Any], timeout_s: float) -> list[Any]:
    """Each ref's value, or None where it failed or did not answer within ``timeout_s`` (a None
    in ``refs`` stays None)."""
    results: list[Any] = [None] * len(refs)

    async def one(i: int) -> None:
        with anyio.move_on_after(timeout_s), contextlib.suppress(Exception):
            results[i] = await refs[i]

    async with anyio.create_task_group() as tg:
        for i, ref in enumerate(refs):
            if ref is not None:
                tg.start_soon(one, i)
    return results


def spawn(options: dict[str, Any], n: int) -> list[tuple[ActorHandle, Any]]:
    """Create ``n`` workers and ask each to describe itself. Blocking: call it in a thread (the
    first actor of a class exports it synchronously, and the first call on an actor still being
    created waits for its handle)."""
    with CREATING:
        actors = [WorkerActor.options(**options).remote() for _ in range(n)]
    return [(actor, actor.describe.remote()) for actor in actors]


async def start_workers(
    options: dict[str, Any],
    n: int,
    timeout_s: float,
    *,
    track: list[ActorHandle] | None = None,
) -> list[tuple[ActorHandle, WorkerMetadata]]:
    """Start ``n`` workers with ``options`` (created off the event loop, see :func:`spawn`) and
    return each with its description, all within ``timeout_s``. When that fails, times out or
    is cancelled, they are killed: nothing half-started is left. ``track`` holds the actors while
    they start, so that an owner that closes meanwhile kills them too.

    Raises:
        TimeoutError: not every worker described itself within ``timeout_s``.
    """
    with anyio.CancelScope(shield=True):  # what is started must be known to be killed
        spawned = await anyio.to_thread.run_sync(spawn, options, n)
    actors = [actor for actor, _ in spawned]
    if track is not None:
        track.extend(actors)
    try:
        with anyio.fail_after(timeout_s):
            metas: list[WorkerMetadata] = await _awaited([ref for _, ref in spawned])
    except BaseException:
        with anyio.CancelScope(shield=True):
            await kill_all(actors, None)
        raise
    finally:
        if track is not None:
            for actor in actors:
                track.remove(actor)
    return list(zip(actors, metas, strict=True))


async def _awaited(refs: Sequence[Any]) -> list[Any]:
    """Every ref's value, awaited at once; the first failure raised."""
    results: list[Any] = [None] * len(refs)

    async def one(i: int) -> None:
        results[i] = await refs[i]

    async with anyio.create_task_group() as tg:
        for i in range(len(refs)):
            tg.start_soon(one, i)
    return results


async def _settle(refs: Sequence[Any]) -> None:
    """Await every ref, ignoring how each ends."""

    async def one(ref: Any) -> None:
        with contextlib.suppress(Exception):
            await ref

    async with anyio.create_task_group() as tg:
        for ref in refs:
            tg.start_soon(one, ref)


async def kill_all(
    actors: Sequence[ActorHandle],
    placement: Placement | None,
    deaths: Sequence[Any] = (),
    timeout_s: float = 0.0,
) -> None:
    """Kill the actors and remove the placement group (in a thread: both are blocking calls to
    Ray), then wait, bounded by ``timeout_s``, until each pending ``deaths`` call has failed,
    which tells that its process is gone."""

    def kill() -> None:
        for actor in actors:
            if is_local(actor):
                actor.kill()
                continue
            try:  # a dead actor is killed without complaint: an error here is news
                ray.kill(actor, no_restart=True)
            except Exception as exc:
                _log.warning("kill_failed", actor=repr(actor), error=describe(exc))
        if placement is not None:
            try:
                placement.remove()
            except Exception as exc:
                _log.warning("placement_remove_failed", error=describe(exc))

    with anyio.CancelScope(shield=True):
        await anyio.to_thread.run_sync(kill)
        if deaths:
            with anyio.move_on_after(timeout_s):
                await _settle(deaths)
