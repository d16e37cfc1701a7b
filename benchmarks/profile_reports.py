"""Where the report path's time goes: asyncexec against the bare batched floor, side by side.

    python benchmarks/profile_reports.py                       # rates only, 1/4/16 workers
    python benchmarks/profile_reports.py --quick               # 1 worker, 2,000 reports, once
    python benchmarks/profile_reports.py --workers 4 --driver  # and cProfile of the driver
    python benchmarks/profile_reports.py --workers 4 --spy     # and py-spy of every process
    python benchmarks/profile_reports.py --buffer-size 2048    # asyncexec's runs with that window

It starts one local Ray as ``run.py`` does, starts the floor's plain actors and an asyncexec
executor of the same size once, then interleaves the two systems' streams of tiny reports
(``--repeats``) and prints each one's reports/s, CPU per report (driver and workers) and their
ratios in one table. ``--driver``
profiles the driver's event loop through asyncexec's streams with cProfile; ``--spy`` samples
the driver and the workers with py-spy (installed apart: ``pip install py-spy``) and prints the
functions that hold the most samples, self and inclusive, per process kind. ``--buffer-size``
runs asyncexec with that credit window instead of its default (the floor's deque keeps
``run.BUFFER``): asyncexec's window bounds every report the consumer has not taken, on the
worker, on the wire and on the driver, where the floor's bounds its worker's deque only.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import io
import os
import pstats
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import _harness  # sets the environment the workers inherit
import run as bench_run
from _harness import Pair, Result
from _systems import AsyncexecGroup, LoopGroup


def _spy_start(pids: list[int], seconds: float, folder: str) -> list[subprocess.Popen[bytes]]:
    exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    procs = []
    for pid in pids:
        out = os.path.join(folder, f"{pid}.txt")
        cmd = [exe, "record", "-p", str(pid), "-d", str(int(seconds)), "-r", "250"]
        cmd += ["-f", "raw", "-o", out, "--nonblocking"]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    return procs


def _spy_summary(files: list[str], title: str, top: int = 25) -> None:
    """Self and inclusive samples per function over the folded stacks in ``files``."""
    own: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    total = 0
    for path in files:
        if not os.path.exists(path):
            continue
        with open(path) as f:
            for line in f:
                stack, _, count = line.rstrip().rpartition(" ")
                if not stack:
                    continue
                n = int(count)
                frames = stack.split(";")
                # Idle threads (waiting in a lock, epoll or a condition) are not the report path.
                leaf = frames[-1]
                if any(w in leaf for w in ("wait (threading", "select (selectors", "_worker (")):
                    continue
                total += n
                own[leaf] += n
                for frame in set(frames):
                    incl[frame] += n
    print(f"\n== py-spy, {title}: {total} active samples")
    print("-- self")
    for frame, n in own.most_common(top):
        print(f"{n / max(total, 1):6.1%}  {frame}")
    print("-- inclusive")
    for frame, n in incl.most_common(top):
        print(f"{n / max(total, 1):6.1%}  {frame}")


#: Polls and reports the driver's assembly took (counted by a wrapper around Assembly.add).
POLLS = Counter[str]()


def _count_polls() -> None:
    from asyncexec._driver.run import _window

    add = _window.Assembly.add

    def counted(self: _window.Assembly, rank: int, poll: Any) -> None:
        POLLS["polls"] += 1
        POLLS["reports"] += len(poll.reports)
        add(self, rank, poll)

    _window.Assembly.add = counted  # type: ignore[method-assign]


@dataclass(frozen=True)
class Sizes:
    workers: str  # worker counts, comma-separated
    steps: int  # reports per worker per run (16 workers: half)
    repeats: int


FULL = Sizes("1,4,16", 20_000, 3)
QUICK = Sizes("1", 2_000, 1)


async def measure(n: int, steps: int, sizes: Sizes, args: argparse.Namespace) -> list[Pair]:
    """The floor's and asyncexec's streams of ``n`` workers, interleaved: reports/s and the CPU
    per report of the driver and of the workers; cProfile and py-spy of them as asked."""
    loops = LoopGroup(n, bench_run.RESOURCES, bench_run.BUFFER)
    ae = AsyncexecGroup(n, bench_run.RESOURCES, tempfile.mkdtemp(prefix="asyncexec-prof-"))
    if args.buffer_size is not None:
        ae.executor.run = functools.partial(ae.executor.run, buffer_size=args.buffer_size)  # type: ignore[method-assign]
    rows = [
        Pair(f"reports/s, {n} worker(s)", "reports/s", higher_is_better=True),
        Pair(f"driver CPU per report, {n} worker(s)", "us"),
        Pair(f"workers' CPU per report, {n} worker(s)", "us"),
    ]

    def figures(stream: Callable[[int], Awaitable[dict[str, float]]]) -> Any:
        async def one() -> list[float]:
            m = await stream(steps)
            return [m["rate"], m["driver_cpu_us"], m["worker_cpu_us"]]

        return one

    await loops.start()
    await ae.start()
    try:
        await ae.stream(min(steps, 2000))  # warm-up: imports on the workers
        await loops.floor(min(steps, 2000))
        POLLS.clear()
        systems = {"base": figures(loops.floor), "ours": figures(ae.stream)}
        await _harness.repeat(rows, systems, sizes.repeats, warm=0, name=f"{n} worker(s)")
        rows[0].label += f" ({POLLS['reports'] / max(POLLS['polls'], 1):.0f} reports a poll)"
        if args.driver:
            for name, stream in (("floor", loops.floor), ("asyncexec", ae.stream)):
                profile = cProfile.Profile()
                profile.enable()
                await stream(steps)
                profile.disable()
                text = io.StringIO()
                stats = pstats.Stats(profile, stream=text)
                stats.sort_stats("tottime").print_stats(30)
                stats.sort_stats("cumulative").print_stats(40)
                print(f"\n== cProfile of the driver, {name}, {n} worker(s)\n{text.getvalue()}")
        if args.spy:
            folder = tempfile.mkdtemp(prefix="asyncexec-spy-")
            seconds = 4
            workers = ae.pids()
            procs = _spy_start([os.getpid(), *workers], seconds, folder)
            await asyncio.sleep(0.5)  # py-spy attaches
            loop = asyncio.get_running_loop()
            end = loop.time() + seconds - 0.5
            while loop.time() < end:
                await ae.stream(steps)
            for proc in procs:
                await asyncio.to_thread(proc.wait)
            _spy_summary([os.path.join(folder, f"{os.getpid()}.txt")], f"driver, {n} worker(s)")
            files = [os.path.join(folder, f"{pid}.txt") for pid in workers]
            _spy_summary(files, f"workers, {n} worker(s)")
    finally:
        await ae.close()
        await loops.close()
    return rows


async def run(sizes: Sizes, args: argparse.Namespace) -> Result:
    _count_polls()
    rows = []
    for n in (int(x) for x in sizes.workers.split(",")):
        rows += await measure(n, sizes.steps if n < 16 else sizes.steps // 2, sizes, args)
    return Result(rows, _harness.pairs("batched floor", "asyncexec"))


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workers", help="worker counts, comma-separated (1,4,16)")
    parser.add_argument("--steps", type=int, help="reports per worker per run (20,000)")
    parser.add_argument("--driver", action="store_true", help="cProfile the driver")
    parser.add_argument("--spy", action="store_true", help="py-spy the driver and the workers")
    parser.add_argument("--buffer-size", type=int, default=None, help="asyncexec's window")


def main(argv: list[str] | None = None) -> int:
    return _harness.main(
        argv,
        doc=__doc__,
        title="the report path, asyncexec beside the batched floor",
        full=FULL,
        quick=QUICK,
        run=run,
        ray={"num_cpus": bench_run.RAY_CPUS},
        options=_options,
    )


if __name__ == "__main__":
    sys.exit(main())
