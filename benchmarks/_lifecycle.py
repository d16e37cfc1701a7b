"""Event-loop lag through whole lifecycles, not only while streaming.

Several asyncexec executors share one event loop. Each one, ``cycles`` times: enters (``async
with``), streams ``steps`` steps at full rate, loses a worker to SIGKILL half-way (the driver
kills the process with ``os.kill``), restarts (``RestartPolicy(max_restarts=1,
wait=tenacity.wait_none())``: the whole group is replaced), streams the rest, finishes (the
``async for`` ends) and closes. A 1 ms heartbeat runs throughout and records, for every wake-up,
when it was due and when it woke. The reference is the same heartbeat beside the batched floor
(``LoopGroup.floor``) doing the same streaming: as many groups of as many plain actors, each
streaming ``steps`` steps ``cycles`` times, all at once. On a loaded 2-core machine the operating
system's scheduling sets a floor under any absolute figure, so the figures are ratios to the
floor's, measured in the same run with the repeats interleaved. Every round starts after a
``gc.collect()``, so that no garbage collection left pending by the rounds before falls into it
(a full collection walks the driver's whole heap, most of it Ray's modules: tens of ms).

Phases. Each executor marks the phase it is in, on the event loop, at the moment it changes:

- ``entering``: from calling ``__aenter__`` until it returns;
- ``streaming``: from calling ``run()`` until the driver kills a worker, and again from the
  resumed attempt's first step until the last step arrives;
- ``restarting``: from ``os.kill`` until the first step of attempt 2;
- ``finishing``: from the last step until the ``async for`` ends (the run's result is set);
- ``closing``: ``__aexit__``.

Attribution rule. A heartbeat sample stands for the interval from when its timer was due to when
it woke: the loop was busy (or the process was not running) for all of it. The sample counts
toward every phase that any executor was in at any moment of that interval, so one stall can
count toward several phases (the executor that blocked the loop usually changes its phase right
after the blocking code returns, inside the same interval). ``streaming alone`` is the samples
whose only phase is ``streaming``: every executor that was doing anything was streaming. The
whole lifecycle is every sample, from the moment the executors start entering until the last one
has closed.

Only asyncexec's public API is used.
"""

from __future__ import annotations

import asyncio
import gc
import math
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import tenacity
from _common import Collection, Heartbeat, gc_log, median, percentile, progress
from _systems import LoopGroup
from _workload import ae_lifecycle

import asyncexec

__all__ = ["LifecycleResult", "PHASES", "measure_lifecycle"]

#: The phases of an executor's lifecycle, in order.
PHASES = ("entering", "streaming", "restarting", "finishing", "closing")
#: The rank whose process the driver kills on attempt 1.
VICTIM = 1
#: A lag counted as a stall in the breakdown (ms).
STALL_MS = 10.0
#: How many of the worst stalls the notes show.
TOP = 5


# Recording ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Span:
    """One executor (``who``) in one phase from ``start`` to ``end`` (perf_counter seconds)."""

    who: str
    phase: str
    start: float
    end: float


class PhaseLog:
    """The phase each executor is in, as spans. Marked on the event loop."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self._open: dict[str, tuple[str, float]] = {}

    def enter(self, who: str, phase: str) -> None:
        now = time.perf_counter()
        self._close(who, now)
        self._open[who] = (phase, now)

    def end(self, who: str) -> None:
        self._close(who, time.perf_counter())

    def end_all(self) -> None:
        now = time.perf_counter()
        for who in list(self._open):
            self._close(who, now)

    def _close(self, who: str, now: float) -> None:
        current = self._open.pop(who, None)
        if current is not None:
            self.spans.append(Span(who, current[0], current[1], now))


@dataclass
class Round:
    """One measured round: the heartbeat's samples, the phases and the GCs."""

    kind: str  # "lifecycle" or "floor"
    repeat: int
    t0: float
    t1: float
    beats: list[tuple[float, float]]
    spans: list[Span]
    gcs: list[Collection]

    def lags_ms(self) -> list[float]:
        return [max(0.0, woke - due) * 1e3 for due, woke in self.beats]

    def attributed(self) -> list[Sample]:
        """Every heartbeat sample with the spans active during it (see the module's rule)."""
        spans = sorted(self.spans, key=lambda s: s.start)
        out = []
        for due, woke in self.beats:
            lo = min(due, woke)
            active = tuple(s for s in spans if s.start <= woke and s.end >= lo)
            out.append(Sample(self, due, woke, active))
        return out


@dataclass(frozen=True)
class Sample:
    round: Round
    due: float
    woke: float
    spans: tuple[Span, ...]

    @property
    def lag_ms(self) -> float:
        return max(0.0, self.woke - self.due) * 1e3

    @property
    def phases(self) -> frozenset[str]:
        return frozenset(s.phase for s in self.spans)


# The two scenarios ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    executors: int
    workers: int
    steps: int
    cycles: int
    resources: dict[str, float]
    storage: str

    @property
    def kill_at(self) -> int:
        return max(1, self.steps // 2)


async def _one_lifecycle(scenario: Scenario, who: str, phases: PhaseLog) -> None:
    """Enter, stream, SIGKILL a worker, restart, finish, close; phases marked as they change."""
    executor = asyncexec.Executor(
        scenario.workers,
        resources_per_worker=scenario.resources,
        restart=asyncexec.RestartPolicy(max_restarts=1, wait=tenacity.wait_none()),
        storage_path=scenario.storage,
        name=who,
    )
    config = {
        "steps": scenario.steps,
        "kill_at": scenario.kill_at,
        "victim": VICTIM,
        "hold_s": 300.0,
    }
    phases.enter(who, "entering")
    await executor.__aenter__()
    try:
        phases.enter(who, "streaming")
        count = 0
        killed = resumed = False
        async for step in executor.run(ae_lifecycle, config):
            count += 1
            if not killed and step.attempt == 1 and count == scenario.kill_at:
                pid = executor.workers[VICTIM].pid
                phases.enter(who, "restarting")
                os.kill(pid, signal.SIGKILL)
                killed = True
            elif not resumed and step.attempt > 1:
                phases.enter(who, "streaming")
                resumed = True
            if count == scenario.steps:
                phases.enter(who, "finishing")
        if count != scenario.steps or not resumed:
            raise RuntimeError(
                f"{who}: {count} of {scenario.steps} steps, resumed after the kill: {resumed}"
            )
    finally:
        phases.enter(who, "closing")
        await executor.__aexit__(None, None, None)
        phases.end(who)


async def lifecycle_round(scenario: Scenario, repeat: int) -> Round:
    """The executors' lifecycles, all at once in this loop, beside the heartbeat."""
    phases = PhaseLog()

    async def executor_cycles(who: str) -> None:
        for _ in range(scenario.cycles):
            await _one_lifecycle(scenario, who, phases)

    gc.collect()  # every round starts with no collection pending from the rounds before
    with gc_log() as gcs:
        async with Heartbeat() as hb:
            t0 = time.perf_counter()
            try:
                async with asyncio.TaskGroup() as tg:
                    for i in range(scenario.executors):
                        tg.create_task(executor_cycles(f"ex{i}"))
            finally:
                phases.end_all()
            t1 = time.perf_counter()
    return Round("lifecycle", repeat, t0, t1, hb.beats(), phases.spans, gcs)


async def floor_round(scenario: Scenario, groups: Sequence[LoopGroup], repeat: int) -> Round:
    """The reference: the batched floor's groups stream the same steps, all at once."""
    phases = PhaseLog()

    async def streams(i: int, group: LoopGroup) -> None:
        who = f"floor{i}"
        phases.enter(who, "streaming")
        for _ in range(scenario.cycles):
            await group.floor(scenario.steps)
        phases.end(who)

    gc.collect()  # every round starts with no collection pending from the rounds before
    with gc_log() as gcs:
        async with Heartbeat() as hb:
            t0 = time.perf_counter()
            async with asyncio.TaskGroup() as tg:
                for i, group in enumerate(groups):
                    tg.create_task(streams(i, group))
            t1 = time.perf_counter()
    return Round("floor", repeat, t0, t1, hb.beats(), phases.spans, gcs)


# Results ----------------------------------------------------------------------------------------


def _p99_max(lags: Sequence[float]) -> tuple[float, float]:
    return percentile(lags, 99), max(lags, default=math.nan)


@dataclass
class LifecycleResult:
    scenario: Scenario
    rounds: list[Round] = field(default_factory=list)

    def per_repeat(self) -> list[dict[str, float]]:
        """Per repeat: p99 and max (ms) of the floor's streaming, of the whole lifecycles, and of
        the lifecycles' samples while streaming alone."""
        out = []
        repeats = sorted({r.repeat for r in self.rounds})
        for rep in repeats:
            row: dict[str, float] = {}
            for r in self.rounds:
                if r.repeat != rep:
                    continue
                if r.kind == "floor":
                    row["floor_p99"], row["floor_max"] = _p99_max(r.lags_ms())
                else:
                    row["life_p99"], row["life_max"] = _p99_max(r.lags_ms())
                    alone = [
                        s.lag_ms for s in r.attributed() if s.phases == frozenset({"streaming"})
                    ]
                    row["alone_p99"], row["alone_max"] = _p99_max(alone)
                    row["seconds"] = r.t1 - r.t0
            out.append(row)
        return out

    def notes(self) -> list[str]:
        """The per-phase breakdown and the worst stalls."""
        sc = self.scenario
        life = [r for r in self.rounds if r.kind == "lifecycle"]
        floor = [r for r in self.rounds if r.kind == "floor"]
        samples = [s for r in life for s in r.attributed()]
        lines = [
            f"- event-loop lag through whole lifecycles ({sc.executors} executors x {sc.workers} "
            f"workers in one loop, each {sc.cycles}x: enter, stream {sc.steps:,} steps, SIGKILL "
            f"rank {VICTIM} at step {sc.kill_at:,}, restart, finish, close; 1 ms heartbeat; "
            f"{len(life)} repeat(s) pooled; a sample counts toward every phase any executor was "
            f"in while it was overdue):"
        ]
        rows: list[tuple[str, list[float]]] = [("whole lifecycle", [s.lag_ms for s in samples])]
        for phase in PHASES:
            rows.append((phase, [s.lag_ms for s in samples if phase in s.phases]))
            if phase == "streaming":
                rows.append(
                    (
                        "streaming alone",
                        [s.lag_ms for s in samples if s.phases == frozenset({"streaming"})],
                    )
                )
        rows.append(("floor streaming (reference)", [lag for r in floor for lag in r.lags_ms()]))
        width = max(len(name) for name, _ in rows)
        lines.append(f"    {'phase'.ljust(width)}  samples   p99 ms    max ms  > {STALL_MS:.0f} ms")
        for name, lags in rows:
            p99, worst = _p99_max(lags)
            over = sum(1 for lag in lags if lag > STALL_MS)
            lines.append(
                f"    {name.ljust(width)}  {len(lags):7,d}  {p99:7.2f}  {worst:8.1f}  {over:7,d}"
            )
        durations: dict[str, list[float]] = {}
        for r in life:
            for span in r.spans:
                durations.setdefault(span.phase, []).append(span.end - span.start)
        lines.append(
            "- lifecycle phases, median length of one (s): "
            + ", ".join(f"{p} {median(durations[p]):.3f}" for p in PHASES if p in durations)
            + f"; one round (every executor's {sc.cycles} lifecycle(s)): "
            + f"{median([r.t1 - r.t0 for r in life]):.1f} s"
        )
        for rounds, what in ((life, "lifecycles"), (floor, "floor")):
            full = [c for r in rounds for c in r.gcs if c.generation == 2]
            longest = max(full, key=lambda c: c.end - c.start, default=None)
            text = (
                f"- driver garbage collections during the {what} rounds: "
                f"{sum(len(r.gcs) for r in rounds)}, of them {len(full)} full"
            )
            if longest is not None:
                text += (
                    f"; the longest full one {(longest.end - longest.start) * 1e3:.1f} ms wall, "
                    f"{longest.cpu_s * 1e3:.1f} ms CPU, {longest.collected:,} objects "
                    f"collected; all full ones "
                    f"{sum(c.end - c.start for c in full) * 1e3:.0f} ms wall"
                )
            lines.append(text)
        stalls = sorted(samples, key=lambda s: s.lag_ms, reverse=True)[:TOP]
        lines.append(
            f"- the {len(stalls)} worst stalls of the lifecycles (s from the round's start; each "
            f"executor's phases during the stall, in order):"
        )
        for s in stalls:
            lines.append(f"    {self._describe(s)}")
        return lines

    def _describe(self, s: Sample) -> str:
        r = s.round
        by_who: dict[str, list[str]] = {}
        for span in sorted(s.spans, key=lambda x: x.start):
            by_who.setdefault(span.who, []).append(span.phase)
        phases = ", ".join(f"{who} {'->'.join(ps)}" for who, ps in sorted(by_who.items()))
        text = (
            f"{s.lag_ms:7.1f} ms  repeat {r.repeat + 1} at +{s.due - r.t0:6.2f} s: "
            f"{phases or 'no executor active'}"
        )
        gcs = [c for c in r.gcs if c.start <= s.woke and c.end >= s.due and c.generation > 0]
        if gcs:
            text += "; gc " + ", ".join(
                f"gen{c.generation} {(c.end - c.start) * 1e3:.1f} ms ({c.cpu_s * 1e3:.1f} CPU, "
                f"{c.collected:,} collected)"
                for c in gcs
            )
        return text


# Entry point ------------------------------------------------------------------------------------


async def measure_lifecycle(
    *,
    executors: int,
    workers: int,
    steps: int,
    cycles: int,
    repeats: int,
    resources: dict[str, float],
    bound: int,
    storage: str,
    warm_up: bool = True,
) -> LifecycleResult:
    """Interleave ``repeats`` floor rounds and lifecycle rounds; return every round. ``warm_up``:
    first one unrecorded lifecycle (not needed when asyncexec has run in this process)."""
    scenario = Scenario(executors, workers, steps, cycles, resources, storage)
    result = LifecycleResult(scenario)
    groups = [LoopGroup(workers, resources, bound) for _ in range(executors)]
    try:
        await asyncio.gather(*(g.start() for g in groups))
        if warm_up:
            # One unrecorded lifecycle pays the one-time costs (the driver's lazy imports,
            # exporting the function to the cluster) that a long-lived application pays once.
            progress("lifecycle lag: warm-up (one executor, unrecorded)")
            warm = Scenario(1, workers, min(steps, 200), 1, resources, storage)
            await asyncio.wait_for(_one_lifecycle(warm, "warm-up", PhaseLog()), 300)
            await floor_round(warm, groups[:1], -1)
        for rep in range(repeats):
            progress(f"lifecycle lag, repeat {rep + 1}: the floor streaming")
            result.rounds.append(await floor_round(scenario, groups, rep))
            progress(f"lifecycle lag, repeat {rep + 1}: {executors} executors' lifecycles")
            result.rounds.append(await asyncio.wait_for(lifecycle_round(scenario, rep), 600))
    finally:
        await asyncio.gather(*(g.close() for g in groups if g.actors))
    return result
