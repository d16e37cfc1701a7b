"""A driver that a test interrupts with SIGINT: it joins the test's Ray (RAY_ADDRESS), runs an
executor, and prints READY once steps flow. MODE=fast: the run streams as fast as it can;
MODE=slow: a report every 50 ms (the consumer waits for each); MODE=stuck: the function stops
reporting after its first steps and ignores being stopped (a teardown that waits its whole
``stop_timeout_s``, 60 s here)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import ray

import asyncexec


def forever(mode: str) -> None:
    i = 0
    while True:
        if mode != "stuck" or i <= 100:
            asyncexec.report({"i": i})
        if mode != "fast" and (mode == "slow" or i > 100):
            time.sleep(0.05)
        i += 1


def dump_tasks() -> None:
    """Every task's stack on stderr (SIGUSR1: the test asks when the driver did not end)."""
    for task in asyncio.all_tasks():
        print(f"task {task!r}", file=sys.stderr)
        task.print_stack(file=sys.stderr)
    sys.stderr.flush()


async def main() -> None:
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump_tasks)
    mode = os.environ.get("MODE", "fast")
    ready = {"fast": 5000, "slow": 5, "stuck": 100}[mode]
    async with asyncexec.Executor(
        2, resources_per_worker={"CPU": 0.25}, timeouts=asyncexec.Timeouts(stop_s=60)
    ) as ex:
        async for step in ex.run(forever, mode, buffer_size=64):
            if step.index == ready:
                print("READY", flush=True)


if __name__ == "__main__":
    ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
    asyncio.run(main())
