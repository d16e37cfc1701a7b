"""The straggler watch: how long after a rank turns slow the ``straggler`` event names it, what
the watch costs, and that a balanced run fires nothing; on Ray actors and on simulated ranks.

    python benchmarks/stragglers.py            # 5 trials a group: about 2 minutes on 2 cores
    python benchmarks/stragglers.py --quick    # 1 trial a group: a smoke run

Each trial runs aligned steps of ``STEP_S`` on every rank (a sleep: the ranks' own work). One
rank turns 3x slower at a step drawn at random past the first window (a slowdown comes at any
point of a window), and the run goes on until the event names it. Measured:

- **delay**: from the slow rank's first slow step starting (on its worker, on this machine's
  monotonic clock, which the driver shares) to the driver logging ``straggler`` for it, in
  seconds and in the slow rank's steps. The watch judges windows of ``straggler_steps`` (10)
  steps in which a rank was slow in every step, so the delay lies between one window and two
  of slow steps, plus reading its stack (py-spy, from outside, when installed).
- **false events**: ``straggler`` events in a balanced run of as many steps (expected 0).
- **cost**: the driver loop's CPU per rank-report in a balanced run with the watch (the
  default) and without it (``straggler_factor=None``), the same run interleaved.

Ray Train (v1 and v2) has no such event: a user finds the slow rank by running py-spy on each
worker by hand. So there is no column for it here; the cost row's "without" column is the
floor the watch adds to.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

import _harness
import structlog
from _common import median, progress
from _harness import Grid, Result
from _scale_workload import turns_slow

import asyncexec
from asyncexec._driver.cluster import SimCluster, SimLoad

STEP_S, SLOW_FACTOR, WINDOW = 0.01, 3.0, 10
#: Simulated ranks' step (1,024 ranks at 10 steps/s: 10,240 reports/s on the driver's loop).
SIM_STEP_S = 0.1
RAY_RANKS, SIM_RANKS, SLOW_RANK = 4, 1024, 2
#: A balanced run for the cost and false-event rows: this many steps.
BALANCED_STEPS = 300


class Straggled:
    """The structlog processor of this benchmark: records when each ``straggler`` event was
    logged (``time.monotonic()``) and drops every event."""

    def __init__(self) -> None:
        self.events: list[tuple[float, dict[str, Any]]] = []

    def __call__(self, logger: Any, method: str, event_dict: MutableMapping[str, Any]) -> Any:
        if event_dict.get("event") == "straggler":
            self.events.append((time.monotonic(), dict(event_dict)))
        raise structlog.DropEvent

    def delay(self, mark: int, started: float | None) -> float:
        """Seconds from ``started`` (the slow rank's first slow step) to the first event after
        ``mark``, which must name SLOW_RANK."""
        events = self.events[mark:]
        assert started is not None and events, "the slow rank was not named"
        assert events[0][1]["rank"] == SLOW_RANK, events
        return events[0][0] - started


async def ray_trial(executor: asyncexec.Executor, seen: Straggled, slow_from: int) -> float:
    """One run whose SLOW_RANK turns slow at step ``slow_from``; the delay to its event, s."""
    mark = len(seen.events)
    config = {
        "step_s": STEP_S,
        "slow_rank": SLOW_RANK,
        "slow_from": slow_from,
        "factor": SLOW_FACTOR,
        "steps": slow_from + 4 * WINDOW,
    }
    started = None
    async for step in executor.run(turns_slow, config):
        report = step.reports[SLOW_RANK].metrics
        if report.get("slow_since") is not None and started is None:
            started = report["slow_since"]
        if len(seen.events) > mark:
            break
    return seen.delay(mark, started)


async def sim_trial(n: int, seen: Straggled, slow_from: int) -> float:
    """The same on ``n`` simulated ranks (steps of SIM_STEP_S), one of which is slow from step
    ``slow_from``; the delay from its first slow step's start (its report time less its step
    time, on the shared monotonic clock) to the event."""
    mark = len(seen.events)
    load = SimLoad(
        reports=slow_from + 4 * WINDOW,
        rate=1.0 / SIM_STEP_S,
        slow={SLOW_RANK: SLOW_FACTOR},
        slow_from=slow_from,
        tagged=False,
    )
    started = None
    health = asyncexec.HealthChecks(interval_s=None)
    async with asyncexec.Executor(n, health=health, cluster=SimCluster(load)) as ex:
        async for step in ex.run(turns_slow):
            if step.index == slow_from:
                batch = step._batch  # the raw report times the step was built from
                assert batch is not None and batch.times is not None
                times, i = batch.times, step.index - batch.first
                made = times.calls[SLOW_RANK * times.steps + i]
                started = made - SIM_STEP_S * SLOW_FACTOR
            if len(seen.events) > mark:
                break
    return seen.delay(mark, started)


async def cost(executor: asyncexec.Executor) -> float:
    """A balanced run on ``executor`` (its watch on or off): the loop's CPU per rank-report,
    us."""
    t0 = time.thread_time()
    n = 0
    async for step in executor.run(turns_slow, {"step_s": STEP_S / 10, "steps": BALANCED_STEPS}):
        n += len(step.reports)
    return (time.thread_time() - t0) / n * 1e6


async def bench(trials: int) -> list[list[str]]:
    seen = Straggled()
    structlog.configure(processors=[seen])
    rng = random.Random(7)
    starts = [WINDOW + rng.randrange(WINDOW) for _ in range(trials)]
    out = []
    with _harness.ray_session(num_cpus=4, fresh_workers=False):
        resources = {"CPU": 0.5}
        on = asyncexec.Executor(RAY_RANKS, resources_per_worker=resources, name="watched")
        off = asyncexec.Executor(
            RAY_RANKS,
            resources_per_worker=resources,
            health=asyncexec.HealthChecks(straggler_factor=None),
            name="unwatched",
        )
        async with on, off:
            delays = []
            for i, slow_from in enumerate(starts):
                progress(f"Ray actors {RAY_RANKS}: trial {i + 1}/{trials}")
                delays.append(await ray_trial(on, seen, slow_from))
            costs: dict[bool, list[float]] = {True: [], False: []}
            false_events = 0
            for i in range(trials):
                progress(f"Ray actors {RAY_RANKS}: balanced runs {i + 1}/{trials}")
                for watched, executor in ((True, on), (False, off)):
                    mark = len(seen.events)
                    costs[watched].append(await cost(executor))
                    false_events += len(seen.events) - mark
        out.append(
            _row(f"Ray actors, {RAY_RANKS} ranks", STEP_S, delays, costs, false_events, trials)
        )
    delays = []
    for i, slow_from in enumerate(starts):
        progress(f"simulated {SIM_RANKS}: trial {i + 1}/{trials}")
        delays.append(await sim_trial(SIM_RANKS, seen, slow_from))
    out.append(_row(f"simulated, {SIM_RANKS} ranks", SIM_STEP_S, delays, None, None, trials))
    return out


def _row(
    what: str,
    step_s: float,
    delays: list[float],
    costs: dict[bool, list[float]] | None,
    false_events: int | None,
    trials: int,
) -> list[str]:
    slow_step = step_s * SLOW_FACTOR
    delay = median(delays)
    cells = [
        what,
        f"{delay:.2f} ({min(delays):.2f}..{max(delays):.2f})",
        f"{delay / slow_step:.1f}",
    ]
    if costs is None:
        cells += ["-", "-"]
    else:
        on, off = median(costs[True]), median(costs[False])
        cells += [f"{on:.1f} / {off:.1f} ({on / off:.2f}x)", f"{false_events} in {trials}"]
    return cells


@dataclass(frozen=True)
class Sizes:
    trials: int  # of each group


FULL, QUICK = Sizes(5), Sizes(1)
GRID = Grid(
    [
        "group",
        "slow to the event, s (min..max)",
        "in slow steps",
        "driver CPU per rank-report, us: watched / not",
        f"events in balanced runs of {BALANCED_STEPS} steps",
    ]
)


async def run(sizes: Sizes, args: argparse.Namespace) -> Result:
    return Result(await bench(sizes.trials), GRID)


def main(argv: list[str] | None = None) -> int:
    return _harness.main(
        argv,
        doc=__doc__,
        title="asyncexec: the straggler watch",
        full=FULL,
        quick=QUICK,
        run=run,
        options=lambda parser: parser.add_argument("--trials", type=int, help="of each group (5)"),
        about=lambda sizes, args: (
            f"steps of {STEP_S * 1e3:.0f} ms (simulated: {SIM_STEP_S * 1e3:.0f} ms), one rank "
            f"{SLOW_FACTOR:.0f}x slower from a random step, windows of {WINDOW} steps; medians "
            f"of {sizes.trials}"
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
