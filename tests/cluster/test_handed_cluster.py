"""The cluster handed in (``cluster=``, as httpx takes ``transport=``): an executor, a pool and the
executors that lease from it run on the simulated cluster they are given, with no Ray and no
block around them; two at once on two clusters; the handed-in cluster wins over
``simulated()``'s default and over ``ASYNCEXEC_LOCAL``; objects that work together on different
clusters (an executor and its pool, a pool and its reservation, a weight channel's two ends)
are refused before anything starts, naming both; ``local=True`` with a cluster is refused; and
``simulated()`` is a context's default, not a process's."""

from __future__ import annotations

import anyio
import pytest
import ray

import asyncexec
from asyncexec.testing import SimCluster, SimLoad, simulated


def train() -> None:
    """The run's function (simulated ranks report as their load says instead)."""


async def steps(executor: asyncexec.Executor) -> list[int]:
    return [step.index async for step in executor.run(train)]


@pytest.mark.timeout(30)
async def test_an_executor_on_a_handed_in_cluster_runs_without_ray() -> None:
    """Two executors at once, each on the simulated cluster it was handed: each cluster made
    and ran its own workers only, and Ray never started."""
    first = SimCluster(SimLoad(reports=3, rate=1000.0))
    second = SimCluster(SimLoad(reports=5, rate=1000.0))
    async with (
        asyncexec.Executor(2, cluster=first) as a,
        asyncexec.Executor(4, cluster=second) as b,
    ):
        assert a.cluster is first and b.cluster is second
        assert await steps(a) == [0, 1, 2]
        assert await steps(b) == [0, 1, 2, 3, 4]
    assert (first.statistics().workers, first.statistics().reports) == (2, 3 * 2)
    assert (second.statistics().workers, second.statistics().reports) == (4, 5 * 4)
    assert not ray.is_initialized()


@pytest.mark.timeout(30)
async def test_executors_lease_from_a_pool_on_a_handed_in_cluster() -> None:
    """A pool handed a simulated cluster keeps its warm workers there; an executor on the pool
    runs on the pool's cluster without being told, on the pool's workers (no new ones)."""
    cluster = SimCluster(SimLoad(reports=2, rate=1000.0))
    async with asyncexec.WorkerPool(3, cluster=cluster) as pool:
        assert cluster.statistics().workers == 3
        async with asyncexec.Executor(2, pool=pool) as executor:
            assert executor.cluster is cluster
            assert cluster.statistics().workers == 3  # leased: none made
            assert await steps(executor) == [0, 1]
    assert cluster.statistics().workers == 3
    assert not ray.is_initialized()


@pytest.mark.timeout(30)
async def test_a_handed_in_cluster_wins_over_simulated_and_the_local_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inside ``simulated(block)``, an executor handed another cluster runs on that one; with
    ``ASYNCEXEC_LOCAL=1`` too (the variable sets the default, which a cluster replaces)."""
    monkeypatch.setenv("ASYNCEXEC_LOCAL", "1")
    handed = SimCluster(SimLoad(reports=1, rate=1000.0))
    with simulated(SimCluster()) as block:
        async with asyncexec.Executor(2, cluster=handed) as executor:
            assert await steps(executor) == [0]
    assert executor.cluster is handed and not executor.config.local
    assert (handed.statistics().workers, block.statistics().workers) == (2, 0)


def test_local_true_with_a_cluster_is_refused_naming_both() -> None:
    cluster = SimCluster()
    with pytest.raises(asyncexec.ConfigurationError, match=r"local=True or a cluster") as info:
        asyncexec.Executor(2, local=True, cluster=cluster)
    assert repr(cluster) in str(info.value)
    with pytest.raises(asyncexec.ConfigurationError, match="local must be"):
        asyncexec.Executor(2, local="yes", cluster=cluster)  # type: ignore[arg-type]
    assert asyncexec.Executor(2, local=False, cluster=cluster).cluster is cluster
    with pytest.raises(asyncexec.ConfigurationError, match=r"cluster must be .*got 'ray'"):
        asyncexec.Executor(2, cluster="ray")  # type: ignore[arg-type]


def test_a_backend_on_a_simulated_cluster_is_refused_when_made() -> None:
    """Defect: an executor on a simulated cluster took a backend, whose worker functions ran
    inline on the driver's loop: a TorchBackend's start bound a store to the rank's made-up
    address and waited for the other ranks there, blocking the loop for good (no deadline or
    cancellation could end it). Refused as local mode refuses one: one process, one group."""
    from asyncexec.backends import Backend, TorchBackend

    for backend in (TorchBackend(), Backend()):
        with pytest.raises(asyncexec.ConfigurationError, match="backend") as info:
            asyncexec.Executor(2, cluster=SimCluster(), backend=backend)
        assert "SimCluster" in str(info.value)
        with simulated(), pytest.raises(asyncexec.ConfigurationError, match="backend"):
            asyncexec.Executor(2, backend=backend)
        with pytest.raises(asyncexec.ConfigurationError, match="backend"):
            pool = asyncexec.WorkerPool(2, cluster=SimCluster())
            asyncexec.Executor(2, pool=pool, backend=backend)
    assert not ray.is_initialized()


def test_an_executor_on_another_cluster_than_its_pool_is_refused_naming_both() -> None:
    """Refused when made: nothing is started (no worker made on either cluster)."""
    ours, theirs = SimCluster(), SimCluster(SimLoad(reports=7))
    pool = asyncexec.WorkerPool(2, cluster=theirs, name="warm")
    with pytest.raises(asyncexec.ConfigurationError, match="one cluster") as info:
        asyncexec.Executor(2, pool=pool, cluster=ours, name="trainer")
    message = str(info.value)
    assert "'trainer'" in message and "'warm'" in message
    assert repr(ours) in message and repr(theirs) in message
    assert ours.statistics().workers == theirs.statistics().workers == 0
    # A pool made outside simulated() keeps its cluster for the executors made inside it.
    with simulated(SimCluster()):
        assert asyncexec.Executor(2, pool=pool).cluster is theirs


def test_a_pool_on_another_cluster_than_its_reservation_is_refused() -> None:
    """A reservation is Ray's placement group: a pool handed a simulated cluster does not go on
    it; and a reservation is refused a simulated cluster (it places no bundles), also as the
    default inside ``simulated()``."""
    reservation = asyncexec.Reservation(2, name="bundles")  # Ray's: not started until entered
    cluster = SimCluster()
    with pytest.raises(asyncexec.ConfigurationError, match="one cluster") as info:
        asyncexec.WorkerPool(2, reservation=reservation, cluster=cluster, name="warm")
    assert "'bundles'" in str(info.value) and repr(cluster) in str(info.value)
    assert asyncexec.Executor(2, reservation=reservation).cluster == reservation.cluster
    with pytest.raises(asyncexec.ConfigurationError, match="places no bundles"):
        asyncexec.Reservation(2, cluster=cluster)
    with simulated(), pytest.raises(asyncexec.ConfigurationError, match="places no bundles"):
        asyncexec.Reservation(2)
    assert not ray.is_initialized()


def test_a_weight_channel_between_two_clusters_is_refused_naming_both() -> None:
    """Its ends on Ray's cluster and a simulated one; refused when made, before either starts
    (a Router or Pipeline takes only a channel into its own servers, so this is theirs too)."""
    cluster = SimCluster()
    learner = asyncexec.Executor(2, name="learner")
    servers = asyncexec.Executor(2, cluster=cluster, name="servers")
    with pytest.raises(asyncexec.ConfigurationError, match="one cluster") as info:
        asyncexec.WeightChannel(learner, servers)
    message = str(info.value)
    assert "'learner'" in message and "'servers'" in message and repr(cluster) in message
    assert "Ray's cluster" in message
    assert not ray.is_initialized()


def test_a_weight_channel_on_a_simulated_cluster_is_refused_when_made() -> None:
    """Simulated workers have no object store or process group to move weights through: a
    channel between two executors on one simulated cluster is refused when made, naming the
    cluster, not at its first push."""
    cluster = SimCluster()
    learner = asyncexec.Executor(2, cluster=cluster, name="learner")
    servers = asyncexec.Executor(2, cluster=cluster, name="servers")
    with pytest.raises(asyncexec.ConfigurationError, match="update_weights") as info:
        asyncexec.WeightChannel(learner, servers)
    assert repr(cluster) in str(info.value)
    assert not ray.is_initialized()


@pytest.mark.timeout(10)
async def test_simulated_is_the_default_of_its_own_context_only() -> None:
    """A task that was already running when another entered ``simulated()`` makes its executors
    on Ray's cluster (the block's default is that context's, not the process's); a task started
    inside the block gets the block's cluster."""
    entered, made = anyio.Event(), anyio.Event()
    outside: list[asyncexec.Executor] = []
    inside: list[asyncexec.Executor] = []

    async def elsewhere() -> None:
        await entered.wait()
        outside.append(asyncexec.Executor(2))
        made.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(elsewhere)
        with simulated() as cluster:
            entered.set()
            await made.wait()
            async with anyio.create_task_group() as inner:
                inner.start_soon(lambda: _append(inside))
    assert repr(outside[0].cluster) == "<Ray's cluster>"
    assert inside[0].cluster is cluster
    assert asyncexec.Executor(2).cluster == outside[0].cluster  # the block is over
    assert not ray.is_initialized()


async def _append(executors: list[asyncexec.Executor]) -> None:
    executors.append(asyncexec.Executor(2))
