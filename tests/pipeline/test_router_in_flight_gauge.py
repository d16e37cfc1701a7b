"""The router's ``asyncexec_router_in_flight`` gauge on simulated servers (no Ray): it says
each server's requests in flight as ``Router.statistics()`` does, whatever way a slot was
freed (a slot handed to a request that cannot use it, or whose caller went, or that finds
the router's servers closed), and its series go when the router closes (and stay gone:
``test_router_units``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, ClassVar

import anyio
import anyio.lowlevel
import pytest

import asyncexec
from asyncexec.testing import SimCluster, metrics_enabled

pytest.importorskip("prometheus_client")


class Gated(asyncexec.RolloutServer):
    """Answers a prompt (a string) once the test opens its gate (simulated servers live in the
    test's process)."""

    gates: ClassVar[dict[str, anyio.Event]] = {}

    async def chunks(self, prompt: Any) -> AsyncIterator[Any]:
        await self.gates[prompt].wait()
        yield prompt

    def load_weights(self, state: Any, version: int) -> None:
        pass


def _gates(monkeypatch: pytest.MonkeyPatch, *prompts: str) -> dict[str, anyio.Event]:
    gates = {prompt: anyio.Event() for prompt in prompts}
    monkeypatch.setattr(Gated, "gates", gates)
    return gates


def _servers(n: int) -> asyncexec.Executor:
    return asyncexec.Executor(n, roles=asyncexec.Role(Gated), cluster=SimCluster(), name="gated")


def _gauge(registry: Any, n: int) -> tuple[float | None, ...]:
    """The gauge's value for each of ``n`` ranks (None: no series)."""
    return tuple(
        registry.get_sample_value(
            "asyncexec_router_in_flight", {"executor": "gated", "router": "gated", "rank": str(r)}
        )
        for r in range(n)
    )


async def _ask(router: asyncexec.Router, prompt: str, key: str | None = None) -> None:
    await router.generate(asyncexec.RolloutRequest(prompt, prompt, key=key))


@pytest.mark.timeout(20)
async def test_every_servers_gauge_is_0_from_the_start() -> None:
    """A server that has had no request yet shows 0 in flight, not a missing series (a panel's
    query over the servers would leave it out, and ``max()`` or ``sum()`` would have no value
    before the first request)."""
    with metrics_enabled() as registry:
        async with (
            _servers(2) as servers,
            asyncexec.Router(servers, max_in_flight=1, health_interval_s=60),
        ):
            assert _gauge(registry, 2) == (0.0, 0.0)
        assert _gauge(registry, 2) == (None, None)


@pytest.mark.timeout(20)
async def test_a_slot_a_sessions_request_cannot_use_is_freed_on_the_gauge(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Defect: two requests of one new session wait for a slot; the first takes a freed one
    (rank 0, the session's server from then on), and the slot freed next (rank 1), handed to
    the second, is refused (it waits for its session's server): rank 1 was free, but the gauge
    still said 1 until rank 1's next request."""
    gates = _gates(monkeypatch, "a0", "a1", "b", "c")
    with metrics_enabled() as registry:
        async with (
            _servers(2) as servers,
            asyncexec.Router(servers, max_in_flight=1, health_interval_s=60) as router,
        ):
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    for prompt in ("a0", "a1"):  # one on each server
                        tg.start_soon(_ask, router, prompt)
                        await anyio.wait_all_tasks_blocked()
                    for prompt in ("b", "c"):  # both wait for a slot, with no server yet
                        tg.start_soon(_ask, router, prompt, "chat")
                        await anyio.wait_all_tasks_blocked()
                    assert router.statistics().in_flight == (1, 1)
                    gates["a0"].set()  # its slot to b: rank 0 is chat's server
                    await anyio.wait_all_tasks_blocked()
                    gates["a1"].set()  # its slot to c, which waits for rank 0 instead
                    await anyio.wait_all_tasks_blocked()
                    assert router.statistics().in_flight == (1, 0)
                    assert _gauge(registry, 2) == (1, 0)
                    gates["b"].set()
                    gates["c"].set()
            assert router.statistics().in_flight == (0, 0)
            assert _gauge(registry, 2) == (0, 0)
        assert _gauge(registry, 2) == (None, None)


@pytest.mark.timeout(20)
async def test_a_caller_cancelled_in_the_turn_its_slot_is_handed_frees_it_on_the_gauge(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Defect: a request waiting for a slot whose caller was cancelled (``task.cancel()``, as
    ``asyncio.timeout`` does) in the turn of the loop a freed slot was handed to it gave the
    slot back, free, but the gauge still said 1 until the server's next request."""
    gates = _gates(monkeypatch, "a", "b")
    with metrics_enabled() as registry:
        async with (
            _servers(1) as servers,
            asyncexec.Router(servers, max_in_flight=1, health_interval_s=60) as router,
        ):
            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_ask, router, "a")
                    await anyio.wait_all_tasks_blocked()
                    waiting = asyncio.create_task(_ask(router, "b"))
                    await anyio.wait_all_tasks_blocked()
                    assert len(router.balance._waiting) == 1
                    gates["a"].set()
                    # Each turn of the loop, until a's end hands its slot to b: b runs in the
                    # next turn at the earliest, and is cancelled before it does.
                    while len(router.balance._waiting):
                        await anyio.lowlevel.checkpoint()
                    assert not waiting.done() and router.statistics().in_flight == (1,)
                    waiting.cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await waiting
            assert router.statistics().in_flight == (0,)
            assert _gauge(registry, 1) == (0,)
        assert _gauge(registry, 1) == (None,)


@pytest.mark.timeout(20)
async def test_a_slot_handed_to_a_request_that_finds_the_servers_closed_is_freed_on_the_gauge(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Defect: with the servers' executor closed under an open router, the slot of the request
    in flight, handed to the request waiting for it, was given back by that one (it raises: the
    servers are closed), free, but the gauge still said 1."""
    _gates(monkeypatch, "a", "b")
    with metrics_enabled() as registry:
        servers = _servers(1)
        async with servers, asyncexec.Router(servers, max_in_flight=1) as router:
            errors: list[BaseException] = []

            async def ask(prompt: str) -> None:
                with pytest.raises(asyncexec.ExecutorStateError) as caught:
                    await _ask(router, prompt)
                errors.append(caught.value)

            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(ask, "a")
                    await anyio.wait_all_tasks_blocked()
                    tg.start_soon(ask, "b")  # waits for a's slot
                    await anyio.wait_all_tasks_blocked()
                    assert _gauge(registry, 1) == (1,)
                    await servers.aclose()
            assert len(errors) == 2
            assert router.statistics().in_flight == (0,)
            assert _gauge(registry, 1) == (0,)
        assert _gauge(registry, 1) == (None,)
