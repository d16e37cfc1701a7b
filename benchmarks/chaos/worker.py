"""The worker side: a deterministic checkpointing counter, the faults it strikes itself with, and
a gated init hook. The workers import these functions by name (``benchmarks.chaos.worker``), so
the project root must be on their ``PYTHONPATH``."""

from __future__ import annotations

import json
import os
import re
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import asyncexec

__all__ = ["BARRIER_MARGIN_S", "counter", "gate_hook"]

#: How long a rank that faults after a barrier waits for the others' reports to reach the driver.
BARRIER_MARGIN_S = 0.5


def counter(config: dict[str, Any]) -> int:
    """Each rank sums ``step * (rank + 1)``, checkpoints every ``every`` steps and resumes from the
    checkpoint it is given; the fault in ``config["fault"]`` strikes on its rank and step.

    Reports ``{"step", "total", "attempt"}``; returns the final total.
    """
    ctx = asyncexec.get_context()
    rank, attempt = ctx.world_rank, ctx.attempt or 1
    start, total = 0, 0
    checkpoint = asyncexec.get_checkpoint()
    if checkpoint is not None:
        state = json.loads((Path(checkpoint.path) / f"rank{rank}.json").read_text())
        start, total = state["step"] + 1, state["total"]
    fault: dict[str, Any] | None = config.get("fault")
    for step in range(start, config["steps"]):
        if fault is not None and fault["rank"] == rank:
            _strike(fault, config, ctx.world_size, attempt, step)
        total += step * (rank + 1)
        time.sleep(config["sleep"])
        saved = None
        if step % config["every"] == 0:
            tmp = Path(tempfile.mkdtemp(dir=config["dir"]))
            (tmp / f"rank{rank}.json").write_text(json.dumps({"step": step, "total": total}))
            saved = asyncexec.Checkpoint.from_directory(tmp)
        asyncexec.report({"step": step, "total": total, "attempt": attempt}, checkpoint=saved)
        if fault is not None and fault.get("barrier") and attempt == 1 and step == fault["at"] - 1:
            Path(config["dir"], f"reported-r{rank}").touch()
    return total


def _strike(
    fault: dict[str, Any], config: dict[str, Any], world: int, attempt: int, step: int
) -> None:
    kind = fault["kind"]
    if kind == "die_always":
        if step >= fault["at"]:
            _mark_fault(config, attempt)
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
        return
    if attempt != 1 or step != fault["at"]:
        return
    if fault.get("barrier"):
        # Every rank has reported step at-1; the margin lets those reports reach the driver, so
        # every step before this one is complete there when the fault strikes.
        deadline = time.monotonic() + 30
        directory = Path(config["dir"])
        while time.monotonic() < deadline:
            if len(list(directory.glob("reported-r*"))) >= world:
                break
            time.sleep(0.005)
        time.sleep(BARRIER_MARGIN_S)
    _mark_fault(config, attempt)
    if kind == "die":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    elif kind == "raise":
        raise ValueError(f"chaos: bad batch at step {step} on rank {fault['rank']}")
    elif kind == "hang":
        time.sleep(3600)
    elif kind == "gil":
        # Catastrophic backtracking in the C regex engine: the GIL is held for minutes.
        re.match(r"(a+)+$", "a" * 64 + "b")


def _mark_fault(config: dict[str, Any], attempt: int) -> None:
    Path(config["dir"], f"fault-a{attempt}-{os.getpid()}.time").write_text(repr(time.time()))


def gate_hook(directory: str) -> None:
    """An init hook that announces the worker (``hook-<pid>.json``) and waits until the driver's
    :class:`Gate` releases it (``go-<pid>``) or kills it."""
    ctx = asyncexec.get_context()
    pid = os.getpid()
    tmp = Path(directory, f".hook-{pid}.tmp")
    tmp.write_text(json.dumps({"rank": ctx.world_rank, "pid": pid}))
    tmp.replace(Path(directory, f"hook-{pid}.json"))
    go = Path(directory, f"go-{pid}")
    deadline = time.monotonic() + 60
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.005)
