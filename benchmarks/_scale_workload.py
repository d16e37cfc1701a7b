"""What the Ray actors of ``benchmarks/scale.py`` run (workers import it by name: it imports
nothing heavy), and the worker class of its dispatch figures (pickled by reference, so that the
simulated ranks' instances share this module's globals with the benchmark)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import asyncexec

#: Ranks' reports fall at different moments, spread evenly over a period by the golden ratio
#: (the simulated ranks spread theirs the same way).
GOLDEN = 0.6180339887498949


def paced(config: dict[str, Any]) -> None:
    """Report ``reports`` empty reports, one every ``1 / rate`` seconds, at a phase of its own."""
    period = 1.0 / config["rate"]
    rank = asyncexec.get_context().world_rank
    due = time.monotonic() + period * (1.0 + (rank * GOLDEN) % 1.0)
    for _ in range(config["reports"]):
        pause = due - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        asyncexec.report({})
        due += period


def flat_out(config: dict[str, Any]) -> None:
    """Report ``reports`` empty reports as fast as credit allows."""
    report = asyncexec.report
    empty: dict[str, Any] = {}
    for _ in range(config["reports"]):
        report(empty)


def turns_slow(config: dict[str, Any]) -> None:
    """Steps of ``step_s``; rank ``slow_rank`` takes ``factor`` times as long from step
    ``slow_from`` on, and reports when its first slow step started (``slow_since``)."""
    slow = asyncexec.get_context().world_rank == config.get("slow_rank", -1)
    slow_from = config.get("slow_from", 0)
    for i in range(config["steps"]):
        started = time.monotonic()
        time.sleep(config["step_s"] * (config["factor"] if slow and i >= slow_from else 1.0))
        asyncexec.report({"slow_since": started if slow and i == slow_from else None})


#: What the held calls of the dispatch figures wait for, by name; how many are held.
HELD: dict[str, asyncio.Event] = {}
WAITING: dict[str, int] = {}


class Shard:
    """The worker class of the dispatch figures: each simulated rank holds an instance."""

    def take(self, part: Any) -> int:
        return 0 if part is None else len(part)

    async def hold(self, name: str, expected: int) -> None:
        WAITING[name] = WAITING.get(name, 0) + 1
        if WAITING[name] == expected:
            HELD[f"{name} all in"].set()
        await HELD[name].wait()
