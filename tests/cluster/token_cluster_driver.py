"""A driver process for tests/cluster/test_token_auth.py: starts a local Ray of its own as
``ray.init()`` starts one by default in Ray 2.60 (token authentication on; a token is made in
``~/.ray`` when none is found), enters an executor of one worker, prints ``READY <address>``, and
holds the worker until its stdin closes; then it leaves the executor and shuts its Ray down.

    HOME=<a folder of the test's> python tests/cluster/token_cluster_driver.py
"""

from __future__ import annotations

import logging
import sys

import anyio
import ray

import asyncexec


async def hold() -> None:
    async with asyncexec.Executor(1, name="held") as executor:
        print("READY", ray.get_runtime_context().gcs_address, executor.workers[0].pid, flush=True)
        await anyio.to_thread.run_sync(sys.stdin.read)


def main() -> None:
    # In the main thread, before the event loop, as a program should start Ray.
    ray.init(num_cpus=1, include_dashboard=False, logging_level=logging.WARNING)
    try:
        anyio.run(hold)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
