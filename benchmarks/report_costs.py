"""What Prometheus metrics and the straggler watch cost the report stream at full rate: the same
run of tiny reports on 4 workers, interleaved rounds, the order alternating each round.

    python benchmarks/report_costs.py               # 10 rounds: about a minute on 2 cores
    python benchmarks/report_costs.py --quick       # 2 rounds of a few reports
    python benchmarks/report_costs.py --repeats 20 --steps 50000

Two executors of 4 workers: one with the straggler watch (the default), one without
(``straggler_factor=None``). Each round runs, in an order that alternates: the watched executor
plain, the unwatched one, and the watched one with Prometheus metrics on and scraped every 0.5 s,
each scrape asking the workers for their backlog (``run.metrics_on``). Printed: each case's
median reports/s, the ratios (metrics on / off, watched / not) and the medians of the paired
ratios over the rounds, with their range.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import _harness
from _harness import Result, Row, Table
from _workload import ae_steps
from run import RAY_CPUS, RESOURCES, metrics_on

import asyncexec

WORKERS = 4


async def rate(ex: asyncexec.Executor, steps: int) -> float:
    """Reports/s of one run of ``steps`` tiny reports a rank, from ``run()`` to its last step."""
    t0 = time.perf_counter()
    count = 0
    async for _ in ex.run(ae_steps, {"steps": steps}):
        count += 1
    assert count == steps
    return steps * WORKERS / (time.perf_counter() - t0)


@dataclass(frozen=True)
class Sizes:
    repeats: int  # rounds
    steps: int  # reports a rank a run


FULL, QUICK = Sizes(10, 20_000), Sizes(2, 2000)
#: The rows: the measured case over the reference case, each round's paired.
TABLE = Table(
    [("off", "watched, metrics off"), ("unwatched", "unwatched"), ("metrics", "metrics on")],
    [(None, "measured / reference")],
    paired=True,
    spread=True,
)


async def bench(sizes: Sizes, args: argparse.Namespace) -> Result:
    watched = asyncexec.Executor(WORKERS, resources_per_worker=RESOURCES, name="watched")
    unwatched = asyncexec.Executor(
        WORKERS,
        resources_per_worker=RESOURCES,
        health=asyncexec.HealthChecks(straggler_factor=None),
        name="unwatched",
    )
    rows = [
        Row("Prometheus metrics on / off", "reports/s", measured="metrics", reference="off"),
        Row("straggler watch on / off", "reports/s", measured="off", reference="unwatched"),
    ]

    async def metered() -> float:
        with metrics_on():
            return await rate(watched, sizes.steps)

    cases: dict[str, Callable[[], Awaitable[float]]] = {
        "off": lambda: rate(watched, sizes.steps),
        "unwatched": lambda: rate(unwatched, sizes.steps),
        "metrics": metered,
    }
    async with watched, unwatched:
        # The warm-up: imports, the function's export.
        await _harness.repeat(rows[:1], cases, sizes.repeats, name="rounds")
    for column in cases:
        rows[1].values[column] = rows[0].values[column]
    return Result(rows, TABLE)


def main(argv: list[str] | None = None) -> int:
    return _harness.main(
        argv,
        doc=__doc__,
        title=f"the report stream's costs, {WORKERS} workers x tiny reports",
        full=FULL,
        quick=QUICK,
        run=bench,
        ray={"num_cpus": RAY_CPUS},
        options=lambda parser: parser.add_argument(
            "--steps", type=int, help="reports a rank a run (20,000)"
        ),
        about=lambda sizes, args: (
            f"{sizes.steps:,} reports a rank a run, {sizes.repeats} interleaved rounds; "
            f"every worker {RESOURCES}"
        ),
    )


if __name__ == "__main__":
    sys.exit(main())
