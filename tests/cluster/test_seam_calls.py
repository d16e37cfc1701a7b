"""The seam maps its own errors (issue 31): a call on a worker made through the seam raises
asyncexec's errors, with the worker's rank and node and its caller's attempt, and a call whose
arguments do not pickle is refused when it is submitted, naming the argument, for ``execute()``
as for ``call()``."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Generator
from typing import Any

import anyio
import pytest
import ray.exceptions as rex

import asyncexec
from asyncexec._driver.cluster import (
    RAY_ERROR_KINDS,
    Call,
    CallCancelledError,
    LocalWorkerGone,
    proxy,
    result_of,
    settled,
)
from asyncexec._driver.cluster._local import LocalCallCancelled
from asyncexec._wire._protocol import WorkerMetadata
from asyncexec.testing import SimCluster

CPU = {"CPU": 0.5}


class _Failed:
    """A call's reference that fails with ``error`` when awaited."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __await__(self) -> Generator[Any, None, Any]:
        raise self.error
        yield  # a generator: ``await`` accepts it

    def loop_future(self) -> None:
        return None


class _Handle:
    """A worker's handle whose calls fail with ``error`` (or refuse their arguments)."""

    key = "fake"

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def call(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        for value in [*args, *kwargs.values()]:
            if isinstance(value, type(threading.Lock())):
                raise TypeError("\x1b[31mCould not serialize the argument\x1b[39m (1.6 KB of it)")
        return _Failed(self.error)

    def call_n(self, method: str, n: int, /, *args: Any) -> list[Any]:
        return [_Failed(self.error) for _ in range(n)]

    def cancel(self, ref: Any) -> None:
        pass


class _Member:
    def __init__(self, error: BaseException, node: str = "ab" * 28) -> None:
        self.handle = _Handle(error)
        self.rank = 3
        self.metadata = WorkerMetadata(node, "127.0.0.1", "host", 4321, {})


class _Caller:
    """A group as the seam sees it: an attempt, and a node table (here: every node gone)."""

    def __init__(self, alive: bool) -> None:
        self.attempt = 1
        self.alive = alive
        self.asked: list[str | None] = []

    async def node_alive(self, node_id: str | None) -> bool:
        self.asked.append(node_id)
        return self.alive


@pytest.mark.timeout(10)
async def test_a_call_through_the_seam_raises_asyncexecs_errors_with_rank_node_and_attempt() -> (
    None
):
    """What upper layers mapped themselves (``call_error`` at ten sites), the seam's call raises:
    a dead actor is a crash, or a lost node when the caller's node table lacks the node; the
    attempt is the caller's when the call fails (a run may take the group meanwhile)."""
    died = rex.ActorDiedError()
    caller = _Caller(alive=True)
    call = proxy(caller, _Member(died)).ping()
    caller.attempt = 4  # read when the call fails
    with pytest.raises(asyncexec.WorkerCrashedError) as info:
        await call
    error = info.value
    assert (error.rank, error.pid, error.attempt, error.node_id) == (3, 4321, 4, "ab" * 28)
    assert error.__context__ is None and error.__cause__ is died  # Ray's error: its cause
    assert caller.asked == ["ab" * 28]  # the caller's cluster's node table was asked
    lost = _Caller(alive=False)
    with pytest.raises(asyncexec.NodeLostError):
        await proxy(lost, _Member(died)).ping()
    # A pending result (a death call, a reference of call_n) awaited through the seam.
    member = _Member(LocalWorkerGone("the local worker was closed"))
    with pytest.raises(asyncexec.WorkerCrashedError):
        await result_of(caller, member, member.handle.call_n("channel_read", 2)[0])
    # The user's code raised on the worker: its own error, as the cause.
    raised = _Member(rex.RayTaskError("execute", "Traceback ...", KeyError("k")))
    with pytest.raises(asyncexec.WorkerRaisedError) as failed:
        await proxy(caller, raised).execute(len)
    assert failed.value.rank == 3


class _Settles:
    """A call's reference that gives a loop future (as a Ray call's does), settled by hand."""

    def __init__(self) -> None:
        self.futures: list[asyncio.Future[Any]] = []

    def loop_future(self) -> asyncio.Future[Any]:
        self.futures.append(asyncio.get_running_loop().create_future())
        return self.futures[-1]


@pytest.mark.timeout(10)
async def test_settled_tells_each_calls_outcome_as_it_ends_whatever_the_others_do() -> None:
    """``settled`` waits for every call (a failure stops no wait, unlike ``gathered``) and
    tells each one's value, or asyncexec's error for its failure, in the order they end; calls
    without loop futures each in a task, with the same outcomes."""
    caller, member = _Caller(alive=True), _Member(rex.ActorDiedError())
    refs = [_Settles() for _ in range(3)]
    calls = [Call(ref, member, caller) for ref in refs]
    seen: list[tuple[int, Any, type[BaseException] | None]] = []
    changed = asyncio.Event()

    def on_settled(i: int, value: Any, error: BaseException | None) -> None:
        seen.append((i, value, None if error is None else type(error)))
        changed.set()

    async def told(count: int) -> None:
        while len(seen) < count:
            changed.clear()
            await changed.wait()

    async def end_them() -> None:
        await asyncio.sleep(0)
        refs[2].futures[0].set_result("c")
        await told(1)
        refs[0].futures[0].set_exception(rex.ActorDiedError())
        await told(2)
        refs[1].futures[0].set_result("b")

    ender = asyncio.get_running_loop().create_task(end_them())
    await settled(calls, on_settled)
    await ender
    assert seen == [(2, "c", None), (0, None, asyncexec.WorkerCrashedError), (1, "b", None)]
    seen.clear()
    await settled([proxy(caller, member).ping(), proxy(caller, member).ping()], on_settled)
    assert sorted(seen) == [(i, None, asyncexec.WorkerCrashedError) for i in range(2)]


#: What each kind of :data:`RAY_ERROR_KINDS` raises through the seam (a live node).
_RAISES = {
    "raised": asyncexec.WorkerRaisedError,
    "died": asyncexec.WorkerCrashedError,
    "unreachable": asyncexec.WorkerUnreachableError,
    "hung": asyncexec.WorkerHungError,
    "startup": asyncexec.StartupError,
}


@pytest.mark.timeout(10)
@pytest.mark.parametrize("cls", list(RAY_ERROR_KINDS), ids=lambda c: c.__name__)
async def test_every_ray_error_is_raised_as_asyncexecs_through_the_seam(
    cls: type[BaseException],
) -> None:
    """As httpx tests that every httpcore error is mapped: whatever Ray raises (built bare, as
    an odd instance would be), a call through the seam raises asyncexec's error of its kind."""
    expected = _RAISES[RAY_ERROR_KINDS[cls]]
    if cls is rex.NodeDiedError:  # Ray says the node died: no look-up needed
        expected = asyncexec.NodeLostError
    with pytest.raises(expected):
        await proxy(_Caller(alive=True), _Member(cls.__new__(cls))).ping()


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "exc",
    [
        *(cls.__new__(cls) for cls in RAY_ERROR_KINDS),
        LocalWorkerGone("the local worker was closed"),
        LocalCallCancelled("the call was cancelled"),
    ],
    ids=lambda e: type(e).__name__,
)
async def test_every_mapped_error_keeps_the_clusters_error_as_its_cause(
    exc: BaseException,
) -> None:
    """Issue 43: a crashed or unreachable worker's error (a lost node's, a hung one's) dropped
    Ray's error; each mapped error now has it as its ``__cause__``, as ``raise ... from`` sets
    (a raised one's cause is the user's error, here the bare Ray error itself), and no
    context."""
    with pytest.raises(asyncexec.AsyncExecError) as info:
        await proxy(_Caller(alive=True), _Member(exc)).ping()
    assert info.value.__cause__ is exc and info.value.__suppress_context__
    assert info.value.__context__ is None
    with pytest.raises(asyncexec.NodeLostError) as lost:  # a node gone: the same cause
        await proxy(_Caller(alive=False), _Member(rex.ActorDiedError())).ping()
    assert isinstance(lost.value.__cause__, rex.ActorDiedError)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "exc",
    [rex.TaskCancelledError(), LocalCallCancelled("cancelled")],
    ids=lambda e: type(e).__name__,
)
async def test_a_call_the_driver_cancelled_is_not_an_unreachable_worker(exc: BaseException) -> None:
    """Issue 43: Ray's ``TaskCancelledError`` (what a call that ``Call.cancel`` cancelled
    before it started ends with) and the local stand-in were a ``WorkerUnreachableError``,
    which the restart policy and the servers' health take for a worker gone; the driver asked
    for it. One the driver did not ask for is still the cluster's failure."""
    call = proxy(_Caller(alive=True), _Member(exc)).ping()
    call.cancel()
    with pytest.raises(asyncexec.AsyncExecError) as info:
        await call
    assert type(info.value) is CallCancelledError and info.value.rank == 3
    assert info.value.__cause__ is exc
    assert not asyncexec.RestartPolicy().should_restart(info.value)
    with pytest.raises(asyncexec.WorkerUnreachableError):
        await proxy(_Caller(alive=True), _Member(exc)).ping()


@pytest.mark.timeout(60)
async def test_a_cancelled_call_on_a_real_worker_ends_as_cancelled_with_its_cause(
    mode: str,
) -> None:
    """A pending ``wait_closed`` on a worker started through the seam (a Ray actor, or a local
    worker), cancelled by the driver: awaiting it raises :class:`CallCancelledError` with the
    cluster's error as its cause; it was a ``WorkerRaisedError`` on Ray (Ray's
    ``TaskCancelledError`` arrives as the task's error) and a ``WorkerUnreachableError`` in
    local mode."""
    cluster = asyncexec.Executor(1, local=mode == "local").cluster  # Ray's, or local mode's
    await cluster.connect(None)
    config = asyncexec.Executor(1, resources_per_worker=CPU).config
    [(handle, metadata)] = await cluster.start_workers(config, None, [None], 30)
    try:
        member = _Started(handle, metadata)
        call = proxy(_Caller(alive=True), member).wait_closed()
        call.cancel()
        with pytest.raises(asyncexec.AsyncExecError) as info:
            await call
        assert type(info.value) is CallCancelledError, info.value
        assert info.value.__cause__ is not None
        assert await proxy(_Caller(alive=True), member).ping() == metadata.pid  # unharmed
    finally:
        await cluster.kill([handle], deaths=[handle.call("wait_closed")], timeout_s=10)


async def _forever() -> None:
    await asyncio.sleep(3600)


@pytest.mark.timeout(10)
async def test_a_call_cancelled_before_it_started_on_a_simulated_worker_ends_as_cancelled() -> None:
    """Defect: on a simulated worker, a call the driver cancelled at once (before its coroutine
    had started: ``execute()`` of an ``async def``), or a pending ``wait_closed``, was never
    answered: awaiting it hung, where Ray's and local mode's workers end it with
    :class:`CallCancelledError` (``test_a_cancelled_call_on_a_real_worker_...``)."""
    cluster = SimCluster()
    config = asyncexec.Executor(1, resources_per_worker=CPU).config
    [(handle, metadata)] = await cluster.start_workers(config, None, [None], 30)
    try:
        member = _Started(handle, metadata)
        for call in [
            proxy(_Caller(alive=True), member).execute(_forever),
            proxy(_Caller(alive=True), member).wait_closed(),
        ]:
            call.cancel()
            with anyio.fail_after(5), pytest.raises(asyncexec.AsyncExecError) as info:
                await call
            assert type(info.value) is CallCancelledError, info.value
        assert await proxy(_Caller(alive=True), member).ping() == metadata.pid  # unharmed
    finally:
        await cluster.kill([handle])


class _PendingRef:
    """An ``ObjectRef`` as ``Result`` uses one: completion callbacks that Ray keeps until the
    call ends."""

    def __init__(self) -> None:
        self.callbacks: list[Any] = []

    def _on_completed(self, callback: Any) -> None:
        self.callbacks.append(callback)


async def test_a_workers_death_call_keeps_one_callback_however_many_waits_were_cancelled() -> None:
    """A worker's death call is awaited by every group and lease that holds it, each wait
    cancelled when that group ends; Ray kept a completion callback (and the wait's future) for
    each until the worker died: a pool's worker gathered one a lease. Its waits now share one,
    and every wait still gets the death, also one made after it."""
    from types import SimpleNamespace

    from asyncexec._driver.cluster._ray import RayHandle

    ref = _PendingRef()
    actor = SimpleNamespace(
        _actor_id=SimpleNamespace(hex=lambda: "ab" * 14),
        call_method=None,
        wait_closed=SimpleNamespace(remote=lambda: ref),
    )
    death = RayHandle(actor).call("wait_closed")  # type: ignore[arg-type]
    member = _Member(rex.ActorDiedError())

    async def lease() -> None:
        await result_of(_Caller(alive=True), member, death)

    for _ in range(50):  # fifty leases, each ended before the worker died
        task = asyncio.ensure_future(lease())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    waiting = asyncio.ensure_future(lease())
    await asyncio.sleep(0)
    assert len(ref.callbacks) == 1
    died = rex.ActorDiedError()
    threading.Thread(target=ref.callbacks[0], args=(died,)).start()  # Ray's thread
    for wait in (waiting, asyncio.ensure_future(lease())):
        with pytest.raises(asyncexec.WorkerCrashedError):
            await asyncio.wait_for(wait, 5)


class _Started:
    def __init__(self, handle: Any, metadata: WorkerMetadata) -> None:
        self.handle = handle
        self.rank = 0
        self.metadata = metadata


@pytest.mark.timeout(10)
async def test_arguments_that_do_not_pickle_are_named_when_submitted() -> None:
    def push(weights: Any, step: int) -> None: ...

    caller, member = _Caller(alive=True), _Member(rex.ActorDiedError())
    with pytest.raises(asyncexec.ConfigurationError) as info:
        proxy(caller, member).execute(push, threading.Lock(), 1)
    message = str(info.value)
    assert "argument 'weights'" in message and "push" in message and "pickle" in message
    assert "\x1b[" not in message and isinstance(info.value.__cause__, TypeError)
    with pytest.raises(asyncexec.ConfigurationError, match=r"argument 'step' of .*push"):
        proxy(caller, member).execute(push, 1, step=threading.Lock())


def _weights_version(weights: Any) -> int:
    return 1


@pytest.mark.ray_only
@pytest.mark.timeout(30)
async def test_execute_names_an_argument_that_does_not_pickle(mode: str) -> None:
    """``execute()`` raised Ray's raw 1.6 KB TypeError (colours, ``_Worker``) where ``call()``
    named the argument."""
    async with asyncexec.Executor(1, resources_per_worker=CPU) as ex:
        with pytest.raises(asyncexec.ConfigurationError) as info:
            await ex.execute(_weights_version, threading.Lock())
        message = str(info.value)
        assert "argument 'weights'" in message and "lock" in message and "pickle" in message
        assert "\x1b[" not in message and "_Worker" not in message and len(message) < 400
        with pytest.raises(asyncexec.ConfigurationError, match="argument 'weights'"):
            await ex.execute_single(0, _weights_version, weights=threading.Lock())
        assert await ex.execute(_weights_version, 1) == [1]  # the group is unharmed
