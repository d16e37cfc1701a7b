"""Executors on simulated workers: :func:`simulated`, over the seam's simulated cluster
(``asyncexec._driver.cluster._sim``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .._driver.cluster import SimCluster
from .._driver.cluster import simulated as _in_force

__all__ = ["simulated"]


@contextlib.contextmanager
def simulated(cluster: SimCluster | None = None) -> Iterator[SimCluster]:
    """Executors made inside put their workers on ``cluster`` (a fresh :class:`SimCluster` when
    None), whatever their ``local`` says; the pools and reservations made inside too. Ray is
    never started. Yields the cluster.

    ::

        with asyncexec.testing.simulated(SimCluster(SimLoad(reports=5))) as cluster:
            async with asyncexec.Executor(4) as executor:
                async for step in executor.run(train):   # 5 steps of simulated reports
                    ...

    The cluster is picked when an executor is made: it keeps it after the block. Nested
    blocks put the executors made in the inner one on the inner cluster.
    """
    cluster = cluster if cluster is not None else SimCluster()
    with _in_force(cluster):
        yield cluster
