"""Executors on simulated workers by default, for a block: :func:`simulated`, a convenience over
handing the cluster in (``Executor(..., cluster=SimCluster())``)."""

from __future__ import annotations

import contextvars
import functools
import inspect
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

from .._driver.cluster import DEFAULT_CLUSTER, SimCluster

__all__ = ["simulated"]


F = TypeVar("F", bound=Callable[..., Any])


def simulated(cluster: SimCluster | None = None) -> Simulated:
    """Executors and pools made inside without a cluster of their own put their workers on
    ``cluster`` (a fresh :class:`SimCluster` when None), whatever their ``local`` says. Ray is
    never started. Entered, it gives the cluster. A ``Reservation`` made inside is refused
    (it is Ray's placement group: a simulated cluster places no bundles).

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
    blocks put the executors made in the inner one on the inner cluster. As a decorator
    (``@simulated()``), it runs each call of the function in a block of its own, an ``async
    def`` test's coroutine too. ::

        @simulated()
        async def test_mean_per_step():
            async with asyncexec.Executor(4) as executor:   # on a fresh SimCluster
                ...
    """
    return Simulated(cluster)


class Simulated:
    """A :func:`simulated` block: a context manager that yields its cluster, and a decorator
    that runs each call of a function (an ``async def`` one's coroutine too) in a block of its
    own (a fresh cluster each, unless one was given)."""

    def __init__(self, cluster: SimCluster | None) -> None:
        self._given = cluster
        self._token: contextvars.Token[Any] | None = None

    def __enter__(self) -> SimCluster:
        if self._token is not None:
            raise RuntimeError("a simulated() block is entered once (make another)")
        cluster = self._given if self._given is not None else SimCluster()
        self._token = DEFAULT_CLUSTER.set(cluster)
        return cluster

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        token, self._token = self._token, None
        if token is not None:
            DEFAULT_CLUSTER.reset(token)

    def __call__(self, fn: F) -> F:
        given = self._given
        if inspect.iscoroutinefunction(fn):  # the block around the coroutine's run, not its making

            @functools.wraps(fn)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                with Simulated(given):
                    return await fn(*args, **kwargs)

            return run_async  # type: ignore[return-value]

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            with Simulated(given):
                return fn(*args, **kwargs)

        return run  # type: ignore[return-value]
