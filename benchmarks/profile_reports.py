"""Where the report path's time goes: asyncexec against the bare batched floor, side by side.

    python benchmarks/profile_reports.py                       # rates only, 1/4/16 workers
    python benchmarks/profile_reports.py --workers 4 --driver  # and cProfile of the driver
    python benchmarks/profile_reports.py --workers 4 --spy     # and py-spy of every process
    python benchmarks/profile_reports.py --buffer-size 2048    # asyncexec's runs with that window

It starts one local Ray as ``run.py`` does, starts the floor's plain actors and an asyncexec
executor of the same size once, then interleaves the two systems' streams of tiny reports and
prints each one's reports/s, CPU per report (driver and workers) and their ratio. ``--driver``
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
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import run as bench_run  # sets the environment the workers inherit
from _common import median
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


async def measure(
    n: int, steps: int, repeats: int, driver: bool, spy: bool, buffer_size: int | None = None
) -> None:
    loops = LoopGroup(n, bench_run.RESOURCES, bench_run.BUFFER)
    ae = AsyncexecGroup(n, bench_run.RESOURCES, tempfile.mkdtemp(prefix="asyncexec-prof-"))
    if buffer_size is not None:
        ae.executor.run = functools.partial(ae.executor.run, buffer_size=buffer_size)  # type: ignore[method-assign]
    await loops.start()
    await ae.start()
    rows: dict[str, list[dict[str, float]]] = {"floor": [], "asyncexec": []}
    try:
        await ae.stream(min(steps, 2000))  # warm-up: imports on the workers
        await loops.floor(min(steps, 2000))
        POLLS.clear()
        for _ in range(repeats):
            rows["floor"].append(await loops.floor(steps))
            rows["asyncexec"].append(await ae.stream(steps))
        per_poll = POLLS["reports"] / max(POLLS["polls"], 1)
        if driver:
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
        if spy:
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
    m: dict[str, dict[str, float]] = {
        k: {f: median([r[f] for r in v]) for f in ("rate", "driver_cpu_us", "worker_cpu_us")}
        for k, v in rows.items()
    }
    print(
        f"{n:>2} worker(s): floor {m['floor']['rate']:>8.0f}/s "
        f"(cpu/report {m['floor']['driver_cpu_us']:.1f} driver + "
        f"{m['floor']['worker_cpu_us']:.1f} workers us); "
        f"asyncexec {m['asyncexec']['rate']:>8.0f}/s "
        f"({m['asyncexec']['driver_cpu_us']:.1f} + {m['asyncexec']['worker_cpu_us']:.1f} us); "
        f"ratio {m['asyncexec']['rate'] / m['floor']['rate']:.2f}x; "
        f"{per_poll:.0f} reports per poll; all asyncexec: "
        f"{[round(r['rate']) for r in rows['asyncexec']]}, floor: "
        f"{[round(r['rate']) for r in rows['floor']]}",
        flush=True,
    )


async def _all(args: argparse.Namespace) -> None:
    for n in (int(x) for x in args.workers.split(",")):
        steps = args.steps if n < 16 else args.steps // 2
        await measure(n, steps, args.repeats, args.driver, args.spy, args.buffer_size)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="1,4,16", help="worker counts, comma-separated")
    parser.add_argument("--steps", type=int, default=20_000, help="reports per worker per run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--driver", action="store_true", help="cProfile the driver")
    parser.add_argument("--spy", action="store_true", help="py-spy the driver and the workers")
    parser.add_argument("--buffer-size", type=int, default=None, help="asyncexec's window")
    args = parser.parse_args()
    _count_polls()
    bench_run.start_ray()
    try:
        asyncio.run(_all(args))
    finally:
        bench_run.ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
