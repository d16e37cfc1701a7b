"""``asyncexec stack``: the threads' stacks of a running cluster's asyncexec workers.

It joins the cluster as a driver of its own, finds the live worker actors in Ray's actor table
(class ``_Worker``, or ``_Threaded`` for a group whose roles have only plain methods; alive)
and reads each process's stacks from outside it, with py-spy on its node (see
``_driver.cluster._stacks``): a hung worker, which answers no call, is read like any other.
The output is grouped by the driver (Ray job) that owns the workers, then by node and pid; the
thread that runs a run's function is named ``asyncexec-fn <executor name> rank <rank>``, and
the header of each process repeats what that name says.

Joining the cluster, its actor table and token authentication belong to the cluster seam
(``_driver/cluster/_join.py``); a cluster that refuses the command for want of a token is told
at once, with what to set.
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Sequence
from typing import Any

import anyio

from .._driver.cluster import (
    DUMP_TIMEOUT_S,
    WorkerProcess,
    dump_processes,
    join_cluster,
    live_workers,
    shutdown_ray,
)
from .._errors import short_node

__all__ = ["WorkerProcess", "format_stacks", "stack_command"]

_FN_THREAD = re.compile(r'"asyncexec-fn (.+) rank (\d+)"')


def _running(text: str) -> tuple[str, int] | None:
    """The executor's name and the rank of the run's function a worker's stacks show."""
    match = _FN_THREAD.search(text)
    return None if match is None else (match.group(1), int(match.group(2)))


def _header(worker: WorkerProcess, running: tuple[str, int] | None) -> str:
    where = f"node {short_node(worker.node_id)} ({worker.node_ip})"
    head = f"=== job {worker.job_id}, {where}, pid {worker.pid}, actor {worker.actor_id[:12]}"
    if running is not None:
        head += f": executor {running[0]}, rank {running[1]}"
    return head


def format_stacks(workers: Sequence[WorkerProcess], texts: Sequence[str]) -> str:
    """The report: a summary line, then each worker's header and stacks, by driver, then by
    executor and rank where a run's function shows them (idle workers last), then node and
    pid."""
    nodes = len({w.node_id for w in workers})
    jobs = len({w.job_id for w in workers})
    lines = [f"{len(workers)} live asyncexec worker(s) on {nodes} node(s), {jobs} driver(s)"]
    found = [(w, text, _running(text)) for w, text in zip(workers, texts, strict=True)]
    found.sort(key=lambda f: (f[0].job_id, f[2] is None, f[2] or ("", 0), f[0].node_id, f[0].pid))
    for worker, text, running in found:
        lines += ["", _header(worker, running), text]
    return "\n".join(lines)


def stack_command(address: str | None, timeout_s: float = DUMP_TIMEOUT_S) -> int:
    """Print the stacks of every live worker of the cluster at ``address`` (None: the one
    ``RAY_ADDRESS`` or this machine's latest names); return the exit status: 0 when stacks were
    printed (a note stands for a stack that could not be taken), 1 when the cluster could not
    be joined or has no live worker."""
    target = address or "auto"
    why = join_cluster(target)
    if why is not None:
        print(f"asyncexec: could not join the Ray cluster at {target}: {why}", file=sys.stderr)
        return 1
    try:
        workers = live_workers()
        if not workers:
            print(f"asyncexec: no live asyncexec worker at {target}", file=sys.stderr)
            return 1
        targets = [(w.node_id, w.pid) for w in workers]
        dump: Any = functools.partial(dump_processes, targets, timeout_s=timeout_s)
        texts: list[str] = anyio.run(dump)
        print(format_stacks(workers, texts))
        return 0
    finally:
        shutdown_ray()
