"""Preemption as an event, not a crash: a run learns that nodes of its group are about to be
taken away, tells its workers, and charges the loss of their workers to a budget of its own.

A spot or preemptible node is announced before it goes: the cluster marks it as draining, with a
deadline (Ray's ``DrainNode``, which a cloud's preemption notice or an autoscaler sends the GCS).
While an attempt runs, :meth:`PreemptionWatch.watch` asks the cluster every
``RestartPolicy.preemption_check_interval_s`` which nodes are draining (one cheap look-up, off
the loop). When one of the group's nodes is marked, or its deadline changes:

- the run learns it: a :class:`PreemptionNotice` (the earliest deadline, the marked nodes, the
  ranks on them) joins ``RunResult.preemption_notices``, is logged (``preemption_noticed``) and
  counted (``asyncexec_preemptions{stage="noticed"}``), and every step handed over from then on
  in the attempt carries it (``Step.preemption``);
- every worker of the group learns it (``get_preemption_info()``), so that the function can save
  a checkpoint before the deadline.

Ray does nothing at the deadline: the node goes when the cloud (or whoever drained it) takes it.
The group moves first where it can (:meth:`PreemptionWatch.move_when_saved`): once a checkpoint has
become the latest while the notice is in effect, and the group would fit on the nodes that are not
draining (its standby spares included; its own bundles there counted as free), the attempt ends at
that safe point and the next starts from that checkpoint on a new group, before the deadline: a
planned move, charged to ``max_preemptions``, with no failure. A group that cannot be placed anew
(leased from a pool, on a reservation's bundles) or finds no room stays until its workers die with
the node.
When the workers die with it, the attempt's failure is a preemption (:meth:`charge`): a death on
a node seen draining, or on one whose cause of death in the node table is a preemption drain
(when the drain came and went between two looks). It restarts from the latest checkpoint (the
one taken on notice) without waiting and without counting against the restart policy, under
``RestartPolicy.max_preemptions``; draining nodes take no new work, so the new group lands
elsewhere. A drain the cluster rejected is never listed; a later drain with no deadline (an
idle termination's, which replaces a preemption's) leaves the notice as it was.

A mark ends with its drain: when the cluster no longer lists a marked node and the node is alive
(the drain was rejected or cancelled), or the node's deadline passed :data:`LAPSE_S` ago and the
node is still alive, the node is no longer marked, the workers are told, and a later death there
is an ordinary failure under the restart policy. What the watch remembers is bounded.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from ..._errors import (
    AsyncExecError,
    NodeLostError,
    RestartsExhaustedError,
    WorkerCrashedError,
    WorkerUnreachableError,
    describe,
    short_node,
)
from ..._wire._checkpoint import CheckpointBook
from ..._wire._protocol import PreemptionNotice
from .._events import Preemption
from .._observe import Observer
from .._restart import PreemptionsSpent, RestartPolicy
from .._taskgroups import task_group
from ..cluster import Cluster, proxy
from ..group import WorkerGroup, WorkerInfo, fitting_workers, measure_free
from ._iterator import RunCore
from ._steps import StepBatch
from ._window import HandOver

__all__ = [
    "DrainMemory",
    "Moving",
    "NoticedHandOver",
    "Preempted",
    "PreemptionWatch",
    "exhausted",
    "mark",
    "notice_of",
]

#: How long telling one worker of a notice may take (a worker that does not answer in time is
#: the health watch's business).
TELL_TIMEOUT_S = 5.0
#: Failures that are a worker's death (its node's, when that node was drained).
_DEATHS = (WorkerCrashedError, NodeLostError, WorkerUnreachableError)
#: How long after its deadline a drained node that is still alive stops counting as drained
#: (whoever drained it did not take it).
LAPSE_S = 30.0
#: The most nodes (and announced deadlines) a run remembers as drained.
_BOUND = 256

Marked = dict[str, float | None]  # node id -> deadline (seconds since the epoch) or None


class Preempted(Exception):  # a signal from an attempt to its driver, not an error
    """The attempt ended because workers were lost to a preemption (``error`` says which)."""

    def __init__(self, error: AsyncExecError) -> None:
        super().__init__(error)
        self.error = error


class Moving(Exception):  # a signal from an attempt to its driver, not an error
    """The attempt ended at a safe point to move the group off nodes about to be preempted."""


def mark(marked: Marked, drains: Mapping[str, float | None], nodes: set[str]) -> None:
    """Bring ``marked`` (the group's nodes marked as draining, with their deadlines) up to date
    with the cluster's ``drains``, for a group on ``nodes``. Pure.

    A node stays marked while workers of the group are on it, also once the cluster no longer
    lists it (it is gone: the failure is on its way); a deadline that becomes None (a drain
    without one replaced the first, as an idle termination does) leaves the mark as it was."""
    for node in [n for n in marked if n not in nodes]:  # no worker of the group is left there
        del marked[node]
    for node, deadline in drains.items():
        if node not in nodes:
            continue
        if node not in marked or (deadline is not None and deadline != marked[node]):
            marked[node] = deadline


def notice_of(marked: Marked, ranks: Sequence[int], noticed: float) -> PreemptionNotice:
    """One notice for every marked node: the earliest deadline (None when none has one), the
    nodes and their ranks, sorted. Pure."""
    deadlines = [d for d in marked.values() if d is not None]
    return PreemptionNotice(
        deadline=min(deadlines) if deadlines else None,
        node_ids=tuple(sorted(marked)),
        ranks=tuple(sorted(ranks)),
        noticed=noticed,
    )


class DrainMemory:
    """What a run remembers of its nodes' drains: the nodes under one (alive, or gone with it),
    and the drains whose deadline lapsed on a node that stayed alive. A node's mark ends with
    its drain (see the module's docstring); both are bounded."""

    def __init__(self, cluster: Cluster, log: Any) -> None:
        self.cluster = cluster
        self.log = log
        #: Nodes under a drain, oldest first: True once seen gone (a death there is then a
        #: preemption for good), False while alive.
        self.drained: dict[str, bool] = {}
        #: Nodes whose deadline passed while they stayed alive, with that deadline.
        self.lapsed: dict[str, float] = {}

    def __contains__(self, node: object) -> bool:
        return node in self.drained

    def in_effect(self, drains: Mapping[str, float | None]) -> dict[str, float | None]:
        """The cluster's ``drains`` less those whose deadline lapsed (a new deadline is a new
        drain; none is the drain that replaced it, as :func:`mark` reads it)."""
        for node in [n for n in self.lapsed if n not in drains]:  # that drain is over
            del self.lapsed[node]
        found: dict[str, float | None] = {}
        for node, deadline in drains.items():
            lapsed = self.lapsed.get(node)
            if lapsed is not None and (deadline is None or deadline == lapsed):
                continue
            self.lapsed.pop(node, None)
            found[node] = deadline
        return found

    async def prune(self, marked: Marked, drains: Mapping[str, float | None]) -> list[str]:
        """Remember ``marked``; end (and return) the marks whose drain ended on a live node: the
        cluster no longer lists it (the drain was rejected or cancelled; a node the drain took
        is dead), or its deadline passed :data:`LAPSE_S` ago. Left as they are when the cluster
        does not answer."""
        for node in marked:
            self.drained.setdefault(node, False)
        _bound(self.drained)
        now = time.time()
        ended = [n for n, gone in self.drained.items() if not gone and n not in drains]
        lapsed = [n for n, d in marked.items() if d is not None and now - d > LAPSE_S]
        if not ended and not lapsed:
            return []
        alive = await self.cluster.live_nodes()
        if alive is None:
            return []
        for node in [n for n in ended if n not in alive]:  # gone with its drain
            self.drained[node] = True
        over = [n for n in [*ended, *lapsed] if n in alive]
        for node in over:
            if node in lapsed:
                deadline = marked[node]
                assert deadline is not None
                self.lapsed[node] = deadline
                _bound(self.lapsed)
            marked.pop(node, None)
            self.drained.pop(node, None)
            self.log.info("drain_ended", node_id=short_node(node), lapsed=node in lapsed)
        return over


class PreemptionWatch:
    """One run's view of the preemption of its group's nodes (see the module's docstring)."""

    def __init__(
        self,
        cluster: Cluster,
        policy: RestartPolicy,
        observer: Observer,
        log: Any,
    ) -> None:
        self.cluster = cluster
        self.interval = policy.preemption_check_interval_s
        self.budget = policy.max_preemptions
        #: The executor's observer (each notice, move and restart after a preemption).
        self.observer = observer
        self.log = log
        #: Every notice of the run, in order.
        self.notices: list[PreemptionNotice] = []
        #: The notice in effect for the current group (stamped on the steps handed over).
        self.current: PreemptionNotice | None = None
        #: Restarts after a preemption so far (charged to ``max_preemptions``).
        self.preemptions = 0
        self._drains = DrainMemory(cluster, log)
        #: Each (node, deadline) the run has announced, and when it was first seen.
        self._seen: dict[tuple[str, float | None], float] = {}
        self._told: dict[str, PreemptionNotice | None] = {}  # by worker key
        self._failing = False  # the last look-up failed (logged once until one works)
        self._saved = anyio.Event()  # a checkpoint became the latest under a notice

    def __repr__(self) -> str:
        return f"<PreemptionWatch notices={len(self.notices)} preemptions={self.preemptions}>"

    async def watch(self, group: WorkerGroup) -> None:
        """Tell the run and ``group``'s workers when nodes of the group are drained, every
        ``interval`` seconds (not at all when it is None). Runs until cancelled; never fails."""
        self.current = None
        if self.interval is None:
            return
        marked: Marked = {}
        while True:
            drains = await self._read()
            if drains is not None:
                await self._update(group, marked, drains)
            await anyio.sleep(self.interval)

    async def _read(self) -> Mapping[str, float | None] | None:
        """The cluster's draining nodes, or None when it did not answer (logged once)."""
        try:
            drains = await self.cluster.draining()
        except Exception as exc:
            drains, error = None, describe(exc)
        else:
            error = "no answer in time"
        if drains is None and not self._failing:
            self.log.warning("drain_check_failed", error=error)
        self._failing = drains is None
        return drains

    async def _update(
        self, group: WorkerGroup, marked: Marked, drains: Mapping[str, float | None]
    ) -> None:
        nodes = {w.metadata.node_id for w in group.workers}
        drains = self._drains.in_effect(drains)
        mark(marked, drains, nodes)
        for node in await self._drains.prune(marked, drains):
            for pair in [p for p in self._seen if p[0] == node]:
                del self._seen[pair]
        ranks = [w.rank for w in group.workers if w.metadata.node_id in marked]
        now = time.time()
        fresh = [pair for pair in marked.items() if pair not in self._seen]
        for pair in fresh:
            self._seen[pair] = now
        if len(self._seen) > _BOUND:  # the oldest that are not in effect go
            old = [p for p in self._seen if p[0] not in marked or marked[p[0]] != p[1]]
            for pair in old[: len(self._seen) - _BOUND]:
                del self._seen[pair]
        notice = None
        if marked:
            noticed = max(self._seen[pair] for pair in marked.items())
            notice = notice_of(marked, ranks, noticed)
            if notice == self.current:
                notice = self.current  # the same word: nobody is told again
            if fresh:
                self._announce(notice)
        self.current = notice
        await self._tell(group, notice)

    def _announce(self, notice: PreemptionNotice) -> None:
        self.notices.append(notice)
        left = notice.seconds_left()
        details = {
            "node_ids": [short_node(n) for n in notice.node_ids],
            "ranks": list(notice.ranks),
            "deadline": notice.deadline,
            "seconds_left": None if left is None else round(left, 3),
        }
        self.observer.emit(Preemption("noticed", details))

    async def _tell(self, group: WorkerGroup, notice: PreemptionNotice | None) -> None:
        """Give ``notice`` to each worker of ``group`` that holds another word (None only to
        those told something before), all at once, each within :data:`TELL_TIMEOUT_S`."""
        keys = {w.handle.key for w in group.workers}
        for key in [k for k in self._told if k not in keys]:  # workers of an earlier group
            del self._told[key]
        async with task_group() as tg:
            for worker in group.workers:
                key = worker.handle.key
                if self._told.get(key) is not notice:
                    self._told[key] = notice
                    tg.start_soon(self._tell_one, group, worker, notice)

    async def _tell_one(
        self, group: WorkerGroup, worker: WorkerInfo, notice: PreemptionNotice | None
    ) -> None:
        try:
            with anyio.move_on_after(TELL_TIMEOUT_S):
                await proxy(group, worker).notify_preemption(notice)
        except AsyncExecError as exc:  # a dead worker: its death is the health watch's to report
            self.log.debug(
                "preemption_notice_undelivered", worker=repr(worker.handle), error=describe(exc)
            )

    # Before the deadline ----------------------------------------------------------------------

    def saved(self) -> None:
        """A checkpoint has become the latest (the hand-over says so)."""
        if self.current is not None:
            self._saved.set()

    async def move_when_saved(self, group: WorkerGroup, move: Callable[[], None]) -> None:
        """Call ``move()`` (and return) once a checkpoint has become the latest while a notice
        is in effect for ``group``, and the group would fit on the nodes that are not draining;
        looked at again at each later checkpoint. Never for a group that cannot be placed anew
        (leased from a pool, on a reservation's bundles) nor beyond ``max_preemptions``. Runs
        until cancelled."""
        self._saved = anyio.Event()
        placement = group.placement
        if self.interval is None or group.pool is not None or placement is None:
            return
        if not placement.owned:
            return
        while True:
            await self._saved.wait()
            self._saved = anyio.Event()
            spent = self.budget is not None and self.preemptions >= self.budget
            if self.current is not None and not spent and await self._room(group):
                move()
                return

    async def _room(self, group: WorkerGroup) -> bool:
        """Whether the nodes that are not draining hold the group that would replace ``group``
        (an elastic one at its minimum; its standby spares included, as its placement holds
        them), its own bundles on them counted as free."""
        config = group.config
        nodes = await measure_free(config, self.cluster, group, self.log)
        need = (config.min_workers or config.num_workers) + config.spares
        if nodes is None:
            return False
        return fitting_workers(config.bundle, config.placement_strategy, nodes, need) >= need

    def moving(self, **fields: Any) -> None:
        """Count a move before the deadline against ``max_preemptions`` (the watch checked the
        budget), and log it with ``fields``."""
        self.preemptions += 1
        notice = self.current
        left = notice.seconds_left() if notice is not None else None
        details = {
            "preemptions": self.preemptions,
            "max_preemptions": self.budget,
            "node_ids": [short_node(n) for n in notice.node_ids] if notice is not None else [],
            "seconds_left": None if left is None else round(left, 3),
            **fields,
        }
        self.observer.emit(Preemption("moved", details))

    # After a failure ---------------------------------------------------------------------------

    async def is_preemption(self, failures: Sequence[AsyncExecError]) -> bool:
        """Whether ``failures`` (of one attempt, or of one rank) are a preemption: a worker died
        (crashed, lost its node, could not be reached) on a node seen draining, or on a node
        that a preemption drain took (the node table's cause of death: a drain that came and
        went between two looks). Any such death makes it one, whatever the other ranks'
        failures (their collectives fail with it)."""
        deaths = [f for f in failures if isinstance(f, _DEATHS)]
        if any(f.node_id in self._drains for f in deaths):
            return True
        lost = {f.node_id for f in deaths if f.node_id}
        if not lost:
            return False
        found: set[str] = set()
        try:
            with anyio.CancelScope(shield=True):  # bounded by the seam
                found = await self.cluster.preempted(lost)
        except Exception as exc:
            self.log.warning("preemption_check_failed", error=describe(exc))
        return bool(found)

    def charge(self, error: AsyncExecError, **fields: Any) -> None:
        """Count a preemption (``error`` is its failure) against ``max_preemptions``, and log
        the restart that follows (with ``fields``).

        Raises:
            PreemptionsSpent: it is one preemption beyond ``max_preemptions``.
        """
        self.preemptions += 1
        if self.budget is not None and self.preemptions > self.budget:
            raise PreemptionsSpent(error, self.preemptions, self.budget)
        details = {
            "preemptions": self.preemptions,
            "max_preemptions": self.budget,
            "error": describe(error),
            **fields,
        }
        self.observer.emit(Preemption("restarted", details))


def _bound(remembered: dict[Any, Any]) -> None:
    """Forget the oldest of ``remembered`` beyond :data:`_BOUND`."""
    while len(remembered) > _BOUND:
        del remembered[next(iter(remembered))]


def exhausted(spent: PreemptionsSpent, attempts: int, failures: list[Any]) -> AsyncExecError:
    """The run's error when a preemption came beyond the budget: the restart policy's
    :class:`RestartsExhaustedError`, with a note that says it was the preemptions'."""
    error = RestartsExhaustedError(attempts, failures)
    error.add_note(spent.note)
    return error


class NoticedHandOver(HandOver):
    """The hand-over of a run whose steps carry the preemption notice in effect as they are
    handed over (``Step.preemption``)."""

    def __init__(
        self,
        run: RunCore,
        send: MemoryObjectSendStream[Any],
        book: CheckpointBook,
        prune: Callable[[list[str]], None],
        watch: PreemptionWatch,
    ) -> None:
        super().__init__(run, send, book, prune)
        self.watch = watch

    def queue(self, batch: StepBatch) -> None:
        batch.preemption = self.watch.current
        super().queue(batch)
        if batch.checkpoints:
            self.watch.saved()
