"""Admission: prompts from the source (and the requeued ones, first) to the servers under the
budget, one task per request in the pipeline's task group, and the samples that come back put
in the budget's buffer (aborted ones requeued at the head, duplicates dropped); and expiry: the
requests a strict batch would wait for, cancelled and their prompts held until the next version,
then requeued at the head."""

from __future__ import annotations

import bisect
import heapq
import time
from collections import Counter
from collections.abc import AsyncIterable, AsyncIterator, Hashable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import anyio
import anyio.abc
import anyio.lowlevel

from ..._errors import ConfigurationError
from ..._logging import Logger
from ..._wire._rollout import RolloutRequest, Sample
from .._observe import Observer
from ._budget import Budget
from ._consumed import Consumed
from ._events import Admitted, BatchHanded, GenerationEnded, RequestExpired, SampleReturned
from ._servers import Servers
from ._stats import PipelineBatch, batch_of

__all__ = ["Admission", "Item"]

#: Requests a closing pipeline stops in one turn of the event loop: each costs the loop its
#: caller's cancellation and its remote call's (``ray.cancel``), so that hundreds stopped in
#: one turn would stall it.
STOP_PER_TURN = 4

#: What the buffer keeps of a sample: the sample and the learner's version it counts as.
Item = tuple[Sample, int]


@dataclass
class _Running:
    """A request in flight (``order``: its place in the queue), the version it was admitted at,
    when, its scope (cancelled to expire it), and whether it was expired (then its task only
    ends: the prompt was requeued)."""

    request: RolloutRequest
    order: int
    admitted: int
    started: float = field(default_factory=time.monotonic)
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    expired: bool = False


def learner_version(sample: Sample, admitted: int) -> int:
    """The learner's version that made ``sample`` (on the learner's scale): its oldest chunk's.
    A chunk made before any weights arrived ran on the servers' own, which stand for the
    learner's first weights: version 0 (a pipeline resumed at a later version counts them as
    that far behind). A sample of no chunk counts from the version it was admitted at."""
    if not sample.versions:
        return admitted
    return min(0 if v is None else v for v in sample.versions)


async def _requests(prompts: Any, consumed: Consumed) -> AsyncIterator[RolloutRequest]:
    """The source's prompts as requests (a prompt's id is its position, unless it is a request),
    without those ``consumed`` (before the pipeline started: a resumed driver's)."""
    position = 0

    def request(prompt: Any) -> RolloutRequest:
        if not isinstance(prompt, RolloutRequest):
            return RolloutRequest(position, prompt)
        try:
            hash(prompt.id)
        except TypeError:
            raise ConfigurationError(
                f"prompts: the RolloutRequest at position {position} has the id "
                f"{prompt.id!r:.100}, which is not hashable (an id names its prompt in the "
                "pipeline's exactly-once record: give a str, an int or a tuple)"
            ) from None
        return prompt

    if isinstance(prompts, AsyncIterable):
        async for prompt in prompts:
            made = request(prompt)
            position += 1
            if made.id not in consumed:
                yield made
    else:
        for prompt in prompts:
            made = request(prompt)
            position += 1
            if made.id not in consumed:
                yield made
            await anyio.lowlevel.checkpoint()


class Admission:
    """The admitting side of a pipeline (see the module's docstring)."""

    def __init__(
        self,
        prompts: Iterable[Any] | AsyncIterable[Any],
        servers: Servers,
        budget: Budget[Item],
        consumed: Consumed,
        observer: Observer,
        log: Logger,
        max_requeues: int = 0,
    ) -> None:
        #: What was consumed before this pipeline started (the checkpoint's), which the source
        #: skips; an id consumed since that comes again is a repeat.
        resumed = Consumed(consumed.watermark, consumed.above, consumed.version)
        self.source = _requests(prompts, resumed)
        self.servers = servers
        self.budget = budget
        self.consumed = consumed
        self.observer = observer  # where its events go (statistics, metrics, timeline, log)
        self.log = log
        #: Requeued prompts by when they were first admitted: sent before the source's.
        self.queue: list[tuple[int, RolloutRequest]] = []
        self.sent = 0  # prompts taken from the source so far
        #: The source's next prompt, pulled by :meth:`_pull` (with its place), not yet admitted.
        self.ahead: tuple[int, RolloutRequest] | None = None
        self.pending: set[Hashable] = set()  # admitted, not consumed (in flight or buffered)
        self.open = True  # False while a weight update holds admission
        self.pushing = False  # an update's push runs, not marked yet (see :meth:`mark`)
        self.closing = False  # the pipeline closes: nothing more is admitted or used
        self.exhausted = False  # the source has no more prompts
        #: The pipeline's task group, once it runs (what an error of a sink's fails: ``hand``).
        self.tg: anyio.abc.TaskGroup | None = None
        #: The channel's versions that this pipeline pushed (or found as it started), each
        #: with the learner's version it stands for, in order (none without a channel).
        self.marks: list[tuple[int, int]] = []
        self.changed = anyio.Event()
        #: How often a prompt may be expired; after that a batch waits for it (0: never).
        self.max_requeues = max_requeues
        self.running: dict[Hashable, _Running] = {}
        self.expiries: Counter[Hashable] = Counter()  # by prompt id, until consumed
        #: Expired prompts by the version they expired at, then their place: requeued once
        #: the learner's version is past it (admitted at the start of a version, a prompt has
        #: the longest time to its deadline; admitted at once, at the end of one, it would
        #: have one training step's).
        self.held: list[tuple[int, int, RolloutRequest]] = []

    def notify(self) -> None:
        """Something changed: wake whoever waits (the admission loop, the learner)."""
        changed, self.changed = self.changed, anyio.Event()
        changed.set()

    async def wait_changed(self) -> None:
        await self.changed.wait()

    @property
    def final(self) -> bool:
        """Nothing more will be admitted unless an aborted prompt comes back."""
        return self.exhausted and not self.queue and not self.held

    def _release(self) -> None:
        """Requeue the held prompts whose version is past."""
        while self.held and self.held[0][0] < self.budget.version:
            _, order, request = heapq.heappop(self.held)
            heapq.heappush(self.queue, (order, request))

    def may_admit(self) -> bool:
        self._release()
        waiting = bool(self.queue) or not self.exhausted
        return self.open and not self.closing and self.budget.admissible() > 0 and waiting

    async def run(self, tg: anyio.abc.TaskGroup) -> None:
        """Admit prompts for as long as the pipeline lives (a task of its group)."""
        self.tg = tg
        tg.start_soon(self._pull)
        while True:
            await self.servers.turn()  # a burst of admissions spreads over turns of the loop
            while not self.may_admit():
                await self.wait_changed()
            taken = await self._next()
            if taken is None:
                continue
            order, request = taken
            if request.id in self.pending or request.id in self.consumed:
                raise ConfigurationError(
                    f"prompts: the id {request.id!r} repeats (a RolloutRequest's id names its "
                    "prompt in the pipeline's exactly-once record: give each prompt its own)"
                )
            # The source may have made us wait: an update may have begun meanwhile.
            while self.closing or not (self.open and self.budget.admissible() > 0):
                await self.wait_changed()
            self.pending.add(request.id)
            admitted = self.budget.admit()
            self.observer.emit(Admitted(self.budget.in_flight_count, self.budget.finished_count))
            tg.start_soon(self._generate, request, admitted, order)

    async def _next(self) -> tuple[int, RolloutRequest] | None:
        """A requeued prompt, else the source's next one; None when neither is there yet (the
        caller looks again)."""
        self._release()
        if self.queue:
            return heapq.heappop(self.queue)
        if self.ahead is not None:
            taken, self.ahead = self.ahead, None
            self.notify()  # the puller may take the next one
            return taken
        await self.wait_changed()
        return None

    async def _pull(self) -> None:
        """Pull the source's prompts, one at a time when one could be admitted and none is
        requeued (a task of the pipeline's group). The admission loop waits for it, not in the
        source's ``anext``: a prompt requeued while a slow source has nothing to give is sent
        at once. A pull in progress is never cancelled (but with the pipeline): its prompt is
        the next one admitted."""
        while True:
            while self.ahead is not None or self.queue or not self.may_admit():
                await self.wait_changed()
            try:
                request = await anext(self.source)
            except StopAsyncIteration:
                self.exhausted = True
                self.log.debug("pipeline_source_exhausted")
                self.notify()
                return
            self.sent += 1
            self.ahead = (self.sent, request)
            self.notify()

    async def _generate(self, request: RolloutRequest, admitted: int, order: int) -> None:
        record = self.running[request.id] = _Running(request, order, admitted)
        try:
            with record.scope:
                sample = await self.servers.generate(request)
                await self._marked(sample)
        except BaseException:
            if not record.expired:
                self.budget.drop(admitted)
                self.pending.discard(request.id)
            raise
        finally:
            if self.running.get(request.id) is record:
                del self.running[request.id]
            self.observer.emit(GenerationEnded(time.monotonic() - record.started))
        if record.expired:  # expire() requeued it
            return
        if self.closing:  # stopped, or its sample is not needed: nothing is in flight after
            self.budget.drop(admitted)
            self.pending.discard(request.id)
            return
        outcome: Literal["finished", "aborted", "duplicate"] = "finished"
        if sample.aborted:
            self.budget.drop(admitted)
            self.pending.discard(request.id)
            heapq.heappush(self.queue, (order, request))
            outcome = "aborted"
        elif sample.id in self.consumed:  # answered twice: consumed already
            self.budget.drop(admitted)
            outcome = "duplicate"
        else:
            sample = self.on_learner_scale(sample)
            version = learner_version(sample, admitted)
            self.budget.finish(admitted, version, (sample, version))
        budget = self.budget
        self.observer.emit(SampleReturned(outcome, budget.in_flight_count, budget.finished_count))
        self.notify()

    async def stop(self) -> None:
        """The pipeline closes: admit nothing more, and stop the requests in flight (each on
        its server), ``STOP_PER_TURN`` a turn of the event loop."""
        self.closing = True
        self.notify()
        for i, record in enumerate(list(self.running.values()), 1):
            record.scope.cancel()
            if i % STOP_PER_TURN == 0:
                await anyio.lowlevel.checkpoint()

    def expire(self) -> int:
        """Expire what the budget says a strict batch waits for (:meth:`Budget.expiring`):
        the requests in flight with a deadline up to it, except prompts expired
        ``max_requeues`` times already (the batch waits for those). Each is cancelled (its
        server stops it) and its prompt is held, then requeued at the head of the queue once
        the version is past this one. Returns how many."""
        cutoff = self.budget.expiring() if self.max_requeues else None
        if cutoff is None:
            return 0
        s = self.budget.staleness
        now = time.monotonic()
        expired = 0
        for id, record in list(self.running.items()):
            if record.admitted + s > cutoff or self.expiries[id] >= self.max_requeues:
                continue
            record.expired = True
            record.scope.cancel()
            del self.running[id]
            self.budget.drop(record.admitted)
            self.pending.discard(id)
            self.expiries[id] += 1
            heapq.heappush(self.held, (self.budget.version, record.order, record.request))
            b = self.budget
            self.observer.emit(
                RequestExpired(b.version, now - record.started, b.in_flight_count, b.finished_count)
            )
            expired += 1
        if expired:
            self.log.debug("pipeline_expired", version=self.budget.version, expired=expired)
            self.notify()
        return expired

    async def _marked(self, sample: Sample) -> None:
        """Until each of ``sample``'s chunks' versions is one the pipeline knows on the
        learner's scale: a chunk made on a push that an update is delivering (generation goes
        on through a "keep" update over servers that hold it for their own loads:
        ``Servers.keep_without_pause``) waits until that push is marked (:meth:`mark`), or,
        failed or cancelled, counted as the version before it (:meth:`learner_of`). Still in
        flight meanwhile (the learner, in ``update_weights()``, takes no batch)."""
        while self.pushing and self.marks and sample.versions:
            newest = max((v for v in sample.versions if v is not None), default=None)
            if newest is None or newest <= self.marks[-1][0]:
                return
            await self.wait_changed()

    def mark(self, pushed: int, version: int) -> None:
        """The channel's version ``pushed`` holds the learner's ``version``."""
        self.marks.append((pushed, version))

    def on_learner_scale(self, sample: Sample) -> Sample:
        """``sample`` with its chunks' versions counted as the learner's (``pipe.version``)
        rather than as the channel's pushes (:meth:`learner_of`)."""
        if not self.marks:
            return sample
        versions = tuple(None if v is None else self.learner_of(v) for v in sample.versions)
        return replace(sample, versions=versions)

    def learner_of(self, pushed: int) -> int:
        """The learner's version of the channel's ``pushed``: that of the latest push of the
        pipeline's at or before it. The channel's numbering runs ahead of the learner's by
        the pushes made before the pipeline started, by others' meanwhile (counted as the
        learner's version before them), and by the pipeline's own that failed or were
        cancelled after the read (a version counted, the servers holding theirs, or some of
        them the new one): a single offset, taken from the latest push, counted the chunks
        made before such a push a version staler for each. A version before the first mark
        counts down from it."""
        i = bisect.bisect_right(self.marks, pushed, key=lambda mark: mark[0]) - 1
        if i < 0:
            first, version = self.marks[0]
            return version - (first - pushed)
        return self.marks[i][1]

    def hand(self, waited_s: float, bound: int) -> PipelineBatch:
        """Take a batch from the buffer (when the budget says it is ready) for the learner,
        whose version is the budget's: its ids are consumed from now on."""
        budget = self.budget
        taken = budget.take()
        v = budget.version
        samples = [sample for _, (sample, _) in taken]
        staleness = tuple(v - version for version, _ in taken)
        for sample in samples:
            self.consumed.add(sample.id)
            self.pending.discard(sample.id)
            self.expiries.pop(sample.id, None)
        batch = batch_of(samples, v, staleness, waited_s)
        try:
            self.observer.emit(
                BatchHanded(
                    v, staleness, batch.staleness_max, waited_s, budget.finished_count, bound
                )
            )
        except Exception as exc:
            # A sink that raised (the application's logging processor, under the
            # pipeline_batch line): raised here, the batch was lost with its samples counted
            # consumed. It is handed, and the error fails the pipeline as an error of its own
            # tasks does (out of its ``async with``).
            if self.tg is None:
                raise
            self.tg.start_soon(_raise, exc)
        self.notify()
        return batch


async def _raise(error: BaseException) -> None:
    """Fail the task group this runs in with ``error``."""
    raise error
