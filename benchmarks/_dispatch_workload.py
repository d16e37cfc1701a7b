"""What runs in the worker processes of the dispatch benchmark (``dispatch.py``): a worker class
used as asyncexec's role, and the same methods on plain Ray actors (async and sync).

Workers import this module by name (the benchmark puts its folder on ``PYTHONPATH``), so the role
is pickled by reference and the module stays light.
"""

from __future__ import annotations

import asyncio
import os
import threading
from typing import Any

import ray

__all__ = [
    "Echo",
    "EchoPlain",
    "RawEcho",
    "RawEchoPlainGroup",
    "RawEchoSync",
    "RawEchoThreaded",
    "part_summary",
]


def part_summary(part: Any) -> dict[str, Any]:
    """What a rank says about the part it received: its bytes, and its first and last items
    (the driver checks them against the part it meant that rank to have)."""
    return {
        "nbytes": int(part.nbytes),
        "first": float(part[0]) if len(part) else None,
        "last": float(part[-1]) if len(part) else None,
        "pid": os.getpid(),
    }


class Echo:
    """The role with ``async def`` methods (its group's workers are async actors): a small
    call on the worker's loop, a scattered part's summary, and a call served by one rank."""

    def __init__(self) -> None:
        self.calls = 0

    async def small(self, x: int) -> int:
        self.calls += 1
        return x + 1

    async def take(self, part: Any) -> dict[str, Any]:
        return part_summary(part)

    async def serve(self, x: int) -> int:
        self.calls += 1
        return x

    def served(self) -> int:
        return self.calls


class EchoPlain:
    """The role with plain methods only, as the hand-written sync actor has: its group's
    workers are threaded sync actors, and the plain method runs on its role's group thread."""

    def __init__(self) -> None:
        self.calls = 0

    def small_sync(self, x: int) -> int:
        self.calls += 1
        return x + 1


@ray.remote
class RawEcho:
    """The same methods on a plain async Ray actor (each runs on the actor's event loop)."""

    def __init__(self) -> None:
        self.calls = 0

    async def ping(self) -> int:
        return os.getpid()

    async def small(self, x: int) -> int:
        self.calls += 1
        return x + 1

    async def take(self, part: Any) -> dict[str, Any]:
        return part_summary(part)

    async def serve(self, x: int) -> int:
        self.calls += 1
        return x


@ray.remote
class RawEchoSync:
    """A plain sync Ray actor: its methods run on Ray's own executor thread."""

    def __init__(self) -> None:
        self.calls = 0

    def ping(self) -> int:
        return os.getpid()

    def small_sync(self, x: int) -> int:
        self.calls += 1
        return x + 1


@ray.remote(concurrency_groups={"plain": 1})
class RawEchoPlainGroup:
    """A plain method on an async Ray actor, in a concurrency group of its own (one call at a
    time, off the actor's loop): where asyncexec runs a role's plain method, by hand. What Ray
    itself costs for that shape, against a sync actor, is the floor of asyncexec's plain rows
    (its workers are async actors)."""

    def __init__(self) -> None:
        self.calls = 0

    async def ping(self) -> int:
        return os.getpid()

    @ray.method(concurrency_group="plain")
    def small_sync(self, x: int) -> int:
        self.calls += 1
        return x + 1


class _Threaded:
    """The other shape a worker could take (measured by hand, not asyncexec's): a *sync* Ray
    actor, its plain methods on Ray's main thread one at a time (as a sync actor's), whose own
    asyncio loop runs in a background thread for the async parts: an ``async def`` runs there,
    sent from a thread of a threaded concurrency group (``run_coroutine_threadsafe``), so that
    such calls run concurrently; long polls would block a thread of a "control" group the
    same way (one is pending here while the calls are measured)."""

    def __init__(self) -> None:
        self.calls = 0
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def ping(self) -> int:
        return os.getpid()

    def small_sync(self, x: int) -> int:
        self.calls += 1
        return x + 1

    @ray.method(concurrency_group="async")
    def small(self, x: int) -> int:
        async def small() -> int:
            self.calls += 1
            return x + 1

        return asyncio.run_coroutine_threadsafe(small(), self.loop).result()

    @ray.method(concurrency_group="control")
    def hold(self, seconds: float) -> None:
        """A long poll: blocks a control thread on the loop's future."""
        asyncio.run_coroutine_threadsafe(asyncio.sleep(seconds), self.loop).result()


RawEchoThreaded = ray.remote(concurrency_groups={"async": 32, "control": 2})(_Threaded)
