"""Task groups held open by an object (a router, an executor) between its ``__aenter__`` and
``__aexit__``: the body's exception reaches the group when it is left (as under a plain ``async
with``), and a teardown step that hangs is cut at its own bound, so that closing returns. Local
mode (threads of this process, no Ray)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import pytest
from structlog.testing import capture_logs

import asyncexec
from asyncexec._driver import _taskgroups
from asyncexec._driver._taskgroups import teardown


class Toy(asyncexec.RolloutServer):
    async def chunks(self, prompt: Any) -> AsyncIterator[Any]:
        yield prompt

    def load_weights(self, state: Any, version: int) -> None:
        pass


async def _fails_when_cancelled() -> None:
    """A task of the group whose own teardown fails as the group cancels it."""
    try:
        await anyio.sleep_forever()
    finally:
        raise RuntimeError("the task's teardown failed")


def _router_group(servers: asyncexec.Executor, router: asyncexec.Router) -> anyio.abc.TaskGroup:
    return router.check_open()


def _executor_group(servers: asyncexec.Executor, router: asyncexec.Router) -> anyio.abc.TaskGroup:
    return servers._life.check_open()


@pytest.mark.timeout(20)
@pytest.mark.parametrize("group_of", [_router_group, _executor_group], ids=["router", "executor"])
async def test_the_bodys_error_reaches_the_held_task_group(
    group_of: Callable[[asyncexec.Executor, asyncexec.Router], anyio.abc.TaskGroup],
) -> None:
    """The body raises while a task of the held group fails as it is cancelled: the body's
    error escapes, the task's attached as a note. (Before, the group was left with ``(None,
    None, None)``: the task's error escaped and the body's was lost, chained only.)"""
    with pytest.raises(ValueError, match="the body's error") as info:
        async with (
            asyncexec.Executor(1, roles=Toy, local=True) as servers,
            asyncexec.Router(servers) as router,
        ):
            group_of(servers, router).start_soon(_fails_when_cancelled)
            await anyio.lowlevel.checkpoint()  # the task is waiting
            raise ValueError("the body's error")
    notes = getattr(info.value, "__notes__", [])
    assert any("the task's teardown failed" in note for note in notes), notes


@pytest.mark.timeout(20)
async def test_the_bodys_error_reaches_the_pipelines_task_group() -> None:
    """The same for a pipeline's group (and its own router's, left after it)."""
    with pytest.raises(ValueError, match="the body's error") as info:
        async with (
            asyncexec.Executor(1, roles=Toy, local=True) as servers,
            asyncexec.Pipeline(servers, ["p"] * 4, batch_size=2, staleness=1) as pipe,
        ):
            assert pipe._tg is not None
            pipe._tg.start_soon(_fails_when_cancelled)
            await anyio.lowlevel.checkpoint()
            raise ValueError("the body's error")
    notes = getattr(info.value, "__notes__", [])
    assert any("the task's teardown failed" in note for note in notes), notes


@pytest.mark.timeout(20)
async def test_the_bodys_error_keeps_its_own_context() -> None:
    """An error raised while handling another keeps that other as its context through the
    held groups (its traceback says "during handling of ...")."""
    with pytest.raises(ValueError, match="second") as info:
        async with (
            asyncexec.Executor(1, roles=Toy, local=True) as servers,
            asyncexec.Router(servers),
        ):
            try:
                raise KeyError("first")
            except KeyError:
                raise ValueError("second") from None
    assert info.value.__suppress_context__
    with pytest.raises(ValueError, match="second") as info:
        async with (
            asyncexec.Executor(1, roles=Toy, local=True) as servers,
            asyncexec.Router(servers),
        ):
            try:
                raise KeyError("first")
            except KeyError:
                raise ValueError("second")  # noqa: B904
    assert isinstance(info.value.__context__, KeyError)
    assert not info.value.__suppress_context__


@pytest.mark.timeout(10)
async def test_teardown_is_shielded_from_outer_cancellation_and_bounded_by_its_own() -> None:
    done = anyio.Event()
    with anyio.CancelScope() as outer:
        outer.cancel()
        with teardown("step", 5.0):
            await anyio.sleep(0.05)  # the outer cancellation does not cut it short
            done.set()
    assert done.is_set()
    t0 = time.monotonic()
    with capture_logs() as logs, teardown("hung step", 0.2) as scope:
        await anyio.sleep_forever()
    assert scope.cancelled_caught and time.monotonic() - t0 < 2.0
    assert [(e["event"], e["step"]) for e in logs] == [("teardown_timed_out", "hung step")]


@pytest.mark.timeout(30)
async def test_closing_the_router_returns_within_its_bound_when_an_attempt_hangs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An attempt whose call never answers its cancellation (a shielded wait that never ends,
    as a seam's call on an unreachable cluster): closing the router waits for it no longer
    than the teardown's bound, logs it, and returns."""
    monkeypatch.setattr(_taskgroups, "TEARDOWN_S", 0.5)
    started, release = anyio.Event(), anyio.Event()

    async def never_answers(*args: Any, **kwargs: Any) -> Any:
        started.set()
        with anyio.CancelScope(shield=True):
            await release.wait()
        raise RuntimeError("released at the test's end")

    async with asyncexec.Executor(1, roles=Toy, local=True) as servers:
        monkeypatch.setattr(servers, "call", never_answers)
        with capture_logs() as logs, anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                async with asyncexec.Router(servers) as router:
                    tg.start_soon(router.generate, asyncexec.RolloutRequest(0, "p"))
                    await started.wait()
                    attempts = [a.task for s in router.balance.servers for a in s.scopes]
                    t0 = time.monotonic()
                closed_in = time.monotonic() - t0
                tg.cancel_scope.cancel()  # its caller waits for an answer that never comes
        release.set()
        assert closed_in < 5.0
        steps = [e.get("step") for e in logs if e["event"] == "teardown_timed_out"]
        assert steps == ["router_attempts"]
        await asyncio.wait([t for t in attempts if t is not None])  # left behind, released


@pytest.mark.timeout(60)
async def test_an_executor_closed_with_aclose_alone_and_dropped_leaves_the_loop_alone() -> None:
    """Defect: an executor entered by hand and closed with ``aclose()`` (never left with
    ``__aexit__``) held its task group through an async generator; when the executor was
    collected, asyncio's finalizer closed that generator in a task of its own, whose exit of the
    group's cancel scope cancelled the task then running (``benchmarks/scale.py`` failed so:
    "Attempted to exit cancel scope in a different task than it was entered in")."""
    import gc

    from asyncexec.testing import SimCluster, SimLoad

    failures: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _, context: failures.append(context))
    cluster = SimCluster(SimLoad(reports=1))
    executor = asyncexec.Executor(2, cluster=cluster)
    await executor.__aenter__()
    await executor.aclose()
    del executor
    gc.collect()
    # What runs next on the loop: a task group's work, which the stray exit cancelled.
    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(anyio.sleep, 0.01)
    again = asyncexec.Executor(2, cluster=cluster)
    async with again:
        steps = [step.index async for step in again.run(lambda: None)]
    assert steps == [0]
    assert failures == []


@pytest.mark.timeout(20)
async def test_a_teardown_that_raised_leaves_no_closer_waiting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Defect: ``aclose()`` marked the executor closed only after a teardown that went well; one
    that raised left it CLOSING, and every later closer (the ``async with``'s own exit after an
    explicit ``aclose()``) waited for it, shielded, for ever."""
    from asyncexec.testing import SimCluster, SimLoad

    async def fails(*, force: bool) -> None:
        raise RuntimeError("the group's teardown failed")

    cluster = SimCluster(SimLoad(reports=1))
    executor = asyncexec.Executor(2, cluster=cluster)
    with pytest.raises(RuntimeError, match="teardown failed"):
        async with executor:
            real = executor._life.slot.discard
            monkeypatch.setattr(executor._life.slot, "discard", fails)
            try:
                await executor.aclose()
            finally:
                monkeypatch.setattr(executor._life.slot, "discard", real)
    assert executor.state is asyncexec.ExecutorState.CLOSED
