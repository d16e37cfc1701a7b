"""What the credit window costs in memory: a consumer that stops taking steps, and what every rank
and the driver then hold, for windows (``buffer_size``) of 1,024 and 2,048 reports.

    python benchmarks/report_window.py            # 16 workers: about a minute on 2 cores
    python benchmarks/report_window.py --quick    # 2 workers, small reports only

Each case is a fresh executor of ``--workers`` workers whose function reports as fast as it can
(tiny reports, ``{"step": i}``, or about 1 KB each: a 1,000-character string made per report).
The consumer takes one step and stops; once every rank is held back by the window (its count of
``report()`` calls no longer grows), the figures are read:

- **ahead**: how many reports each rank made beyond the steps the consumer took (the most over
  the ranks): how far behind the consumer may fall;
- **worker**: each worker process's RSS growth from before the run (median and most over the
  ranks), and the Python memory the function's process allocated and still holds (tracemalloc,
  started by the function itself: the reports, their times and any poll's answer);
- **driver**: the Python memory the driver allocated during the run and still holds
  (tracemalloc, started at the run's start: the unconsumed reports it received, their steps)
  and its RSS growth.

The RSS figures move by the allocator's pages; tracemalloc's are the objects themselves.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tracemalloc
from dataclasses import dataclass
from typing import Any

import _harness
import psutil
from _common import MiB, median, progress
from _harness import Grid, Result

import asyncexec

WINDOWS = (1024, 2048)
#: The characters of a ~1 KB report's string (made afresh per report, so none is shared).
KB = 1000


def reporter(config: dict[str, Any]) -> None:
    """Report ``steps`` times as fast as possible; trace this process's allocations first."""
    import tracemalloc

    if config["trace"]:
        tracemalloc.start()
    size = config["size"]
    for i in range(config["steps"]):
        if size:
            asyncexec.report({"step": i, "payload": str(i).rjust(size, "x")})
        else:
            asyncexec.report({"step": i})


def held_back() -> tuple[int, int]:
    """On a worker, during the run: its ``report()`` calls so far and the Python memory its
    function allocated and still holds (bytes)."""
    import tracemalloc

    from asyncexec._worker import _place

    session = _place.current_session()
    assert session is not None
    made: int = session.reports.reported
    return made, tracemalloc.get_traced_memory()[0] if tracemalloc.is_tracing() else 0


def rss(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / MiB


async def case(workers: int, window: int, size: int) -> dict[str, float]:
    """One executor, one stalled run; the figures of the module's docstring."""
    async with asyncexec.Executor(
        workers, resources_per_worker={"CPU": 0.1}, buffer_size=window, name="window"
    ) as ex:
        # Warm-up: the same function, consumed at once (imports, the function's export).
        async for _ in ex.run(reporter, {"steps": 3 * window, "size": size, "trace": False}):
            pass
        pids = [w.pid for w in ex.workers]
        before = [rss(p) for p in pids]
        driver_before = rss(os.getpid())
        tracemalloc.start()
        config = {"steps": 4 * window, "size": size, "trace": True}
        run = ex.run(reporter, config)
        taken = 0
        async for _ in run:
            taken += 1
            last: list[tuple[int, int]] = []
            while True:  # until no rank's count grows between two looks 50 ms apart
                await asyncio.sleep(0.05)
                now = list(await ex.execute(held_back))
                if [made for made, _ in now] == [made for made, _ in last]:
                    break
                last = now
            driver_traced = tracemalloc.get_traced_memory()[0]
            after = [rss(p) for p in pids]
            driver_after = rss(os.getpid())
            break
        await run.aclose()
        tracemalloc.stop()
    growth = [a - b for a, b in zip(after, before, strict=True)]
    return {
        "ahead": max(made for made, _ in last) - taken,
        "worker_rss_med": median(growth),
        "worker_rss_max": max(growth),
        "worker_traced": median([traced / MiB for _, traced in last]),
        "driver_traced": driver_traced / MiB,
        "driver_rss": driver_after - driver_before,
    }


@dataclass(frozen=True)
class Sizes:
    workers: int
    reports: tuple[int, ...]  # each report's size: 0 (tiny) or about KB bytes


FULL, QUICK = Sizes(16, (0, KB)), Sizes(2, (0,))
GRID = Grid(
    [
        "window",
        "report",
        "ahead (most over ranks)",
        "worker RSS growth, median / most, MiB",
        "worker Python memory held, MiB (median)",
        "driver Python memory held, MiB",
        "driver RSS growth, MiB",
    ]
)


async def bench(sizes: Sizes, args: argparse.Namespace) -> Result:
    rows = []
    for size in sizes.reports:
        for window in WINDOWS:
            progress(f"window {window}, reports of {size or 'tiny'}")
            f = await case(sizes.workers, window, size)
            rows.append(
                [
                    f"{window:,}",
                    "~1 KB" if size else "tiny",
                    f"{f['ahead']:,.0f}",
                    f"{f['worker_rss_med']:.2f} / {f['worker_rss_max']:.2f}",
                    f"{f['worker_traced']:.2f}",
                    f"{f['driver_traced']:.2f}",
                    f"{f['driver_rss']:.1f}",
                ]
            )
    return Result(rows, GRID)


def main(argv: list[str] | None = None) -> int:
    return _harness.main(
        argv,
        doc=__doc__,
        title="the credit window's memory",
        full=FULL,
        quick=QUICK,
        run=bench,
        ray={"num_cpus": 4, "fresh_workers": False},
        options=lambda parser: parser.add_argument("--workers", type=int, help="(16)"),
        about=lambda sizes, args: f"{sizes.workers} workers",
    )


if __name__ == "__main__":
    sys.exit(main())
