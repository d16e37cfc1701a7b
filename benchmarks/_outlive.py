"""Runs that outlive their failures: independent ranks and a named run that a new driver resumes.

Measured in the caller's Ray (``run.py`` starts it):

- ``n`` independent ranks with one standby spare, each reporting every few milliseconds; one
  rank SIGKILLed: how many survivors' functions started again (a per-process counter), the
  longest gap in any survivor's report stream around the kill against the longest gap before it
  (the consumer's own pace), and from the SIGKILL to the replaced rank's next report;
- a driver process running a named run, SIGKILLed at step k; a new driver process started with
  the same name (joining the caller's Ray, so Ray's start-up is aside): from the new process's
  start to its first step, which must be step k+1 or later, and from its executor being ready to
  that step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from typing import Any

import anyio
import ray
from _common import Rows

import asyncexec

__all__ = ["measure_independent", "measure_resume"]

HERE = os.path.dirname(os.path.abspath(__file__))
_starts = 0


def rollout(config: dict[str, Any]) -> None:
    """Reports every ``delay`` seconds until stopped, counting its starts per process."""
    global _starts
    _starts += 1
    rank = asyncexec.get_context().world_rank
    n = 0
    while True:
        time.sleep(config["delay"])
        asyncexec.report({"rank": rank, "n": n})
        n += 1


def starts() -> int:
    return _starts


async def _independent_once(n: int, resources: dict[str, float], storage: str, rows: Rows) -> None:
    victim = n // 2
    async with asyncexec.Executor(
        n, resources_per_worker=resources, spares=1, storage_path=storage, name="bench-indep"
    ) as executor:
        pids = [w.pid for w in executor.workers]
        run = executor.run(rollout, {"delay": 0.005}, independent=True)
        last: dict[int, float] = {}
        gap_before = 0.0
        gap_around = 0.0
        killed_at: float | None = None
        replaced: float | None = None
        seen_after_replace = 0
        with anyio.fail_after(60):
            async for step in run:
                now = time.perf_counter()
                rank = step.rank
                assert rank is not None
                if rank != victim and rank in last:
                    gap = now - last[rank]
                    if killed_at is None:
                        gap_before = max(gap_before, gap)
                    else:
                        gap_around = max(gap_around, gap)
                last[rank] = now
                if killed_at is None and step.index >= 40 * n:
                    gap_before = max(gap_before, 1e-6)
                    os.kill(pids[victim], signal.SIGKILL)
                    killed_at = time.perf_counter()
                elif killed_at is not None and rank == victim and step.attempt == 2:
                    replaced = now - killed_at if replaced is None else replaced
                if replaced is not None:
                    seen_after_replace += 1
                    if seen_after_replace > 20 * n:  # the survivors went on past it
                        break
        await run.aclose()
        counts = await executor.execute(starts)
        restarted = sum(1 for r, c in enumerate(counts) if r != victim and c != 1)
    assert replaced is not None
    rows.add("indep_restarted", "asyncexec", restarted)
    # The floor: the longest gap before the kill (the consumer's own pace).
    rows.add("indep_gap", "asyncexec", gap_around * 1e3)
    rows.add("indep_gap", "floor", gap_before * 1e3)
    rows.add("indep_replaced", "asyncexec", replaced * 1e3)


async def measure_independent(
    rows: Rows, n: int, repeats: int, resources: dict[str, float], storage: str
) -> None:
    for _ in range(repeats):
        await _independent_once(n, resources, storage, rows)


def _spawn(args: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


async def measure_resume(
    rows: Rows, repeats: int, storage: str, kill_at: int = 20, steps: int = 60
) -> None:
    """Each repeat: a driver process runs a named run and is SIGKILLed at step ``kill_at``; a
    new one resumes it. Both join the caller's Ray."""
    address = ray.get_runtime_context().gcs_address
    driver = os.path.join(HERE, "_resume_driver.py")
    for i in range(repeats):
        name = f"bench-resume-{os.getpid()}-{i}"
        args = [sys.executable, driver, address, storage, name, str(steps)]
        first = _spawn(args)
        assert first.stdout is not None
        index = -1
        while index < kill_at:
            line = await anyio.to_thread.run_sync(first.stdout.readline)
            if not line:
                raise RuntimeError("the first driver ended before it was killed")
            index = json.loads(line).get("index", index)
        first.send_signal(signal.SIGKILL)
        await anyio.to_thread.run_sync(first.wait)
        t0 = time.perf_counter()
        second = _spawn(args)
        assert second.stdout is not None
        ready = None
        while True:
            line = await anyio.to_thread.run_sync(second.stdout.readline)
            if not line:
                raise RuntimeError("the second driver ended without a step")
            record = json.loads(line)
            if "ready" in record:
                ready = time.perf_counter()
            if "index" in record:
                now = time.perf_counter()
                rows.add("resume", "asyncexec", now - t0)
                rows.note("resume_ready_to_step_s", now - (ready or t0))
                # The index goes on from the step after the checkpoint: it matches the work.
                if record["index"] != record["i"]:
                    rows.note("resume_index_not_the_work", 1.0)
                break
        second.send_signal(signal.SIGKILL)
        await anyio.to_thread.run_sync(second.wait)
