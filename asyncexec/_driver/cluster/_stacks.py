"""Stacks of worker processes, read from outside them: for the errors of hung workers and for
``asyncexec stack``.

A hung worker may answer nothing (blocked in C code holding the GIL, its actor's event loop
stalled), so its threads' stacks are read from outside its process, by py-spy on its node: a
subprocess of this process for the workers on this process's node, and a small Ray task pinned to
each other node (it asks for no CPU, so a full cluster still runs it). Every process is dumped at
once, and the whole is bounded by one deadline. Where a stack cannot be taken, its text is a note
that says why (py-spy is not installed there, no permission to read the process, no answer in
time), never an error: a diagnosis must not turn a failure into a worse one.

Nothing here runs on the hot path: stacks are taken only when a hang is declared, when a stopped
run's functions do not end in time, and on request.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence

import anyio
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from ..._errors import describe, short_node
from .._taskgroups import task_group

__all__ = [
    "DUMP_TIMEOUT_S",
    "NOT_TAKEN",
    "dump_processes",
    "find_pyspy",
    "take_stacks",
]

#: The bound of one dump of a group's stacks, all nodes at once.
DUMP_TIMEOUT_S = 10.0
#: The share of the bound py-spy itself gets on a node (the rest is the task's trip there).
_PYSPY_SHARE = 0.7
#: How long a killed py-spy gets to go, at most: never more than a fifth of its node's budget
#: (``take_stacks`` ends within its ``timeout_s``, kill included).
_REAP_S = 1.0
#: How a stack that could not be taken begins.
NOT_TAKEN = "stack not taken: "
#: The most of py-spy's error output a note keeps.
_ERROR_CHARS = 400
_INSTALL = "pip install py-spy, or asyncexec[diagnostics]"
_PERMISSION = (
    "py-spy may not read the process's memory: run the workers as root, give py-spy "
    "CAP_SYS_PTRACE, or set kernel.yama.ptrace_scope to 0"
)


def find_pyspy() -> str | None:
    """The py-spy program of this environment (beside ``sys.executable``), else on the PATH."""
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if os.access(beside, os.X_OK):
        return beside
    return shutil.which("py-spy")


def take_stacks(pids: Sequence[int], timeout_s: float, where: str) -> list[str]:
    """``py-spy dump`` of each process of this node, all at once; for each, its threads' stacks
    or a note saying why they were not taken. Blocking (runs in a thread, or as a Ray task on
    the processes' node); never raises, and returns within about ``timeout_s``: a py-spy that
    has not answered by four fifths of it is killed, and given the rest to go. ``where`` names
    the node in the notes."""
    program = find_pyspy()
    if program is None:
        return [f"{NOT_TAKEN}py-spy is not installed on {where} ({_INSTALL})"] * len(pids)
    started: list[subprocess.Popen[str] | str] = []
    for pid in pids:
        try:
            started.append(
                subprocess.Popen(
                    [program, "dump", "--pid", str(pid)],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    stdin=subprocess.DEVNULL,
                    text=True,
                )
            )
        except Exception as exc:  # a note, whatever went wrong
            started.append(f"{NOT_TAKEN}py-spy could not be started on {where}: {describe(exc)}")
    reap_s = min(_REAP_S, timeout_s / 5)
    deadline = time.monotonic() + timeout_s - reap_s
    # Each py-spy read in a thread of its own: read one after another, one that did not answer
    # held the others past the deadline (their pipes full, or read with no time left), and
    # each of them became a note.
    with concurrent.futures.ThreadPoolExecutor(len(pids) or 1) as pool:
        reading = [
            one if isinstance(one, str) else pool.submit(_finish, one, pid, deadline, reap_s, where)
            for pid, one in zip(pids, started, strict=True)
        ]
        return [one if isinstance(one, str) else one.result() for one in reading]


def _finish(
    process: subprocess.Popen[str], pid: int, deadline: float, reap_s: float, where: str
) -> str:
    try:
        out, err = process.communicate(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        process.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):  # a child may hold its pipes
            process.communicate(timeout=reap_s)
        return f"{NOT_TAKEN}py-spy did not finish in time on {where} (pid {pid})"
    except Exception as exc:  # a note, whatever went wrong
        process.kill()
        return f"{NOT_TAKEN}reading py-spy's output failed on {where}: {describe(exc)}"
    if process.returncode == 0 and out.strip():
        return out.rstrip()
    said = " ".join((err or out).split())[:_ERROR_CHARS] or "no output"
    hint = f" ({_PERMISSION})" if "ermission" in said or "not permitted" in said else ""
    status = f"pid {pid}, exit {process.returncode}"
    return f"{NOT_TAKEN}py-spy failed on {where} ({status}): {said}{hint}"


# A task on the processes' own node; no CPU, so that it runs on a node whose CPUs are all taken.
_take_stacks_task = ray.remote(num_cpus=0, max_retries=0)(take_stacks)


def _here() -> str | None:
    """This process's node (None outside a Ray node)."""
    try:
        node: str = ray.get_runtime_context().get_node_id()
    except Exception:
        return None
    return node


async def dump_processes(
    targets: Sequence[tuple[str, int]],
    *,
    timeout_s: float = DUMP_TIMEOUT_S,
    local: bool = True,
) -> list[str]:
    """The stacks of each ``(node_id, pid)`` of ``targets``, in their order (a note where one
    could not be taken), within ``timeout_s``. Processes on this process's node are read by a
    subprocess of this process (``local=False``: by a Ray task there too), the others by a Ray
    task on their node. Never raises, and never blocks the event loop."""
    here = _here() if local else None
    texts = [f"{NOT_TAKEN}no answer within {timeout_s:g} s"] * len(targets)
    by_node: dict[str, list[int]] = {}
    for i, (node, _pid) in enumerate(targets):
        by_node.setdefault(node, []).append(i)

    async def one_node(node: str, indices: list[int]) -> None:
        pids = [targets[i][1] for i in indices]
        where = f"node {short_node(node)}"
        budget = timeout_s * _PYSPY_SHARE
        got: list[str]
        try:
            with anyio.fail_after(timeout_s):
                if node == here:
                    got = await anyio.to_thread.run_sync(
                        take_stacks, pids, budget, where, abandon_on_cancel=True
                    )
                else:
                    # Submitting may export the task (a blocking call to Ray): off the loop,
                    # in a thread abandoned at the bound (a GCS that does not answer).
                    ref = await anyio.to_thread.run_sync(
                        _submit, node, pids, budget, where, abandon_on_cancel=True
                    )
                    got = await ref
        except TimeoutError:
            got = [f"{NOT_TAKEN}no answer from {where} within {timeout_s:g} s"] * len(pids)
        except Exception as exc:
            got = [f"{NOT_TAKEN}the task on {where} failed: {describe(exc)}"] * len(pids)
        for i, text in zip(indices, got, strict=True):
            texts[i] = text

    async with task_group() as tg:
        for node, indices in by_node.items():
            tg.start_soon(one_node, node, indices)
    return texts


def _submit(node: str, pids: list[int], timeout_s: float, where: str) -> ray.ObjectRef[list[str]]:
    strategy = NodeAffinitySchedulingStrategy(node, soft=False)
    ref: ray.ObjectRef[list[str]] = _take_stacks_task.options(scheduling_strategy=strategy).remote(
        pids, timeout_s, where
    )
    return ref
