"""The named run's scenario: a driver process (:mod:`benchmarks.chaos.driver`) runs a named run
and is SIGKILLed at a step (or, when the scenario's cancel is drawn, cancels its own consumer);
its workers must be gone; a new driver process resumes the run from the latest recorded
checkpoint, its step index matching the work, to the end. ``RUNNERS`` maps the kind to it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import ray

from asyncexec._driver.run import RECORD_FILE
from benchmarks.chaos.group_invariants import Line, check_resumed
from benchmarks.chaos.harness import STEP_SLEEP_S, wait_no_leftovers
from benchmarks.chaos.invariants import RECOVERY_BOUND_S, STOP_BOUND_S, expected_total
from benchmarks.chaos.scenarios import Env, Outcome, Scenario

__all__ = ["RUNNERS"]

#: The project root: the driver process runs ``-m benchmarks.chaos.driver`` from it.
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
#: Bound on a driver process's life.
DRIVER_BOUND_S = 120.0


class _Driver:
    """A driver process and what it printed."""

    def __init__(self, args: list[str], log: Path) -> None:
        self.log = log
        with open(log, "w") as stderr:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.chaos.driver", *args],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )
        self.steps: list[Line] = []
        self.times: list[float] = []
        self.end: dict[str, Any] = {}

    async def lines(self) -> Any:
        """Each line it prints, parsed, until it exits; steps are recorded on the way."""
        assert self.proc.stdout is not None
        while True:
            text = await anyio.to_thread.run_sync(self.proc.stdout.readline)
            if not text:
                return
            line = json.loads(text)
            if "index" in line:
                self.steps.append((line["index"], line["step"], line["attempt"]))
                self.times.append(time.time())
            elif "ready" not in line:
                self.end = line
            yield line

    async def wait(self) -> int:
        with anyio.move_on_after(DRIVER_BOUND_S):
            return await anyio.to_thread.run_sync(self.proc.wait)
        self.proc.kill()
        return await anyio.to_thread.run_sync(self.proc.wait)

    def tail(self) -> str:
        lines = self.log.read_text(errors="replace").strip().splitlines()
        return " | ".join(lines[-3:])


def _record(storage: Path, name: str) -> dict[str, Any] | None:
    path = storage / name / RECORD_FILE
    return json.loads(path.read_text()) if path.exists() else None


def _checkpoint_index(record: dict[str, Any] | None) -> int | None:
    """The step index of the record's latest checkpoint (its folder is
    ``checkpoint_<index>_a<attempt>``)."""
    if record is None or record["checkpoint"] is None:
        return None
    return int(Path(record["checkpoint"]).name.split("_")[1])


async def _driver_killed(sc: Scenario, env: Env, out: Outcome, directory: Path) -> None:
    """SIGKILL the first driver when it prints step index ``at`` (with ``cancel_s``: it cancels
    its consumer that long after it starts its run instead); then a second driver of the same
    name must go on from the recorded checkpoint, with matching indices, to the whole result."""
    storage, name = directory / "runs", f"chaos{sc.number}"
    await anyio.Path(directory / "tmp").mkdir()
    config: dict[str, Any] = {"steps": sc.steps, "every": sc.every, "sleep": STEP_SLEEP_S * 2}
    config.update(dir=str(directory / "tmp"), fault=None)
    address = ray.get_runtime_context().gcs_address
    args = [address, str(storage), name, json.dumps(config)]
    options = {"buffer": sc.buffer, "slow": sc.slow, "cancel_s": sc.cancel_s}
    first = _Driver([*args, json.dumps(options)], directory / "first.err")
    stopped: float | None = None
    try:
        async for line in first.lines():
            if sc.cancel_s is None and line.get("index", -1) >= sc.at:
                first.proc.send_signal(signal.SIGKILL)
                stopped = time.time()
                break
            if "cancelled" in line:
                stopped = line["cancelled"]
    finally:
        code = await first.wait()
    if stopped is None and "result" in first.end and sc.cancel_s is not None:
        out.note = "finished before the cancel"
        _check_whole(out, sc, first)
        return
    if stopped is None:
        out.fail("fault_injected", f"the first driver ended ({code}) before it was stopped")
        out.note = first.tail()
        return
    found = await wait_no_leftovers(STOP_BOUND_S)
    if found:
        out.fail("dead_driver_workers_gone", f"after the first driver ended: {found}")
    record = await anyio.to_thread.run_sync(_record, storage, name)
    second = _Driver([*args, json.dumps({**options, "cancel_s": None})], directory / "second.err")
    try:
        async for _ in second.lines():
            pass
    finally:
        code = await second.wait()
    out.steps = len(first.steps) + len(second.steps)
    out.attempts = second.end.get("attempts", 0)
    if code != 0 or "result" not in second.end:
        out.fail("resumed", f"the second driver exited {code}: {second.tail()}")
        return
    out.record(
        check_resumed(
            first.steps,
            second.steps,
            checkpoint_index=_checkpoint_index(record),
            recorded_attempt=0 if record is None else record["attempt"],
            total=sc.steps,
        )
    )
    expected = [expected_total(r, sc.steps - 1) for r in range(2)]
    if second.end["result"] != expected:
        out.fail("final_state", f"return values {second.end['result']}, expected {expected}")
    final = await anyio.to_thread.run_sync(_record, storage, name)
    if final is None or final["status"] != "finished":
        out.fail("record_finished", f"the record after the run: {final}")
    if second.times:
        took = second.times[0] - stopped
        out.recovery_s.append(took)
        if took > RECOVERY_BOUND_S:
            out.fail("recovery_time", f"{took:.1f} s from the first driver's end to a step")
    if record is not None:
        out.note = f"record: {record['steps']} steps, checkpoint at {_checkpoint_index(record)}"


def _check_whole(out: Outcome, sc: Scenario, driver: _Driver) -> None:
    """A driver that ran the whole run: steps 0.. in order, in attempt 1, the right result."""
    if driver.steps != [(i, i, 1) for i in range(sc.steps)]:
        out.fail("consecutive", f"the driver delivered {driver.steps}")
    expected = [expected_total(r, sc.steps - 1) for r in range(2)]
    if driver.end.get("result") != expected:
        out.fail("final_state", f"return values {driver.end.get('result')}, expected {expected}")


RUNNERS = {"driver_killed": _driver_killed}
