"""Elastic size (``num_workers=(min, max)``): how many workers fit now, and when a group grows.

Each group start of an elastic executor decides its size from what the cluster has free: as many
of ``max`` as fit at once (first-fit of the bundles over the live nodes' available resources, as
:func:`~._placement.infeasible_reason` checks them), and ``min`` when fewer fit (the placement
deadline then applies as to any group). After a lost node the run goes on with what is left
instead of waiting for the lost capacity: when at least ``min`` workers are left on the live
nodes (and no backend's framework group has to be rebuilt by fresh processes), they are kept,
ranked anew and set up for the smaller world, and no process starts; else the restart starts a
group of the size that fits. While a run goes on with fewer than ``max``, a watcher measures
every ``elastic_check_interval_s`` how many would fit if the group's own bundles were free; when
more would, the run restarts on a larger group from the latest checkpoint (a planned resize, not
a failure).

The cluster's resource view is read off the loop, bounded (see ``Cluster.free_nodes``): a slow
answer counts as unknown.
Ray shows resources freed by a removed placement group a moment after the removal, so the
free resources are measured before a group is discarded, counting its own bundles as free, and
the next start uses that measure when it is recent; a start that measures anew and finds fewer
than ``max`` looks once more :data:`SETTLE_S` later (another executor may just have closed).
A kept group's placement group keeps the lost bundles, which Ray places again when a node can
hold them: they count as the group's own.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import anyio

from ..._errors import AsyncExecError, ConfigurationError, NodeLostError, describe
from .._config import ExecutorConfig
from ..cluster import Cluster, infeasible_reason
from ._group import WorkerGroup
from ._spares import shrink
from ._startup import worker_contexts

__all__ = ["Resize", "Sizer", "decide_size", "fitting_workers", "holding", "measure_free"]

#: How long a measure taken as a group was discarded stays good for the next start.
MEASURE_FRESH_S = 5.0
#: A start that measures anew and finds fewer than the maximum free looks once more after this
#: (resources that another group just gave back show a moment late).
SETTLE_S = 0.2

Nodes = list[dict[str, float]]


class Resize(Exception):  # a signal from an attempt to its driver, not an error
    """A planned resize: the attempt stopped because ``size`` workers would now fit."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


def fitting_workers(
    bundle: Mapping[str, float], strategy: str, nodes: Sequence[Mapping[str, float]], most: int
) -> int:
    """How many workers of ``bundle`` (at most ``most``) the ``nodes``' free resources hold at
    once under ``strategy``; 0 when not one does. Pure."""
    for n in range(most, 0, -1):
        if infeasible_reason([dict(bundle)] * n, strategy, nodes) is None:
            return n
    return 0


def decide_size(fitting: int, minimum: int, maximum: int) -> int:
    """The size of the next group: as many as fit, within ``[minimum, maximum]`` (``minimum``
    when fewer fit: the placement deadline then waits for them). Pure."""
    return max(minimum, min(fitting, maximum))


def holding(group: WorkerGroup) -> dict[str, int]:
    """How many of ``group``'s bundles each node holds (one per worker, on its node)."""
    return dict(Counter(w.metadata.node_id for w in group.workers))


async def measure_free(
    config: ExecutorConfig, cluster: Cluster, group: WorkerGroup | None, log: Any
) -> Nodes | None:
    """The live nodes' free resources (``group``'s bundles counted as free), or None when the
    cluster did not answer within its bound or failed (logged)."""
    try:
        placement = group.placement if group is not None else None
        held = holding(group) if group is not None else {}
        nodes = await cluster.free_nodes(config.bundle, placement, held)
        if nodes is None:
            log.warning("elastic_measure_timed_out")
        return nodes
    except Exception as exc:
        log.warning("elastic_measure_failed", error=describe(exc))
    return None


class Sizer:
    """Decides each start's size for an elastic executor; the group slot holds one."""

    def __init__(self, config: ExecutorConfig, cluster: Cluster, log: Any) -> None:
        assert config.min_workers is not None and config.max_workers is not None
        self.config = config
        self.cluster = cluster
        self.minimum = config.min_workers
        self.maximum = config.max_workers
        self.log = log
        self._measured: tuple[float, Nodes] | None = None

    def fitting(self, nodes: Nodes) -> int:
        config = self.config
        return fitting_workers(config.bundle, config.placement_strategy, nodes, self.maximum)

    async def remember(self, group: WorkerGroup) -> None:
        """Measure what is free as if ``group`` were gone, before it is discarded (see the
        module's docstring)."""
        nodes = await measure_free(self.config, self.cluster, group, self.log)
        self._measured = None if nodes is None else (time.monotonic(), nodes)

    async def size(self) -> int:
        """The next group's size: from the measure taken as the last group was discarded, when
        recent, else from one taken now. Call it on the executor's thread.

        Raises:
            ConfigurationError: the executor runs inside a placement group that captures child
                tasks (its workers would take the parent's bundles, which this does not measure).
        """
        if await self.cluster.parent() is not None:
            raise ConfigurationError(
                "an elastic executor cannot place its workers in the parent placement group "
                "that captures child tasks: give it a fixed num_workers"
            )
        measured, self._measured = self._measured, None
        if measured is not None and time.monotonic() - measured[0] <= MEASURE_FRESH_S:
            fitting = self.fitting(measured[1])
        else:
            fitting = await self._measure()
            if fitting < self.maximum:
                await anyio.sleep(SETTLE_S)
                fitting = max(fitting, await self._measure())
        size = decide_size(fitting, self.minimum, self.maximum)
        self.log.debug("elastic_size", fitting=fitting, size=size)
        return size

    async def _measure(self, group: WorkerGroup | None = None) -> int:
        """How many workers fit now (``group``'s bundles counted as free); 0 when unknown."""
        nodes = await measure_free(self.config, self.cluster, group, self.log)
        return 0 if nodes is None else self.fitting(nodes)

    async def watch_growth(self, group: WorkerGroup, grow: Callable[[int], None]) -> None:
        """While ``group`` is smaller than the maximum: every ``elastic_check_interval_s``, call
        ``grow(n)`` (and return) once ``n`` workers, more than the group has, would fit."""
        size = len(group.workers)
        while size < self.maximum:
            await anyio.sleep(self.config.elastic_check_interval_s)
            fitting = await self._measure(group)
            if fitting > size:
                grow(fitting)
                return

    async def keep_survivors(self, group: WorkerGroup, failure: AsyncExecError) -> bool:
        """After a lost node: go on with the workers on the nodes that are left, when they are
        at least the minimum, their functions stop in time and no backend has to rebuild its
        framework's group with fresh processes (torch's process group); whether it did. The
        attempt then restarts from the latest checkpoint on them, without starting a process."""
        if (
            not isinstance(failure, NodeLostError)
            or group.closed
            or group.backend is not None
            or group.pool is not None
            or group.placement is None
            or not group.placement.owned
        ):
            return False
        alive = await self.cluster.live_nodes()
        if alive is None:
            return False
        keep = [w for w in group.workers if w.metadata.node_id in alive]
        if len(keep) < self.minimum or len(keep) == len(group.workers):
            return False
        if not await group.stop_functions(keep, self.config.stop_timeout_s):
            return False
        # The kept workers stay in rank order (grouped by node, the driver's first): only their
        # ranks and the world's size change.
        config = replace(group.config, num_workers=len(keep))
        await shrink(group, config, keep, worker_contexts(config, [w.metadata for w in keep]))
        return True
