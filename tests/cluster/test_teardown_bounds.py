"""Shielded steps have deadlines of their own: a cluster that never answers cannot hang a close.

A shield keeps out the cancellation that closes an object (a task group's, a teardown's), so a
shielded wait without a deadline of its own waits as long as what it waits for. The structure
test (``tests/project/test_structure.py``) checks that every shield has one; these tests show
what one that had none did."""

from __future__ import annotations

import asyncio
import pickle
import threading
from typing import Any

import anyio
import pytest
import ray
import ray.exceptions as rex

import asyncexec
from asyncexec._driver.cluster import Placement, RayCluster, _errors, _ray
from asyncexec._driver.cluster._errors import call_error


class _Who:
    rank = 1

    def __init__(self) -> None:
        from asyncexec._wire._protocol import WorkerMetadata

        self.metadata = WorkerMetadata("ab" * 28, "127.0.0.1", "host", 1234, {})


@pytest.mark.timeout(30)
async def test_a_deaths_node_check_that_never_answers_ends_at_its_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The node check that maps a dead worker's call (is its node gone?) was shielded with no
    deadline: a node table that never answered hung the mapping, and with it whatever waited for
    the call, cancelled or not (a task group's close, a teardown's bounded step). It now gives up
    at ``NODE_CHECK_S`` and takes the node as alive: the death is a crashed worker."""
    monkeypatch.setattr(_errors, "NODE_CHECK_S", 0.3, raising=False)
    asked = anyio.Event()
    answer = anyio.Event()  # set only to let a hung check go at the end

    async def never(node_id: str | None) -> bool:
        asked.set()
        await answer.wait()
        return True

    async def mapped_under_a_close() -> Any:
        # The close's own cancellation, as a task group's exit or a teardown's deadline gives.
        with anyio.move_on_after(0.1):
            return await call_error(rex.RayActorError(), _Who(), 2, never)
        return "cancelled before the mapping ended"

    task = asyncio.ensure_future(mapped_under_a_close())
    try:
        with anyio.fail_after(10):
            await asked.wait()
        done, _ = await asyncio.wait({task}, timeout=5.0)  # (waits without cancelling it)
        assert task in done, "the shielded node check hung past its bound and the close's"
        error = task.result()
        assert type(error) is asyncexec.WorkerCrashedError, error
        assert (error.rank, error.attempt) == (1, 2)
    finally:
        answer.set()
        await task


@pytest.mark.timeout(30)
async def test_a_placement_timeout_whose_resource_lookup_never_answers_says_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Defect: after a placement group's deadline, the error's message read the cluster's
    available resources in a thread with no bound of its own: a GCS that did not answer hung
    the error path (the executor's or pool's entry never raised). The look-up now ends at
    ``LOOKUP_TIMEOUT_S`` and the message says the resources are unknown."""
    monkeypatch.setattr(_ray, "LOOKUP_TIMEOUT_S", 0.2)
    gate = threading.Event()  # set only to let the hung look-up's thread go at the end

    def never() -> dict[str, float]:
        gate.wait()
        return {}

    monkeypatch.setattr(ray, "available_resources", never)
    never_ready = asyncio.get_running_loop().create_future()
    placement = Placement(None, [{"CPU": 1.0}], owned=True, ready=never_ready)  # type: ignore[arg-type]
    try:
        with anyio.fail_after(10), pytest.raises(asyncexec.PlacementTimeoutError) as info:
            await RayCluster().wait_placed(placement, 0.05)
    finally:
        gate.set()
    assert info.value.available is None
    assert "available unknown" in str(info.value)
    assert str(pickle.loads(pickle.dumps(info.value))) == str(info.value)
