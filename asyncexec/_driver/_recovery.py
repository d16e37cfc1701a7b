"""What the dispatcher does when a call's worker died: say so when the executor replaced the group
meanwhile (a restart); outside a run, put a fresh process in a crashed rank's place, once however
many calls saw it die, in the executor's task group, or drop the group so that the next call
starts a fresh one. The calls that saw the death raise at once, without waiting for the fresh
process (a rollout server's engine takes tens of seconds to start: its router sends their
requests elsewhere meanwhile); a call sent to the rank meanwhile waits for it. A renewed rank
joins what the group receives (a weight channel's latest version, as ranks joining a run get it:
the executor's joiners) before those calls go on; a rollout server's router does the same for its
own servers.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from .._errors import AsyncExecError, ExecutorStateError, WorkerCrashedError, describe
from ._events import RankRenewed
from ._lifecycle import ExecutorState, Lifecycle
from ._loads import Loads
from .group import WorkerGroup, WorkerInfo

__all__ = ["Recovery"]


class Recovery:
    """An executor's answer to its calls' dead workers (see the module's docstring)."""

    def __init__(self, life: Lifecycle, loads: Loads, log: Any) -> None:
        self.life = life
        self.loads = loads
        self.log = log

    async def lost(
        self, group: WorkerGroup, worker: WorkerInfo | None, exc: AsyncExecError
    ) -> AsyncExecError:
        """The error of a call whose worker died, saying so when the executor replaced the group
        meanwhile (a restart). Outside a run, a dead group is discarded, so that the next call
        starts a fresh one; or, when it can be, only the dead rank gets a fresh process (see
        ``_renew``), once however many calls saw it die. The renewal runs in the executor's
        task group: the error is returned at once (calls to the rank wait for the renewal:
        ``Loads.renewing``). A call whose worker went because the executor closed meanwhile
        fails with :class:`ExecutorStateError` (the worker's error its cause): no worker
        crashed, and calling again cannot help."""
        if self.life.state in (ExecutorState.CLOSING, ExecutorState.CLOSED):
            rank = getattr(exc, "rank", None)
            on = f" on rank {rank}" if isinstance(rank, int) else ""
            return ExecutorStateError(f"the executor closed while the call was in flight{on}")
        slot = self.life.slot
        if group.closed and slot.group is not group:
            exc.add_note(
                "the call was on its way when the executor replaced its group (a restart): the "
                "new group has new instances; call again"
            )
            return exc
        run = self.life.run
        if run is not None and run.active:
            return exc
        if worker is None or not isinstance(exc, WorkerCrashedError) or group.backend is not None:
            await slot.drop_if(group)
            return exc
        renew = functools.partial(self._renew, group, worker, exc.rank)
        await self.loads.renew_once(worker.handle.key, renew, self.life.tg)
        return exc

    async def renewed(self, group: WorkerGroup, ranks: Sequence[int]) -> WorkerGroup:
        """``group``, or the live group that took its place, once no worker of ``ranks`` is
        being renewed: a call to a rank whose worker died waits for the fresh process put in
        its place, where the calls that saw it die did not."""
        while (done := self.loads.renewing(group.workers, ranks)) is not None:
            await done.wait()
            self.life.check_open()
            group = await self.life.slot.acquire()
        return group

    async def _renew(self, group: WorkerGroup, worker: WorkerInfo, rank: int) -> None:
        """Outside a run, put a fresh process in a crashed rank's place and keep the others
        (their calls in flight go on: rollout servers lose only the dead one's requests); where
        that cannot be done (no bundle of its own) or fails, the group is dropped."""
        slot = self.life.slot
        if group.closed or slot.group is not group:
            return
        if rank >= len(group.workers) or group.workers[rank].handle.key != worker.handle.key:
            return  # renewed already (a worker's key is its own, in local mode too)
        try:
            freed = await slot.renew(group, rank)
        except Exception as failure:
            self.log.warning("rank_renew_failed", rank=rank, error=describe(failure))
            freed = None
        if freed is not None:
            self.life.observer.emit(RankRenewed(rank))
            await self._join(group, rank)
        else:
            await slot.drop_if(group)

    async def _join(self, group: WorkerGroup, rank: int) -> None:
        """Bring the renewed rank up to what its group receives (a weight channel's latest
        version); a failure is logged (the rank serves what it holds, as before: its channel
        delivers the next version to it)."""
        for join in list(self.life.slot.joiners):
            try:
                await join(group)
            except Exception as failure:
                self.log.warning("renewed_rank_join_failed", rank=rank, error=describe(failure))
