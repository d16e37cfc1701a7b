"""How a live group's members change without a new group: a standby spare takes a failed rank's
place, a failed rank is replaced alone by a fresh process in its bundle, a rank of an independent
run is renewed while the others run, a smaller group goes on after a lost node, and a spare is
started again in the background.

Each keeps the group's invariants: ``workers[r]`` is rank r, ``deaths[r]`` its pending death call,
each worker set up (devices, context, init hook) for its place; a worker let go is killed (or
given back to its pool); a worker started and not taken in is killed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import anyio

from ..._errors import describe
from ..._wire._protocol import WorkerContext
from .._config import ExecutorConfig
from .._taskgroups import task_group
from ..cluster import death_of
from ._group import WorkerGroup, device_envs
from ._members import Standby, WorkerInfo
from ._roles import make_roles
from ._startup import worker_contexts

__all__ = ["refill_spare", "renew_rank", "replace_rank", "shrink", "take_spare"]


def _spare_for(group: WorkerGroup, rank: int) -> tuple[Standby, dict[str, str]] | None:
    """A spare that can take ``rank``'s place, and its device environment: one on the rank's
    node whose devices leave the survivors' device environment as it is."""
    failed = group.workers[rank]
    before = device_envs([w.metadata for w in group.workers], group.config)
    for spare in group.spares:
        if spare.metadata.node_id != failed.metadata.node_id:
            continue
        metas = [spare.metadata if w.rank == rank else w.metadata for w in group.workers]
        after = device_envs(metas, group.config)
        if all(after[i] == before[i] for i in range(len(metas)) if i != rank):
            return spare, after[rank]
    return None


def _seat(group: WorkerGroup, rank: int, fresh: WorkerInfo) -> None:
    """Put ``fresh`` in ``rank``'s place, with its death call."""
    group.workers[rank] = fresh
    handle = fresh.handle
    group.deaths[rank] = fresh.death if fresh.death is not None else death_of(handle)


def _in_place_of(failed: WorkerInfo, spare: Standby) -> WorkerInfo:
    context = replace(
        failed.context, pid=spare.metadata.pid, accelerator_ids=spare.metadata.accelerator_ids
    )
    return WorkerInfo(spare.handle, spare.metadata, context, spare.bundle, spare.death)


def _moved(group: WorkerGroup, rank: int, fresh: WorkerInfo) -> WorkerInfo:
    """``fresh`` with the context of its own node: an independent rank whose node is gone goes
    on where Ray placed its bundle again. Its local rank and node rank are those of the group
    with it there; the other ranks keep the contexts their functions started with."""
    metas = [fresh.metadata if w.rank == rank else w.metadata for w in group.workers]
    moved = worker_contexts(group.config, metas)[rank]
    context = replace(
        fresh.context,
        node_id=moved.node_id,
        node_ip=moved.node_ip,
        node_rank=moved.node_rank,
        local_rank=moved.local_rank,
        local_world_size=moved.local_world_size,
    )
    return replace(fresh, context=context)


async def take_spare(group: WorkerGroup, rank: int) -> Standby | None:
    """Put a standby spare in the place of the failed ``rank`` and keep the other ranks, whose
    functions are stopped first. Returns the failed worker's record (its bundle is free for a new
    spare), or None when no spare fits (none left, none on the rank's node, or one would change
    the survivors' devices), a survivor's function did not stop, or the group closed meanwhile
    (the spare is let go): the caller then replaces the whole group. With a backend, its group
    is formed anew (``on_shutdown``, then ``on_start``) around the new member."""
    found = None if group.closed else _spare_for(group, rank)
    if found is None:
        return None
    spare, env = found
    config = group.config
    failed = group.workers[rank]
    survivors = [w for w in group.workers if w.rank != rank]
    group.spares.remove(spare)
    fresh = _in_place_of(failed, spare)
    stopped = [False]

    async def stop_survivors() -> None:
        stopped[0] = await group.stop_functions(survivors, config.stop_timeout_s)

    # The survivors' functions stop, the spare is set up and the failed worker goes, at once.
    try:
        with anyio.fail_after(config.start_timeout_s + config.stop_timeout_s):
            async with task_group() as tg:
                tg.start_soon(stop_survivors)
                tg.start_soon(group.drop, [failed.handle])
                await group.setup([env], [fresh])
    except BaseException:
        # bounded by the seam: drop() is a kill without patience
        with anyio.CancelScope(shield=True):
            await group.drop([spare.handle])  # set up (or half): not a clean spare
        raise
    if not stopped[0] or group.closed:  # (closed meanwhile: nothing may be left of it)
        await group.drop([spare.handle])
        return None
    _seat(group, rank, fresh)
    with anyio.fail_after(config.start_timeout_s):
        if group.backend is not None:
            await group.run_backend_hook("on_shutdown")
            await group.run_backend_hook("on_start")
        # The new member's instances; every rank's when the backend's group was formed anew.
        await make_roles(group, group.workers if group.backend is not None else [fresh])
    group.log.info("spare_took_rank", rank=rank, pid=spare.metadata.pid)
    return Standby(failed.handle, failed.metadata, failed.bundle)


async def replace_rank(group: WorkerGroup, rank: int) -> bool:
    """Replace one failed rank with a fresh process in its bundle, keeping the others.

    The survivors' functions are stopped first (bounded by ``stop_timeout_s``); when one does not
    stop (stuck in a collective, say), or the new process lands on another node, nothing is kept
    and False is returned: the caller then replaces the whole group.
    """
    failed = group.workers[rank]
    placement = group.placement
    if (
        group.closed
        or group.backend is not None
        or placement is None
        or not placement.owned
        or failed.bundle is None
    ):
        return False
    config = group.config
    await group.cluster.kill([failed.handle])
    survivors = [w for w in group.workers if w.rank != rank]
    if not await group.stop_functions(survivors, config.stop_timeout_s):
        return False
    [(handle, meta)] = await group.cluster.start_workers(
        config, placement, [failed.bundle], config.start_timeout_s
    )
    try:
        with anyio.fail_after(config.start_timeout_s):
            if meta.node_id != failed.metadata.node_id:
                raise RuntimeError("the replacement landed on another node")
            metas = [meta if w.rank == rank else w.metadata for w in group.workers]
            context = replace(failed.context, pid=meta.pid, accelerator_ids=meta.accelerator_ids)
            fresh = WorkerInfo(handle, meta, context, failed.bundle)
            await group.setup([device_envs(metas, config)[rank]], [fresh])
            await make_roles(group, [fresh])
    except BaseException:
        # bounded by the seam: a kill without patience or deaths (see Cluster's bounds)
        with anyio.CancelScope(shield=True):
            await group.cluster.kill([handle])
        raise
    if group.closed:  # it closed while the new process started: nothing may be left of it
        # bounded by the seam: a kill without patience or deaths (see Cluster's bounds)
        with anyio.CancelScope(shield=True):
            await group.cluster.kill([handle])
        return False
    _seat(group, rank, fresh)
    group.log.info("rank_replaced", rank=rank, pid=meta.pid)
    return True


def _own_bundle_of(group: WorkerGroup) -> bool:
    """Whether the group's bundles are its own to start workers in: its placement's, or its
    reservation's slots (not a parent placement group's)."""
    placement = group.placement
    return placement is not None and (placement.owned or placement.slots is not None)


def _own_bundle(group: WorkerGroup, failed: WorkerInfo) -> tuple[bool, int | None]:
    """Whether a fresh worker can be started in ``failed``'s place, and the bundle: its own
    bundle of the group's placement (or of its reservation); anywhere when the group has no
    placement and no pool (its cluster reserves nothing: local mode)."""
    placement = group.placement
    if group.pool is not None:
        return False, None
    if placement is None:
        return True, None
    if _own_bundle_of(group) and failed.bundle is not None:
        return True, failed.bundle
    return False, None


async def renew_rank(group: WorkerGroup, rank: int) -> Standby | None:
    """Independent ranks: put a standby spare on the rank's node, or else (none fits, or the
    node is gone) a fresh process in the rank's bundle, in the failed ``rank``'s place while the
    other ranks' functions keep running. Returns the failed worker's record (a used spare's
    bundle is free for a new one), or None when neither is possible (no fitting spare, and no
    bundle of its own: a pooled group, or a parent placement group).

    Raises:
        AsyncExecError, TimeoutError, RuntimeError: the new process failed to start or landed on
            another node (the caller's restart policy decides what next).
    """
    if group.closed:
        return None
    config = group.config
    failed = group.workers[rank]
    # A spare on a node that is gone (lost, or preempted) went with it. (No await from the
    # choice of a spare to its removal from the list: another rank may be renewed meanwhile.)
    alive = not group.spares or await group.cluster.node_alive(failed.metadata.node_id)
    found = _spare_for(group, rank) if alive else None
    env: dict[str, str] | None = None
    if found is not None:
        spare, env = found
        group.spares.remove(spare)
    else:
        possible, bundle = _own_bundle(group, failed)
        if not possible:
            return None
        await group.drop([failed.handle])  # its bundle's resources, for the new process
        [(handle, meta)] = await group.cluster.start_workers(
            config, group.placement, [bundle], config.start_timeout_s
        )
        spare = Standby(handle, meta, bundle)
    fresh = _in_place_of(failed, spare)
    try:
        with anyio.fail_after(config.start_timeout_s):
            if fresh.metadata.node_id != failed.metadata.node_id:
                if group.backend is not None or await group.cluster.node_alive(
                    failed.metadata.node_id
                ):
                    raise RuntimeError("the replacement landed on another node")
                fresh = _moved(group, rank, fresh)  # its node is gone (lost, or preempted)
            if env is None:
                metas = [fresh.metadata if w.rank == rank else w.metadata for w in group.workers]
                env = device_envs(metas, config)[rank]
            async with task_group() as tg:
                tg.start_soon(group.drop, [failed.handle])
                await group.setup([env], [fresh])
            await make_roles(group, [fresh])
    except BaseException:
        # bounded by the seam: drop() is a kill without patience
        with anyio.CancelScope(shield=True):
            await group.drop([fresh.handle])
        raise
    if group.closed:  # it closed while the new process started: nothing may be left of it
        # bounded by the seam: drop() is a kill without patience
        with anyio.CancelScope(shield=True):
            await group.drop([fresh.handle])
        return None
    _seat(group, rank, fresh)
    group.log.info("rank_renewed", rank=rank, pid=fresh.metadata.pid, spare=found is not None)
    return Standby(failed.handle, failed.metadata, failed.bundle)


async def refill_spare(group: WorkerGroup, bundle: int | None) -> None:
    """Start (or lease) a new spare, in the background after one took a rank's place. A failure
    is logged: the group runs on with one spare less."""
    try:
        if group.pool is not None:
            [leased] = await group.pool.lease(1)
            spare = Standby(leased.handle, leased.metadata, leased.bundle, leased.death)
        elif group.placement is None or (bundle is not None and _own_bundle_of(group)):
            # In its bundle, or anywhere when the cluster reserves nothing (simulated workers).
            [(handle, meta)] = await group.cluster.start_workers(
                group.config,
                group.placement,
                [bundle],
                group.config.start_timeout_s,
                track=group.starting,
            )
            spare = Standby(handle, meta, bundle)
        else:  # no bundle of the group's to start it in (a parent placement group)
            group.log.info("spare_not_refilled", bundle=bundle)
            return
    except Exception as exc:
        group.log.warning("spare_refill_failed", error=describe(exc))
        return
    if group.closed:
        await group.drop([spare.handle], clean=True)
    else:
        group.spares.append(spare)


async def shrink(
    group: WorkerGroup,
    config: ExecutorConfig,
    keep: Sequence[WorkerInfo],
    contexts: Sequence[WorkerContext],
) -> None:
    """Go on with the workers ``keep`` alone (an elastic group whose other workers' node was
    lost), in that order, with their new ``contexts`` and ``config`` (its ``num_workers`` their
    number). Their functions must have stopped. They are set up anew (device environment,
    context, init hook); the others are killed. The placement stays: the cluster places the lost
    bundles again when a node can hold them."""
    fresh = [replace(w, context=c) for w, c in zip(keep, contexts, strict=True)]
    deaths = [group.deaths[w.rank] for w in keep]
    gone = [w.handle for w in group.workers if all(w is not k for k in keep)]
    await group.cluster.kill(gone)
    group.config = config
    # Bounded as a replaced rank's set-up is: shrink runs shielded (a recovery), and the init
    # hook and the roles' instances are the user's code on workers that may not answer.
    with anyio.fail_after(config.start_timeout_s):
        await group.setup(device_envs([w.metadata for w in fresh], config), fresh)
        group.workers, group.deaths = fresh, deaths
        await make_roles(group, fresh)  # for the new world size
    group.log.info("group_shrunk", workers=len(fresh), ranks_lost=len(gone))
