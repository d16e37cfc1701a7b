"""What a run yields and returns: Report, Step, RunResult, and the compact StepBatch that
carries complete steps from the driver task to the iterator (with StepTimes: when each rank made
its reports)."""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..._wire._checkpoint import Checkpoint
from ..._wire._protocol import PreemptionNotice

__all__ = ["Report", "RunResult", "Step", "StepBatch", "StepTimes"]

_NO_CHECKPOINT: tuple[None, tuple[int, ...]] = (None, ())


class Report:
    """What one rank reported for one step."""

    __slots__ = ("checkpoint", "metrics", "rank", "version")

    def __init__(
        self,
        rank: int,
        metrics: Mapping[str, Any],
        checkpoint: Checkpoint | None = None,
        version: int | None = None,
    ):
        self.rank = rank
        self.metrics = metrics
        self.checkpoint = checkpoint
        #: The weight version the rank held when it reported (from a WeightChannel), or None.
        self.version = version

    def __repr__(self) -> str:
        ckpt = f", checkpoint={self.checkpoint!r}" if self.checkpoint is not None else ""
        version = f", version={self.version}" if self.version is not None else ""
        return f"Report(rank={self.rank}, metrics={self.metrics!r}{ckpt}{version})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Report) and (
            self.rank,
            self.metrics,
            self.checkpoint,
            self.version,
        ) == (other.rank, other.metrics, other.checkpoint, other.version)

    def __reduce__(self) -> tuple[Any, ...]:
        return (Report, (self.rank, self.metrics, self.checkpoint, self.version))


class Step:
    """One step of a run: every rank's report for it.

    Attributes:
        index: the step's position in the run's stream (0, 1, 2, ...), counted across attempts.
            After a restart the function resumes from its checkpoint and the steps it reports
            again get new indices.
        attempt: the attempt that produced it (1 for the first).
        reports: one Report per rank, in rank order.
        checkpoint: the persisted checkpoint this step carried, if any rank reported one.
        preemption: the notice that nodes of the step's group are about to be taken away (see
            :class:`PreemptionNotice`), when one was in effect as the step was handed over;
            None otherwise (the steps of the attempt after the move carry none).
    """

    # A step is its batch and its place in it: everything else is read from the batch when
    # asked, and its Report objects are built the first time ``reports`` is read. The
    # iterator makes one of these a step, so a consumer that reads ``metrics``, or nothing,
    # pays for one small object per step instead of one per rank and step. A step made by
    # hand has a batch of its own.
    __slots__ = ("_batch", "_i", "_reports")

    def __init__(
        self,
        index: int,
        attempt: int,
        reports: Sequence[Report],
        checkpoint: Checkpoint | None = None,
        rank: int | None = None,
        preemption: PreemptionNotice | None = None,
    ) -> None:
        batch = StepBatch(
            index,
            attempt,
            [()],
            {} if checkpoint is None else {0: (checkpoint, ())},
            None,
            None if rank is None else [rank],
        )
        batch.preemption = preemption
        self._batch = batch
        self._i = 0
        self._reports: Sequence[Report] | None = reports

    @property
    def index(self) -> int:
        """The step's position in the run's stream."""
        return self._batch.first + self._i

    @index.setter
    def index(self, value: int) -> None:
        self._own().first = value

    @property
    def attempt(self) -> int:
        """The attempt that produced it (1 for the first)."""
        return self._batch.attempt

    @attempt.setter
    def attempt(self, value: int) -> None:
        self._own().attempt = value

    @property
    def checkpoint(self) -> Checkpoint | None:
        """The persisted checkpoint this step carried, if any rank reported one."""
        checkpoints = self._batch.checkpoints
        if checkpoints and self._i in checkpoints:
            return checkpoints[self._i][0]
        return None

    @checkpoint.setter
    def checkpoint(self, value: Checkpoint | None) -> None:
        batch = self._own()
        ranks = batch.checkpoints[0][1] if batch.checkpoints else ()
        batch.checkpoints = {} if value is None else {0: (value, ranks)}

    @property
    def preemption(self) -> PreemptionNotice | None:
        """The preemption notice in effect as the step was handed over, or None."""
        return self._batch.preemption

    @preemption.setter
    def preemption(self, value: PreemptionNotice | None) -> None:
        self._own().preemption = value

    def _own(self) -> StepBatch:
        """This step's batch, made its own first when it shares one (before a field of it is
        set: the other steps of the batch keep theirs)."""
        batch, i = self._batch, self._i
        if batch.size == 1:
            return batch
        self.reports  # noqa: B018  (built from the shared batch, then kept)
        own = StepBatch(
            batch.first + i,
            batch.attempt,
            [batch.row(i)],
            {0: batch.checkpoints[i]} if i in batch.checkpoints else {},
            None if batch.versions is None else [batch.versions[i]],
            None if batch.ranks is None else [batch.ranks[i]],
            None if batch.times is None else batch.times.part(i, i + 1),
        )
        own.preemption = batch.preemption
        self._batch, self._i = own, 0
        return own

    @property
    def reports(self) -> Sequence[Report]:
        """One Report per rank, in rank order."""
        reports = self._reports
        if reports is None:
            batch, i = self._batch, self._i
            row = batch.row(i)
            versions = batch.versions[i] if batch.versions is not None else (None,) * len(row)
            reports = [
                Report(rank, metrics, None, version)
                for rank, (metrics, version) in enumerate(zip(row, versions, strict=True))
            ]
            checkpoint, ranks = batch.checkpoints.get(i, _NO_CHECKPOINT)
            if batch.ranks is not None:  # an unaligned step: one report, of this rank
                reports[0].rank = batch.ranks[i]
                if ranks:
                    reports[0].checkpoint = checkpoint
            else:
                for rank in ranks:
                    reports[rank].checkpoint = checkpoint
            self._reports = reports
        return reports

    @property
    def rank(self) -> int | None:
        """The rank of an unaligned step's one report (a run of independent ranks); None for a
        step of every rank."""
        ranks = self._batch.ranks
        return None if ranks is None else ranks[self._i]

    @property
    def versions(self) -> tuple[int | None, ...]:
        """The weight version each rank held when it reported (None where it held none), in
        rank order; see :class:`WeightChannel`."""
        versions = self._batch.versions
        if versions is not None:
            return versions[self._i]
        return tuple(r.version for r in self.reports)

    @property
    def arrivals(self) -> Mapping[int, float]:
        """When each rank made its report of this step (called ``report()``), in seconds after
        the first rank's, by rank: ``{0: 0.0, 1: 0.0021, 2: 0.0004}``; the slowest rank has the
        largest. Each time is taken on its worker's own clock and placed on the driver's (to
        within the time a poll takes to arrive), so the clocks of different nodes need not
        agree. One rank's step (independent ranks) has ``{rank: 0.0}``; empty when not known
        (a step made by hand).

        Under backpressure the ranks that are ahead wait for credit, so a slow rank's report
        can come as much as ``buffer_size`` steps after the others': see :attr:`durations` for
        each rank's own speed."""
        batch = self._batch
        if batch.times is not None:
            return batch.times.arrivals(self._i)
        rank = self.rank
        return {rank: 0.0} if rank is not None else {}

    @property
    def skew(self) -> float:
        """Seconds between the first and the last rank's report of this step: how long the
        step waited for its slowest rank (the largest of :attr:`arrivals`; 0.0 when not
        known)."""
        batch = self._batch
        if batch.times is not None:
            return batch.times.skew(self._i)
        return 0.0

    @property
    def durations(self) -> Mapping[int, float]:
        """How long each rank's function ran for this step, in seconds, by rank: from the end of
        its previous ``report()`` (or its start) to this ``report()``, on its own clock. The
        time ``report()`` waited for credit (for the consumer) is not in it, so a rank held back
        by a slower one still shows its own speed: the straggler has the longest (see
        :class:`HealthChecks`). Empty when not known (a step of independent ranks, or made by
        hand)."""
        batch = self._batch
        if batch.times is not None:
            return batch.times.durations(self._i)
        return {}

    @property
    def metrics(self) -> Mapping[str, Any]:
        """Rank 0's metrics."""
        if self._reports is None:
            return self._batch.first_metrics(self._i)
        return self._reports[0].metrics

    def __repr__(self) -> str:
        return (
            f"Step(index={self.index}, attempt={self.attempt}, metrics={self.metrics!r}, "
            f"ranks={len(self.reports)}{', checkpoint' if self.checkpoint else ''})"
        )

    def __reduce__(self) -> tuple[Any, ...]:
        return (
            Step,
            (
                self.index,
                self.attempt,
                list(self.reports),
                self.checkpoint,
                self.rank,
                self.preemption,
            ),
        )


class StepTimes(NamedTuple):
    """When the ranks made their reports of a batch of ``steps`` steps (see ``ReportTimes``):
    the times ``report()`` was called on each worker's clock, and how long its function ran
    before each, rank by rank (entry ``r * steps + i`` is rank r's of step i; NaN where not
    known); and per rank the offset from its worker's clock to the driver's. Two arrays a batch,
    whatever the number of ranks: the driver makes no object per rank and step."""

    calls: array[float]
    busy: array[float]
    offsets: list[float]
    steps: int

    def part(self, start: int, stop: int) -> StepTimes:
        """The times of steps ``start .. stop - 1`` of the batch (``stop`` at most its end)."""
        n, ranks = self.steps, len(self.offsets)
        stop = min(stop, n)
        keep = [r * n + i for r in range(ranks) for i in range(start, stop)]
        calls, busy = self.calls, self.busy
        return StepTimes(
            array("d", [calls[k] for k in keep]),
            array("d", [busy[k] for k in keep]),
            self.offsets,
            stop - start,
        )

    def column(self, i: int) -> array[float]:
        """Step ``i``'s busy times, rank by rank."""
        return self.busy[i :: self.steps]

    def _on_driver(self, i: int) -> list[float]:
        """Step ``i``'s report times of every rank, on the driver's clock."""
        return [c + o for c, o in zip(self.calls[i :: self.steps], self.offsets, strict=True)]

    def arrivals(self, i: int) -> dict[int, float]:
        """Step ``i``'s report times, in seconds after the first rank's, by rank (the ranks
        whose time is not known left out)."""
        known = [(r, t) for r, t in enumerate(self._on_driver(i)) if t == t]
        if not known:
            return {}
        first = min(t for _, t in known)
        return {r: t - first for r, t in known}

    def skew(self, i: int) -> float:
        """Seconds between the first and the last rank's report of step ``i``."""
        known = [t for t in self._on_driver(i) if t == t]
        return max(known) - min(known) if known else 0.0

    def durations(self, i: int) -> dict[int, float]:
        """How long each rank's function ran for step ``i``, by rank."""
        return {r: b for r, b in enumerate(self.column(i)) if b == b}


class StepBatch:
    """Complete steps as they travel from the driver task to the iterator: the ranks' metrics
    and the few checkpoints. The iterator makes each :class:`Step` when the consumer asks for
    it, so steps that are consumed and dropped are freed at once instead of piling up in the
    garbage collector's older generations (which cost the event loop tens of milliseconds per
    full collection).

    The metrics are held as rows (one tuple per step, an entry per rank) or as columns (one
    list per rank, an entry per step, ``columns=``): the assembly of many steps of a few ranks
    makes columns, which cost a list per rank and batch instead of a tuple per step."""

    __slots__ = (
        "_rows",
        "attempt",
        "checkpoints",
        "columns",
        "first",
        "preemption",
        "ranks",
        "size",
        "times",
        "versions",
    )

    def __init__(
        self,
        first: int,
        attempt: int,
        rows: list[tuple[dict[str, Any], ...]] | None,
        checkpoints: dict[int, tuple[Checkpoint, tuple[int, ...]]],
        versions: list[tuple[int | None, ...]] | None = None,
        ranks: list[int] | None = None,
        times: StepTimes | None = None,
        *,
        columns: list[list[dict[str, Any]]] | None = None,
    ) -> None:
        self.first = first
        self.attempt = attempt
        self._rows = rows
        #: Per rank, its metrics of each step (when made from columns; else None).
        self.columns = columns
        self.size = len(rows) if rows is not None else len(columns[0]) if columns else 0
        self.checkpoints = checkpoints
        self.versions = versions
        #: Unaligned steps (independent ranks): each row is one report of this rank.
        self.ranks = ranks
        #: When each rank made its reports (aligned steps; None for unaligned ones).
        self.times = times
        #: The preemption notice in effect when the batch was handed over (every step's).
        self.preemption: PreemptionNotice | None = None

    def __len__(self) -> int:
        return self.size

    @property
    def rows(self) -> list[tuple[dict[str, Any], ...]]:
        """One tuple of metrics per step, an entry per rank."""
        if self._rows is None:
            self._rows = list(zip(*(self.columns or ()), strict=True))
        return self._rows

    def row(self, i: int) -> tuple[dict[str, Any], ...]:
        """Step ``i``'s metrics, rank by rank."""
        if self._rows is not None:
            return self._rows[i]
        return tuple([column[i] for column in self.columns or ()])

    def first_metrics(self, i: int) -> dict[str, Any]:
        """Step ``i``'s metrics of its first rank (rank 0's, or an unaligned step's one)."""
        if self._rows is not None:
            return self._rows[i][0]
        assert self.columns is not None
        return self.columns[0][i]

    @property
    def num_ranks(self) -> int:
        """The reports in each step."""
        if self._rows is not None:
            return len(self._rows[0]) if self._rows else 0
        return len(self.columns or ())

    def step(self, i: int) -> Step:
        """The i-th step of the batch (its reports are built when first read)."""
        step = object.__new__(Step)
        step._batch = self
        step._i = i
        step._reports = None
        return step

    def split(self, size: int) -> list[StepBatch]:
        """This batch cut into batches of at most ``size`` steps."""
        if self.size <= size:
            return [self]
        rows, columns = self._rows, self.columns
        parts = [
            StepBatch(
                self.first + start,
                self.attempt,
                rows[start : start + size] if rows is not None else None,
                {i - start: c for i, c in self.checkpoints.items() if start <= i < start + size},
                self.versions[start : start + size] if self.versions is not None else None,
                self.ranks[start : start + size] if self.ranks is not None else None,
                self.times.part(start, start + size) if self.times is not None else None,
                columns=None if columns is None else [c[start : start + size] for c in columns],
            )
            for start in range(0, self.size, size)
        ]
        for part in parts:
            part.preemption = self.preemption
        return parts


@dataclass(frozen=True)
class RunResult:
    """How a finished run ended.

    Attributes:
        run_id: the run's id (also the folder of its checkpoints under the storage path).
        return_values: what ``fn`` returned on each rank, in rank order.
        checkpoint: the latest persisted checkpoint, or the starting one, or None.
        steps: how many steps were delivered, over all attempts (the stream's length: for a
            named run resumed by a new driver, the steps up to the checkpoint it resumed from
            count, made by the dead driver).
        attempts: how many attempts ran (1 when nothing failed and the group was neither
            resized nor moved off preempted nodes, each of which starts one more; for
            independent ranks, 1 plus the ranks replaced; for a resumed named run, the dead
            driver's attempts count too).
        failures: the error that ended each failed attempt (or rank), in order (a worker lost
            to a preemption included).
        checkpoints: for independent ranks, each rank's latest checkpoint (else empty).
        preemption_notices: each preemption notice the run received, in order (a node marked,
            or its deadline changed).
    """

    run_id: str
    return_values: list[Any]
    checkpoint: Checkpoint | None
    steps: int
    attempts: int
    failures: list[BaseException] = field(default_factory=list)
    checkpoints: list[Checkpoint | None] = field(default_factory=list)
    preemption_notices: list[PreemptionNotice] = field(default_factory=list)
