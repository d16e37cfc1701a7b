"""The executor's one live group: started when first needed, replaced after a failure, closed.

Runs and ``execute()`` calls ask the slot for the group; the slot starts one when there is none
(one at a time, under a lock) and counts starts and restarts. It is what a run's driver task
sees of the executor, so the two never import each other.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

import anyio
import anyio.abc

from ..._errors import (
    AsyncExecError,
    ExecutorStateError,
    WorkerCrashedError,
    WorkerHungError,
    describe,
)
from ..._timeline._timeline import Timeline
from ...backends._base import Backend
from .._config import ExecutorConfig
from .._observe import Observer
from ..cluster import Cluster
from ._elastic import Sizer
from ._group import WorkerGroup
from ._members import Standby
from ._spares import refill_spare, renew_rank, replace_rank, take_spare
from ._startup import start_group

__all__ = ["GroupSlot"]


class GroupSlot:
    """Holds at most one live :class:`WorkerGroup` of an executor.

    ``starting`` is None, or ``"starting"`` / ``"restarting"`` while a group starts.
    """

    #: The executor's timeline, when it keeps one (the weight channel records on it; the
    #: groups' events reach it through the observer).
    timeline: Timeline | None = None
    #: The executor's observer (its groups emit to it; until set, one without sinks).
    observer: Observer = Observer()

    def __init__(
        self,
        config: ExecutorConfig,
        backend: Backend | None,
        cluster: Cluster,
        log: Any,
        pool: Any = None,
        reservation: Any = None,
    ) -> None:
        self.config = config
        self.backend = backend
        self.cluster = cluster
        self.log = log
        self.pool = pool  # a WorkerPool the groups are leased from, or None
        self.reservation = reservation  # a Reservation the groups are placed on, or None
        #: Where background work (refilling a spare) runs: the executor's task group.
        self.tg: anyio.abc.TaskGroup | None = None
        self.group: WorkerGroup | None = None
        self.starts = 0
        self.restarts = 0
        #: Elastic executors: groups that started at another size than the one before.
        self.resizes = 0
        self.sizer = Sizer(config, cluster, log) if config.elastic else None
        self._size: int | None = None  # the size of the last group started
        self._planned = False  # the next start is a planned resize, not a restart
        self.closing = False
        self.starting: str | None = None
        #: Called with a group before a run's functions start on it (a channel's joining ranks
        #: get the latest version); the executor's list, shared by its slots.
        self.joiners: list[Callable[[WorkerGroup], Awaitable[None]]] = []
        #: The checkpoint the roles' instances are restored from when a group (or a member of
        #: it) is started after a failure: the run's latest (the run keeps it current).
        self.restore_from: Any = None
        self._lock = anyio.Lock()
        self._refills: list[tuple[WorkerGroup, int | None]] = []
        #: The end of a renewal of a rank under way (a worker that a call found dead, put in
        #: its place outside a run: the executor's), or None.
        self.renewing: Callable[[], anyio.Event | None] = lambda: None

    def start_refills(self) -> None:
        """Start the spares owed to the live group (one per spare that took a rank's place),
        in the background. Called when an attempt's functions have started, and before a
        group is used for anything else."""
        refills, self._refills = self._refills, []
        for group, bundle in refills:
            if group is self.group and not group.closed:
                self.refill(group, bundle)

    def refill(self, group: WorkerGroup, bundle: int | None) -> None:
        """Start a spare in ``bundle`` again, in the background (one took a rank's place)."""
        if self.tg is not None:
            self.tg.start_soon(refill_spare, group, bundle)

    async def renew(self, group: WorkerGroup, rank: int) -> Standby | None:
        """:func:`renew_rank`, and a spare that took the rank's place is started again at once:
        the other ranks run on, so nothing waits for the CPU it takes."""
        spares = len(group.spares)
        freed = await renew_rank(group, rank)
        if freed is not None and len(group.spares) < spares:
            self.refill(group, freed.bundle)
        return freed

    async def acquire(self, attempt: int | None = None) -> WorkerGroup:
        """The live group, started first when there is none. ``attempt`` (a run's attempt
        number) is recorded on the group, and counts a restart when it starts one after the
        first attempt; a run's attempt waits for a rank's renewal under way first.

        Raises:
            ExecutorStateError: the executor is closing.
            StartupError: the group could not be started.
        """
        # A run's attempt starts once no rank is being renewed (a worker that a call found dead
        # just before the run): the attempt's recovery and the renewal would both put a worker
        # in the rank's place, and one of them would be left running, in no group. (Not under
        # the lock: a renewal may make calls that acquire the group.)
        while attempt is not None and (renewal := self.renewing()) is not None:
            await renewal.wait()  # (bounded by the renewal's start deadline)
        async with self._lock:
            if self.group is None or self.group.closed:
                if self.closing:
                    raise ExecutorStateError("the executor is closed")
                self.starting = "starting" if self.starts == 0 else "restarting"
                planned, self._planned = self._planned, False
                if self.starts and attempt is not None and attempt > 1 and not planned:
                    self.restarts += 1
                try:
                    config = self.config
                    if self.sizer is not None:
                        config = replace(config, num_workers=await self.sizer.size())
                    self.group = await start_group(
                        self.cluster,
                        config,
                        self.backend,
                        attempt=attempt or 1,
                        log=self.log,
                        pool=self.pool,
                        reservation=self.reservation,
                        restore_from=self.restore_from,
                        observer=self.observer,  # its start-up phases
                    )
                finally:
                    self.starting = None
                self.starts += 1
                self.group.observer = self.observer
                self._sized(len(self.group.workers), attempt, planned)
            if attempt is not None:
                self.group.attempt = attempt
            else:
                self.start_refills()  # not for a run's attempt: the attempt starts them
            return self.group

    def _sized(self, size: int, attempt: int | None, planned: bool) -> None:
        """Count and log a group that started at another size than the one before."""
        before, self._size = self._size, size
        if before is not None and size != before:
            self.resizes += 1
            log = self.log.info if planned else self.log.warning
            log("resized", from_workers=before, to_workers=size, planned=planned, attempt=attempt)

    async def resize(self, *, force: bool) -> None:
        """Discard the group for a planned resize (its functions have stopped, or ``force``):
        the next start decides the new size and is not counted as a restart."""
        self._planned = True
        await self.discard(force=force)

    async def recover(self, failure: AsyncExecError, *, reuse_survivors: bool) -> None:
        """After a failed attempt: put a standby spare in the failed rank's place (a new spare
        is then started in the background), or replace only that rank with a new process when
        asked; after a lost node, an elastic group goes on with the workers that are left; else
        discard the whole group (the next attempt starts or leases a fresh one)."""
        group = self.group
        if group is not None:
            group.restore_from = self.restore_from
        if group is not None and self.sizer is not None:
            try:
                if await self.sizer.keep_survivors(group, failure):
                    self.restarts += 1
                    self._sized(len(group.workers), group.attempt + 1, planned=False)
                    return
            except Exception as exc:
                self.log.warning("group_shrink_failed", error=describe(exc))
        if group is not None and isinstance(failure, WorkerCrashedError | WorkerHungError):
            try:
                freed = await take_spare(group, failure.rank) if group.spares else None
                if freed is not None:
                    # Started once the next attempt runs (see start_refills): a process
                    # starting now would compete for the CPU with the restart itself.
                    self._refills.append((group, freed.bundle))
                    self.restarts += 1
                    return
                if reuse_survivors and await replace_rank(group, failure.rank):
                    self.restarts += 1
                    return
            except Exception as exc:
                self.log.warning("rank_replace_failed", error=describe(exc))
        await self.discard(force=True)

    async def discard(self, *, force: bool) -> None:
        """Close the live group, if any (shielded, bounded). An elastic executor first measures
        what the cluster has free with the group's bundles counted as free (see ``_elastic``)."""
        group, self.group = self.group, None
        if group is not None:
            if self.sizer is not None and not self.closing and not group.closed:
                # bounded by the seam's look-up timeout (free_nodes)
                with anyio.CancelScope(shield=True):
                    await self.sizer.remember(group)
            await group.close(force=force)

    async def drop_if(self, group: WorkerGroup) -> None:
        """Discard ``group`` if it is still the live one (a worker of it was found dead)."""
        if self.group is group:
            # bounded: remember() by the seam's look-up, close() by its own deadlines
            with anyio.CancelScope(shield=True):
                await self.discard(force=True)
