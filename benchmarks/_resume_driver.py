"""A driver process for the resume figure of ``_outlive.py``: a named run of small steps with a
checkpoint every 5, on an existing Ray; one JSON line when the executor is ready and one per step.

    python benchmarks/_resume_driver.py ADDRESS STORAGE NAME STEPS
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


def train(config: dict[str, Any]) -> None:
    start = 0
    checkpoint = asyncexec.get_checkpoint()
    if checkpoint is not None:
        with open(os.path.join(checkpoint.path, "i.json")) as f:
            start = json.load(f)
    for i in range(start, config["steps"]):
        time.sleep(0.02)
        if i % 5 == 4:
            with tempfile.TemporaryDirectory() as tmp:
                with open(os.path.join(tmp, "i.json"), "w") as f:
                    json.dump(i + 1, f)
                asyncexec.report({"i": i}, checkpoint=asyncexec.Checkpoint.from_directory(tmp))
        else:
            asyncexec.report({"i": i})


async def main(address: str, storage: str, name: str, steps: int) -> None:
    async with asyncexec.Executor(
        2, address=address, storage_path=storage, resources_per_worker={"CPU": 0.25}
    ) as executor:
        print(json.dumps({"ready": time.time()}), flush=True)
        async for step in executor.run(train, {"steps": steps}, name=name):
            print(json.dumps({"index": step.index, "i": step.metrics["i"]}), flush=True)


if __name__ == "__main__":
    address, storage, name, steps = sys.argv[1:5]
    asyncio.run(main(address, storage, name, int(steps)))
