"""Pauses, resumes and rejoins that cross, on simulated servers (no Ray): a server that rejoins
while a pause or a resume goes on ends as the router's latest one says, and an update cancelled
during its resume leaves no server paused."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import anyio
import pytest

import asyncexec
from asyncexec.testing import ScriptedServer, SimCluster


@dataclass
class Hold:
    """Holds the servers' calls of ``method`` (on ``rank``, or on every rank when None): each
    sets ``began``, then waits until the test sets ``go``."""

    method: Literal["pause", "resume"] | None = None
    rank: int | None = None
    began: anyio.Event = field(default_factory=anyio.Event)
    go: anyio.Event = field(default_factory=anyio.Event)

    async def at(self, method: str) -> None:
        rank = asyncexec.get_context().world_rank
        if method == self.method and self.rank in (None, rank):
            self.began.set()
            await self.go.wait()


class Held(ScriptedServer):
    """A :class:`ScriptedServer` whose pause and resume wait at the test's :class:`Hold`."""

    hold: ClassVar[Hold] = Hold()  # (simulated servers live in the test's process)

    def __init__(self) -> None:
        super().__init__(chunks=3, delay_s=0.001)

    async def pause(self, mode: Literal["keep", "abort"]) -> int:
        await self.hold.at("pause")
        return await super().pause(mode)

    async def resume(self) -> None:
        await self.hold.at("resume")
        await super().resume()

    def paused_as(self) -> str | None:
        """The mode this server is paused in (None: it generates)."""
        return self._gate().mode


def _hold(
    monkeypatch: pytest.MonkeyPatch,
    method: Literal["pause", "resume"] | None,
    rank: int | None = None,
) -> Hold:
    hold = Hold(method, rank)
    monkeypatch.setattr(Held, "hold", hold)
    return hold


def _servers() -> asyncexec.Executor:
    return asyncexec.Executor(2, roles=asyncexec.Role(Held), cluster=SimCluster())


async def _paused_as(servers: asyncexec.Executor) -> list[str | None]:
    result: list[str | None] = await servers.call(asyncexec.method(Held, Held.paused_as))
    return result


async def _serving(server: Any) -> None:
    with anyio.fail_after(5):
        while not server.serving:  # noqa: ASYNC110 (the router's record, no event to wait on)
            await anyio.sleep(0.01)


async def _one_on_each(router: asyncexec.Router) -> list[int]:
    """The ranks that answer two requests at once (a cap of 1: one goes to each server)."""
    ranks: list[int] = []

    async def ask(i: int) -> None:
        ranks.append((await router.generate(asyncexec.RolloutRequest(i, "prompt"))).rank)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            for i in range(2):
                tg.start_soon(ask, i)
    return sorted(ranks)


@pytest.mark.timeout(20)
async def test_a_server_that_rejoins_during_a_pause_is_resumed_by_the_resume_it_missed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 1 rejoins while the router is paused, and the router resumes while the rejoin's
    pause of rank 1 is in flight: the resume skipped rank 1 (not serving yet), and rank 1
    served paused for ever, its requests parked. The rejoin now resumes it too."""
    hold = _hold(monkeypatch, "pause", rank=1)
    async with (
        _servers() as servers,
        asyncexec.Router(servers, max_in_flight=1, health_interval_s=60) as router,
    ):
        one = router.balance.servers[1]
        router.watch.lost(1, one.worker)  # seen gone: it rejoins
        await router.pause("keep")  # rank 0 (rank 1 does not serve)
        with anyio.fail_after(5):
            await hold.began.wait()  # the rejoin pauses rank 1, as the router is
        await router.resume()  # rank 0
        hold.go.set()
        await _serving(one)
        assert await _paused_as(servers) == [None, None]
        assert router.paused is None
        assert await _one_on_each(router) == [0, 1]


@pytest.mark.timeout(20)
async def test_a_server_lost_while_paused_whose_process_comes_back_after_the_resume_is_resumed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Rank 1 is paused with the others, seen lost (a transient error), and its same process
    rejoins once the router resumed (which skipped it): the rejoin saw the router not paused
    and did nothing, and rank 1 served paused. It now resumes it."""
    _hold(monkeypatch, None)
    async with (
        _servers() as servers,
        asyncexec.Router(servers, max_in_flight=1, health_interval_s=60) as router,
    ):
        await router.pause("keep")
        one, worker = router.balance.servers[1], router.balance.servers[1].worker
        router.watch.lost(1, worker)
        await router.resume()  # rank 0
        await _serving(one)
        assert one.worker == worker  # the same process
        assert await _paused_as(servers) == [None, None]
        assert await _one_on_each(router) == [0, 1]


@pytest.mark.timeout(30)
async def test_an_update_cancelled_during_its_resume_leaves_no_server_paused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``update_weights()`` cancelled (the caller's own bound) while the servers' resume calls
    are in flight: the update counted them resumed before the calls returned, and no resume
    was done again; every server stayed paused and no batch came. The update's end now resumes
    them (shielded), and the router is no longer paused."""
    hold = _hold(monkeypatch, "resume")
    async with (
        _servers() as servers,
        asyncexec.Router(servers, max_in_flight=2, health_interval_s=60) as router,
        asyncexec.Pipeline(router, range(40), batch_size=4) as pipe,
    ):
        await pipe.__anext__()
        bound = anyio.CancelScope()

        async def update() -> None:
            with bound:
                # (to abort: a "keep" update pauses no server that holds its chunks for its
                # own loads, as these do)
                await pipe.update_weights({"w": 1}, on_update="abort")

        async with anyio.create_task_group() as tg:
            tg.start_soon(update)
            with anyio.fail_after(5):
                await hold.began.wait()  # the resume's calls are in flight
            bound.cancel()
            hold.go.set()
        assert bound.cancelled_caught
        assert router.paused is None
        assert await _paused_as(servers) == [None, None]
        with anyio.fail_after(5):
            batch = await pipe.__anext__()
        assert len(batch.ids) == 4


@pytest.mark.timeout(20)
async def test_a_whole_group_replaced_is_seen_by_the_first_rejoin_and_every_server_rejoins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The executor replaced its whole group while the router was paused, and the first to see
    it was one server's loss (a check, a pause or a request that is not sent again), not the
    router's look at the group: that server's rejoin took the new group for the router's own,
    and the other server kept serving in a fresh process it never rejoined, unpaused. The
    rejoin now sees the group changed, and every server rejoins, paused as the router is."""
    _hold(monkeypatch, None)
    async with (
        _servers() as servers,
        asyncexec.Router(servers, max_in_flight=1, health_interval_s=60) as router,
    ):
        await router.pause("keep")
        zero, one = router.balance.servers
        await servers._slot.drop_if(servers._slot.group)  # (a death in a group with a backend)
        router.watch.lost(0, zero.worker)
        await _serving(zero)
        await _serving(one)
        assert await _paused_as(servers) == ["keep", "keep"]
        assert router.statistics().replaced == 2
        await router.resume()
        assert await _one_on_each(router) == [0, 1]
