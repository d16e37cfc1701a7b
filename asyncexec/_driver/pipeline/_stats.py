"""What a pipeline shows: its batches, its statistics, and the counters they are made from."""

from __future__ import annotations

import time
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from ..._wire._rollout import Sample
from .._observe import Handler
from ._events import (
    Admitted,
    BatchHanded,
    GenerationEnded,
    PipelineClosed,
    RequestExpired,
    SampleReturned,
    UpdateEnded,
)

__all__ = ["Meter", "PauseFigures", "PipelineBatch", "PipelineStatistics", "batch_of"]


@dataclass(frozen=True)
class PipelineBatch:
    """A batch handed to the learner by :class:`~asyncexec.Pipeline`.

    Attributes:
        samples: the samples, oldest version first.
        ids: their ids, in the same order.
        version: the learner's version when it was handed (the updates done).
        staleness: per sample, ``version`` minus the sample's version (its oldest chunk's;
            the samples' versions are on the learner's scale, a chunk made before any weights
            counted as version 0).
        staleness_max: the largest of ``staleness`` (0 for an empty batch).
        staleness_mean: their mean.
        waited_s: how long the learner waited for it (the trainer's idle time before it).
    """

    samples: list[Sample]
    ids: list[Hashable]
    version: int
    staleness: tuple[int, ...]
    staleness_max: int
    staleness_mean: float
    waited_s: float

    def __len__(self) -> int:
        return len(self.samples)


def batch_of(
    samples: list[Sample], version: int, staleness: tuple[int, ...], waited_s: float
) -> PipelineBatch:
    """The batch of ``samples`` handed at ``version``."""
    return PipelineBatch(
        samples=samples,
        ids=[s.id for s in samples],
        version=version,
        staleness=staleness,
        staleness_max=max(staleness, default=0),
        staleness_mean=round(sum(staleness) / len(staleness), 4) if staleness else 0.0,
        waited_s=round(waited_s, 6),
    )


class PauseFigures(NamedTuple):
    """The weight updates of one mode: how many, and how long generation was paused for them
    (from the pause to the resume, the push itself apart), and the pushes' own time."""

    updates: int
    total_s: float
    max_s: float
    push_s: float


@dataclass(frozen=True)
class PipelineStatistics:
    """A snapshot of a pipeline's counters, from :meth:`Pipeline.statistics` (once it has
    closed, those at its close: nothing in flight, its times stopped there).

    Attributes:
        version: the learner's version (updates done).
        admitted: prompts sent to the servers (a requeued prompt counts again).
        consumed: samples handed to the learner.
        in_flight: prompts admitted whose sample has not come back.
        buffer_depth: finished samples waiting for a batch; ``buffer_depth_max`` the most.
        aborted: generations aborted: samples that came back aborted (``on_update="abort"``)
            and requests expired.
        requeued: prompts put back at the head of the queue (the aborted ones).
        duplicates: samples dropped because their request was answered twice (a retried
            request whose sample was consumed already).
        staleness_max: the largest staleness of a consumed sample; ``staleness_mean`` the mean.
        beyond_bound: consumed samples staler than the bound S (0 in strict mode).
        trainer_idle_ratio: the share of the time since the pipeline started that the learner
            spent waiting for batches.
        rollout_idle_ratio: the share of that time with no prompt in flight.
        pauses: per update mode (``"wait"``, ``"abort"``, ``"keep"``), the updates made and how
            long generation was paused for them (:class:`PauseFigures`).
        elapsed_s: the time since the pipeline started (until it closed).
        expired: requests a strict batch would have waited for, cancelled and requeued
            instead (``on_expire="requeue"``; counted in ``aborted`` and ``requeued`` too).
        expired_s: the time those requests had been in flight when expired: generation
            thrown away.
        generation_s: the time every request that ended was in flight (from its admission,
            the wait for a server included): ``expired_s / generation_s`` is the share thrown
            away.
    """

    version: int
    admitted: int
    consumed: int
    in_flight: int
    buffer_depth: int
    buffer_depth_max: int
    aborted: int
    requeued: int
    duplicates: int
    staleness_max: int
    staleness_mean: float
    beyond_bound: int
    trainer_idle_ratio: float
    rollout_idle_ratio: float
    pauses: Mapping[str, PauseFigures] = field(default_factory=dict)
    elapsed_s: float = 0.0
    expired: int = 0
    expired_s: float = 0.0
    generation_s: float = 0.0


class Meter:
    """The counters behind :class:`PipelineStatistics` (mutable; on the pipeline's loop): the
    statistics' sink of the pipeline's events."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.admitted = self.consumed = self.aborted = self.requeued = self.duplicates = 0
        self.buffer_depth_max = 0
        self.expirations = 0
        self.expired_s = self.generated_s = 0.0
        self.staleness_sum = self.staleness_max = self.beyond = 0
        self.trainer_idle_s = 0.0
        self.rollout_idle_s = 0.0
        self._idle_since: float | None = self.started
        self.pauses: dict[str, PauseFigures] = {}
        #: When the pipeline closed: its times stop there (None: open).
        self.closed: float | None = None

    def restart(self) -> None:
        """The pipeline starts (it is entered): its times count from now."""
        self.started = time.monotonic()
        self.trainer_idle_s = self.rollout_idle_s = 0.0
        self._idle_since = self.started

    def handlers(self) -> Mapping[type, Handler]:
        return {
            Admitted: self._admitted,
            GenerationEnded: self._generation_ended,
            SampleReturned: self._returned,
            RequestExpired: self._expired,
            BatchHanded: self._batch,
            UpdateEnded: self._update_ended,
            PipelineClosed: self._closed,
        }

    def _admitted(self, event: Admitted) -> None:
        self.admitted += 1
        self.in_flight_changed(event.in_flight)

    def _generation_ended(self, event: GenerationEnded) -> None:
        self.generated_s += event.seconds

    def _returned(self, event: SampleReturned) -> None:
        if event.outcome == "aborted":
            self.aborted += 1
            self.requeued += 1
        elif event.outcome == "duplicate":
            self.duplicates += 1
        else:
            self.buffer_depth_max = max(self.buffer_depth_max, event.buffered)
        self.in_flight_changed(event.in_flight)

    def _expired(self, event: RequestExpired) -> None:
        """A request expired: aborted, its prompt requeued."""
        self.expirations += 1
        self.aborted += 1
        self.requeued += 1
        self.expired_s += event.in_flight_s
        self.in_flight_changed(event.in_flight)

    def in_flight_changed(self, in_flight: int) -> None:
        """Track the time with nothing in flight."""
        now = time.monotonic()
        if in_flight == 0 and self._idle_since is None:
            self._idle_since = now
        elif in_flight > 0 and self._idle_since is not None:
            self.rollout_idle_s += now - self._idle_since
            self._idle_since = None

    def _batch(self, event: BatchHanded) -> None:
        staleness = event.staleness
        self.consumed += len(staleness)
        self.staleness_sum += sum(staleness)
        self.staleness_max = max([self.staleness_max, *staleness])
        self.beyond += sum(s > event.bound for s in staleness)
        self.trainer_idle_s += event.waited_s

    def _update_ended(self, event: UpdateEnded) -> None:
        mode, pause_s = event.mode, event.pause_s
        count, total, most, pushes = self.pauses.get(mode, PauseFigures(0, 0.0, 0.0, 0.0))
        self.pauses[mode] = PauseFigures(
            count + 1, total + pause_s, max(most, pause_s), pushes + event.push_s
        )

    def _closed(self, event: PipelineClosed) -> None:
        self.closed = time.monotonic()

    def snapshot(self, version: int, in_flight: int, buffer_depth: int) -> PipelineStatistics:
        now = time.monotonic() if self.closed is None else self.closed
        elapsed = max(now - self.started, 1e-9)
        idle = self.rollout_idle_s
        if self._idle_since is not None:
            idle += now - self._idle_since
        return PipelineStatistics(
            version=version,
            admitted=self.admitted,
            consumed=self.consumed,
            in_flight=in_flight,
            buffer_depth=buffer_depth,
            buffer_depth_max=self.buffer_depth_max,
            aborted=self.aborted,
            requeued=self.requeued,
            duplicates=self.duplicates,
            staleness_max=self.staleness_max,
            staleness_mean=round(self.staleness_sum / self.consumed, 4) if self.consumed else 0.0,
            beyond_bound=self.beyond,
            trainer_idle_ratio=round(min(1.0, self.trainer_idle_s / elapsed), 4),
            rollout_idle_ratio=round(min(1.0, idle / elapsed), 4),
            pauses=dict(self.pauses),
            elapsed_s=round(elapsed, 4),
            expired=self.expirations,
            expired_s=round(self.expired_s, 4),
            generation_s=round(self.generated_s, 4),
        )
