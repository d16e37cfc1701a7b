"""Executors on simulated workers by default, for a block: :func:`simulated`, a convenience over
handing the cluster in (``Executor(..., cluster=SimCluster())``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from .._driver.cluster import DEFAULT_CLUSTER, SimCluster

__all__ = ["simulated"]


@contextlib.contextmanager
def simulated(cluster: SimCluster | None = None) -> Iterator[SimCluster]:
    """Executors and pools made inside without a cluster of their own put their workers on
    ``cluster`` (a fresh :class:`SimCluster` when None), whatever their ``local`` says. Ray is
    never started. Yields the cluster. A ``Reservation`` made inside is refused (it is Ray's
    placement group: a simulated cluster places no bundles).

    A thin convenience over handing the cluster in, which says the same thing where the object
    is made and needs no block::

        cluster = SimCluster(SimLoad(reports=5))
        async with asyncexec.Executor(4, cluster=cluster) as executor:
            ...

    The block sets the context's default cluster (a ``contextvars.ContextVar``, so a task
    started inside sees it, and other tasks and threads do not); an object handed a cluster,
    or made on a pool or reservation, keeps that one. ::

        with asyncexec.testing.simulated(SimCluster(SimLoad(reports=5))) as cluster:
            async with asyncexec.Executor(4) as executor:
                async for step in executor.run(train):   # 5 steps of simulated reports
                    ...

    The cluster is picked when an executor is made: it keeps it after the block. Nested
    blocks put the executors made in the inner one on the inner cluster.
    """
    cluster = cluster if cluster is not None else SimCluster()
    token = DEFAULT_CLUSTER.set(cluster)
    try:
        yield cluster
    finally:
        DEFAULT_CLUSTER.reset(token)
