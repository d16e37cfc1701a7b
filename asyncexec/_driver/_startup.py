"""Starting a worker group: placement, actors, ranks, devices, set-up, backend.

Start-up awaits everything (no ``ray.get``), sends every request that does not depend on another
before awaiting any (actors are created while the placement group is still being placed; all
workers are described, set up and given their devices concurrently) and is bounded by one
deadline. What is requested is known before anything can cancel it, so that a failed or cancelled
start-up leaves nothing behind.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import anyio
import ray
from ray.actor import ActorHandle

from .._config import ExecutorConfig
from .._errors import ConfigurationError, PlacementTimeoutError, describe, short_node
from .._protocol import WorkerContext, WorkerMetadata
from .._ranks import assign_ranks, order_workers
from .._worker._actor import WorkerActor
from ..backends._base import Backend
from ._boundary import startup_error
from ._group import CREATING, WorkerGroup, actor_options, device_envs, kill_all
from ._local import LocalWorker
from ._metrics import metrics
from ._placement import Placement, create_placement, current_parent, wait_placement_ready
from ._workers import Standby, WorkerInfo

__all__ = ["start_group", "start_local_group", "worker_contexts"]


def _request(
    config: ExecutorConfig, parent: Any, reservation: Any, log: Any
) -> tuple[Placement, list[ActorHandle], list[Any]]:
    """Create the placement group and the actors, and ask each actor to describe itself. In a
    thread: the first actor of a class in a process exports the class to the cluster
    synchronously (about 0.1 s), and so does the first readiness check of a placement group;
    the first call on an actor that is still being created waits for its handle (measured: up to
    50 ms on the loop while several executors start)."""
    if reservation is not None:
        placement = reservation.placement(config.bundles)
    else:
        placement = create_placement(config.bundles, config.placement_strategy, parent, log)
    options = actor_options(config)
    actors: list[ActorHandle] = []
    try:
        with CREATING:
            for i in range(config.num_workers + config.spares):
                strategy = placement.strategy(i)
                actors.append(
                    WorkerActor.options(scheduling_strategy=strategy, **options).remote()
                )
    except Exception as exc:
        # Ray refused the options (a resource amount below its precision, a fractional amount of
        # a whole-unit accelerator, a runtime_env it cannot read).
        for actor in actors:
            ray.kill(actor, no_restart=True)
        placement.remove()
        raise ConfigurationError(f"Ray refused the worker options: {describe(exc)}") from exc
    # Describing the actors is requested now: they answer as soon as the group is placed.
    return placement, actors, [a.describe.remote() for a in actors]


def worker_contexts(config: ExecutorConfig, metas: list[WorkerMetadata]) -> list[WorkerContext]:
    """Each worker's context, for workers already in rank order."""
    ranks = assign_ranks([m.node_id for m in metas])
    return [
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


async def _describe_in_parent(described: list[Any], config: ExecutorConfig) -> list[WorkerMetadata]:
    """Await the descriptions of workers in a placement group that is not the executor's own (a
    parent's, or a reservation's): it is ready from the start, and whether its free bundles hold
    the workers shows only when they are placed, under the placement deadline."""
    with anyio.move_on_after(config.placement_timeout_s):
        return list(await _all(described))
    available = await anyio.to_thread.run_sync(ray.available_resources, abandon_on_cancel=True)
    raise PlacementTimeoutError(config.bundles, available, config.placement_timeout_s, parent=True)


async def _all(refs: list[Any]) -> list[Any]:
    results: list[Any] = [None] * len(refs)

    async def one(i: int) -> None:
        results[i] = await refs[i]

    async with anyio.create_task_group() as tg:
        for i in range(len(refs)):
            tg.start_soon(one, i)
    return results


async def start_group(
    config: ExecutorConfig,
    backend: Backend | None,
    *,
    attempt: int,
    log: Any,
    pool: Any = None,
    reservation: Any = None,
) -> WorkerGroup:
    """Start a group (in its own placement group, or on ``reservation``, a
    :class:`~._reservation.Reservation`; or lease it from ``pool``, a
    :class:`~._pool.WorkerPool`) and return it ready to run.

    Raises:
        PlacementInfeasibleError: the workers can never fit and the cluster cannot grow.
        PlacementTimeoutError: the placement group was not ready in time.
        StartupTimeoutError: the rest of start-up overran ``start_timeout_s``.
        StartupError: a worker died or the init hook failed during start-up.
        BackendError: the backend's ``on_start`` failed.
        ExecutorStateError: the pool is closed.
    """
    if config.local:
        return await start_local_group(config, attempt=attempt, log=log)
    if pool is not None:
        return await _lease_group(config, backend, pool, attempt=attempt, log=log)
    t0 = time.perf_counter()
    parent = current_parent()  # Ray's task context is thread-local: read it here
    with anyio.CancelScope(shield=True):  # what is requested must be known to be cleaned up
        placement, actors, described = await anyio.to_thread.run_sync(
            _request, config, parent, reservation, log
        )
    group: WorkerGroup | None = None
    phase = ["waiting for the placement group"]
    try:
        await wait_placement_ready(placement, config.placement_timeout_s)
        log.debug("placement_ready", seconds=_phase(config, "placement", t0))
        if not placement.owned:  # placed only as the workers come up: the placement deadline
            metas = await _describe_in_parent(described, config)
        # One deadline from here on: the processes (one that never comes up included), their
        # set-up and the backend.
        with anyio.fail_after(config.start_timeout_s):
            phase[0] = "starting the worker processes"
            if placement.owned:
                metas = list(await _all(described))
            log.debug("workers_ready", seconds=_phase(config, "workers", t0))
            members: list[tuple[ActorHandle, WorkerMetadata, int | None, Any]] = [
                (a, m, i, None) for i, (a, m) in enumerate(zip(actors, metas, strict=True))
            ]
            group = _form(config, backend, placement, members, attempt, log, None)
            await _set_up(group, phase, t0)
        log.info("group_started", seconds=_phase(config, "ready", t0), attempt=attempt)
        return group
    except BaseException as exc:
        await _undo(group, lambda: kill_all(actors, placement))
        _raise_mapped(exc, phase[0], config.start_timeout_s)


async def start_local_group(config: ExecutorConfig, *, attempt: int, log: Any) -> WorkerGroup:
    """A local executor's group: ``num_workers`` workers in threads of this process (see
    ``_local``), in creation order, set up as actors are (context, init hook).

    Raises:
        StartupTimeoutError: set-up overran ``start_timeout_s``.
        StartupError: the init hook failed.
    """
    t0 = time.perf_counter()
    workers = [LocalWorker(config.name) for _ in range(config.num_workers)]
    phase = ["starting the local workers"]
    group: WorkerGroup | None = None
    try:
        with anyio.fail_after(config.start_timeout_s):
            metas = list(await _all([w.describe.remote() for w in workers]))
            members = [
                WorkerInfo(w, m, c)
                for w, m, c in zip(workers, metas, worker_contexts(config, metas), strict=True)
            ]
            group = WorkerGroup(config, None, None, members, attempt, log)
            phase[0] = "setting the workers up (init hook)"
            await group.setup([{} for _ in members], members)  # no devices to share
            log.info("worker_table", workers=[_row(w) for w in members])
        log.info("group_started", seconds=_phase(config, "ready", t0), attempt=attempt, local=True)
        return group
    except BaseException as exc:
        await _undo(group, lambda: kill_all(workers, None))
        _raise_mapped(exc, phase[0], config.start_timeout_s)


async def _lease_group(
    config: ExecutorConfig, backend: Backend | None, pool: Any, *, attempt: int, log: Any
) -> WorkerGroup:
    """A group of warm workers leased from ``pool``: no process starts (unless the pool is
    short); ranks, devices, init hook and backend are set up as for fresh workers."""
    t0 = time.perf_counter()
    phase = ["leasing workers from the pool"]
    group: WorkerGroup | None = None
    leased: list[Any] = []
    try:
        leased = await pool.lease(config.num_workers + config.spares)
        with anyio.fail_after(config.start_timeout_s):
            members = [(w.actor, w.metadata, w.bundle, w.death) for w in leased]
            if pool.reservation is not None:  # rank order is the reservation's bundle order
                members.sort(key=lambda m: (m[2] is None, m[2] or 0))
            group = _form(config, backend, None, members, attempt, log, pool)
            await _set_up(group, phase, t0)
        log.info("group_leased", seconds=_phase(config, "leased", t0), attempt=attempt)
        return group
    except BaseException as exc:
        await _undo(group, lambda: pool.give_back([(w.actor, True) for w in leased]))
        _raise_mapped(exc, phase[0], config.start_timeout_s)


def _phase(config: ExecutorConfig, phase: str, t0: float) -> float:
    """Seconds since ``t0``, observed as start-up ``phase`` when metrics are on."""
    seconds = time.perf_counter() - t0
    meters = metrics()
    if meters is not None:
        meters.startup.labels(config.name, phase).observe(seconds)
    return round(seconds, 3)


async def _undo(group: WorkerGroup | None, release: Callable[[], Awaitable[Any]]) -> None:
    """After a failed or cancelled start-up: close the group when it was formed, else
    ``release`` what was requested (shielded: nothing may be left behind)."""
    with anyio.CancelScope(shield=True):
        if group is not None:
            await group.close(force=True)
        else:
            await release()


def _raise_mapped(exc: BaseException, phase: str, timeout_s: float) -> NoReturn:
    """Raise what a failed start-up raises (see :func:`startup_error`)."""
    mapped = startup_error(exc, phase, timeout_s)
    if mapped is exc:
        raise exc
    raise mapped from mapped.__cause__


def _form(
    config: ExecutorConfig,
    backend: Backend | None,
    placement: Placement | None,
    members: list[tuple[ActorHandle, WorkerMetadata, int | None, Any]],
    attempt: int,
    log: Any,
    pool: Any,
) -> WorkerGroup:
    """The group of the first ``num_workers`` members, in rank order (the driver's node
    first; on a reservation, the order of its bundles); the rest are its standby spares."""
    n = config.num_workers
    spares = [Standby(*member) for member in members[n:]]
    members = members[:n]
    metas = [m for _, m, _, _ in members]
    if (placement is not None and placement.slots is not None) or (
        pool is not None and pool.reservation is not None
    ):
        order = list(range(n))
    else:
        driver_node = ray.get_runtime_context().get_node_id()
        order = order_workers(
            [m.node_id for m in metas], [m.accelerator_ids for m in metas], driver_node
        )
    metas = [metas[i] for i in order]
    workers = [
        WorkerInfo(members[i][0], m, c, members[i][2], members[i][3])
        for i, m, c in zip(order, metas, worker_contexts(config, metas), strict=True)
    ]
    return WorkerGroup(config, backend, placement, workers, attempt, log, pool=pool, spares=spares)


async def _set_up(group: WorkerGroup, phase: list[str], t0: float) -> None:
    """Devices, context, data context and init hook on every worker, then the backend (the
    ``set_up`` phase ends between the two)."""
    phase[0] = "setting the workers up (devices, data context, init hook)"
    metas = [w.metadata for w in group.workers]
    await group.setup(device_envs(metas, group.config), group.workers)
    group.log.info(
        "worker_table",
        workers=[_row(w) for w in group.workers],
        seconds=_phase(group.config, "set_up", t0),
    )
    if group.backend is not None:
        phase[0] = f"running {group.backend.name}.on_start"
        await group.run_backend_hook("on_start")


def _row(worker: WorkerInfo) -> dict[str, Any]:
    return {
        "rank": worker.rank,
        "local_rank": worker.context.local_rank,
        "node_rank": worker.context.node_rank,
        "node_id": short_node(worker.metadata.node_id),
        "pid": worker.metadata.pid,
        "devices": dict(worker.metadata.accelerator_ids),
    }
