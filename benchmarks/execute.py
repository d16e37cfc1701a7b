"""``Executor.execute`` (a function run on every rank) beside the same function sent to plain Ray
actors by hand, in one run.

    python benchmarks/execute.py            # about a minute on 2 cores
    python benchmarks/execute.py --quick    # a smoke run

For 1 and 4 ranks: ``await ex.execute(add_one, x)`` against ``await asyncio.gather(*[a.run.remote(
add_one, x) for a in actors])`` on as many plain async actors whose ``run`` calls the function it
is given (both pickle the function with each call); per repeat the median latency of a block of
sequential calls and the event loop's CPU per call. The repeats interleave the two systems.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import _harness
import ray
from _harness import Pair, Result, latency

import asyncexec

RESOURCES = {"CPU": 0.25}


@dataclass(frozen=True)
class Sizes:
    repeats: int
    calls: int  # sequential calls per repeat (each system)


FULL, QUICK = Sizes(repeats=9, calls=200), Sizes(repeats=1, calls=20)


def add_one(x: int) -> int:
    return x + 1


@ray.remote
class Runner:
    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return fn(*args)


async def measure(n: int, sizes: Sizes) -> list[Pair]:
    ranks = f"{n} rank{'s' if n > 1 else ''}"
    rows = [
        Pair(f"execute(fn), {ranks}: median latency", "us", limit=1.2),
        Pair(f"the same: the event loop's CPU per call, {ranks}", "us"),
    ]
    actors = [Runner.options(num_cpus=RESOURCES["CPU"]).remote() for _ in range(n)]
    async with asyncexec.Executor(n, resources_per_worker=RESOURCES) as ex:

        async def ours(_: int) -> None:
            assert await ex.execute(add_one, 1) == [2] * n

        async def base(_: int) -> None:
            assert await asyncio.gather(*(a.run.remote(add_one, 1) for a in actors)) == [2] * n

        await _harness.repeat(
            rows,  # the latency and the loop's CPU per call (not the whole driver's)
            {
                "base": lambda: latency(sizes.calls, base),
                "ours": lambda: latency(sizes.calls, ours),
            },
            sizes.repeats,
            name=f"execute, {ranks}",
        )
    for actor in actors:
        ray.kill(actor)
    return rows


async def bench(sizes: Sizes, args: argparse.Namespace) -> Result:
    rows = [row for n in (1, 4) for row in await measure(n, sizes)]
    return Result(rows, _harness.pairs("plain Ray", "asyncexec"))


def main(argv: list[str] | None = None) -> int:
    return _harness.main(
        argv,
        doc=__doc__,
        title="asyncexec execute() beside plain Ray actors",
        full=FULL,
        quick=QUICK,
        run=bench,
        ray={"num_cpus": 16},
    )


if __name__ == "__main__":
    sys.exit(main())
