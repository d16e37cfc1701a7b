"""The seam's errors and the driver's bookkeeping under failure (issue 31): one node look-up for
every failed call of one death, a lost node reported as lost; drain marks that end with their
drain; a pool's lease that never hands out workers its closing killed; one policy for what
escapes a task group."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import pytest
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

import asyncexec

CPU = {"CPU": 0.5}


@ray.remote(num_cpus=0)
class _Gate:
    """Opens once ``n`` calls have arrived (an actor of the test, on the driver's node)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.arrived = 0
        self.open = asyncio.Event()

    async def arrive(self) -> None:
        self.arrived += 1
        if self.arrived >= self.n:
            self.open.set()

    async def wait_open(self) -> None:
        await self.open.wait()


def _gate(n: int) -> Any:
    here = ray.get_runtime_context().get_node_id()
    return _Gate.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)
    ).remote(n)


async def _hold(gate: Any) -> None:
    """Arrive at ``gate``, then wait to be killed."""
    await gate.arrive.remote()
    await anyio.sleep(120)


async def _failures(ex: asyncexec.Executor, n: int, kill: Callable[[], Any]) -> list[Any]:
    """Start ``n`` calls of :func:`_hold` on rank 0, call ``kill()`` once they have all begun on
    the worker, and return how each ended."""
    ended: list[Any] = [None] * n
    gate = _gate(n)

    async def one(i: int) -> None:
        try:
            ended[i] = await ex.execute_single(0, _hold, gate)
        except Exception as exc:
            ended[i] = exc

    try:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for i in range(n):
                    tg.start_soon(one, i)
                await gate.wait_open.remote()
                await kill()
    finally:
        ray.kill(gate)
    return ended


# Item 8: one look-up of the node table per death, not per failed call ---------------------------


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("ray_local")
async def test_one_death_makes_one_node_lookup_for_all_its_failed_calls() -> None:
    """Eight calls in flight on a worker that is SIGKILLed fail together; each failure asks
    whether the worker's node is gone. They share one look-up of the node table (it made one
    ``ray.nodes()`` each, in a thread, with no bound of its own)."""
    from asyncexec._driver.cluster import _ray

    n = 8
    async with asyncexec.Executor(1, resources_per_worker=CPU) as ex:
        pid = ex.workers[0].pid
        before = _ray.LIVENESS.lookups

        async def kill() -> None:
            os.kill(pid, signal.SIGKILL)

        ended = await _failures(ex, n, kill)
        assert all(isinstance(e, asyncexec.WorkerCrashedError) for e in ended), ended
        assert _ray.LIVENESS.lookups - before == 1


@pytest.mark.timeout(90)
async def test_calls_on_a_removed_node_fail_as_a_lost_node(
    make_cluster: Callable[[list[dict[str, Any]]], Any],
) -> None:
    """Every call in flight on a worker whose node is removed fails with NodeLostError (not a
    crash), naming the node, with one look-up of the node table for all of them."""
    from asyncexec._driver.cluster import _ray

    cluster = make_cluster([{"num_cpus": 1}, {"num_cpus": 1, "resources": {"far": 1}}])
    (far,) = cluster.worker_nodes
    n = 8
    async with asyncexec.Executor(1, resources_per_worker={"CPU": 0.5, "far": 0.5}) as ex:
        assert ex.workers[0].node_id == far.node_id
        before = _ray.LIVENESS.lookups

        async def remove() -> None:
            await anyio.to_thread.run_sync(lambda: cluster.remove_node(far, allow_graceful=False))

        ended = await _failures(ex, n, remove)
        assert all(isinstance(e, asyncexec.NodeLostError) for e in ended), ended
        assert {e.node_id for e in ended} == {far.node_id}
        assert _ray.LIVENESS.lookups - before == 1


@pytest.mark.timeout(10)
async def test_node_liveness_is_asked_once_for_concurrent_askers_and_bounded() -> None:
    """Without Ray: askers at once share one look-up; "alive" is kept a moment, "dead" for good;
    a look-up that hangs counts as "alive" at its bound, and is not kept."""
    import threading

    from asyncexec._driver.cluster._liveness import Liveness

    asked: list[str] = []
    release = threading.Event()

    def lookup(node: str, timeout_s: float) -> bool:
        asked.append(node)
        release.wait(10)  # longer than any bound here: a look-up that hangs
        return node != "dead"

    liveness = Liveness(lookup, timeout_s=5.0, ttl_s=60.0)
    answers: list[bool] = []

    async def ask(node: str) -> None:
        answers.append(await liveness.alive(node))

    async with anyio.create_task_group() as tg:
        for _ in range(10):
            tg.start_soon(ask, "dead")
        await anyio.wait_all_tasks_blocked()
        release.set()
    assert answers == [False] * 10 and asked == ["dead"]
    assert (
        not await liveness.alive("dead")
        and await liveness.alive("a")
        and await liveness.alive(None)
    )
    assert asked == ["dead", "a"] and liveness.lookups == 2
    release.clear()
    hung = Liveness(lookup, timeout_s=0.2)
    with anyio.fail_after(2):
        assert await hung.alive("b") and await hung.alive("b")
    assert hung.lookups == 2  # an unknown answer is not kept
    release.set()


@pytest.mark.timeout(10)
async def test_a_node_listing_that_fails_is_no_answer_not_an_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Without Ray: ``ray.nodes()`` raising (the GCS failing) escaped the seam's ``live_nodes``,
    whose None says the cluster did not answer: the preemption watch, which never fails a
    run, and an elastic group's sizing failed with it."""
    from asyncexec._driver.cluster import _ray

    def failing() -> set[str]:
        raise RuntimeError("the GCS did not answer")

    monkeypatch.setattr(_ray, "_alive", failing)
    cluster = object.__new__(_ray.RayCluster)
    assert await cluster.live_nodes() is None


# Item 7: a drain's mark ends with the drain ------------------------------------------------------


class _Drains:
    """The part of a cluster a preemption watch asks: which nodes are alive."""

    def __init__(self, alive: set[str]) -> None:
        self.alive = alive

    async def live_nodes(self) -> set[str] | None:
        return set(self.alive)

    async def preempted(self, node_ids: Any) -> set[str]:
        return set()


class _Handle:
    def __init__(self, key: str) -> None:
        self.key = key
        self.told: list[Any] = []

    async def call(self, method: str, notice: Any) -> None:
        self.told.append(notice)


def _group(nodes: list[str], tag: str) -> Any:
    """A stand-in for a group: rank i on ``nodes[i]``, worker keys named by ``tag``."""
    from types import SimpleNamespace

    workers = [
        SimpleNamespace(rank=i, metadata=SimpleNamespace(node_id=n), handle=_Handle(f"{tag}{i}"))
        for i, n in enumerate(nodes)
    ]
    return SimpleNamespace(workers=workers)


@pytest.mark.timeout(10)
async def test_a_drain_that_ends_on_a_live_node_leaves_no_mark_and_the_watch_stays_bounded() -> (
    None
):
    """A crash on a node whose drain ended (rejected, cancelled, or its deadline long past) while
    the node stayed alive was still a preemption: restarted at once outside the restart policy,
    without bound under ``max_preemptions=None``. A node that left with its drain stays one."""
    import time

    import structlog

    from asyncexec._driver._observe import Observer
    from asyncexec._driver.run._preemption import LAPSE_S, PreemptionWatch

    cluster = _Drains({"a", "b"})
    policy = asyncexec.RestartPolicy()
    watch = PreemptionWatch(cluster, policy, Observer(), structlog.get_logger())  # type: ignore[arg-type]
    group = _group(["a", "b"], "first")
    on_a = asyncexec.WorkerCrashedError(0, node_id="a", attempt=1, detail="crashed")
    on_b = asyncexec.WorkerCrashedError(1, node_id="b", attempt=1, detail="crashed")
    marked: dict[str, float | None] = {}
    soon = time.time() + 60
    await watch._update(group, marked, {"a": soon})
    assert watch.current is not None and watch.current.node_ids == ("a",)
    assert await watch.is_preemption([on_a])
    # The drain ended and "a" is alive: its crashes are crashes again, and the workers are told.
    await watch._update(group, marked, {})
    assert marked == {} and watch.current is None
    assert group.workers[0].handle.told[-1] is None
    assert not await watch.is_preemption([on_a])
    # A node that leaves with its drain stays drained: its workers' deaths are the preemption.
    await watch._update(group, marked, {"b": soon})
    cluster.alive = {"a"}
    await watch._update(group, marked, {})
    assert await watch.is_preemption([on_b])
    # A deadline long past on a node still alive: no longer drained, and not marked again.
    cluster.alive = {"a", "b"}
    later = _group(["a", "c"], "second")
    marked = {}
    past = time.time() - LAPSE_S - 1
    await watch._update(later, marked, {"a": past})
    await watch._update(later, marked, {"a": past})
    assert marked == {} and watch.current is None
    assert not await watch.is_preemption([on_a])
    # What the watch remembers is the current group's workers, not every worker it ever told.
    assert set(watch._told) <= {"second0", "second1"}


# Item 11: a lease never hands out what the pool's closing killed ---------------------------------


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("ray_local")
async def test_a_lease_that_the_pools_close_overtakes_raises_and_hands_out_nothing() -> None:
    """A pool closed while a lease waits for its workers' pings killed those workers, and the
    lease returned them. It raises ExecutorStateError naming the closed pool instead."""
    outcome: list[Any] = []
    async with asyncexec.WorkerPool(2, resources_per_worker=CPU) as pool:
        stock = pool._stock
        real = stock.alive
        answered, closed = anyio.Event(), anyio.Event()

        async def alive(workers: list[Any]) -> list[Any]:
            found = await real(workers)
            answered.set()  # the pings answered; the pool closes before the lease goes on
            await closed.wait()
            return found

        stock.alive = alive  # type: ignore[method-assign]

        async def lease() -> None:
            try:
                outcome.append(await pool.lease(2))
            except asyncexec.ExecutorStateError as exc:
                outcome.append(exc)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                tg.start_soon(lease)
                await answered.wait()
                await pool.aclose()
                closed.set()
    [got] = outcome
    assert isinstance(got, asyncexec.ExecutorStateError), got
    assert "closed" in str(got)
    assert pool.statistics().leased == 0


# Item 3 (the seam's part): one policy for what escapes a task group -------------------------------


async def _value(v: int) -> int:
    await anyio.lowlevel.checkpoint()
    return v


async def _fail(error: BaseException) -> None:
    await anyio.lowlevel.checkpoint()
    raise error


@pytest.mark.timeout(10)
async def test_awaited_raises_the_failed_calls_own_error_not_an_exception_group() -> None:
    """``awaited()`` says the first failure is raised: an ExceptionGroup escaped, which an
    ``except asyncexec.WorkerCrashedError`` misses."""
    from asyncexec._driver.cluster import awaited

    crashed = asyncexec.WorkerCrashedError(1, node_id="n" * 20, attempt=1, detail="killed")
    assert await awaited([_value(1), _value(2)]) == [1, 2]
    with pytest.raises(asyncexec.WorkerCrashedError) as info:
        await awaited([_value(1), _fail(crashed)])
    assert info.value is crashed


@pytest.mark.timeout(10)
async def test_a_task_group_raises_one_error_the_others_as_notes() -> None:
    """Of several failures: an interrupt first, then asyncexec's error, then the first other;
    the rest as notes; a group of cancellations alone is left to anyio."""
    from asyncexec._driver._taskgroups import escaped, task_group

    raised = asyncexec.WorkerRaisedError(0, attempt=1, detail="ValueError: bad")
    with pytest.raises(asyncexec.WorkerRaisedError) as info:
        async with task_group() as tg:
            tg.start_soon(_fail, KeyError("internal"))
            tg.start_soon(_fail, raised)
    assert info.value is raised
    assert any("KeyError" in note for note in info.value.__notes__)
    assert isinstance(info.value.__context__, BaseExceptionGroup)
    with pytest.raises(KeyError):
        async with task_group() as tg:
            tg.start_soon(_fail, KeyError("only"))
    group = BaseExceptionGroup("", [ValueError("v"), KeyboardInterrupt()])
    assert isinstance(escaped(group), KeyboardInterrupt)
    cancelled = BaseExceptionGroup("", [anyio.get_cancelled_exc_class()()])
    assert escaped(cancelled) is cancelled
