"""What Prometheus metrics and the straggler watch cost the report stream at full rate: the same
run of tiny reports on 4 workers, interleaved rounds, the order alternating each round.

    python benchmarks/report_costs.py               # 10 rounds: about a minute on 2 cores
    python benchmarks/report_costs.py --quick       # 2 rounds of a few reports

Two executors of 4 workers: one with the straggler watch (the default), one without
(``straggler_factor=None``). Each round runs, in an order that alternates: the watched executor
plain, the unwatched one, and the watched one with Prometheus metrics on and scraped every 0.5 s,
each scrape asking the workers for their backlog (``run.metrics_on``). Printed: each case's
median reports/s, and the medians of the paired ratios (metrics on / off, watched / not) over the
rounds, with their spread.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import sys
import time
from collections.abc import Awaitable, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)

import psutil  # noqa: E402
import ray  # noqa: E402
from _common import median, progress  # noqa: E402
from _workload import ae_steps  # noqa: E402
from run import RESOURCES, metrics_on, start_ray  # noqa: E402 (sets the workers' environment)

import asyncexec  # noqa: E402

WORKERS = 4


async def rate(ex: asyncexec.Executor, steps: int) -> float:
    """Reports/s of one run of ``steps`` tiny reports a rank, from ``run()`` to its last step."""
    t0 = time.perf_counter()
    count = 0
    async for _ in ex.run(ae_steps, {"steps": steps}):
        count += 1
    assert count == steps
    return steps * WORKERS / (time.perf_counter() - t0)


async def main_async(rounds: int, steps: int) -> list[str]:
    watched = asyncexec.Executor(WORKERS, resources_per_worker=RESOURCES, name="watched")
    unwatched = asyncexec.Executor(
        WORKERS,
        resources_per_worker=RESOURCES,
        health=asyncexec.HealthChecks(straggler_factor=None),
        name="unwatched",
    )
    samples: dict[str, list[float]] = {"off": [], "unwatched": [], "metrics": []}

    async def metered() -> float:
        with metrics_on():
            return await rate(watched, steps)

    cases: list[tuple[str, Callable[[], Awaitable[float]]]] = [
        ("off", lambda: rate(watched, steps)),
        ("unwatched", lambda: rate(unwatched, steps)),
        ("metrics", metered),
    ]
    async with watched, unwatched:
        await rate(watched, steps)  # warm-up: imports, the function's export
        await rate(unwatched, steps)
        for i in range(rounds):
            progress(f"round {i + 1} of {rounds}")
            for name, measure in cases if i % 2 == 0 else cases[::-1]:
                samples[name].append(await measure())

    def pairs(a: str, b: str) -> str:
        ratios = [x / y for x, y in zip(samples[a], samples[b], strict=True)]
        return (
            f"{median(ratios):.2f}x (paired ratios {min(ratios):.2f}-{max(ratios):.2f}; "
            f"medians {median(samples[a]):,.0f} and {median(samples[b]):,.0f} reports/s)"
        )

    return [
        f"- watched (the default), metrics off: {median(samples['off']):,.0f} reports/s",
        f"- Prometheus metrics on / off: {pairs('metrics', 'off')}",
        f"- straggler watch on / off: {pairs('off', 'unwatched')}",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 rounds of 2,000 reports a rank")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=20_000, help="reports a rank a run")
    args = parser.parse_args(argv)
    rounds, steps = (2, 2000) if args.quick else (args.rounds, args.steps)
    start_ray()
    try:
        lines = asyncio.run(main_async(rounds, steps))
    finally:
        ray.shutdown()
    print(
        f"\nThe report stream's costs, {WORKERS} workers x {steps:,} tiny reports, {rounds} "
        f"interleaved rounds, {time.strftime('%Y-%m-%d %H:%M')}, "
        f"{psutil.cpu_count(logical=True)} cores ({platform.machine()}); every worker {RESOURCES}"
    )
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
