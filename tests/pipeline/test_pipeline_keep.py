"""A pipeline's "keep" update on simulated servers (no Ray): servers that hold their generation for
their own loads (``RolloutServer.pauses_for_its_loads``) are not paused, and each goes on
generating while the others load; an engine that does not pause itself for a load is paused for
the whole update, as before."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator
from typing import Any, ClassVar, Literal

import anyio
import pytest

import asyncexec
from asyncexec.testing import Script, ScriptedServer, SimCluster


class Logged(ScriptedServer):
    """A :class:`ScriptedServer` that logs its chunks, loads and pauses (simulated servers live
    in the test's process: one log for all); rank 1's loads take ``LOAD_S``."""

    LOAD_S = 0.3
    log: ClassVar[list[tuple[str, int, Any]]] = []
    lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self) -> None:
        super().__init__()
        self.rank = asyncexec.get_context().world_rank

    def _note(self, what: str, detail: Any = None) -> None:
        with self.lock:
            self.log.append((what, self.rank, detail))

    async def chunks(self, prompt: Any) -> AsyncIterator[int]:
        async for chunk in super().chunks(prompt):
            self._note("chunk", self.weights_version())
            yield chunk

    def load_weights(self, state: Any, version: int) -> None:
        self._note("load", version)
        if self.rank == 1:
            time.sleep(self.LOAD_S)  # (in the install's thread)
        super().load_weights(state, version)
        self._note("loaded", version)

    async def pause_engine(self, mode: Literal["keep", "abort"]) -> None:
        self._note("pause", mode)


class EngineLike(Logged):
    """Pauses in its engine, and says nothing of its loads: paused for a keep update."""

    pause_point: ClassVar[Literal["chunk", "engine"]] = "engine"


class EngineThatPausesForLoads(EngineLike):
    load_pauses_engine: ClassVar[bool] = True


async def _one_update(cls: type[Logged], monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The log of a keep update, after a batch, with generations in flight on both servers."""
    monkeypatch.setattr(Logged, "log", [])
    # The first batch's 4 are short; those after it take about a second.
    prompts = [Script(20 if i < 4 else 500, 0.002) for i in range(24)]
    async with (
        asyncexec.Executor(2, roles=asyncexec.Role(cls), cluster=SimCluster()) as servers,
        asyncexec.Router(servers, max_in_flight=4) as router,
        asyncexec.Pipeline(router, prompts, batch_size=4, on_update="keep") as pipe,
    ):
        await pipe.__anext__()
        assert all(n > 0 for n in router.in_flight.values()), router.in_flight
        with anyio.fail_after(10):
            await pipe.update_weights({"w": 1})
        return list(Logged.log)


def _during(log: list[Any], rank: int) -> list[Any]:
    """What was logged during ``rank``'s load."""
    start = log.index(("load", rank, 1))
    return log[start + 1 : log.index(("loaded", rank, 1))]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("cls", [Logged, EngineThatPausesForLoads])
async def test_a_keep_update_pauses_no_server_and_each_waits_for_its_own_load_only(
    cls: type[Logged], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect: a keep update paused every server from before the learner's state was read to
    after the last server loaded it; server 0 made no chunk while server 1 loaded."""
    log = await _one_update(cls, monkeypatch)
    assert not [entry for entry in log if entry[0] == "pause"]
    during = _during(log, 1)
    assert ("chunk", 0, 1) in during  # server 0 loaded, and went on at the new version
    assert not [entry for entry in during if entry[:2] == ("chunk", 1)]  # server 1 held


@pytest.mark.timeout(30)
async def test_a_keep_update_pauses_an_engine_that_does_not_pause_itself_for_a_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    log = await _one_update(EngineLike, monkeypatch)
    assert sorted(entry for entry in log if entry[0] == "pause") == [
        ("pause", 0, "keep"),
        ("pause", 1, "keep"),
    ]
    # Both paused before either loaded.
    paused = max(log.index(("pause", rank, "keep")) for rank in (0, 1))
    assert paused < min(log.index(("load", rank, 1)) for rank in (0, 1))
