"""The worker side: a deterministic checkpointing counter, the faults it strikes itself with, a
gated init hook, a counter whose state does not depend on the group's size (elastic runs), and the
two ends of a weight channel (a source whose state the driver tags, a target that records what
it installs). The workers import these functions by name (``benchmarks.chaos.worker``), so the
project root must be on their ``PYTHONPATH``."""

from __future__ import annotations

import json
import os
import re
import signal
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import asyncexec

__all__ = [
    "BARRIER_MARGIN_S",
    "counter",
    "gate_hook",
    "installs",
    "learner",
    "rollout",
    "set_tag",
    "sized_counter",
    "starts",
]

#: How long a rank that faults after a barrier waits for the others' reports to reach the driver.
BARRIER_MARGIN_S = 0.5
#: The bytes of a channel state's payload: through the object store, not inline.
BLOB_BYTES = 200_000

#: Functions started in this worker process (``counter`` and ``sized_counter``).
_starts = 0
_lock = threading.Lock()
#: A source rank's state tag, set by the driver before each push.
_tag = 0
#: What a target rank installed, in order: (version, tag, source pid, payload intact).
_installs: list[tuple[int, int, int, bool]] = []
#: The (version, tag, source pid) a target rank's install last put in place.
_held: tuple[int | None, int | None, int | None] = (None, None, None)


def counter(config: dict[str, Any]) -> int:
    """Each rank sums ``step * (rank + 1)``, checkpoints every ``every`` steps and resumes from the
    checkpoint it is given; the fault in ``config["fault"]`` strikes on its rank and step.

    Reports ``{"step", "total", "attempt"}``; returns the final total.
    """
    global _starts
    _starts += 1
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


def starts() -> tuple[int, int]:
    """This process's pid and how many functions it started."""
    return os.getpid(), _starts


def sized_counter(config: dict[str, Any]) -> int:
    """Sums the step numbers, whatever the group's size: rank 0 checkpoints every ``every``
    steps and every rank resumes from it. Reports ``{"step", "total", "attempt", "world"}``;
    returns the final total.

    An attempt before ``until_attempt`` never ends on its own (up to ``limit`` steps): the run
    must grow back before it can finish, after ``steps`` steps and ``after`` steps of that
    attempt.
    """
    global _starts
    _starts += 1
    ctx = asyncexec.get_context()
    start, total = 0, 0
    checkpoint = asyncexec.get_checkpoint()
    if checkpoint is not None:
        state = json.loads((Path(checkpoint.path) / "state.json").read_text())
        start, total = state["step"] + 1, state["total"]
    step = start
    while step < config["limit"]:
        grown = ctx.attempt >= config["until_attempt"]
        if grown and step >= config["steps"] and step - start >= config["after"]:
            break
        total += step
        time.sleep(config["sleep"])
        saved = None
        if ctx.world_rank == 0 and step % config["every"] == 0:
            tmp = Path(tempfile.mkdtemp(dir=config["dir"]))
            (tmp / "state.json").write_text(json.dumps({"step": step, "total": total}))
            saved = asyncexec.Checkpoint.from_directory(tmp)
        metrics = {"step": step, "total": total, "attempt": ctx.attempt, "world": ctx.world_size}
        asyncexec.report(metrics, checkpoint=saved)
        step += 1
    return total


# A weight channel's two ends --------------------------------------------------------------------


def set_tag(tag: int) -> int:
    """Tag this source rank's state (what the next read returns); return this process's pid."""
    global _tag
    with _lock:
        _tag = tag
    return os.getpid()


def _state(tag: int, transport: str) -> dict[str, Any]:
    """A state whose every byte says its tag, and the pid of the process that read it."""
    if transport == "torch":
        import torch

        return {
            "tag": torch.tensor([tag, os.getpid()], dtype=torch.int64),
            "blob": torch.full((BLOB_BYTES // 8,), tag, dtype=torch.int64),
        }
    return {"tag": tag, "pid": os.getpid(), "blob": bytes([tag % 256]) * BLOB_BYTES}


def _unpack(state: Mapping[str, Any]) -> tuple[int, int, bool]:
    """(tag, source pid, whether the payload says the same tag throughout)."""
    if "pid" in state:
        tag = int(state["tag"])
        return tag, int(state["pid"]), state["blob"] == bytes([tag % 256]) * BLOB_BYTES
    tag, pid = (int(v) for v in state["tag"].tolist())
    return tag, pid, bool((state["blob"] == tag).all())


def learner(config: dict[str, Any]) -> None:
    """A channel's source: serves its tagged state (each read takes ``read_sleep``, so that a
    kill lands during a push) and reports a step every ``sleep`` until stopped."""
    attempt = asyncexec.get_context().attempt

    def read() -> dict[str, Any]:
        time.sleep(config["read_sleep"])
        with _lock:
            tag = _tag
        return _state(tag, config["transport"])

    asyncexec.serve_weights(read)
    step = 0
    while True:
        time.sleep(config["sleep"])
        asyncexec.report({"step": step, "attempt": attempt})
        step += 1


def rollout(config: dict[str, Any]) -> None:
    """A channel's target: each install takes ``install_sleep`` and is recorded; each report
    says the version the function saw just before ``report()`` (``held``) and just after the
    previous one returned (``after_prev``), and the (version, tag, source pid) its install put
    in place."""
    attempt = asyncexec.get_context().attempt

    def install(state: Mapping[str, Any], version: int) -> None:
        global _held
        tag, pid, intact = _unpack(state)
        time.sleep(config["install_sleep"])
        with _lock:
            _installs.append((version, tag, pid, intact))
            _held = (version, tag, pid)

    asyncexec.receive_weights(install)
    step = 0
    after: int | None = None
    while True:
        time.sleep(config["sleep"])
        # The time first: a version the function sees is at least what was installed by then.
        now = time.time()
        with _lock:
            version, tag, pid = _held
        held = asyncexec.weights_version()
        metrics = {
            "step": step,
            "attempt": attempt,
            "held": held,
            "after_prev": after,
            "tag_version": version,
            "tag": tag,
            "source_pid": pid,
            "t": now,
        }
        asyncexec.report(metrics)
        after = asyncexec.weights_version()
        step += 1


def installs() -> tuple[int, list[tuple[int, int, int, bool]]]:
    """This target process's pid and what it installed, in order."""
    with _lock:
        return os.getpid(), list(_installs)
