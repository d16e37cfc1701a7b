"""Standby spares on simulated workers (no Ray): what a spare does when the node of the rank it
would stand in for is gone, a spare being set up in a rank's place while its group closes, a run
started while a call's renewal of a dead rank is under way, and a pooled spare that died."""

from __future__ import annotations

import anyio
import pytest

import asyncexec
from asyncexec._driver.group._spares import take_spare
from asyncexec.testing import SimCluster, SimLoad

pytestmark = pytest.mark.timeout(30)


class NodesLost(SimCluster):
    """Simulated workers whose nodes can be lost: a lost node is dead in the node table, which
    takes a moment to read."""

    def __init__(self, load: SimLoad, ranks_per_node: int) -> None:
        super().__init__(load, ranks_per_node=ranks_per_node, gpus=False)
        self.lost: set[str] = set()

    async def node_alive(self, node_id: str | None) -> bool:
        await anyio.sleep(0.01)  # a look-up in the node table, as Ray's (off the loop)
        return node_id not in self.lost

    async def live_nodes(self) -> set[str] | None:
        alive = await super().live_nodes()
        return None if alive is None else alive - self.lost


def train() -> None:
    """The run's function (simulated ranks report as the cluster's load says)."""


async def test_an_independent_rank_whose_node_is_lost_is_not_renewed_by_a_spare_gone_with_it() -> (
    None
):
    """Defect: a rank of an independent run whose node was lost was handed the standby spare on
    that node, dead with it: its set-up failed, the renewal was a ``StartupError`` charged to
    the restart policy (with ``max_restarts=1`` the run failed), and only the next renewal
    started a fresh process. Now the rank gets a fresh process at once, on a live node."""
    cluster = NodesLost(SimLoad(reports=200, rate=400.0), ranks_per_node=2)
    policy = asyncexec.RestartPolicy(max_restarts=1, wait=lambda _: 0.0)
    async with asyncexec.Executor(1, cluster=cluster, spares=1, restart=policy) as executor:
        [worker] = executor.workers
        assert worker.node_id == "sim-node-0"  # and its spare, made next, too
        lost = False
        async for step in executor.run(train, independent=True):
            if step.index == 10 and not lost:
                lost = True
                cluster.lost.add(worker.node_id)
                cluster.crash(worker.pid + 1)  # the spare
                cluster.crash(worker.pid)
        result = executor.result
        assert result.attempts == 2
        assert len(result.failures) == 1  # the lost rank only
        assert executor.workers[0].node_id == "sim-node-1"


async def test_two_independent_ranks_lost_at_once_do_not_both_take_the_one_spare() -> None:
    """Two ranks of an independent run that crash at once are renewed at once: the one spare
    goes to one of them, a fresh process to the other (a spare used twice would fail one)."""
    cluster = NodesLost(SimLoad(reports=200, rate=400.0), ranks_per_node=4)
    policy = asyncexec.RestartPolicy(max_restarts=1, wait=lambda _: 0.0)
    async with asyncexec.Executor(2, cluster=cluster, spares=1, restart=policy) as executor:
        before = [w.pid for w in executor.workers]
        crashed = False
        async for step in executor.run(train, independent=True):
            if step.index == 10 and not crashed:
                crashed = True
                for pid in before:
                    cluster.crash(pid)
        result = executor.result
        assert result.attempts == 3 and len(result.failures) == 2
        assert before[-1] + 1 in [w.pid for w in executor.workers]  # the spare took one


#: (entered, release): the next set-up that runs the init hook says it entered and waits.
GATES: list[tuple[anyio.Event, anyio.Event]] = []


async def held_hook() -> None:
    """An init hook that waits for the test when it has set a gate."""
    if GATES:
        entered, release = GATES.pop()
        entered.set()
        await release.wait()


async def test_a_spare_set_up_while_its_group_closes_is_not_left_running() -> None:
    """Defect: a spare being set up in a failed rank's place (an init hook, a role's engine that
    takes long) when the group closed (the executor's close outlasted by the recovery) was
    neither among the group's workers nor among its spares, so the close did not kill it; the
    swap then seated it in the closed group, and the process was left running. Now it is let
    go, and the swap is given up."""
    cluster = SimCluster(SimLoad(), gpus=False)
    async with asyncexec.Executor(2, cluster=cluster, spares=1, init_hook=held_hook) as executor:
        group = executor._slot.group  # type: ignore[attr-defined]
        spare = group.spares[0].metadata.pid
        entered, release = anyio.Event(), anyio.Event()
        GATES.append((entered, release))
        took: list[object] = []

        async def swap() -> None:
            took.append(await take_spare(group, 1))

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(swap)
                await entered.wait()  # the spare's set-up is under way
                await group.close(force=True)
                release.set()
        assert took == [None]
        with pytest.raises(LookupError):
            cluster.crash(spare)  # not a live worker


def noop() -> None:
    """A call on every rank."""


async def test_a_run_started_while_a_call_renews_a_dead_rank_waits_for_the_renewal() -> None:
    """Defect: a run started right after a call had found a rank dead (the call raises at once,
    and a spare is put in the rank's place in the background) started on the dead worker, failed
    and put a second spare in the rank's place while the first was being set up: the one seated
    first was then in no group, left running after the executor closed, and the run counted a
    restart. Now the run's attempt waits for the renewal and starts on the renewed rank."""
    cluster = SimCluster(SimLoad(reports=20, rate=500.0), gpus=False)
    policy = asyncexec.RestartPolicy(max_restarts=3, wait=lambda _: 0.0)
    options = {"spares": 2, "restart": policy, "init_hook": held_hook}
    async with asyncexec.Executor(2, cluster=cluster, **options) as executor:  # type: ignore[arg-type]
        first = executor.workers[0].pid  # the first worker made
        entered, release = anyio.Event(), anyio.Event()
        GATES.append((entered, release))
        cluster.crash(executor.workers[1].pid)
        with pytest.raises(asyncexec.WorkerCrashedError):
            await executor.execute(noop)
        steps: list[asyncexec.Step] = []

        async def consume() -> None:
            steps.extend([step async for step in executor.run(train)])

        with anyio.fail_after(10):
            await entered.wait()  # the renewal sets a spare up
            async with anyio.create_task_group() as tg:
                tg.start_soon(consume)
                await anyio.wait_all_tasks_blocked()  # the run waits (or, before, went on)
                release.set()
        result = executor.result
        assert (result.attempts, result.failures, len(steps)) == (1, [], 20)
        made = cluster.statistics().workers
    for pid in range(first, first + made):
        with pytest.raises(LookupError):
            cluster.crash(pid)  # nothing left running


async def test_a_pooled_spare_that_died_standing_by_is_not_given_back_as_idle() -> None:
    """Defect: an executor gave its standby spares back to their pool as reusable without a
    look: a spare that had died while it stood by went back to the idle list (``idle`` counted
    it, nothing replaced it) until a later lease found it dead. Now it is reset like the ranks'
    workers; a dead one is killed and its bundle refilled."""
    cluster = SimCluster(SimLoad(), gpus=False)
    async with asyncexec.WorkerPool(3, cluster=cluster) as pool:
        async with asyncexec.Executor(2, pool=pool, spares=1) as executor:
            spare = executor._slot.group.spares[0].metadata.pid  # type: ignore[attr-defined]
            cluster.crash(spare)
        stats = pool.statistics()
        assert (stats.returned, stats.replaced) == (3, 1)
