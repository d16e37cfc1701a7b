"""A worker pool's leases on simulated workers (no Ray): a lease cancelled while it checks its
workers gives them back, a lease that waits for a worker given back gets it, and a bundle whose
refill gave up is refilled when the cluster has room again (a lease that waits for it fails with
the refill's error)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import anyio.lowlevel
import pytest

import asyncexec
from asyncexec._driver.group import _stock
from asyncexec.testing import SimCluster

pytestmark = pytest.mark.timeout(30)


async def test_a_lease_cancelled_while_it_pings_its_workers_gives_them_back() -> None:
    """Defect: the workers a lease was pinging (each answers before it is leased) were leased
    to nobody once the lease was cancelled (a timeout around an executor's start, Ctrl-C): the
    pool was smaller for good, and a lease of all its workers waited in vain."""
    async with asyncexec.WorkerPool(2, cluster=SimCluster(), when_short="wait") as pool:
        with anyio.move_on_after(0) as scope:
            await pool.lease(1)
        assert scope.cancelled_caught
        stats = pool.statistics()
        assert (stats.idle, stats.leased) == (2, 0)
        with anyio.fail_after(5):
            assert len(await pool.lease(2)) == 2


async def test_a_lease_that_waits_gets_a_worker_given_back_meanwhile() -> None:
    """Defect: a lease with no worker idle yielded once before it took the event that a
    give-back sets: a worker given back then set the event before, and the lease waited for
    the next one until its bound, with the worker idle."""
    timeouts = asyncexec.Timeouts(placement_s=60)
    async with asyncexec.WorkerPool(
        1, cluster=SimCluster(), when_short="wait", timeouts=timeouts
    ) as pool:
        [worker] = await pool.lease(1)
        got: list[int] = []

        async def waiter() -> None:
            got.append(len(await pool.lease(1)))

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter)
                await anyio.lowlevel.checkpoint()  # the waiter runs up to its first wait
                await pool.give_back([(worker.handle, True)])
        assert got == [1]


async def test_leases_that_wait_for_workers_given_back_one_at_a_time_do_not_starve_each_other() -> (
    None
):
    """Defect: leases that waited took whatever was idle: with workers given back one at a
    time (executors that end, workers started again after their last lease), two leases of 3
    of a pool of 4 each took 2 and waited for the third until both failed at their bound. Now a
    waiting lease takes its workers when they are all idle, in the order the leases came."""
    timeouts = asyncexec.Timeouts(placement_s=20)
    async with asyncexec.WorkerPool(
        4, cluster=SimCluster(), when_short="wait", timeouts=timeouts
    ) as pool:
        held = await pool.lease(4)
        order: list[str] = []

        async def lease(name: str) -> None:
            workers = await pool.lease(3)
            order.append(name)
            await pool.give_back([(w.handle, True) for w in workers])

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(lease, "first")
                await anyio.lowlevel.checkpoint()  # the first waits before the second comes
                tg.start_soon(lease, "second")
                await anyio.lowlevel.checkpoint()
                for worker in held:  # one at a time, each lease waking in between
                    await pool.give_back([(worker.handle, True)])
                    for _ in range(10):
                        await anyio.lowlevel.checkpoint()
        assert order == ["first", "second"]


class _Full(SimCluster):
    """Simulated workers on a cluster that has no room for new ones while ``full``."""

    def __init__(self) -> None:
        super().__init__()
        self.full = False
        self.refused = anyio.Event()

    async def start_workers(self, *args: Any, **kwargs: Any) -> Any:
        if self.full:
            self.refused.set()
            raise RuntimeError("no room in the cluster")
        return await super().start_workers(*args, **kwargs)


def _waiting_pool(cluster: _Full) -> asyncexec.WorkerPool:
    """A pool of 2 on ``cluster`` whose short leases wait (for as long as a test may take)."""
    timeouts = asyncexec.Timeouts(placement_s=60)
    return asyncexec.WorkerPool(2, cluster=cluster, when_short="wait", timeouts=timeouts)


async def _until(predicate: Callable[[], bool]) -> None:
    """Let the pool's background tasks run until ``predicate`` holds (the caller bounds it)."""
    while not predicate():
        await anyio.lowlevel.checkpoint()


async def test_a_pool_whose_refill_gave_up_refills_when_the_cluster_has_room_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Defect: a bundle whose refill failed through its backoff (``pool_refill_gave_up``)
    stayed empty for good: the pool was one worker short for ever, and its leases took fresh
    workers outside it. Now the next lease or give-back tries the bundle again."""
    monkeypatch.setattr(_stock, "_REFILL_BACKOFF_S", ())  # one try, then give up
    cluster = _Full()
    async with asyncexec.WorkerPool(2, cluster=cluster) as pool:
        [worker] = await pool.lease(1)
        cluster.full = True
        with anyio.fail_after(5):
            await pool.give_back([(worker.handle, False)])  # killed: its bundle is refilled
            await cluster.refused.wait()
            await _until(lambda: pool.statistics().starting == 0)  # it gave up
        assert pool.statistics().idle == 1
        cluster.full = False
        [worker] = await pool.lease(1)  # the cluster has room again
        await pool.give_back([(worker.handle, True)])
        with anyio.fail_after(5):
            await _until(lambda: pool.statistics().idle == 2)
        workers = await pool.lease(2)
        assert len(workers) == 2
        assert pool.statistics().fresh_for_leases == 0


async def test_a_lease_that_waits_for_a_bundle_whose_refill_gives_up_fails_with_its_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Defect: a lease that waited (``when_short="wait"``) for a bundle whose refill it tried
    again gave up again waited until its own bound, with nothing left to start the bundle, and
    then said no worker was given back. Now it fails at once with the refill's error."""
    monkeypatch.setattr(_stock, "_REFILL_BACKOFF_S", ())  # one try, then give up
    cluster = _Full()
    async with _waiting_pool(cluster) as pool:
        [worker] = await pool.lease(1)
        cluster.full = True
        with anyio.fail_after(5):
            await pool.give_back([(worker.handle, False)])  # killed: its refill gives up
            await _until(lambda: pool.statistics().starting == 0)
            with pytest.raises(asyncexec.StartupError, match="refill") as caught:
                await pool.lease(2)  # tries the bundle again, which gives up again
        assert isinstance(caught.value.__cause__, RuntimeError)
        assert "no room in the cluster" in str(caught.value.__cause__)
        assert pool.statistics().idle == 1  # the lease gave back nothing it did not take
        cluster.full = False
        with anyio.fail_after(5):
            assert len(await pool.lease(2)) == 2  # the next lease tries the bundle again


async def test_a_lease_that_waits_for_workers_still_leased_outlasts_a_refill_that_gives_up(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A lease that the pool's remaining workers can serve keeps waiting for them to be given
    back when the refill of another bundle gives up."""
    monkeypatch.setattr(_stock, "_REFILL_BACKOFF_S", ())  # one try, then give up
    cluster = _Full()
    async with _waiting_pool(cluster) as pool:
        doomed, kept = await pool.lease(2)
        cluster.full = True
        with anyio.fail_after(5):
            await pool.give_back([(doomed.handle, False)])  # killed: its refill gives up
            await _until(lambda: pool.statistics().starting == 0)
            got: list[int] = []

            async def waiter() -> None:
                got.append(len(await pool.lease(1)))  # tries the bundle again: gives up again

            cluster.refused = anyio.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(waiter)
                await cluster.refused.wait()
                await _until(lambda: pool.statistics().starting == 0)  # it gave up again
                for _ in range(10):  # the waiter wakes, and waits on
                    await anyio.lowlevel.checkpoint()
                assert got == []
                await pool.give_back([(kept.handle, True)])
        assert got == [1]


async def test_a_bundle_whose_refill_waits_to_try_again_counts_as_starting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Defect: while a refill waited out its backoff between two tries, its bundle was counted
    nowhere: ``statistics()`` said no worker was starting (idle + leased + starting fell short
    of the size), as if the refill had given up."""
    monkeypatch.setattr(_stock, "_REFILL_BACKOFF_S", (60.0,))  # a second try, after a while
    cluster = _Full()
    async with asyncexec.WorkerPool(1, cluster=cluster) as pool:
        [worker] = await pool.lease(1)
        cluster.full = True
        with anyio.fail_after(5):
            await pool.give_back([(worker.handle, False)])  # killed: its bundle is refilled
            await cluster.refused.wait()  # the first try failed: the refill waits
            for _ in range(10):
                await anyio.lowlevel.checkpoint()
        stats = pool.statistics()
        assert (stats.idle, stats.leased, stats.starting) == (0, 0, 1)
