"""A vLLM engine's health, as a :class:`~asyncexec.engines.VLLMServer` checks it: the engine's
own check, and a round trip to its core process, which a core that is stopped never answers (the
router's bound on the check then takes the server out).

A core answers nothing while it loads weights: a load is one call into it, which it runs through
before it reads the next, however long a large model's state takes. During a load the engine's
processes are looked at in place of the round trip: one that is stopped fails the check, and a
core that died is the engine's own check's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

__all__ = ["LOOK_S", "check", "named_processes", "processes"]

#: How often a check whose round trip to the core waits looks whether a load began meanwhile.
LOOK_S = 0.5


async def check(engine: Any, engine_processes: list[Any], loading: Callable[[], bool]) -> None:
    """On the engine loop: raise (or wait) when ``engine`` is unhealthy; ``loading()`` says
    whether weights go into it now.

    Raises:
        EngineDeadError: the engine died (its own check).
        RuntimeError: one of ``engine_processes`` is stopped during a load.
    """
    await engine.check_health()
    if not loading():
        # Asked for, then looked at now and then: a load that began meanwhile (vLLM sends the
        # round trip a turn of the loop later) is answered first.
        round_trip = asyncio.ensure_future(engine.is_paused())
        try:
            while not loading():
                done, _ = await asyncio.wait({round_trip}, timeout=LOOK_S)
                if done:
                    round_trip.result()
                    return
        finally:
            round_trip.cancel()  # (vLLM drops the answer of a round trip cancelled)
    stopped = _stopped(engine_processes)
    if stopped is not None:
        raise RuntimeError(f"the vLLM engine's process {stopped} is stopped during a load")


def processes(pids: list[int]) -> list[Any]:
    """``psutil.Process`` of each of ``pids`` still running (a handle that tells its process
    from a later one given the same pid)."""
    import psutil

    found = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            found.append(psutil.Process(pid))
    return found


def named_processes(engine: Any) -> dict[str, int]:
    """``engine``'s processes by name (``VLLM::EngineCore``, ``VLLM::Worker``, ...), among this
    process's children.

    The engine core is read from the engine's own process manager, by the name vLLM gives the
    process; the others by the title vLLM sets, which only shows where ``setproctitle`` can
    rewrite the command line (CI machines read no title at all)."""
    import psutil

    found: dict[str, int] = {}
    for p in psutil.Process().children(recursive=True):
        try:  # the title vLLM sets is in the command line; the name may be cut at 15
            title = (p.cmdline() or [p.name()])[0].split()[0]
        except (psutil.Error, IndexError):
            continue
        if title.startswith("VLLM::"):
            found[title] = p.pid
    resources = getattr(getattr(engine, "engine_core", None), "resources", None)
    for process in getattr(getattr(resources, "engine_manager", None), "processes", ()):
        if process.pid is not None and process.is_alive():
            found[f"VLLM::{process.name}"] = process.pid
    return found


def _stopped(engine_processes: list[Any]) -> int | None:
    """The pid of one of ``engine_processes`` that is stopped (``SIGSTOP``, or a tracer's
    stop), if any; one that ended is not (the engine's own check says that its core died)."""
    import psutil

    for process in engine_processes:
        with contextlib.suppress(psutil.Error):
            if process.is_running() and process.status() in (
                psutil.STATUS_STOPPED,
                psutil.STATUS_TRACING_STOP,
            ):
                return int(process.pid)
    return None
