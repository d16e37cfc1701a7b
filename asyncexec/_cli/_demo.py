"""The function that ``asyncexec demo`` runs: a toy training loop that checkpoints, crashes once
and recovers.

Every rank "trains" for ``total_steps`` steps (a short sleep each), reports its loss, and saves
its state into a checkpoint every ``checkpoint_every`` steps. On the first attempt, rank
``crash_rank`` kills its own process with SIGKILL at step ``crash_step`` (a real crash: no
exception, no clean exit). The executor notices the dead worker, stops the others, starts a
fresh group and resumes every rank from the latest checkpoint, with attempt 2. It needs nothing
beyond asyncexec itself (no torch, no numpy), so it runs on a fresh install.
"""

from __future__ import annotations

import json
import math
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

from .._wire._checkpoint import Checkpoint
from .._worker import get_checkpoint, get_context, report

__all__ = ["DEFAULT_CONFIG", "demo_train"]

#: The demo's settings; ``asyncexec demo`` overrides some from its flags.
DEFAULT_CONFIG: dict[str, Any] = {
    "total_steps": 12,
    "checkpoint_every": 3,
    "crash_step": 7,
    "crash_rank": -1,  # the last rank
    "step_s": 0.15,
    "lr": 0.25,
}


def demo_train(config: dict[str, Any]) -> dict[str, Any]:
    """Train a pretend model on every rank; crash once on the first attempt; resume on the next.

    Args:
        config: ``total_steps``, ``checkpoint_every``, ``crash_step`` (``None`` for no crash),
            ``crash_rank`` (negative counts from the last rank), ``step_s`` (seconds per step)
            and ``lr`` (how fast the loss falls).

    Returns:
        The rank, the attempt it finished in, the step it resumed from and its final loss.
    """
    ctx = get_context()
    total = int(config["total_steps"])
    every = int(config["checkpoint_every"])
    crash_step = config.get("crash_step")
    crash_rank = int(config.get("crash_rank", -1)) % ctx.world_size
    start, loss = 0, 1.0 + 0.05 * ctx.world_rank
    checkpoint = get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            state = json.loads((Path(folder) / f"rank_{ctx.world_rank}.json").read_text())
        start, loss = int(state["step"]) + 1, float(state["loss"])
    for step in range(start, total):
        time.sleep(float(config["step_s"]))  # the work of one step
        crash_here = crash_step is not None and step == crash_step and ctx.world_rank == crash_rank
        if crash_here and ctx.attempt == 1:
            _crash()
        loss *= math.exp(-float(config["lr"]) * (1 + 0.1 * math.sin(step)))
        metrics = {"step": step, "loss": round(loss, 5), "resumed_from": start}
        if (step + 1) % every == 0:
            # Every rank saves its own state; the files of all ranks for one step land in one
            # persisted checkpoint directory.
            with tempfile.TemporaryDirectory() as folder:
                state = {"step": step, "loss": loss}
                Path(folder, f"rank_{ctx.world_rank}.json").write_text(json.dumps(state))
                report(metrics, checkpoint=Checkpoint.from_directory(folder))
        else:
            report(metrics)
    return {"rank": ctx.world_rank, "attempt": ctx.attempt, "resumed_from": start, "loss": loss}


def _crash() -> None:
    """Die the way a real crash does: no exception, no clean-up."""
    sig = getattr(signal, "SIGKILL", None)
    if sig is not None:
        os.kill(os.getpid(), sig)
    os._exit(137)  # pragma: no cover (no SIGKILL on this platform)


# How the command line learns the length of a run for its progress bar (a ``total_steps`` key
# in the run's config, as the demo passes, takes precedence).
demo_train.total_steps = DEFAULT_CONFIG["total_steps"]  # type: ignore[attr-defined]
