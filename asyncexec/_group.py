"""The live group of actors: spawn, call all, watch health, close.

Start-up awaits everything (no ``ray.get``), sends every request that does not depend on another
before awaiting any (actors are created while the placement group is still being placed; all
workers are described, set up and given their devices concurrently) and is bounded by one deadline.
Closing is shielded from cancellation, bounded in time and idempotent; when it returns, the actors
are dead and the placement group is removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import anyio
import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError, RayTaskError

from ._config import ExecutorConfig
from ._devices import shared_device_env
from ._errors import (
    AsyncExecError,
    BackendError,
    ConfigurationError,
    NodeLostError,
    PlacementTimeoutError,
    StartupError,
    StartupTimeoutError,
    WorkerCrashedError,
    WorkerError,
    WorkerHungError,
    WorkerRaisedError,
)
from ._placement import Placement, create_placement, wait_placement_ready
from ._ranks import assign_ranks, order_workers
from ._session import WorkerContext
from ._worker import WorkerActor, WorkerMetadata
from .backends._base import Backend

__all__ = ["WorkerGroup", "WorkerInfo"]

T = TypeVar("T")
E = TypeVar("E", bound=WorkerError)
FailureSink = Callable[[BaseException], None]


@dataclass(frozen=True)
class WorkerInfo:
    """One live worker: its actor, what it said about itself, and its place in the group."""

    actor: ActorHandle
    metadata: WorkerMetadata
    context: WorkerContext
    bundle: int = -1

    @property
    def rank(self) -> int:
        return self.context.world_rank


def _actor_options(config: ExecutorConfig) -> dict[str, Any]:
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


def _first_sentence(text: str) -> str:
    """Ray's actor-death messages run to many lines of advice; keep what happened."""
    for line in text.strip().splitlines():
        line = line.strip()
        if line and not line.startswith(("class_name", "actor_id", "pid:", "namespace", "ip:")):
            return line.split(" Some common causes")[0][:300]
    return ""


def _device_envs(metas: Sequence[WorkerMetadata], config: ExecutorConfig) -> list[dict[str, str]]:
    """Each worker's environment for seeing its node's devices, in the order of ``metas``."""
    return shared_device_env(
        [m.node_id for m in metas],
        [m.accelerator_ids for m in metas],
        sorted(config.share_devices),
    )


def _driver_data_context() -> Any:
    """The driver's Ray Data context, when the driver uses Ray Data (never imported otherwise:
    it is heavy, and workers that do not need it must not pay for it)."""
    import sys

    if "ray.data" not in sys.modules:
        return None
    from ray.data import DataContext

    return DataContext.get_current()


async def _node_alive(node_id: str | None) -> bool:
    if node_id is None:
        return True

    def lookup() -> bool:
        return any(n["NodeID"] == node_id and n["Alive"] for n in ray.nodes())

    with anyio.move_on_after(5):
        return await anyio.to_thread.run_sync(lookup)
    return True


class WorkerGroup:
    """N actors in one placement group, in rank order."""

    def __init__(
        self,
        config: ExecutorConfig,
        backend: Backend | None,
        placement: Placement,
        workers: list[WorkerInfo],
        attempt: int,
        log: Any,
    ) -> None:
        self.config = config
        self.backend = backend
        self.placement = placement
        self.workers = workers
        self.attempt = attempt
        self._log = log
        self._closed = False

    def __repr__(self) -> str:
        state = "closed" if self._closed else "live"
        return f"<WorkerGroup {len(self.workers)} workers, attempt {self.attempt}, {state}>"

    @property
    def contexts(self) -> list[WorkerContext]:
        return [w.context for w in self.workers]

    @property
    def closed(self) -> bool:
        return self._closed

    # Start-up ---------------------------------------------------------------------------------

    @classmethod
    async def start(
        cls, config: ExecutorConfig, backend: Backend | None, *, attempt: int, log: Any
    ) -> WorkerGroup:
        """Start a group and return it ready to run.

        Raises:
            PlacementTimeoutError: the placement group was not ready in time.
            StartupTimeoutError: the rest of start-up overran ``start_timeout_s``.
            StartupError: a worker died or the init hook failed during start-up.
            BackendError: the backend's ``on_start`` failed.
        """
        t0 = time.perf_counter()
        options = _actor_options(config)

        def request() -> tuple[Placement, list[ActorHandle]]:
            # Off the loop: the first actor of a class in a process exports the class to the
            # cluster synchronously (about 0.1 s).
            placement = create_placement(config.bundles, config.placement_strategy, config.name)
            actors: list[ActorHandle] = []
            try:
                for i in range(config.num_workers):
                    strategy = placement.strategy(i)
                    actors.append(
                        WorkerActor.options(scheduling_strategy=strategy, **options).remote()
                    )
            except Exception as exc:
                # Ray refused the options (a resource amount below its precision, a fractional
                # amount of a whole-unit accelerator, a runtime_env it cannot read).
                for actor in actors:
                    with contextlib.suppress(Exception):
                        ray.kill(actor, no_restart=True)
                placement.remove()
                raise ConfigurationError(f"Ray refused the worker options: {exc}") from exc
            return placement, actors

        with anyio.CancelScope(shield=True):  # what is requested must be known to be cleaned up
            placement, actors = await anyio.to_thread.run_sync(request)
        group: WorkerGroup | None = None
        phase = "waiting for the placement group"
        try:
            # Describing the actors is requested now: they start as soon as the group is placed.
            described = [a.describe.remote() for a in actors]
            await wait_placement_ready(placement, config.placement_timeout_s)
            log.debug("placement_ready", seconds=round(time.perf_counter() - t0, 3))
            if not placement.owned:
                # A parent group is ready from the start; whether its free bundles hold the
                # workers shows only when they are placed, under the same deadline.
                with anyio.move_on_after(config.placement_timeout_s) as placed:
                    await _gather(described, "start-up")
                if placed.cancelled_caught:
                    available = await anyio.to_thread.run_sync(ray.available_resources)
                    raise PlacementTimeoutError(
                        config.bundles, available, config.placement_timeout_s, parent=True
                    )
            with anyio.fail_after(config.start_timeout_s):
                phase = "starting the worker processes"
                metas: list[WorkerMetadata] = await _gather(described, "start-up")
                t1 = time.perf_counter()
                log.debug("workers_ready", seconds=round(t1 - t0, 3))
                driver_node = ray.get_runtime_context().get_node_id()
                order = order_workers(
                    [m.node_id for m in metas], [m.accelerator_ids for m in metas], driver_node
                )
                metas = [metas[i] for i in order]
                actors = [actors[i] for i in order]
                bundles = list(order)
                ranks = assign_ranks([m.node_id for m in metas])
                envs = _device_envs(metas, config)
                contexts = [
                    WorkerContext(
                        world_rank=r.world_rank,
                        local_rank=r.local_rank,
                        node_rank=r.node_rank,
                        world_size=r.world_size,
                        local_world_size=r.local_world_size,
                        node_id=m.node_id,
                        node_ip=m.node_ip,
                        pid=m.pid,
                        accelerator_ids=m.accelerator_ids,
                        executor_name=config.name,
                    )
                    for r, m in zip(ranks, metas, strict=True)
                ]
                phase = "setting the workers up (devices, data context, init hook)"
                data_context = _driver_data_context()
                await _gather(
                    [
                        a.setup.remote(env, ctx, config.init_hook, data_context)
                        for a, env, ctx in zip(actors, envs, contexts, strict=True)
                    ],
                    "set-up",
                )
                workers = [
                    WorkerInfo(a, m, c, b)
                    for a, m, c, b in zip(actors, metas, contexts, bundles, strict=True)
                ]
                group = cls(config, backend, placement, workers, attempt, log)
                log.info(
                    "worker_table",
                    workers=[
                        {
                            "rank": w.rank,
                            "local_rank": w.context.local_rank,
                            "node_rank": w.context.node_rank,
                            "node_id": w.metadata.node_id[:12],
                            "pid": w.metadata.pid,
                            "devices": dict(w.metadata.accelerator_ids),
                        }
                        for w in workers
                    ],
                )
                if backend is not None:
                    phase = f"running {backend.name}.on_start"
                    await group.run_backend_hook("on_start")
            log.info("group_started", seconds=round(time.perf_counter() - t0, 3), attempt=attempt)
            return group
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                if group is not None:
                    await group.close(force=True)
                else:
                    await _kill(actors, placement, timeout_s=config.shutdown_timeout_s)
            if isinstance(exc, TimeoutError) and not isinstance(exc, AsyncExecError):
                raise StartupTimeoutError(phase, config.start_timeout_s) from exc
            if isinstance(exc, RayTaskError) and isinstance(exc.cause, BaseException):
                # Name the worker's own error first, not Ray's (colored) task header.
                cause = exc.cause
                raise StartupError(
                    f"start-up failed while {phase}: {type(cause).__name__}: {cause}"
                ) from cause
            if isinstance(exc, Exception) and not isinstance(exc, StartupError):
                raise StartupError(f"start-up failed while {phase}: {exc}") from exc
            raise

    # Calls ------------------------------------------------------------------------------------

    async def classify(self, rank: int, exc: BaseException) -> AsyncExecError:
        """Map an error from a call on ``rank`` to asyncexec's error tree."""
        if isinstance(exc, AsyncExecError):
            return exc
        if isinstance(exc, RayTaskError):
            cause = exc.cause if isinstance(exc.cause, BaseException) else exc
            return self.worker_error(
                WorkerRaisedError,
                rank,
                f"{type(cause).__name__}: {cause}",
                error=cause,
                remote_traceback=str(exc),
            )
        if isinstance(exc, RayActorError):
            detail = _first_sentence(str(exc)) or type(exc).__name__
            # Ray marks a lost node's actors dead only after it has marked the node dead, so the
            # node table tells a lost node from a crashed process.
            node = self.workers[rank].metadata.node_id
            if not await _node_alive(node):
                return self.worker_error(NodeLostError, rank, f"node {node[:12]} left the cluster")
            return self.worker_error(WorkerCrashedError, rank, detail)
        return self.worker_error(WorkerRaisedError, rank, f"{type(exc).__name__}: {exc}", error=exc)

    def worker_error(self, cls: type[E], rank: int, detail: str, **extra: Any) -> E:
        """An error of ``cls`` about ``rank``, with its node, pid and attempt filled in."""
        worker = self.workers[rank]
        return cls(
            rank,
            node_id=worker.metadata.node_id,
            pid=worker.metadata.pid,
            attempt=self.attempt,
            detail=detail,
            **extra,
        )

    async def _first_error(self, refs: Sequence[Any], ranks: Sequence[int]) -> list[Any]:
        """Await ``refs``; on the first failure, stop waiting and raise it, classified."""
        futures = [asyncio.ensure_future(_as_coro(r)) for r in refs]
        try:
            await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
            for rank, fut in zip(ranks, futures, strict=True):
                if fut.done() and not fut.cancelled() and fut.exception() is not None:
                    raise await self.classify(rank, fut.exception())  # type: ignore[arg-type]
            return [f.result() for f in futures]
        finally:
            for f in futures:
                f.cancel()

    async def execute(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> list[T]:
        """Run ``fn`` on every worker concurrently; results in rank order."""
        refs = [w.actor.execute.remote(fn, args, kwargs) for w in self.workers]
        return await self._first_error(refs, range(len(refs)))

    async def execute_single(
        self, rank: int, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> T:
        """Run ``fn`` on one rank."""
        if not 0 <= rank < len(self.workers):
            from ._errors import ConfigurationError

            raise ConfigurationError(f"rank must be in 0..{len(self.workers) - 1}, got {rank!r}")
        ref = self.workers[rank].actor.execute.remote(fn, args, kwargs)
        result: list[T] = await self._first_error([ref], [rank])
        return result[0]

    async def call_each(self, method: str, args_per_rank: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Call actor ``method`` on every worker with its own arguments; results in rank order."""
        refs = [
            getattr(w.actor, method).remote(*args)
            for w, args in zip(self.workers, args_per_rank, strict=True)
        ]
        return await self._first_error(refs, range(len(refs)))

    async def run_backend_hook(self, hook: str) -> None:
        """Run a backend hook; a failure becomes a BackendError naming backend, hook and rank."""
        if self.backend is None:
            return
        name = getattr(self.backend, "name", type(self.backend).__name__)
        try:
            await getattr(self.backend, hook)(self)
        except WorkerError as exc:
            detail = str(exc.__cause__ or exc).splitlines()[0] if str(exc.__cause__ or exc) else ""
            raise BackendError(name, hook, exc.rank, detail) from exc
        except AsyncExecError:
            raise
        except Exception as exc:
            raise BackendError(name, hook, None, f"{type(exc).__name__}: {exc}") from exc

    async def find_dead(self, timeout_s: float = 2.0) -> WorkerError | None:
        """Probe every worker at once; return the error of the first one found dead, if any.

        A rank's error can be the echo of another's death (a collective fails with "connection
        reset by peer" before Ray reports the dead peer); the executor asks this before it
        blames the user's function."""

        async def probe(worker: WorkerInfo) -> WorkerError | None:
            try:
                with anyio.move_on_after(timeout_s):
                    await worker.actor.ping.remote()
            except RayActorError as exc:
                error = await self.classify(worker.rank, exc)
                return error if isinstance(error, WorkerError) else None
            return None

        found = await asyncio.gather(*(probe(w) for w in self.workers))
        return next((f for f in found if f is not None), None)

    async def replace_rank(self, rank: int) -> bool:
        """Replace one failed rank with a fresh process in its bundle, keeping the others.

        The survivors' functions are stopped first (bounded by ``stop_timeout_s``); when one does
        not stop (stuck in a collective, say), or the new process lands on another node, nothing
        is kept and False is returned: the caller then replaces the whole group.
        """
        if self._closed or self.backend is not None or not self.placement.owned:
            return False
        failed = self.workers[rank]
        with contextlib.suppress(Exception):
            ray.kill(failed.actor, no_restart=True)
        survivors = [w for w in self.workers if w.rank != rank]
        timeout = self.config.stop_timeout_s
        stopped = False
        with anyio.move_on_after(timeout + 1):
            try:
                results = await asyncio.gather(
                    *(_as_coro(w.actor.stop_run.remote(timeout)) for w in survivors)
                )
                stopped = all(results)
            except Exception:
                stopped = False
        if not stopped:
            return False
        actor = WorkerActor.options(
            scheduling_strategy=self.placement.strategy(failed.bundle),
            **_actor_options(self.config),
        ).remote()
        try:
            with anyio.fail_after(self.config.start_timeout_s):
                meta: WorkerMetadata = await actor.describe.remote()
                if meta.node_id != failed.metadata.node_id:
                    raise RuntimeError("the replacement landed on another node")
                metas = [meta if w.rank == rank else w.metadata for w in self.workers]
                env = _device_envs(metas, self.config)[rank]
                context = replace(
                    failed.context, pid=meta.pid, accelerator_ids=meta.accelerator_ids
                )
                await actor.setup.remote(
                    env, context, self.config.init_hook, _driver_data_context()
                )
        except BaseException:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
            raise
        self.workers[rank] = WorkerInfo(actor, meta, context, failed.bundle)
        self._log.info("rank_replaced", rank=rank, pid=meta.pid)
        return True

    # Health -----------------------------------------------------------------------------------

    async def watch(self, fail: FailureSink) -> None:
        """Report the first failure of any worker to ``fail``; runs until cancelled.

        Death is noticed at once: each worker holds a call (``wait_closed``) that fails the moment
        its process dies or its node is lost. Hangs are noticed by health checks: a worker whose
        actor does not answer within ``health_check_timeout_s`` is declared hung.
        """
        async with anyio.create_task_group() as tg:
            for worker in self.workers:
                tg.start_soon(self._watch_death, worker, fail)
            if self.config.health_check_interval_s is not None:
                tg.start_soon(self._health_loop, fail)

    async def _watch_death(self, worker: WorkerInfo, fail: FailureSink) -> None:
        try:
            await worker.actor.wait_closed.remote()
        except Exception as exc:
            if not self._closed:
                fail(await self.classify(worker.rank, exc))

    async def _health_loop(self, fail: FailureSink) -> None:
        interval = self.config.health_check_interval_s
        assert interval is not None
        timeout = self.config.health_check_timeout_s
        while True:
            await anyio.sleep(interval)
            async with anyio.create_task_group() as tg:
                for worker in self.workers:
                    tg.start_soon(self._ping, worker, timeout, fail)

    async def _ping(self, worker: WorkerInfo, timeout: float, fail: FailureSink) -> None:
        try:
            with anyio.move_on_after(timeout):
                await worker.actor.ping.remote()
                return
        except Exception as exc:
            fail(await self.classify(worker.rank, exc))
            return
        fail(
            self.worker_error(
                WorkerHungError, worker.rank, f"no answer to a health check within {timeout:g} s"
            )
        )

    # Shutdown ---------------------------------------------------------------------------------

    async def close(self, *, force: bool = False) -> None:
        """Stop the group: backend ``on_shutdown``, graceful exit with a patience bound, then kill,
        then remove the placement group. ``force`` skips the graceful part (used after a failure:
        survivors may be stuck in a collective). Shielded, bounded, idempotent."""
        if self._closed:
            return
        self._closed = True
        actors = [w.actor for w in self.workers]
        with anyio.CancelScope(shield=True):
            t0 = time.perf_counter()
            try:
                if not force:
                    await self._close_gracefully(actors)
            finally:
                # Whatever happened above, nothing of the group may be left behind.
                await _kill(actors, self.placement, timeout_s=self.config.shutdown_timeout_s)
            self._log.info("group_closed", force=force, seconds=round(time.perf_counter() - t0, 3))

    async def _close_gracefully(self, actors: list[ActorHandle]) -> None:
        with anyio.move_on_after(self.config.shutdown_timeout_s):
            try:
                await self.run_backend_hook("on_shutdown")
            except Exception as exc:
                self._log.warning("backend_shutdown_failed", error=str(exc))
            for actor in actors:
                actor.close.remote()
            terminating = [a.__ray_terminate__.remote() for a in actors]
            with anyio.move_on_after(self.config.graceful_patience_s):
                await asyncio.gather(*map(_as_coro, terminating), return_exceptions=True)


async def _as_coro(ref: Any) -> Any:
    return await ref


async def _gather(refs: Sequence[Any], what: str) -> list[Any]:
    """Await all refs; raise the first error (the group is torn down by the caller)."""
    return list(await asyncio.gather(*map(_as_coro, refs)))


async def _kill(actors: Sequence[ActorHandle], placement: Placement, *, timeout_s: float) -> None:
    """Kill the actors, remove the placement group, and wait (bounded) until the actors are dead."""
    for actor in actors:
        with contextlib.suppress(Exception):  # already gone
            ray.kill(actor, no_restart=True)
    placement.remove()
    with anyio.move_on_after(timeout_s):
        await asyncio.gather(*(_wait_dead(a) for a in actors))


async def _wait_dead(actor: ActorHandle) -> None:
    while True:
        try:
            await actor.ping.remote()
        except RayActorError:
            return
        except Exception:
            return
        await anyio.sleep(0.05)
