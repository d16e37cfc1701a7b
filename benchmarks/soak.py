"""Soak: many executor lifecycles in a row, and many executors at once in one event loop, with
what the driver holds measured before and after.

    python -m benchmarks.soak                                  # 200 lifecycles; 16 at once x 5
    python -m benchmarks.soak --lifecycles 30 --concurrent 8 --rounds 2

(``python benchmarks/soak.py`` runs it too.)

Phase one starts and closes an executor (1 worker, CPU 0.5, a 3-step run) ``--lifecycles`` times
in one process; phase two runs ``--rounds`` rounds of ``--concurrent`` executors at once (CPU 0.25
each, a 3-step run each) in one event loop, the service case. Before and after each phase (after a
warm-up, with the cluster settled) it records live asyncexec worker actors, placement groups not
removed, the driver's threads, its open file descriptors and its resident memory, and prints them
as start / end / growth, with the time per lifecycle and the worst event-loop stall. It exits with
status 1 when an actor or placement group is left, or threads or descriptors grew beyond a small
tolerance (memory is a figure, not a verdict: the allocator keeps what it took).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __name__ == "__main__" and not __package__:
    # Run as a script (python benchmarks/soak.py): the project root is importable, as with -m.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import anyio
import psutil

import asyncexec
from benchmarks._common import LoopBeat, MiB, live_placement_groups, live_workers, percentile

__all__ = [
    "FD_TOLERANCE",
    "THREAD_TOLERANCE",
    "Phase",
    "Snapshot",
    "concurrent",
    "lifecycles",
    "render",
    "settle",
    "tiny",
]


#: Growth tolerated in the driver's threads (anyio's idle worker threads come and go).
THREAD_TOLERANCE = 2
#: Growth tolerated in the driver's open file descriptors (Ray opens a few lazily).
FD_TOLERANCE = 8


def tiny(config: dict[str, Any]) -> int:
    """A tiny run: ``config["steps"]`` reports."""
    for i in range(config["steps"]):
        asyncexec.report({"i": i})
    return asyncexec.get_context().world_rank


@dataclass(frozen=True)
class Snapshot:
    """What the driver and the cluster hold at one moment."""

    actors: int
    groups: int
    threads: int
    fds: int
    rss_mib: float


def _cluster_counts() -> tuple[int, int]:
    return len(live_workers()), len(live_placement_groups())


async def settle(timeout_s: float = 15.0, since: Snapshot | None = None) -> Snapshot:
    """Wait (bounded) until no asyncexec actor or placement group is live, and, given the
    phase's start (``since``), until the driver's threads are within ``THREAD_TOLERANCE`` of
    it: anyio's idle worker threads end 10 s after their last job, and a burst of teardowns
    at once (more of them on a loaded machine) leaves more of them for a while. Then take a
    snapshot. The driver's own figures are read before the cluster is asked (which uses a
    thread)."""
    deadline = time.monotonic() + timeout_s
    while True:
        gc.collect()
        proc = psutil.Process()
        threads, fds, rss = threading.active_count(), proc.num_fds(), proc.memory_info().rss
        actors, groups = await anyio.to_thread.run_sync(_cluster_counts)
        settled = since is None or threads - since.threads <= THREAD_TOLERANCE
        if (actors == 0 and groups == 0 and settled) or time.monotonic() > deadline:
            return Snapshot(actors, groups, threads, fds, rss / MiB)
        await anyio.sleep(0.1)


@dataclass
class Phase:
    """One phase's figures."""

    name: str
    count: int
    start: Snapshot | None = None
    end: Snapshot | None = None
    seconds: list[float] = field(default_factory=list)
    max_lag_s: float = 0.0

    @property
    def growth(self) -> dict[str, float]:
        assert self.start is not None and self.end is not None
        return {
            "actors": self.end.actors - self.start.actors,
            "groups": self.end.groups - self.start.groups,
            "threads": self.end.threads - self.start.threads,
            "fds": self.end.fds - self.start.fds,
            "rss_mib": self.end.rss_mib - self.start.rss_mib,
        }

    def problems(self) -> list[str]:
        """What breaks the soak's promise: anything left in the cluster, threads or descriptors
        grown beyond the tolerance."""
        assert self.end is not None
        out = []
        if self.end.actors or self.end.groups:
            out.append(f"{self.name}: {self.end.actors} actor(s), {self.end.groups} group(s) left")
        growth = self.growth
        if growth["threads"] > THREAD_TOLERANCE:
            out.append(f"{self.name}: threads grew by {growth['threads']:g}")
        if growth["fds"] > FD_TOLERANCE:
            out.append(f"{self.name}: file descriptors grew by {growth['fds']:g}")
        return out


async def _one(storage: Path, cpu: float, steps: int) -> float:
    t0 = time.perf_counter()
    async with asyncexec.Executor(
        1, resources_per_worker={"CPU": cpu}, storage_path=storage, name="soak"
    ) as ex:
        got = [s async for s in ex.run(tiny, {"steps": steps})]
    if len(got) != steps:
        raise AssertionError(f"a soak run delivered {len(got)} of {steps} steps")
    return time.perf_counter() - t0


async def lifecycles(count: int, storage: Path, *, warmup: int = 3, steps: int = 3) -> Phase:
    """``count`` executor lifecycles in a row (1 worker, CPU 0.5), after ``warmup`` uncounted
    ones; the snapshots frame the counted ones."""
    phase = Phase("lifecycles", count)
    for _ in range(warmup):
        await _one(storage, 0.5, steps)
    phase.start = await settle()
    beat = LoopBeat()
    async with anyio.create_task_group() as tg:
        tg.start_soon(beat.run)
        for _ in range(count):
            phase.seconds.append(await _one(storage, 0.5, steps))
        tg.cancel_scope.cancel()
    phase.max_lag_s = beat.max_gap
    phase.end = await settle(since=phase.start)
    return phase


async def concurrent(
    executors: int, rounds: int, storage: Path, *, warmup: int = 1, steps: int = 3
) -> Phase:
    """``rounds`` rounds of ``executors`` executors at once in this event loop (CPU 0.25 each),
    after ``warmup`` uncounted rounds; the snapshots frame the counted rounds."""
    phase = Phase("concurrent", executors * rounds)

    async def round_() -> float:
        t0 = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for _ in range(executors):
                tg.start_soon(_one, storage, 0.25, steps)
        return time.perf_counter() - t0

    for _ in range(warmup):
        await round_()
    phase.start = await settle()
    beat = LoopBeat()
    async with anyio.create_task_group() as tg:
        tg.start_soon(beat.run)
        for _ in range(rounds):
            phase.seconds.append(await round_())
        tg.cancel_scope.cancel()
    phase.max_lag_s = beat.max_gap
    phase.end = await settle(since=phase.start)
    return phase


def render(phases: Sequence[Phase]) -> str:
    """The figures: per phase, start / end / growth of each measure, then timings."""
    lines = []
    header = (
        f"{'phase':<12}{'':<8}{'actors':>8}{'groups':>8}{'threads':>9}{'fds':>6}{'rss MiB':>10}"
    )
    lines += [header, "-" * len(header)]
    for p in phases:
        assert p.start is not None and p.end is not None
        for label, snap in (("start", p.start), ("end", p.end)):
            lines.append(
                f"{p.name if label == 'start' else '':<12}{label:<8}{snap.actors:>8}"
                f"{snap.groups:>8}{snap.threads:>9}{snap.fds:>6}{snap.rss_mib:>10.1f}"
            )
        g = p.growth
        lines.append(
            f"{'':<12}{'growth':<8}{g['actors']:>+8.0f}{g['groups']:>+8.0f}{g['threads']:>+9.0f}"
            f"{g['fds']:>+6.0f}{g['rss_mib']:>+10.1f}"
        )
    lines.append("")
    for p in phases:
        unit = "lifecycle" if p.name == "lifecycles" else "round"
        lines.append(
            f"{p.name}: {p.count} executors; seconds per {unit} "
            f"p50 {percentile(p.seconds, 50):.2f}, "
            f"max {max(p.seconds):.2f}; worst event-loop stall {p.max_lag_s * 1000:.0f} ms"
        )
    return "\n".join(lines)


async def _main(args: argparse.Namespace, storage: Path) -> list[Phase]:
    phases = [await lifecycles(args.lifecycles, storage)]
    phases.append(await concurrent(args.concurrent, args.rounds, storage))
    return phases


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lifecycles", type=int, default=200)
    parser.add_argument("--concurrent", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    import logging

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    # Imported here: importing it sets the environment Ray's workers inherit (the project root
    # on their path, from which they import ``benchmarks.soak``).
    from benchmarks import _harness

    t0 = time.perf_counter()
    with (
        _harness.ray_session(num_cpus=4, fresh_workers=False),
        tempfile.TemporaryDirectory(prefix="asyncexec-soak-") as storage,
    ):
        phases = anyio.run(_main, args, Path(storage))
    print(f"asyncexec soak: {time.perf_counter() - t0:.0f} s\n")
    print(render(phases))
    problems = [p for phase in phases for p in phase.problems()]
    for problem in problems:
        print(f"FAILED: {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    # Run as the module ``benchmarks.soak``, not ``__main__``, so that the workers import ``tiny``
    # by that name (the project root is on their PYTHONPATH).
    import importlib

    raise SystemExit(importlib.import_module("benchmarks.soak").main())
