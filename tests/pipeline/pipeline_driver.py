"""A driver process for tests/pipeline/test_pipeline.py: a pipeline of 40 prompts in batches of 4
(local mode), a learner that "trains" by recording the ids, a checkpoint after every second update
(the ids trained on and ``pipe.state_dict()``), one JSON line per batch. The test SIGKILLs it and
starts it again from the checkpoint.

    ASYNCEXEC_LOCAL=1 python tests/pipeline/pipeline_driver.py CHECKPOINT
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import AsyncIterator
from typing import Any

import asyncexec


class Server(asyncexec.RolloutServer):
    async def chunks(self, prompt: int) -> AsyncIterator[int]:
        for i in range(1 + prompt % 3):
            await asyncio.sleep(0.002)
            yield i

    def load_weights(self, state: Any, version: int) -> None:
        pass


def load(path: str) -> tuple[list[int], Any]:
    if not os.path.exists(path):
        return [], None
    with open(path) as f:
        saved = json.load(f)
    return saved["trained"], saved["pipeline"]


def save(path: str, trained: list[int], pipeline: dict[str, Any]) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump({"trained": trained, "pipeline": pipeline}, f)
    os.replace(path + ".tmp", path)


async def main(path: str) -> None:
    trained, consumed = load(path)
    async with (
        asyncexec.Executor(2, roles=asyncexec.Role(Server)) as servers,
        asyncexec.Pipeline(
            servers, range(40), batch_size=4, staleness=1, consumed=consumed
        ) as pipe,
    ):
        async for batch in pipe:
            print(json.dumps({"version": batch.version, "ids": batch.ids}), flush=True)
            trained += batch.ids  # the learner's step
            await pipe.update_weights(None)
            if pipe.version % 2 == 0:
                save(path, trained, pipe.state_dict())
            await asyncio.sleep(0.05)  # time for the test to kill it between batches
    save(path, trained, pipe.state_dict())


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
