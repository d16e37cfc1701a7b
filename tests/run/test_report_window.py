"""The default credit window: 2,048 reports a rank, everywhere they may be (the worker, the wire,
the driver), and a consumer that stops taking steps holds every rank back at it, on Ray actors
and in local mode."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

import asyncexec

WINDOW = 2048


#: The reports each rank's ``fast_reporter`` made (``report()`` returned) in this process.
_made_by_rank: dict[int, int] = {}


def fast_reporter(config: dict[str, Any]) -> None:
    rank = asyncexec.get_context().world_rank
    _made_by_rank[rank] = 0
    for i in range(config["steps"]):
        asyncexec.report({"i": i})
        _made_by_rank[rank] = i + 1


def _made_so_far() -> int:
    return _made_by_rank.get(asyncexec.get_context().world_rank, 0)


async def _made(ex: asyncexec.Executor) -> list[int]:
    return list(await ex.execute(_made_so_far))


async def _until_window_full(ex: asyncexec.Executor, least: int, timeout_s: float) -> list[int]:
    """Each rank's reports once every rank made ``least`` (or what they made at the timeout)."""
    deadline = time.monotonic() + timeout_s
    while True:
        made = await _made(ex)
        if min(made) >= least or time.monotonic() > deadline:
            return made
        await asyncio.sleep(0.02)


@pytest.mark.timeout(30)
@pytest.mark.usefixtures("mode")
async def test_a_consumer_that_stops_holds_every_rank_back_at_the_default_window() -> None:
    async with asyncexec.Executor(2, resources_per_worker={"CPU": 0.5}) as ex:
        assert ex.config.buffer_size == WINDOW
        run = ex.run(fast_reporter, {"steps": 3 * WINDOW})
        taken = 0
        async for step in run:
            taken += 1
            assert step.index == taken - 1
            if taken == 1:
                # The ranks run ahead a whole window, and no further.
                made = await _until_window_full(ex, WINDOW, 20)
                assert min(made) >= WINDOW, made
                await asyncio.sleep(0.2)  # time to overrun it, were it not enforced
                made = await _made(ex)
                assert max(made) <= WINDOW + taken, made
            elif taken == 1800:
                # Past 7 batches of 256 steps (1,792), three quarters of the window at least: the
                # ranks were polled, learned it, and ran ahead a window of it again.
                made = await _until_window_full(ex, WINDOW + 1792, 20)
                assert min(made) >= WINDOW + 1792, made
                await asyncio.sleep(0.2)
                made = await _made(ex)
                assert max(made) <= WINDOW + taken, made
        assert taken == 3 * WINDOW


def test_the_docs_give_the_default_window() -> None:
    root = Path(__file__).resolve().parents[2]
    semantics = (root / "docs" / "semantics.md").read_text()
    default = asyncexec.Executor(1).config.buffer_size  # what an executor gets
    assert f"`buffer_size` is {default:,} by default" in semantics
