"""A driver process for the ``driver_killed`` kind: a named run of the chaos counter on an existing
Ray, one JSON line per step (and one when the executor is ready, one at the end). The runner
SIGKILLs it mid-run (or it cancels its own consumer ``cancel_s`` after its run starts) and
starts another.

    python -m benchmarks.chaos.driver ADDRESS STORAGE NAME CONFIG_JSON OPTIONS_JSON

``OPTIONS_JSON``: ``{"buffer": 2, "slow": false, "cancel_s": null}`` (a slow consumer spends 0.1
s on each step).
"""

from __future__ import annotations

import json
import logging
import math
import sys
import time
from typing import Any

import anyio
import structlog

import asyncexec
from benchmarks.chaos.harness import SLOW_CONSUMER_S
from benchmarks.chaos.worker import counter


def _say(**line: Any) -> None:
    print(json.dumps(line), flush=True)


async def main(
    address: str, storage: str, name: str, config: dict[str, Any], options: dict[str, Any]
) -> None:
    cancel_s = options["cancel_s"]
    async with asyncexec.Executor(
        2,
        address=address,
        storage_path=storage,
        resources_per_worker={"CPU": 0.5},
        buffer_size=options["buffer"],
        name="chaos-driver",
    ) as executor:
        _say(ready=time.time())
        run = executor.run(counter, config, name=name)
        with anyio.move_on_after(math.inf if cancel_s is None else cancel_s) as scope:
            async for step in run:
                metrics = step.reports[0].metrics
                _say(index=step.index, step=metrics["step"], attempt=step.attempt, t=time.time())
                if options["slow"]:
                    await anyio.sleep(SLOW_CONSUMER_S)
        if scope.cancelled_caught:
            await run.aclose()
            _say(cancelled=time.time())
            return
        result = executor.result
        _say(result=result.return_values, attempts=result.attempts)


if __name__ == "__main__":
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL))
    address, storage, name, config, options = sys.argv[1:6]
    anyio.run(main, address, storage, name, json.loads(config), json.loads(options))
