"""The seam between the driver and wherever its workers live.

Everything the driver does to workers goes through a :class:`Cluster` and the :class:`Handle` of
each worker, as anyio's code goes through its backends and httpx's through its transports:
start or join the cluster, reserve bundles (a placement), start workers in them, call a worker's
methods, kill workers, see a worker's death (a pending call that fails when its process dies), the
node table (and which nodes are being drained, as before a preemption), workers' stacks, and the
mapping of the cluster's errors to asyncexec's.

Two implementations: :class:`~.._ray.RayCluster` (Ray actors, the real thing) and
:class:`~.._local.LocalCluster` (threads of the driver's process: local mode). Nothing above this
package imports Ray or knows which one it talks to.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Collection, Generator, Mapping, Sequence
from typing import Any, NamedTuple, Protocol

import anyio

from ..._wire._interface import WorkerMethod
from ..._wire._protocol import WorkerMetadata
from .._config import ExecutorConfig
from .._taskgroups import task_group
from ._placement import Placement

__all__ = ["Cluster", "Handle", "PendingResult", "Spawned", "awaited", "described", "settle"]


class PendingResult(Protocol):
    """A call's result as a handle returns it, the cluster's own (a Ray call's ``Result``, a
    local worker's, a simulated worker's answer): awaitable any number of times, failing with
    the cluster's errors (``_calls.Call`` maps them); a cancelled wait leaves the call going.

    It has no ``cancel()`` of its own: the handle that made it cancels it
    (:meth:`Handle.cancel`), which knows how (a local or simulated worker's call is cancelled
    on that worker's loop, through its table of tasks). Every pending call above the seam (the
    mapped ``_calls.Call``, a group's ``ObservedCall``) has ``cancel()``, which goes there."""

    def __await__(self) -> Generator[Any, None, Any]: ...

    def loop_future(self) -> asyncio.Future[Any] | None:
        """A new future of the running loop settled as the call ends, where the cluster
        settles one without a task (Ray's completion callbacks), else None."""
        ...


class Handle(Protocol):
    """One worker as the driver calls it."""

    @property
    def key(self) -> str:
        """A stable id of the worker (of its process), the same for every handle to it."""
        ...

    def call(self, method: WorkerMethod, /, *args: Any, **kwargs: Any) -> PendingResult:
        """Call the worker's ``method`` (see ``asyncexec._worker._actor``); the result is awaited
        (arguments that are references of :meth:`Cluster.put` or :meth:`call_n` arrive
        resolved). Its failures are the cluster's own: called inside the seam only (above it,
        through the typed proxy of ``_proxy``, whose calls raise asyncexec's errors)."""
        ...

    def call_n(self, method: WorkerMethod, n: int, /, *args: Any) -> list[Any]:
        """Call ``method``, which returns ``n`` values, and return a reference to each: awaited,
        or passed to other workers' calls, which receive the value without it passing through
        the driver."""
        ...

    def cancel(self, ref: Any) -> None:
        """Ask the worker to cancel the call whose pending result is ``ref`` (what :meth:`call`
        returned): an ``async def`` running on the worker's loop is cancelled there (it sees
        ``CancelledError``), and ``ref`` then fails once the cancellation has landed; a call
        not started yet is dropped. Meant for ``async def`` calls only: a plain method in a
        thread cannot be cancelled. Returns at once; never raises (a call that has ended, or a
        dead worker, ignores it)."""
        ...


class Spawned(NamedTuple):
    """A worker being started: its handle, and its description to await."""

    handle: Handle
    described: Any


class Cluster(Protocol):
    """Where a driver's workers live. Every member is a coroutine that never blocks the event
    loop: what blocks (Ray's placement groups, actor creation, node table) runs in a thread
    inside the implementation, as anyio's backends and httpcore's keep their threads.

    Bounds. The driver awaits some members shielded (what they make must be known to be
    released; a teardown must finish), so each ends within a bound of its own, and a shield
    around it is bounded by the seam (``# bounded by the seam``, which the structure test
    reads): the look-ups (``node_alive``, ``free_nodes``, ``live_nodes``, ``available``,
    ``draining``, ``preempted``) by their own timeout, their threads abandoned at it; ``kill``
    by ``patience_s`` and ``timeout_s`` (a kill without them waits for nothing but its
    requests); ``place``, ``spawn`` and ``release`` are requests to the cluster (Ray's GCS) in a
    thread that a deadline would not cut, bounded by the cluster's own handling of them. A
    worker's call is not bounded: whoever awaits it gives it a deadline."""

    async def connect(self, address: str | None) -> None:
        """Start a cluster, or join the one at ``address``, unless this process already has one."""
        ...

    async def driver_node(self) -> str | None:
        """The node of this process (its workers rank first), or None."""
        ...

    async def parent(self) -> Any:
        """The placement group that captures this task's children (a Ray task running an
        executor), else None. Reads a thread-local: await it on the executor's loop."""
        ...

    async def place(
        self, bundles: list[dict[str, float]], strategy: str, parent: Any, log: Any
    ) -> Placement | None:
        """Reserve ``bundles`` (or use ``parent``). Once it returns, the reservation is made:
        await it shielded, so that what is made is known to be released.

        Raises:
            PlacementInfeasibleError: they can never fit, and the cluster cannot grow.
        """
        ...

    async def wait_placed(self, placement: Placement | None, timeout_s: float) -> None:
        """Wait until the reservation is placed.

        Raises:
            PlacementTimeoutError: not within ``timeout_s``.
        """
        ...

    async def release(self, placement: Placement | None) -> None:
        """Give a reservation back (idempotent; not one this process did not make)."""
        ...

    async def bundle_nodes(self, placement: Placement) -> list[str]:
        """Each bundle's node, by bundle index."""
        ...

    async def spawn(
        self, config: ExecutorConfig, placement: Placement | None, bundles: Sequence[int | None]
    ) -> list[Spawned]:
        """Create a worker in each of ``bundles`` and ask each to describe itself, without
        waiting (see :func:`described`). Await it shielded: the workers made must be known to
        be killed.

        Raises:
            ConfigurationError: the cluster refused the worker options.
        """
        ...

    async def start_workers(
        self,
        config: ExecutorConfig,
        placement: Placement | None,
        bundles: Sequence[int | None],
        timeout_s: float,
        *,
        track: list[Handle] | None = None,
    ) -> list[tuple[Handle, WorkerMetadata]]:
        """Start a worker in each of ``bundles`` of ``placement`` (None: anywhere in it) and
        return each with its description, all within ``timeout_s``. When that fails, times out
        or is cancelled, they are killed: nothing half-started is left. ``track`` holds the
        handles while they start (an owner that closes meanwhile kills them too).

        Raises:
            ConfigurationError: the cluster refused the worker options.
            TimeoutError: not every worker described itself in time.
        """
        ...

    async def kill(
        self,
        handles: Sequence[Handle],
        placement: Placement | None = None,
        deaths: Sequence[Any] = (),
        timeout_s: float = 0.0,
        *,
        patience_s: float = 0.0,
    ) -> None:
        """Let the workers exit gracefully for up to ``patience_s`` (none when 0): each is
        closed (its pending ``wait_closed`` calls end), then left to exit the cluster's own way
        (a Ray actor's ``__ray_terminate__``); then kill them and
        give ``placement`` back (shielded, off the loop, also when the graceful wait is
        cancelled), then wait, up to ``timeout_s``, until each pending death call of ``deaths``
        has failed (the processes are gone). A failure to kill is logged, never raised."""
        ...

    async def node_alive(self, node_id: str | None) -> bool:
        """Whether ``node_id`` is alive in the node table (True when it cannot tell in time)."""
        ...

    async def free_nodes(
        self, bundle: Mapping[str, float], placement: Placement | None, held: Mapping[str, int]
    ) -> list[dict[str, float]] | None:
        """Each live node's available resources, with the bundles ``held`` per node (or, for
        ``placement``'s own reservation, as placed) counted as free; None when the cluster did
        not answer in time."""
        ...

    async def available(self) -> dict[str, float] | None:
        """The cluster's available resources now, for error messages (None when it cannot tell
        in time; never raises)."""
        ...

    async def live_nodes(self) -> set[str] | None:
        """The ids of the live nodes; None when the cluster did not answer in time, or failed
        to (never raises)."""
        ...

    async def draining(self) -> dict[str, float | None] | None:
        """The nodes marked to leave the cluster (drained: a spot or preemptible node announced
        before it goes), each with its deadline in seconds since the epoch (None: the cluster
        gave none); {} when none is; None when the cluster did not answer in time. One cheap
        look-up, off the loop."""
        ...

    async def preempted(self, node_ids: Collection[str]) -> set[str]:
        """Those of ``node_ids`` that left the cluster because they were drained for a
        preemption (the node table's cause of death); empty when it cannot tell in time."""
        ...

    async def stacks(self, workers: Sequence[tuple[int, Handle, WorkerMetadata]]) -> dict[int, str]:
        """Each worker's threads' stacks by rank (a note where one could not be taken), read from
        outside the processes, within a bound. Never raises."""
        ...

    async def put(self, value: Any) -> Any:
        """``value`` where every worker can read it (a reference), put once, off the loop."""
        ...

    async def data_context(self) -> Any:
        """The driver's data-processing context to give the workers (Ray Data's), or None."""
        ...


async def described(
    cluster: Cluster,
    spawned: Sequence[Spawned],
    timeout_s: float,
    track: list[Handle] | None = None,
) -> list[tuple[Handle, WorkerMetadata]]:
    """Await the descriptions of ``spawned`` workers within ``timeout_s``; kill them all when
    that fails, times out or is cancelled. ``track`` holds their handles meanwhile."""
    handles = [s.handle for s in spawned]
    if track is not None:
        track.extend(handles)
    try:
        with anyio.fail_after(timeout_s):
            metas: list[WorkerMetadata] = await awaited([s.described for s in spawned])
    except BaseException:
        # bounded by the seam: a kill without patience or deaths (see Cluster's bounds)
        with anyio.CancelScope(shield=True):
            await cluster.kill(handles)
        raise
    finally:
        if track is not None:
            for handle in handles:
                track.remove(handle)
    return list(zip(handles, metas, strict=True))


async def awaited(refs: Sequence[Any]) -> list[Any]:
    """Every ref's value, awaited at once; the first failure raised."""
    results: list[Any] = [None] * len(refs)

    async def one(i: int) -> None:
        results[i] = await refs[i]

    async with task_group() as tg:
        for i in range(len(refs)):
            tg.start_soon(one, i)
    return results


async def settle(refs: Sequence[Any]) -> None:
    """Await every ref, ignoring how each ends."""

    async def one(ref: Any) -> None:
        with contextlib.suppress(Exception):
            await ref

    async with task_group() as tg:
        for ref in refs:
            tg.start_soon(one, ref)
