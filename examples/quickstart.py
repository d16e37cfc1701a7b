"""Quickstart: start a local Ray, run a group of workers, print their reports as they arrive.

    python examples/quickstart.py

The README's first example as a program: the same executor (4 workers of half a CPU), the same
``async def main()`` run by ``asyncio.run``; it also prints where each rank runs and every rank's
loss per step (``step.reports``; ``step.metrics`` is rank 0's).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time

import asyncexec


def train(config: dict[str, float]) -> float:
    """A stand-in for a training loop: every rank reports a loss per step."""
    ctx = asyncexec.get_context()
    loss = 1.0 + ctx.world_rank * 0.1
    for step in range(int(config["steps"])):
        time.sleep(0.05)  # the work of one step
        loss *= math.exp(-config["lr"])
        asyncexec.report({"step": step, "loss": round(loss, 4)})
    return loss


async def main() -> None:
    async with asyncexec.Executor(num_workers=4, resources_per_worker={"CPU": 0.5}) as executor:
        for w in executor.workers:
            print(
                f"rank {w.world_rank}: node {w.node_id[:8]} pid {w.pid} local_rank {w.local_rank}"
            )
        async for step in executor.run(train, {"lr": 0.1, "steps": 10}):
            losses = " ".join(f"{r.metrics['loss']:.4f}" for r in step.reports)
            print(f"step {step.index}: loss per rank {losses}")
        print("returned:", [round(v, 4) for v in executor.result.return_values])


if __name__ == "__main__":
    raw = argparse.RawDescriptionHelpFormatter  # --help prints the docstring above as it is
    argparse.ArgumentParser(description=__doc__, formatter_class=raw).parse_args()
    asyncio.run(main())
