"""A driver process for tests/run/test_resume.py: runs a named run on an existing Ray and prints one
JSON line per step, then the result. The test SIGKILLs it mid-run and starts it again.

    python tests/run/resume_driver.py ADDRESS STORAGE NAME STEPS DELAY_S [CONFIG_TAG]
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import tempfile
import time
from typing import Any

import asyncexec


def train(config: dict[str, Any]) -> int:
    """Adds i * (rank + 1) for i in 0..steps-1; checkpoints (next i, total) every 3 steps."""
    rank = asyncexec.get_context().world_rank
    start, total = 0, 0
    checkpoint = asyncexec.get_checkpoint()
    if checkpoint is not None:
        with open(os.path.join(checkpoint.path, f"rank{rank}.json")) as f:
            start, total = json.load(f)
    for i in range(start, config["steps"]):
        total += i * (rank + 1)
        time.sleep(config["delay"])
        metrics = {"i": i, "total": total}
        if i % 3 == 2:
            with tempfile.TemporaryDirectory() as tmp:
                with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
                    json.dump([i + 1, total], f)
                asyncexec.report(metrics, checkpoint=asyncexec.Checkpoint.from_directory(tmp))
        else:
            asyncexec.report(metrics)
    return total


#: A set of strings in the config: it pickles in an order that differs between processes (each
#: driver is started with its own PYTHONHASHSEED), and must still be the same config.
TAGS = frozenset({"alpha", "beta", "gamma", "delta", "epsilon", "zeta"})


async def main(address: str, storage: str, name: str, steps: int, delay: float, tag: str) -> None:
    async with asyncexec.Executor(
        2,
        address=address,
        storage_path=storage,
        resources_per_worker={"CPU": 0.5},
        checkpoint=asyncexec.CheckpointConfig(num_to_keep=2),
    ) as executor:
        print(json.dumps({"started": time.time()}), flush=True)
        config = {"steps": steps, "delay": delay, "tag": tag, "tags": set(TAGS)}
        run = executor.run(train, config, name=name)
        async for step in run:
            line = {"index": step.index, "i": step.metrics["i"], "attempt": step.attempt}
            print(json.dumps(line), flush=True)
        result = executor.result
        print(json.dumps({"result": result.return_values, "attempts": result.attempts}), flush=True)


if __name__ == "__main__":
    address, storage, name, steps, delay = sys.argv[1:6]
    tag = sys.argv[6] if len(sys.argv) > 6 else ""
    asyncio.run(main(address, storage, name, int(steps), float(delay), tag))
