"""Starting a worker group: placement, workers, ranks, devices, set-up, backend.

Start-up awaits everything (no ``ray.get``), sends every request that does not depend on another
before awaiting any (workers are created while their placement is still being placed; all workers
are described, set up and given their devices concurrently) and is bounded by one deadline. What
is requested is known before anything can cancel it, so that a failed or cancelled start-up leaves
nothing behind.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

import anyio

from ..._errors import PlacementTimeoutError, short_node
from ..._wire._protocol import WorkerContext, WorkerMetadata
from ...backends._base import Backend
from .._config import ExecutorConfig
from .._events import PhaseEnded
from .._observe import Observer
from ..cluster import Cluster, Handle, Placement, Spawned, awaited, startup_error
from ._group import WorkerGroup, device_envs
from ._members import Standby, WorkerInfo
from ._ranks import assign_ranks, order_workers
from ._roles import make_roles

__all__ = ["start_group", "worker_contexts"]

#: A member of a group being formed: its handle, description, bundle and pending death call.
Member = tuple[Handle, WorkerMetadata, int | None, Any]


async def _request(
    cluster: Cluster, config: ExecutorConfig, parent: Any, reservation: Any, log: Any
) -> tuple[Placement | None, list[Spawned]]:
    """Reserve the bundles and create the workers, each asked to describe itself (see
    ``Cluster.place`` and ``Cluster.spawn``); the workers are created while the placement is
    still being placed. Await it shielded: what it made is returned."""
    if reservation is not None:
        placement = reservation.placement(config.bundles)
    else:
        placement = await cluster.place(config.bundles, config.placement_strategy, parent, log)
    bundles = list(range(config.num_workers + config.spares))
    try:
        return placement, await cluster.spawn(config, placement, bundles)
    except BaseException:
        if reservation is None:
            await cluster.release(placement)
        raise


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


async def _describe_in_parent(
    cluster: Cluster, described: list[Any], config: ExecutorConfig
) -> list[Any]:
    """Await the descriptions of workers in a placement that is not the executor's own (a
    parent's, or a reservation's): it is ready from the start, and whether its free bundles hold
    the workers shows only when they are placed, under the placement deadline."""
    with anyio.move_on_after(config.placement_timeout_s):
        return await awaited(described)
    available = await cluster.available()
    raise PlacementTimeoutError(config.bundles, available, config.placement_timeout_s, parent=True)


async def start_group(
    cluster: Cluster,
    config: ExecutorConfig,
    backend: Backend | None,
    *,
    attempt: int,
    log: Any,
    pool: Any = None,
    reservation: Any = None,
    restore_from: Any = None,
    observer: Observer | None = None,
) -> WorkerGroup:
    """Start a group (in its own placement, or on ``reservation``, a
    :class:`~._reservation.Reservation`; or lease it from ``pool``, a
    :class:`~._pool.WorkerPool`) and return it ready to run.

    Raises:
        PlacementInfeasibleError: the workers can never fit and the cluster cannot grow.
        PlacementTimeoutError: the placement was not ready in time.
        StartupTimeoutError: the rest of start-up overran ``start_timeout_s``.
        StartupError: a worker died or the init hook failed during start-up.
        BackendError: the backend's ``on_start`` failed.
        ExecutorStateError: the pool is closed.
    """
    seen = observer if observer is not None else Observer()
    if pool is not None:
        return await _lease_group(
            cluster,
            config,
            backend,
            pool,
            attempt=attempt,
            log=log,
            restore_from=restore_from,
            observer=seen,
        )
    t0 = time.perf_counter()
    parent = await cluster.parent()  # a thread-local of the cluster's: read on this thread
    # bounded by the seam: placing and spawning are requests (see Cluster's bounds)
    with anyio.CancelScope(shield=True):  # what is requested must be known to be cleaned up
        placement, spawned = await _request(cluster, config, parent, reservation, log)
    handles = [s.handle for s in spawned]
    described = [s.described for s in spawned]
    group: WorkerGroup | None = None
    phase = ["waiting for the placement group"]
    try:
        await cluster.wait_placed(placement, config.placement_timeout_s)
        log.debug("placement_ready", seconds=_phase(seen, "placement", t0))
        own = placement is None or placement.owned
        if not own:  # placed only as the workers come up: the placement deadline
            metas = await _describe_in_parent(cluster, described, config)
        # One deadline from here on: the processes (one that never comes up included), their
        # set-up and the backend.
        with anyio.fail_after(config.start_timeout_s):
            phase[0] = "starting the worker processes"
            if own:
                metas = await awaited(described)
            log.debug("workers_ready", seconds=_phase(seen, "workers", t0))
            members: list[Member] = [
                (h, m, i, None) for i, (h, m) in enumerate(zip(handles, metas, strict=True))
            ]
            group = await _form(cluster, config, backend, placement, members, attempt, log, None)
            group.restore_from = restore_from
            await _set_up(group, phase, t0, seen)
        log.info("group_started", seconds=_phase(seen, "ready", t0), attempt=attempt)
        return group
    except BaseException as exc:
        # The placement goes too, when it is the executor's own (see ``Placement.remove``).
        await _undo(group, lambda: cluster.kill(handles, placement))
        _raise_mapped(exc, phase[0], config.start_timeout_s)


async def _lease_group(
    cluster: Cluster,
    config: ExecutorConfig,
    backend: Backend | None,
    pool: Any,
    *,
    attempt: int,
    log: Any,
    restore_from: Any,
    observer: Observer,
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
            members: list[Member] = [(w.handle, w.metadata, w.bundle, w.death) for w in leased]
            if pool.reservation is not None:  # rank order is the reservation's bundle order
                members.sort(key=lambda m: (m[2] is None, m[2] or 0))
            group = await _form(cluster, config, backend, None, members, attempt, log, pool)
            group.restore_from = restore_from
            await _set_up(group, phase, t0, observer)
        log.info("group_leased", seconds=_phase(observer, "leased", t0), attempt=attempt)
        return group
    except BaseException as exc:
        await _undo(group, lambda: pool.give_back([(w.handle, True) for w in leased]))
        _raise_mapped(exc, phase[0], config.start_timeout_s)


def _phase(observer: Observer, phase: str, t0: float) -> float:
    """Seconds since ``t0`` (rounded, for the log line), emitted as start-up ``phase``'s end
    (the executor's metrics and timeline take it)."""
    seconds = time.perf_counter() - t0
    observer.emit(PhaseEnded(phase, t0, seconds))
    return round(seconds, 3)


async def _undo(group: WorkerGroup | None, release: Callable[[], Awaitable[Any]]) -> None:
    """After a failed or cancelled start-up: close the group when it was formed, else
    ``release`` what was requested (shielded: nothing may be left behind)."""
    # bounded: close() has deadlines of its own; a release is the seam's request
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


async def _form(
    cluster: Cluster,
    config: ExecutorConfig,
    backend: Backend | None,
    placement: Placement | None,
    members: list[Member],
    attempt: int,
    log: Any,
    pool: Any,
) -> WorkerGroup:
    """The group of the first ``num_workers`` members, in rank order (the driver's node first;
    on a reservation, the order of its bundles); the rest are its standby spares."""
    n = config.num_workers
    spares = [Standby(*member) for member in members[n:]]
    members = members[:n]
    metas = [m for _, m, _, _ in members]
    if (placement is not None and placement.slots is not None) or (
        pool is not None and pool.reservation is not None
    ):
        order = list(range(n))
    else:
        order = order_workers(
            [m.node_id for m in metas],
            [m.accelerator_ids for m in metas],
            await cluster.driver_node(),
        )
    metas = [metas[i] for i in order]
    workers = [
        WorkerInfo(members[i][0], m, c, members[i][2], members[i][3])
        for i, m, c in zip(order, metas, worker_contexts(config, metas), strict=True)
    ]
    return WorkerGroup(
        config, backend, cluster, placement, workers, attempt, log, pool=pool, spares=spares
    )


async def _set_up(group: WorkerGroup, phase: list[str], t0: float, observer: Observer) -> None:
    """Devices, context, data context and init hook on every worker, then the backend (the
    ``set_up`` phase ends between the two)."""
    phase[0] = "setting the workers up (devices, data context, init hook)"
    metas = [w.metadata for w in group.workers]
    await group.setup(device_envs(metas, group.config), group.workers)
    group.log.info(
        "worker_table",
        workers=[_row(w) for w in group.workers],
        seconds=_phase(observer, "set_up", t0),
    )
    if group.backend is not None:
        phase[0] = f"running {group.backend.name}.on_start"
        await group.run_backend_hook("on_start")
    if group.config.roles:
        phase[0] = "making the instances of the roles"
        await make_roles(group, group.workers)


def _row(worker: WorkerInfo) -> dict[str, Any]:
    return {
        "rank": worker.rank,
        "local_rank": worker.context.local_rank,
        "node_rank": worker.context.node_rank,
        "node_id": short_node(worker.metadata.node_id),
        "pid": worker.metadata.pid,
        "devices": dict(worker.metadata.accelerator_ids),
    }
