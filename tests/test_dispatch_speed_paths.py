"""The call paths of dispatch: a role's plain method that runs one call at a time goes to the
role's own Ray concurrency group (``call_role_sync``: no hop from the actor's loop to a thread),
every other call through ``call_role``; and what a caller that stops waiting does to the call on
the worker (an ``async def`` is cancelled there and its slot frees when that lands; a plain
method runs to its end and keeps its slot), on Ray actors, in local mode and on simulated
ranks."""

from __future__ import annotations

import asyncio
import functools
import threading
from typing import Any

import anyio
import pytest

import asyncexec
from asyncexec._dispatch import plan_call
from asyncexec._driver.cluster import SimCluster, SimLoad, simulated
from asyncexec._worker import ROLE_GROUPS

CPU = {"CPU": 0.25}
NO_HEALTH = asyncexec.HealthChecks(interval_s=None)
WAIT_S = 20.0


class Worker:
    """A role whose plain method blocks until an ``async def`` method releases it: the release
    can only run while the plain method blocks if that method runs off the actor's loop."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.go = threading.Event()
        self.active = 0
        self.most_active = 0
        self.finished = 0
        self.cancelled = 0
        self.hanging = 0
        self.hang_in = asyncio.Event()
        self.cancel_seen = asyncio.Event()
        self.lock = threading.Lock()

    def block(self) -> str:
        with self.lock:
            self.active += 1
            self.most_active = max(self.most_active, self.active)
        self.entered.set()
        try:
            if not self.go.wait(WAIT_S):
                raise TimeoutError("never released")
            return threading.current_thread().name
        finally:
            with self.lock:
                self.active -= 1
                self.finished += 1

    async def wait_entered(self) -> bool:
        return await asyncio.to_thread(self.entered.wait, WAIT_S)

    async def release(self) -> str:
        self.go.set()
        return threading.current_thread().name

    async def state(self) -> dict[str, int]:
        return {
            "most_active": self.most_active,
            "finished": self.finished,
            "cancelled": self.cancelled,
            "hanging": self.hanging,
        }

    def fail(self, rank: int) -> int:
        if asyncexec.get_context().world_rank == rank:
            raise KeyError(f"no such thing on rank {rank}")
        return rank

    async def hang(self) -> None:
        """Runs until cancelled; counts the cancellation it sees."""
        self.hanging += 1
        self.hang_in.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled += 1
            self.cancel_seen.set()
            raise
        finally:
            self.hanging -= 1

    async def wait_hanging(self) -> int:
        await asyncio.wait_for(self.hang_in.wait(), WAIT_S)
        return self.hanging

    async def wait_cancelled(self) -> int:
        await asyncio.wait_for(self.cancel_seen.wait(), WAIT_S)
        return self.cancelled


class Other:
    """A second role on the same workers: its own plain calls."""

    def quick(self) -> int:
        return 7


# The plan says which path a call takes ----------------------------------------------------------


def test_the_plan_sends_only_one_at_a_time_plain_methods_to_the_fast_path() -> None:
    one = asyncexec.Role(Worker)
    two = asyncexec.Role(Worker).options(max_concurrency=2)
    assert plan_call(Worker.block, (), {}, 1, roles=[one]).plain
    assert not plan_call(Worker.block, (), {}, 1, roles=[two]).plain  # k at once: threads
    hang = plan_call(Worker.hang, (), {}, 1, roles=[one])
    assert not hang.plain and hang.cancellable  # an async def: on the actor's loop
    assert not plan_call(Worker.block, (), {}, 1, roles=[one]).cancellable
    assert not plan_call(len, ([1],), {}, 1, roles=[one]).plain  # a function: execute


def test_a_method_named_with_its_class_keeps_its_kind() -> None:
    """``asyncexec.method(cls, fn)`` wraps the method: an ``async def`` named so is still
    run on the actor's loop, concurrently, and cancelled when given up (it went to the plain
    path once, one call at a time: the router's generations ran one after another)."""
    one = [asyncexec.Role(Worker)]
    hang = plan_call(asyncexec.method(Worker, "hang"), (), {}, 1, roles=one)
    assert not hang.plain and hang.cancellable
    block = plan_call(asyncexec.method(Worker, Worker.block), (), {}, 1, roles=one)
    assert block.plain and not block.cancellable


# The plain path, on Ray actors and in local mode ------------------------------------------------


@pytest.mark.timeout(40)
async def test_plain_method_runs_off_the_actor_loop_one_call_at_a_time(mode: str) -> None:
    """Two concurrent calls of a blocking plain method: an ``async def`` answers while the
    first blocks (it is not on the actor's loop), the second starts only after the first
    ended; another role's plain calls do not wait for it; an error keeps its rank."""
    roles = [asyncexec.Role(Worker), asyncexec.Role(Other)]
    async with asyncexec.Executor(2, resources_per_worker=CPU, roles=roles) as ex:
        threads: list[Any] = []

        async def block() -> None:
            threads.append(await ex.call(Worker.block, on=asyncexec.rank(0)))

        async with anyio.create_task_group() as tg:
            tg.start_soon(block)
            tg.start_soon(block)
            assert await ex.call(Worker.wait_entered, on=asyncexec.rank(0))
            assert await ex.call(Other.quick, on=asyncexec.rank(0)) == 7  # its own group
            state = await ex.call(Worker.state, on=asyncexec.rank(0))
            assert state["most_active"] == 1 and state["finished"] == 0
            loop_thread = await ex.call(Worker.release, on=asyncexec.rank(0))
        state = await ex.call(Worker.state, on=asyncexec.rank(0))
        assert state["most_active"] == 1 and state["finished"] == 2
        assert len(threads) == 2 and loop_thread not in threads
        with pytest.raises(asyncexec.WorkerRaisedError) as info:
            await ex.call(Worker.fail, 1)
        assert info.value.rank == 1 and isinstance(info.value.__cause__, KeyError)


class R0:
    pass


class R1:
    pass


class R2:
    pass


class R3:
    pass


class Fifth:
    """A role past the concurrency groups: its plain calls go through ``call_role``."""

    def __init__(self) -> None:
        self.calls = 0

    def count(self) -> int:
        self.calls += 1
        return self.calls


@pytest.mark.timeout(30)
async def test_a_role_past_the_concurrency_groups_still_runs_its_plain_methods(mode: str) -> None:
    roles = [R0, R1, R2, R3, Fifth]
    assert len(roles) > ROLE_GROUPS
    async with asyncexec.Executor(1, resources_per_worker=CPU, roles=roles) as ex:
        async with anyio.create_task_group() as tg:
            for _ in range(3):
                tg.start_soon(ex.call, Fifth.count)
        assert await ex.call(Fifth.count) == [4]


# Cancelling a call ------------------------------------------------------------------------------


@pytest.mark.timeout(60)
async def test_an_async_call_given_up_is_cancelled_on_the_worker_and_frees_its_slot(
    mode: str,
) -> None:
    """Under ``least_loaded(max_in_flight=1)`` on one rank, a caller gives up on an ``async
    def`` that would run for an hour: the worker sees the cancellation and the next call gets
    the rank. A call to every rank given up is cancelled on each."""
    cap = asyncexec.least_loaded(max_in_flight=1)
    async with asyncexec.Executor(1, resources_per_worker=CPU, roles=Worker) as ex:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(functools.partial(ex.call, Worker.hang, on=cap))
                assert await ex.call(Worker.wait_hanging, on=asyncexec.rank(0)) == 1
                scope.cancel()
        with anyio.fail_after(WAIT_S):  # the slot frees once the cancellation has landed
            state = await ex.call(Worker.state, on=cap)
        assert state["cancelled"] == 1 and state["hanging"] == 0
    async with asyncexec.Executor(2, resources_per_worker=CPU, roles=Worker) as ex:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(ex.call, Worker.hang)
                assert await ex.call(Worker.wait_hanging) == [1, 1]
                scope.cancel()
        assert await ex.call(Worker.wait_cancelled) == [1, 1]


@pytest.mark.timeout(60)
async def test_a_plain_call_given_up_runs_to_its_end_and_keeps_its_slot(mode: str) -> None:
    """The caller gives up on a plain method; it runs on, and the next least-loaded call
    under a cap of one starts only after it ended (it sees the method finished)."""
    cap = asyncexec.least_loaded(max_in_flight=1)
    async with asyncexec.Executor(1, resources_per_worker=CPU, roles=Worker) as ex:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(functools.partial(ex.call, Worker.block, on=cap))
                assert await ex.call(Worker.wait_entered, on=asyncexec.rank(0))
                scope.cancel()
        seen: list[dict[str, int]] = []

        async def next_call() -> None:
            seen.append(await ex.call(Worker.state, on=cap))

        async with anyio.create_task_group() as tg:
            tg.start_soon(next_call)
            assert await ex.call(Worker.wait_entered, on=asyncexec.rank(0))  # a round trip
            assert seen == []  # waiting for the slot
            await ex.call(Worker.release, on=asyncexec.rank(0))
        assert seen[0]["finished"] == 1 and seen[0]["cancelled"] == 0


@pytest.mark.timeout(30)
async def test_simulated_ranks_cancel_an_async_call_given_up() -> None:
    cap = asyncexec.least_loaded(max_in_flight=1)
    with simulated(SimCluster(SimLoad(reports=1))):
        async with asyncexec.Executor(1, roles=Worker, health=NO_HEALTH) as ex:
            with anyio.CancelScope() as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(functools.partial(ex.call, Worker.hang, on=cap))
                    assert await ex.call(Worker.wait_hanging, on=asyncexec.rank(0)) == 1
                    scope.cancel()
            with anyio.fail_after(5):
                state = await ex.call(Worker.state, on=cap)
            assert state["cancelled"] == 1 and state["hanging"] == 0


# The least-loaded wait: an ended call hands its slot over ----------------------------------------


class _Group:
    def __init__(self, n: int) -> None:
        self.workers = [object()] * n


async def test_an_ended_call_hands_its_slot_to_the_longest_waiter_only() -> None:
    """One waiter wakes per ended call, with the slot (still counted); a caller that did not
    wait cannot take it first; a waiter cancelled after it was handed one passes it on."""
    from asyncexec._driver._loads import Loads

    loads = Loads()
    group = _Group(1)
    slot = loads.take(group, max_in_flight=1)
    assert slot is not None
    got: list[Any] = []

    async def waiter() -> None:
        got.append(await loads.wait_slot())

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        loads.release(*slot)
        assert loads.take(group, max_in_flight=1) is None  # handed: still counted
        await anyio.wait_all_tasks_blocked()
        assert got == [slot]  # the first waiter only
        loads.release(*slot)
    assert got == [slot, slot] and loads.of(group).counts == (1,)
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)  # will be handed a slot, then cancelled before it runs
            await anyio.wait_all_tasks_blocked()
            tg.start_soon(waiter)
            await anyio.wait_all_tasks_blocked()
            loads.release(*slot)
            scope.cancel()
    # The slot is counted only while a waiter holds it: a waiter that returned with it before
    # its cancellation arrived holds it; one cancelled first passed it on, and it went round
    # to be free again.
    holders = len(got) - 2
    assert loads.of(group).counts == (holders,) and holders in (0, 1)


async def test_a_refused_slot_is_freed_and_every_waiter_looks_again() -> None:
    from asyncexec._driver._loads import Loads

    loads = Loads()
    group = _Group(1)
    slot = loads.take(group, max_in_flight=1)
    assert slot is not None
    woken: list[Any] = []

    async def waiter() -> None:
        woken.append(await loads.wait_slot())

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(waiter)
        await anyio.wait_all_tasks_blocked()
        loads.release(*slot)
        await anyio.wait_all_tasks_blocked()
        assert woken == [slot]
        loads.refuse(slot)  # say its group was replaced: free, and the others look again
    assert woken == [slot, None, None] and loads.of(group).counts == (0,)


def test_a_handed_slot_the_call_cannot_use_is_given_back_and_the_call_looks_again() -> None:
    """A slot of a replaced group (or over this call's cap) is refused, and the call takes a
    free rank of its own group at once rather than waiting for another call to end."""
    from asyncexec._driver._dispatcher import _next_slot
    from asyncexec._driver._loads import Loads

    loads = Loads()
    old, live = _Group(1), _Group(2)
    handed = loads.take(old, max_in_flight=1)
    assert handed is not None
    taken = _next_slot(loads, live, handed, 1, ())  # type: ignore[arg-type]
    assert taken is not None and taken[1] == 0 and taken[0] is loads.of(live)
    assert loads.of(old).counts == (0,)  # given back
    over = loads.take(live, max_in_flight=3)
    assert over is not None and loads.of(live).counts == (1, 1)
    loads.of(live).started(1)  # rank 1 has 2 in flight: over a cap of 1 for the next call
    assert _next_slot(loads, live, (loads.of(live), 1), 1, ()) is None  # type: ignore[arg-type]
    assert loads.of(live).counts == (1, 1)  # the handed one given back; none free under 1
