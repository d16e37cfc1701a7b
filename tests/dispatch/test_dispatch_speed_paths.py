"""The call paths of dispatch: a role's plain method that runs one call at a time goes to the
role's own Ray concurrency group (``call_method_sync``: no hop from the actor's loop to a
thread), every other call through ``call_method`` (the role and method as one key; a bare value
back as it is, every kind of value whole); the plan of the commonest call; what a caller that
stops waiting does to the call on the worker (an ``async def`` is cancelled there and its slot
frees when that lands; a plain method runs to its end and keeps its slot), on Ray actors, in
local mode and on simulated ranks; and a rank renewed outside a run, which joins what its group
receives from a weight channel."""

from __future__ import annotations

import asyncio
import functools
import gc
import os
import signal
import threading
import time
import weakref
from typing import Any

import anyio
import pytest

import asyncexec
from asyncexec._dispatch._plan import plan_call
from asyncexec._dispatch._targets import ALL
from asyncexec._driver.cluster import _ray
from asyncexec._worker import ROLE_GROUPS
from asyncexec.testing import SimCluster, SimLoad

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
    """A role past the concurrency groups: its plain calls go through ``call_method``."""

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
        await _give_up_on_every_rank(ex)


async def _give_up_on_every_rank(ex: asyncexec.Executor) -> None:
    """Call ``Worker.hang`` on both ranks, give up once both hang: each sees its cancellation."""
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
    cluster = SimCluster(SimLoad(reports=1))
    async with asyncexec.Executor(1, roles=Worker, health=NO_HEALTH, cluster=cluster) as ex:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(functools.partial(ex.call, Worker.hang, on=cap))
                assert await ex.call(Worker.wait_hanging, on=asyncexec.rank(0)) == 1
                scope.cancel()
        with anyio.fail_after(5):
            state = await ex.call(Worker.state, on=cap)
        assert state["cancelled"] == 1 and state["hanging"] == 0


class Stubborn:
    """A role whose ``async def`` method, cancelled, returns anyway; it keeps a weak reference
    to the task that ran it."""

    def __init__(self) -> None:
        self.entered = asyncio.Event()
        self.task: weakref.ref[asyncio.Task[Any]] | None = None

    async def stubborn(self) -> str:
        task = asyncio.current_task()
        assert task is not None
        self.task = weakref.ref(task)
        self.entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            return "returned anyway"
        return "never"

    async def wait_entered(self) -> bool:
        await self.entered.wait()
        return True

    def task_kept(self) -> bool:
        gc.collect()
        return self.task is not None and self.task() is not None


@pytest.mark.timeout(30)
async def test_simulated_ranks_keep_no_task_of_a_cancelled_call_that_returned() -> None:
    """Defect: a simulated worker kept the task of a call that the driver cancelled and whose
    coroutine returned anyway (it swallowed the cancellation), for the worker's life: a task
    (and its result) leaked per such call."""
    cap = asyncexec.least_loaded(max_in_flight=1)
    cluster = SimCluster(SimLoad(reports=1))
    async with asyncexec.Executor(1, roles=Stubborn, health=NO_HEALTH, cluster=cluster) as ex:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(functools.partial(ex.call, Stubborn.stubborn, on=cap))
                assert await ex.call(Stubborn.wait_entered, on=asyncexec.rank(0))
                scope.cancel()
        with anyio.fail_after(5):  # the slot is free once the call has ended on the worker
            assert await ex.call(Stubborn.task_kept, on=cap) is False


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


# The call's own path: one method key, a bare value back ---------------------------------------


class Values:
    """Methods that return values of each kind, ``async def`` and plain."""

    def plain(self, value: Any) -> Any:
        return value

    async def coro(self, value: Any) -> Any:
        return value

    def rank_of(self) -> int:
        return asyncexec.get_context().world_rank


#: Bare values (they come back as they are) and others (in an outcome), each with its type kept.
SENT: list[Any] = [
    None,
    True,
    0,
    2**70,
    1.5,
    "text",
    b"\x00bytes",
    b"x" * (100 * 1024),
    (1, "two"),
    ("ok", 3, None, ""),  # shaped as an outcome, but the user's tuple
    {"loss": 0.5},
    [1, 2],
]


@pytest.mark.timeout(60)
async def test_every_kind_of_value_comes_back_as_it_was_sent_on_each_path(mode: str) -> None:
    """A role method's value comes back whole and of its own type, whether it travels bare (a
    number, a string, bytes, None) or in an outcome, through ``call_method`` (``async def``)
    and ``call_method_sync`` (a plain method), to one rank, to every rank and by load."""
    async with asyncexec.Executor(2, resources_per_worker=CPU, roles=Values) as ex:
        for method in (Values.plain, Values.coro):
            for value in SENT:
                one = await ex.call(method, value, on=asyncexec.rank(1))
                every = await ex.call(method, value)
                chosen = await ex.call(method, value, on=asyncexec.least_loaded())
                for got in (one, *every, chosen):
                    assert got == value and type(got) is type(value), (method, value, got)
        assert await ex.call(Values.rank_of) == [0, 1]


def test_a_method_key_carries_the_role_and_the_method_name() -> None:
    from asyncexec._wire._interface import method_key, parse_key

    plan = plan_call(Other.quick, (), {}, 1, roles=[asyncexec.Role(Worker), asyncexec.Role(Other)])
    assert plan.key == method_key(1, "quick") and parse_key(plan.key) == (1, "quick")
    assert parse_key(method_key(0, "a:b")) == (0, "a:b")
    assert plan_call(len, ([1],), {}, 1).key == ""  # a function: no key
    for bad in ("quick", "x:quick", "1:", "-1:quick", 1):
        with pytest.raises(ValueError, match="not a role method's key"):
            parse_key(bad)


async def test_a_worker_answers_a_bad_key_with_an_error_and_call_role_with_an_outcome() -> None:
    """The worker's side, without Ray: a key it cannot read, a role or method it does not hold,
    are error outcomes; ``call_role`` answers as an outcome even a bare value."""
    from asyncexec._wire._interface import as_outcome
    from asyncexec._wire._protocol import Outcome
    from asyncexec._worker import _roles
    from asyncexec._worker._actor import WorkerCode
    from asyncexec._worker._place import PLACE, Place

    place = Place()
    token = PLACE.set(place)
    try:
        place.roles = _roles.Roles([Values()], None)
        assert await _roles.call("0:plain", (5,), {}) == 5
        assert await _roles.call_here("0:coro", ("s",), {}) == "s"
        wrapped = await _roles.call("0:plain", ({"a": 1},), {})
        assert type(wrapped) is Outcome and wrapped.kind == "ok"
        for bad in ("plain", "1:plain", "0:missing", 7):
            failed = await _roles.call(bad, (), {})  # type: ignore[arg-type]
            assert type(failed) is Outcome and failed.kind == "error", bad
            assert isinstance(failed.error, asyncexec.ExecutorStateError)
        assert await WorkerCode().call_role(0, "plain", 3) == Outcome("ok", 3)
        assert as_outcome(None) == Outcome("ok", None) and as_outcome(wrapped) is wrapped
    finally:
        PLACE.reset(token)


async def test_simulated_ranks_answer_call_method() -> None:
    cluster = SimCluster(SimLoad(reports=1))
    async with asyncexec.Executor(2, roles=Values, health=NO_HEALTH, cluster=cluster) as ex:
        assert await ex.call(Values.plain, b"b") == [b"b", b"b"]
        assert await ex.call(Values.coro, {"k": 1}, on=asyncexec.least_loaded()) == {"k": 1}


# Planning: the commonest call is planned from what was found of its method once ---------------


class Planned:
    def one(self, x: Any) -> Any:
        return x

    async def two(self, x: Any, y: Any = 0) -> Any:
        return x

    @staticmethod
    def alone(x: Any) -> Any:
        return x


def test_the_quick_plan_is_the_plan_of_the_whole_planner() -> None:
    """A role's method with positional arguments, to every rank, one rank or by load, is
    planned as the whole planner plans it (a ``functools.partial`` without arguments takes the
    whole way); the same value passed twice is one part; errors are the same."""
    roles = [asyncexec.Role(Worker), asyncexec.Role(Planned).options(max_concurrency=2)]
    shared = [1, 2]
    for fn, args in (
        (Planned.one, (5,)),
        (Planned.two, (shared, shared)),
        (Planned.alone, ("a",)),
        (Worker.block, ()),
    ):
        for on in (ALL, asyncexec.rank(1), asyncexec.least_loaded(max_in_flight=2)):
            quick = plan_call(fn, args, {}, 2, on, roles=roles)
            whole = plan_call(functools.partial(fn), args, {}, 2, on, roles=roles)
            assert quick == whole and quick.key == whole.key and quick.names == whole.names
    assert plan_call(Planned.two, (shared, shared), {}, 2, roles=roles).parts == (shared,)
    for bad in ((1, 2, 3), ([asyncexec.scatter([1, 2])],)):
        with pytest.raises(asyncexec.ConfigurationError) as quick_error:
            plan_call(Planned.two, bad, {}, 2, roles=roles)
        with pytest.raises(asyncexec.ConfigurationError) as whole_error:
            plan_call(functools.partial(Planned.two), bad, {}, 2, roles=roles)
        assert str(quick_error.value) == str(whole_error.value)


def test_a_method_replaced_on_its_class_is_looked_up_again() -> None:
    class Swapped:
        def m(self) -> int:
            return 1

    roles = [asyncexec.Role(Swapped)]
    old = Swapped.m
    assert plan_call(old, (), {}, 1, roles=roles).method == (0, "m")

    def other(self: Any) -> int:
        return 2

    other.__name__, other.__qualname__ = "m", "Swapped.m"
    Swapped.m = other  # type: ignore[method-assign]
    with pytest.raises(asyncexec.ConfigurationError):
        plan_call(old, (), {}, 1, roles=roles)  # no longer the role's method
    assert plan_call(Swapped.m, (), {}, 1, roles=roles).method == (0, "m")


# A rank renewed outside a run, and a weight channel to its group -------------------------------


class Holder:
    """A role that installs what a weight channel pushes (as a rollout server does)."""

    def __init__(self) -> None:
        self.state: Any = None
        asyncexec.receive_weights(self.install)

    def install(self, state: Any, version: int) -> None:
        self.state = state

    def held(self) -> tuple[int | None, Any]:
        return asyncexec.weights_version(), self.state

    def pid(self) -> int:
        import os

        return os.getpid()


def _serve_weights() -> None:
    asyncexec.serve_weights(lambda: {"w": 2.0})


@pytest.mark.ray_only
@pytest.mark.timeout(60)
async def test_a_rank_renewed_outside_a_run_gets_the_channels_latest_version(
    ray_local: None,
) -> None:
    """A ``call()`` user without a Router: a rank of the receiving group dies and the
    dispatcher puts a fresh process in its place; before the next call reaches it, it holds the
    channel's latest version (it held nothing: the channel gives it to ranks joining a run)."""
    import os
    import signal

    async with (
        asyncexec.Executor(1, resources_per_worker=CPU) as learner,
        asyncexec.Executor(2, resources_per_worker=CPU, roles=Holder) as servers,
    ):
        await learner.execute(_serve_weights)
        async with asyncexec.WeightChannel(learner, servers) as channel:
            assert await channel.push() == 1
            assert await servers.call(Holder.held) == [(1, {"w": 2.0})] * 2
            dead = (await servers.call(Holder.pid))[0]
            os.kill(dead, signal.SIGKILL)
            with pytest.raises(asyncexec.WorkerCrashedError), anyio.fail_after(30):
                while True:  # until a call sees the death (it raises at once)
                    await servers.call(Holder.pid, on=asyncexec.rank(0))
            assert (await servers.call(Holder.pid))[0] != dead  # waits for the fresh process
            assert servers.statistics().renewed_ranks == 1
            assert await servers.call(Holder.held) == [(1, {"w": 2.0})] * 2


# Results settled in batches ---------------------------------------------------------------------


@pytest.mark.timeout(60)
async def test_calls_that_end_together_wake_the_loop_once(ray_local: None) -> None:
    """16 calls of one rank end while the loop is busy: their results are settled in one turn
    of the loop, woken once, not once a call (each wake-up is a write to the loop's self-pipe
    on Ray's thread and a turn of the loop)."""
    import ray

    async with asyncexec.Executor(1, resources_per_worker=CPU, health=NO_HEALTH) as ex:
        group = ex._slot.group
        assert group is not None
        handle: Any = group.workers[0].handle
        await handle.call("ping")
        results = [handle.call("ping") for _ in range(16)]
        loop = asyncio.get_running_loop()
        woken: list[Any] = []
        real = loop.call_soon_threadsafe

        def counted(callback: Any, *args: Any, **kwargs: Any) -> Any:
            woken.append(callback)
            return real(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        try:
            waits = [asyncio.ensure_future(_awaited(r)) for r in results]
            await asyncio.sleep(0)  # each wait has registered its completion callback
            # The loop is held (as by other work) until every call has ended.
            ready, _ = ray.wait([r.ref for r in results], num_returns=16, timeout=30)
            assert len(ready) == 16
            # A reference is ready before Ray's thread has run its completion callback (on a
            # loaded machine, long before): hold the loop until every callback has reached the
            # settler (10 s at most; one settled in the turn above never does).
            settler, deadline = _ray._settler(loop), time.monotonic() + 10
            while len(settler._pending) < 16 and time.monotonic() < deadline:
                time.sleep(0.001)  # noqa: ASYNC251 (the loop is held on purpose)
            answers = await asyncio.gather(*waits)
        finally:
            del loop.call_soon_threadsafe
        assert len(answers) == 16
        assert 1 <= len(woken) <= 4, f"{len(woken)} wake-ups for 16 calls that ended together"


async def _awaited(result: Any) -> Any:
    return await result


class HoldOrDie:
    """Rank 0 holds its call until told; rank 1 dies in it."""

    def __init__(self) -> None:
        self.rank = asyncexec.get_context().world_rank
        self.go = asyncio.Event()

    async def hold_or_die(self) -> int:
        if self.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        await self.go.wait()
        return self.rank

    async def small(self) -> int:
        return self.rank


@pytest.mark.timeout(60)
async def test_a_rank_that_dies_ends_the_wait_while_another_holds(ray_local: None) -> None:
    """Rank 1 dies in a call that rank 0 holds: the call raises rank 1's crash at once, without
    waiting for rank 0."""
    async with asyncexec.Executor(2, resources_per_worker=CPU, roles=HoldOrDie) as ex:
        with pytest.raises(asyncexec.WorkerCrashedError) as info:
            with anyio.fail_after(WAIT_S):
                await ex.call(HoldOrDie.hold_or_die)
        assert info.value.rank == 1


async def _hang_and_mark(path: str) -> None:
    """An ``execute()`` function that runs until cancelled, and marks its cancellation."""
    try:
        await asyncio.sleep(3600)
    except asyncio.CancelledError:
        with open(path, "a") as out:  # noqa: ASYNC230 (a line, in the worker's process)
            out.write("cancelled\n")
        raise


@pytest.mark.timeout(60)
async def test_calls_given_up_are_cancelled_on_the_workers_with_a_timeline_and_for_execute(
    ray_local: None, tmp_path: Any
) -> None:
    """With a timeline kept (each call recorded), a call to every rank given up is cancelled on
    each; so is an ``execute()`` of an ``async def`` given up (it was left running)."""
    async with asyncexec.Executor(2, resources_per_worker=CPU, roles=Worker, timeline=True) as ex:
        await _give_up_on_every_rank(ex)
        marks = tmp_path / "marks"
        with anyio.move_on_after(1.0):
            await ex.execute(_hang_and_mark, str(marks))
        with anyio.fail_after(WAIT_S):
            # Written by the workers' processes: no event to await here.
            while not marks.exists() or marks.read_text().count("cancelled") < 2:  # noqa: ASYNC110
                await anyio.sleep(0.05)
