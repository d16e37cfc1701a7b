"""Standby spares on simulated workers (no Ray): what a spare does when the node of the rank it
would stand in for is gone."""

from __future__ import annotations

import pytest

import asyncexec
from asyncexec.testing import SimCluster, SimLoad

pytestmark = pytest.mark.timeout(30)


class NodesLost(SimCluster):
    """Simulated workers whose nodes can be lost: a lost node is dead in the node table."""

    def __init__(self, load: SimLoad, ranks_per_node: int) -> None:
        super().__init__(load, ranks_per_node=ranks_per_node, gpus=False)
        self.lost: set[str] = set()

    async def node_alive(self, node_id: str | None) -> bool:
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
