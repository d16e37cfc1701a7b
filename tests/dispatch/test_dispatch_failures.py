"""Dispatch under failure: an idempotent call follows the group when it is replaced, a call's slot
is held until the remote call ends, each group keeps its own load record, a dead rank is renewed
once however many calls saw it die, a renewal does not hold the caller past its deadline nor
outlive the executor, and a stream raises the rank's error. The dispatcher's bookkeeping is
tested without an executor."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import os
import signal
import time
import warnings
from pathlib import Path
from typing import Any

import anyio
import pytest
from structlog.testing import capture_logs

import asyncexec
from asyncexec.testing import metrics_enabled

CPU = {"CPU": 0.25}


class Server:
    """A stateless server: answers with its pid; ``slow`` holds the call."""

    def pid(self) -> int:
        return os.getpid()

    async def answer(self, request: int) -> tuple[int, int]:
        return request, os.getpid()

    async def slow(self, seconds: float) -> int:
        await asyncio.sleep(seconds)
        return int(asyncexec.get_context().world_rank)

    def slow_plain(self, seconds: float) -> int:
        time.sleep(seconds)
        return int(asyncexec.get_context().world_rank)

    def fail_on_one(self) -> int:
        rank = int(asyncexec.get_context().world_rank)
        if rank == 1:
            raise KeyError("rank one says no")
        return rank


def _block_while(path: str, entered: str) -> None:
    """An init hook that waits while ``path`` exists (saying so in ``entered``): holds a
    renewal's start-up until the test lets it go."""
    if os.path.exists(path):
        Path(entered).touch()
    deadline = time.monotonic() + 60
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.02)


# Item 1: an idempotent call follows the group ----------------------------------------------


@pytest.mark.timeout(120)
async def test_idempotent_calls_go_to_the_new_group_after_a_backend_group_died(
    ray_local: None,
) -> None:
    """2 servers with TorchBackend (gloo), one SIGKILLed: the group is dropped, and every
    idempotent request is answered by the group started in its place."""
    pytest.importorskip("torch")
    from asyncexec.backends import TorchBackend

    async with asyncexec.Executor(
        2, resources_per_worker=CPU, roles=Server, backend=TorchBackend(backend="gloo")
    ) as ex:
        pids = await ex.call(Server.pid)
        os.kill(pids[0], signal.SIGKILL)
        retry = asyncexec.least_loaded(max_in_flight=4, retry=True)
        answers: dict[int, int] = {}

        async def ask(request: int) -> None:
            got, pid = await ex.call(Server.answer, request, on=retry)
            answers[got] = pid

        with anyio.fail_after(90):
            async with anyio.create_task_group() as tg:
                for request in range(8):
                    tg.start_soon(ask, request)
        assert sorted(answers) == list(range(8))
        assert pids[0] not in answers.values()
        assert ex.statistics().resends >= 1
        new = await ex.call(Server.pid)  # a new group: the survivor went with the dead one
        assert not set(new) & set(pids)
        assert set(new) & set(answers.values())  # and the requests sent again went to it


@pytest.mark.timeout(150)
async def test_idempotent_calls_are_answered_after_a_node_is_lost(make_cluster: Any) -> None:
    """Two workers, one on each node; the second node is lost (its actor dead in Ray's tables
    before the requests are sent): every idempotent request is answered, none by the lost
    node."""
    from conftest import live_workers

    cluster = make_cluster([{"num_cpus": 2}, {"num_cpus": 2}])
    (node,) = cluster.worker_nodes
    async with asyncexec.Executor(
        2, resources_per_worker={"CPU": 0.5}, roles=Server, placement_strategy="SPREAD"
    ) as ex:
        assert node.node_id in {w.node_id for w in ex.workers}
        await anyio.to_thread.run_sync(lambda: cluster.remove_node(node, allow_graceful=False))
        with anyio.fail_after(30):
            while len(await anyio.to_thread.run_sync(live_workers)) > 1:  # noqa: ASYNC110
                await anyio.sleep(0.1)
        retry = asyncexec.least_loaded(max_in_flight=2, retry=True)
        answers: dict[int, int] = {}

        async def ask(request: int) -> None:
            got, pid = await ex.call(Server.answer, request, on=retry)
            answers[got] = pid

        with anyio.fail_after(100):
            async with anyio.create_task_group() as tg:
                for request in range(6):
                    tg.start_soon(ask, request)
        assert sorted(answers) == list(range(6))
        assert ex.statistics().resends >= 1
        assert node.node_id not in {w.node_id for w in ex.workers}


# Item 2: a call's slot is held until the remote call ends --------------------------------


@pytest.mark.timeout(60)
async def test_a_call_the_caller_stopped_waiting_for_keeps_its_slot_until_it_ends(
    mode: str,
) -> None:
    """A plain method (an ``async def`` is cancelled instead: see
    ``test_dispatch_speed_paths.py``)."""
    one = asyncexec.least_loaded(max_in_flight=1)
    async with asyncexec.Executor(2, resources_per_worker=CPU, roles=Server) as ex:
        with anyio.move_on_after(0.3):
            await ex.call(Server.slow_plain, 1.5, on=one)  # rank 0, still running there
        assert ex.statistics().in_flight == (1, 0)
        # Rank 0 is busy until its call ends: the next calls go to rank 1, one at a time.
        assert await ex.call(Server.slow, 0.0, on=one) == 1
        assert await ex.call(Server.slow, 0.0, on=one) == 1
        # Once rank 0's call has ended, its slot is free again (the lowest rank wins ties).
        with anyio.fail_after(10):
            while await ex.call(Server.slow, 0.0, on=one) != 0:  # noqa: ASYNC110 - remote
                await anyio.sleep(0.05)


@pytest.mark.timeout(60)
async def test_a_call_whose_argument_does_not_pickle_gives_its_slot_back(ray_local: None) -> None:
    """Defect: the slot a least-loaded call took was kept when its argument failed to pickle
    (before anything was sent): after ``max_in_flight`` such calls on each rank, every later
    call waited for ever."""
    import threading

    one = asyncexec.least_loaded(max_in_flight=1)
    async with asyncexec.Executor(2, resources_per_worker=CPU, roles=Server) as ex:
        for _ in range(2):
            with pytest.raises(asyncexec.ConfigurationError, match="cannot be pickled"):
                await ex.call(Server.answer, threading.Lock(), on=one)
        assert ex.statistics().in_flight == (0, 0)
        with anyio.fail_after(10):
            assert (await ex.call(Server.answer, 7, on=one))[0] == 7


@pytest.mark.timeout(90)
@pytest.mark.parametrize("reserved", [False, True], ids=["own-placement", "reservation"])
async def test_a_spare_that_takes_a_rank_outside_a_run_is_replaced(
    ray_local: None, reserved: bool
) -> None:
    """Defect: a rank found dead by a call outside a run took the standby spare's place, and no
    new spare was started (none was left for the next death), where a restart inside a run
    starts one; on a reservation's bundles no spare was ever started again."""
    async with contextlib.AsyncExitStack() as stack:
        reservation = None
        if reserved:
            reservation = await stack.enter_async_context(asyncexec.Reservation(3, CPU))
        ex = await stack.enter_async_context(
            asyncexec.Executor(
                2, resources_per_worker=CPU, roles=Server, spares=1, reservation=reservation
            )
        )
        dead = ex.workers[0].pid
        os.kill(dead, signal.SIGKILL)
        with pytest.raises(asyncexec.WorkerCrashedError), anyio.fail_after(30):
            while True:  # until a call sees the death (it raises at once)
                await ex.call(Server.pid, on=asyncexec.rank(0))
        with anyio.fail_after(30):
            pids = await ex.call(Server.pid)  # waits for the spare in rank 0's place
            assert dead not in pids and ex.statistics().renewed_ranks == 1
            while not ex._slot.group.spares:  # type: ignore[union-attr]  # noqa: ASYNC110
                await anyio.sleep(0.05)


# Item 6: one renewal per death, in local mode too ----------------------------------------


@pytest.mark.timeout(60)
async def test_a_dead_rank_is_renewed_once_however_many_calls_saw_it_die(mode: str) -> None:
    async with asyncexec.Executor(2, resources_per_worker=CPU, roles=Server) as ex:
        group = ex._slot.group
        assert group is not None
        if mode == "local":
            handle: Any = group.workers[0].handle
            handle.kill()  # a local worker dies so
        else:
            os.kill(ex.workers[0].pid, signal.SIGKILL)
        failures: list[BaseException] = []

        async def call_dead_rank() -> None:
            try:
                await ex.call(Server.slow, 0.0, on=asyncexec.rank(0))
            except asyncexec.WorkerCrashedError as exc:
                failures.append(exc)

        with capture_logs() as logs, anyio.fail_after(40):
            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(call_dead_rank)
            assert len(failures) == 3  # at once, each: none waits for the fresh process
            assert (ex.statistics().calls, ex.statistics().resends) == (3, 0)
            assert await ex.call(Server.slow, 0.0) == [0, 1]  # rank 0's call waits for it
        assert [e["event"] for e in logs].count("rank_renewed") == 1
        stats = ex.statistics()
        assert (stats.renewed_ranks, stats.in_flight) == (1, (0, 0))


# Item 4: a renewal neither holds the caller nor outlives the executor ----------------------


@pytest.mark.ray_only
@pytest.mark.timeout(90)
async def test_a_renewal_holds_no_caller_and_dies_with_the_executor(
    mode: str, tmp_path: Path
) -> None:
    block, entered = tmp_path / "block", tmp_path / "entered"
    hook = functools.partial(_block_while, str(block), str(entered))
    async with anyio.create_task_group() as outer:
        async with asyncexec.Executor(
            2, resources_per_worker=CPU, roles=Server, init_hook=hook
        ) as ex:
            block.touch()  # the renewed worker's start-up waits until the test lets it go
            outer.start_soon(_unlink_after, block, 15.0)  # or until a caller held gets out
            os.kill(ex.workers[0].pid, signal.SIGKILL)
            with anyio.fail_after(10), pytest.raises(asyncexec.WorkerCrashedError):
                await ex.call(Server.slow, 0.0, on=asyncexec.rank(0))
            assert block.exists(), "the caller waited for the renewal"
            with anyio.fail_after(30):
                while not entered.exists():  # noqa: ASYNC110 - a worker's file
                    await anyio.sleep(0.05)
        # The executor closed during the renewal: the worker made for its group is killed
        # (the ray_local fixture checks that no worker is left), once it is let go.
        block.unlink(missing_ok=True)
        outer.cancel_scope.cancel()


async def _unlink_after(path: Path, seconds: float) -> None:
    await anyio.sleep(seconds)
    path.unlink(missing_ok=True)  # noqa: ASYNC240 - a test's file


# Item 18: counters of dispatch -----------------------------------------------------------


@pytest.mark.timeout(60)
async def test_calls_resends_and_renewed_ranks_are_counted_in_statistics_and_metrics(
    mode: str,
) -> None:
    pytest.importorskip("prometheus_client")
    with metrics_enabled() as registry:
        async with asyncexec.Executor(
            2, resources_per_worker=CPU, roles=Server, name="dispatching"
        ) as ex:
            await ex.call(Server.slow, 0.0)  # 2 calls
            group = ex._slot.group
            assert group is not None
            if mode == "local":
                handle: Any = group.workers[0].handle
                handle.kill()
            else:
                os.kill(ex.workers[0].pid, signal.SIGKILL)
            retry = asyncexec.least_loaded(retry=True)
            with anyio.fail_after(40):  # rank 0 (the lowest) is dead: sent again to rank 1
                assert await ex.call(Server.slow, 0.0, on=retry) == 1
                # A call to rank 0 waits for the fresh process put in its place.
                assert await ex.call(Server.slow, 0.0, on=asyncexec.rank(0)) == 0
            stats = ex.statistics()
        counted = (stats.calls, stats.resends, stats.renewed_ranks)
        assert counted == (5, 1, 1)
        label = {"executor": "dispatching"}
        names = ("asyncexec_calls_total", "asyncexec_call_resends_total")
        names += ("asyncexec_ranks_renewed_total",)
        assert tuple(registry.get_sample_value(n, label) for n in names) == counted


class _Unpicklable:
    def __reduce__(self) -> Any:
        raise TypeError("this part does not travel")


@pytest.mark.timeout(30)
async def test_calls_whose_arguments_fail_to_pickle_part_way_count_the_calls_sent_only() -> None:
    """Defect: a call to every rank whose rank-1 part did not pickle counted a call for each
    rank, and an ``execute()`` whose argument did not pickle counted one for each rank too,
    though rank 0's call alone (and for ``execute()`` none) was sent."""
    pytest.importorskip("prometheus_client")
    from asyncexec.testing import SimCluster

    with metrics_enabled() as registry:
        async with asyncexec.Executor(3, cluster=SimCluster(), roles=Server, name="parts") as ex:
            parts = asyncexec.scatter([1, _Unpicklable(), 3])
            with pytest.raises(asyncexec.ConfigurationError, match="cannot be pickled"):
                await ex.call(Server.answer, parts)
            with pytest.raises(asyncexec.ConfigurationError, match="cannot be pickled"):
                await ex.execute(os.getpid, _Unpicklable())
            calls = ex.statistics().calls
        assert calls == 1
        assert registry.get_sample_value("asyncexec_calls_total", {"executor": "parts"}) == 1


# Item 3: a stream raises the rank's error --------------------------------------------------


class Holder:
    """``hold_on_one``: rank 0 answers, rank 1 waits until it is cancelled (and says so)."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}

    def _event(self, name: str) -> asyncio.Event:  # made on the worker's loop
        return self._events.setdefault(name, asyncio.Event())

    async def hold_on_one(self) -> int:
        rank = int(asyncexec.get_context().world_rank)
        if rank == 1:
            self._event("started").set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self._event("cancelled").set()
                raise
        return rank

    async def wait_for(self, name: str, timeout_s: float) -> bool:
        try:
            await asyncio.wait_for(self._event(name).wait(), timeout_s)
        except TimeoutError:
            return False
        return True

    async def awaits_a_cancelled_task(self) -> int:
        return await awaits_a_cancelled_task()


async def awaits_a_cancelled_task() -> int:
    task = asyncio.get_running_loop().create_task(asyncio.sleep(3600))
    await asyncio.sleep(0)
    task.cancel()
    return await task  # raises CancelledError: the code's own, the call was not cancelled


@pytest.mark.timeout(60)
async def test_leaving_a_stream_held_in_a_variable_cancels_the_other_ranks(mode: str) -> None:
    """Defect: ``break`` out of ``async for`` over a stream held in a variable cancelled
    nothing: the other ranks' ``async def`` calls went on until the variable was dropped."""
    async with asyncexec.Executor(2, resources_per_worker=CPU, roles=Holder) as ex:
        stream = ex.stream(Holder.hold_on_one)
        async for rank, _ in stream:
            assert rank == 0
            # Rank 1's call has begun (cancelled before it began, it would have nothing to say).
            assert await ex.call(Holder.wait_for, "started", 20.0, on=asyncexec.rank(1))
            break
        assert await ex.call(Holder.wait_for, "cancelled", 20.0, on=asyncexec.rank(1))
        del stream


@pytest.mark.timeout(60)
async def test_a_cancelled_error_of_the_called_code_is_its_error_not_a_crash(mode: str) -> None:
    """Defect: an ``async def`` called by ``execute()`` or ``call()`` that raised
    CancelledError of its own (it awaited a task that was cancelled) ended the worker's call as
    if the driver had cancelled it: Ray's TaskCancelledError without the code's traceback, and
    in local mode a WorkerCrashedError (the worker taken for closed)."""
    async with asyncexec.Executor(2, resources_per_worker=CPU, roles=Holder) as ex:
        pids = [w.pid for w in ex.workers]
        with pytest.raises(asyncexec.WorkerRaisedError) as info:
            await ex.execute(awaits_a_cancelled_task)
        assert isinstance(info.value.__cause__, asyncio.CancelledError)
        assert "awaits_a_cancelled_task" in info.value.remote_traceback
        with pytest.raises(asyncexec.WorkerRaisedError) as info:
            await ex.call(Holder.awaits_a_cancelled_task, on=asyncexec.rank(1))
        assert info.value.rank == 1
        assert isinstance(info.value.__cause__, asyncio.CancelledError)
        assert await ex.execute(abs, -1) == [1, 1]
        assert [w.pid for w in ex.workers] == pids  # no worker taken for dead


@pytest.mark.timeout(60)
async def test_a_stream_raises_the_ranks_error_not_a_group_of_them(mode: str) -> None:
    async with asyncexec.Executor(2, resources_per_worker=CPU, roles=Server) as ex:
        with pytest.raises(asyncexec.WorkerRaisedError) as info:
            async for _ in ex.stream(Server.fail_on_one):
                pass
        assert info.value.rank == 1
        assert isinstance(info.value.__cause__, KeyError)


@pytest.mark.timeout(60)
async def test_a_stream_read_to_its_end_failed_or_dropped_leaves_nothing_open(mode: str) -> None:
    """Defect: a stream's receiving end was never closed (read to its end, failed or dropped),
    a ResourceWarning ("Unclosed <MemoryObjectReceiveStream>") for each when collected."""
    gc.collect()  # what earlier tests left is collected first: this test's own is counted
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        async with asyncexec.Executor(2, resources_per_worker=CPU, roles=Server) as ex:
            assert sorted([r async for r, _ in ex.stream(Server.pid)]) == [0, 1]
            with pytest.raises(asyncexec.WorkerRaisedError):
                async for _ in ex.stream(Server.fail_on_one):
                    pass
            dropped = ex.stream(Server.slow, 30.0)
            del dropped
            gc.collect()
            await asyncio.sleep(0)  # the dropped stream's end is closed on the loop
            read = ex.stream(Server.pid)
            assert len([r async for r, _ in read]) == 2
            assert [r async for r, _ in read] == []  # read again: nothing more, no error
        gc.collect()
    unclosed = [str(w.message) for w in caught if "MemoryObject" in str(w.message)]
    assert unclosed == []
