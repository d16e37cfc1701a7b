"""One worker's start-up time and memory: the async worker actor against the threaded one (the
workers of a group whose roles have only plain methods) at several sizes of its default group.

    python benchmarks/worker_start.py            # about a minute on 2 cores
    python benchmarks/worker_start.py --quick    # 2 workers of each kind

Each worker is created alone (the kinds interleaved, every process fresh: no pre-started
workers), timed from ``.remote()`` until its ``ping`` is answered; then its process's resident
memory and threads are read. Medians over the workers of each kind; the ratio is asyncexec's
threaded worker (its default group) over the async one.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import _harness
import psutil
import ray
from _harness import Result, Row, Table

from asyncexec._worker import CONTROL_THREADS, ThreadedWorkerActor, WorkerActor

#: Each kind's column: its header, its actor class and its control threads (None: its default).
KINDS = {
    "async": ("async worker actor", WorkerActor, None),
    "threaded8": ("threaded, 8 control threads", ThreadedWorkerActor, 8),
    "threaded": (f"threaded, {CONTROL_THREADS} (asyncexec's)", ThreadedWorkerActor, None),
    "threaded256": ("threaded, 256 control threads", ThreadedWorkerActor, 256),
}
TABLE = Table([(k, header) for k, (header, _, _) in KINDS.items()], [("async", "ratio")])


@dataclass(frozen=True)
class Sizes:
    repeats: int  # fresh workers of each kind


FULL, QUICK = Sizes(8), Sizes(2)


async def start_one(cls: object, threads: int | None) -> tuple[float, float, float]:
    """Milliseconds to a first answer, resident MiB and threads of one fresh worker."""
    options: dict[str, object] = {"num_cpus": 0.25}
    if threads is not None:
        options["max_concurrency"] = threads
    t0 = time.perf_counter()
    actor = cls.options(**options).remote()  # type: ignore[attr-defined]
    pid = await actor.ping.remote()
    ms = (time.perf_counter() - t0) * 1e3
    process = psutil.Process(pid)
    rss, threads_seen = process.memory_info().rss / 2**20, process.num_threads()
    ray.kill(actor, no_restart=True)
    return ms, rss, float(threads_seen)


def one(cls: object, threads: int | None) -> Callable[[], Awaitable[tuple[float, ...]]]:
    return lambda: start_one(cls, threads)


async def bench(sizes: Sizes, args: argparse.Namespace) -> Result:
    rows = [
        Row("start-up to first answer", "ms", measured="threaded", reference="async"),
        Row("resident memory", "MiB", measured="threaded", reference="async"),
        Row("threads", "count", measured="threaded", reference="async"),
    ]
    kinds = {k: one(cls, threads) for k, (_, cls, threads) in KINDS.items()}
    # The warm-up round exports each class.
    await _harness.repeat(rows, kinds, sizes.repeats, name="fresh workers")
    return Result(rows, TABLE)


def main(argv: list[str] | None = None) -> int:
    return _harness.main(
        argv,
        doc=__doc__,
        title="one worker's start-up",
        full=FULL,
        quick=QUICK,
        run=bench,
        ray={"num_cpus": 4},
        about=lambda sizes, args: f"medians of {sizes.repeats} fresh workers of each kind",
    )


if __name__ == "__main__":
    sys.exit(main())
