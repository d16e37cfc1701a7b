"""The seam's Ray implementation: workers are Ray actors in placement groups: the async
``WorkerActor``, or the threaded ``ThreadedWorkerActor`` for a group whose roles have only plain
methods (Ray's own rule for a sync actor, made per group: :func:`worker_class`).

Ray's calls that block (creating actors: the first of a class exports it; creating and removing
placement groups; the node table; ``ray.put``) run in threads, never on the event loop; calls on
actors return ``ObjectRef``s, which are awaited.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import weakref
from collections import Counter
from collections.abc import Collection, Generator, Mapping, Sequence
from typing import Any

import anyio
import ray
from ray._raylet import NodeID, ObjectRef
from ray.actor import ActorHandle
from ray.core.generated.common_pb2 import NodeDeathInfo
from ray.exceptions import RayError, RayTaskError

from ..._dispatch._role import plain_only
from ..._errors import ConfigurationError, describe
from ..._logging import get_logger
from ..._wire._interface import WorkerMethod, packed, parse_key
from ..._wire._protocol import WorkerMetadata
from ..._wire._tracing import plain
from ..._worker import ROLE_GROUPS, ThreadedWorkerActor, WorkerActor, role_group
from .._config import ExecutorConfig
from ._base import Handle, Spawned, described, settle
from ._liveness import Liveness
from ._placement import (
    Placement,
    create_placement,
    current_parent,
    wait_placement_ready,
)
from ._stacks import dump_processes
from ._start import ensure_ray

__all__ = [
    "CREATING",
    "LIVENESS",
    "RayCluster",
    "RayHandle",
    "Result",
    "SharedResult",
    "actor_options",
    "node_alive",
    "worker_class",
]

#: Held while worker actors are created, by every thread of the process: Ray checks whether the
#: actor class is exported without a lock, so executors starting at once each exported it again
#: (each holding the GIL, stalling the event loop in the first round of a service).
CREATING = threading.Lock()
#: How long a look-up in Ray's node table may take before it counts as unknown.
LOOKUP_TIMEOUT_S = 5.0
#: Where the failures of teardown calls are logged (they never raise: teardown goes on).
_log = get_logger(component="cluster")
#: The node table's cause of death of a node that a preemption drain took.
_PREEMPTED = NodeDeathInfo.Reason.Value("AUTOSCALER_DRAIN_PREEMPTED")


class Result:
    """A call's ``ObjectRef``, awaitable (as often as the reference is) through one asyncio
    future that Ray's completion callback settles on the loop. Awaiting the ``ObjectRef``
    itself goes through a ``concurrent.futures.Future`` chained to an asyncio one: more of the
    event loop a call, and one wake-up of the loop per call (see :class:`_Settler`). It raises
    what awaiting the reference raises."""

    __slots__ = ("ref",)

    def __init__(self, ref: ObjectRef) -> None:
        self.ref = ref

    def __await__(self) -> Generator[Any, None, Any]:
        return (yield from self.loop_future())

    def loop_future(self) -> asyncio.Future[Any]:
        """A new future of the running loop, settled as the call ends (with what awaiting the
        reference gives or raises); cancelling it stops nothing but this wait."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        settler = _settler(loop)
        ref = self.ref

        def completed(result: Any) -> None:  # on a thread of Ray's; holds the reference
            settler.add(future, result, ref)

        ref._on_completed(completed)
        return future


class SharedResult(Result):
    """A :class:`Result` awaited many times over a long life: a worker's death call, which every
    group and every lease that holds the worker awaits (a pool's worker: one wait a lease). Its
    waits on one loop share one completion callback of Ray's, and a wait that is cancelled
    leaves nothing behind. (Each wait of a plain ``Result`` registers a callback that Ray keeps,
    with the wait's future, until the call ends: for a death call, until the worker dies, so a
    pool's worker gathered one a lease.)"""

    __slots__ = ("_shared",)

    def __init__(self, ref: ObjectRef) -> None:
        super().__init__(ref)
        #: The one future a loop's waits share, settled by Ray's callback.
        self._shared: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Future[Any]]
        self._shared = weakref.WeakKeyDictionary()

    def loop_future(self) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        shared = self._shared.get(loop)
        if shared is None:
            shared = self._shared[loop] = super().loop_future()
        mine = loop.create_future()

        def relay(done: asyncio.Future[Any]) -> None:
            if mine.done():
                return
            if done.cancelled():
                mine.cancel()
            elif (error := done.exception()) is not None:
                mine.set_exception(error)
            else:
                mine.set_result(done.result())

        shared.add_done_callback(relay)
        mine.add_done_callback(lambda _: shared.remove_done_callback(relay))
        return mine


class _Settler:
    """Settles one event loop's call futures from Ray's completion callbacks, in batches: the
    first completion after the loop took the last batch wakes it (``call_soon_threadsafe``: a
    write to its self-pipe, a turn of the loop); those that come before that turn runs go with
    it. With many calls in flight a turn settles several, where one wake-up each cost a
    syscall on Ray's thread and a turn of the loop per call."""

    __slots__ = ("_lock", "_loop", "_pending", "_woken")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Future[Any], Any, ObjectRef]] = []
        self._woken = False

    def add(self, future: asyncio.Future[Any], result: Any, ref: ObjectRef) -> None:
        """On Ray's thread: settle ``future`` with ``result`` (the reference ``ref`` goes with
        it, so that it is dropped on the loop)."""
        with self._lock:
            self._pending.append((future, result, ref))
            if self._woken:
                return
            self._woken = True
        loop = self._loop()
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._settle_all)

    def _settle_all(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
            self._woken = False
        for future, result, _ in pending:
            _settle(future, result)


#: Each event loop's settler (held weakly by its loop), and the one used last.
_SETTLERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Settler] = (
    weakref.WeakKeyDictionary()
)
_last: tuple[Any, _Settler] | None = None


def _settler(loop: asyncio.AbstractEventLoop) -> _Settler:
    """``loop``'s settler (made on first use)."""
    global _last
    last = _last
    if last is not None and last[0]() is loop:
        return last[1]
    settler = _SETTLERS.get(loop)
    if settler is None:
        settler = _SETTLERS[loop] = _Settler(loop)
    _last = (weakref.ref(loop), settler)
    return settler


def _settle(future: asyncio.Future[Any], result: Any) -> None:
    """Settle ``future`` with what Ray gave a reference's callback (as ``ObjectRef.future``
    does: a task's error as its cause's type), unless its waiter was cancelled."""
    if future.done():
        return
    if isinstance(result, RayTaskError):
        future.set_exception(result.as_instanceof_cause())
    elif isinstance(result, RayError):
        future.set_exception(result)
    else:
        future.set_result(result)


class RayHandle:
    """A worker that is a Ray actor."""

    __slots__ = ("_method", "_plain", "_returning", "actor", "key")

    def __init__(self, actor: ActorHandle) -> None:
        self.actor = actor
        self.key: str = actor._actor_id.hex()
        #: ``call_method_sync`` in the concurrency group of each method key's role (or
        #: ``call_method``, for a role past the groups), made on first use.
        self._plain: dict[str, Any] = {}
        #: ``call_method`` (Ray makes a method's handle again on each look-up).
        self._method: Any = actor.call_method
        #: A method with ``num_returns`` set, by (method, n) (``options()`` checks and copies
        #: the method's options on each call, on a weight push's path).
        self._returning: dict[tuple[str, int], Any] = {}

    def __repr__(self) -> str:
        return f"<RayHandle {self.key[:12]}>"

    def call(self, method: WorkerMethod, /, *args: Any, **kwargs: Any) -> Result:
        """Call the actor's ``method``; its result, awaitable (a :class:`Result`; the death
        call's, awaited once a group or a lease over the worker's life, a :class:`SharedResult`)."""
        ref = self._submit(method, *args, **kwargs)
        return SharedResult(ref) if method == "wait_closed" else Result(ref)

    def _submit(self, method: WorkerMethod, /, *args: Any, **kwargs: Any) -> ObjectRef:
        """The call's ``ObjectRef``. A role method's key and positional arguments go as one
        argument (``_interface.packed``: Ray serialises each argument of a call apart, on both
        sides) unless there are keyword arguments or an ``ObjectRef`` among them (a scattered
        part: Ray resolves only those at the top)."""
        if method == "call_method_sync":  # a plain method, one call at a time
            key = plain(args[0])  # (without a call's trace context)
            remote = (self._plain.get(key) or self._plain_method(key)).remote
        elif method == "call_method":
            remote = self._method.remote
        else:
            return getattr(self.actor, method).remote(*args, **kwargs)
        if kwargs:
            return remote(*args, **kwargs)
        for arg in args:
            if isinstance(arg, ObjectRef):
                return remote(*args)
        return remote(packed(args))

    def _plain_method(self, key: str) -> Any:
        """``call_method_sync`` in the concurrency group of method key ``key``'s role (Ray runs
        its calls one at a time on a thread of their own, beside the actor's loop);
        ``call_method`` for a role past the groups (the same calls, through a thread of the
        actor's loop)."""
        try:
            role_index = parse_key(key)[0]
        except (TypeError, ValueError):  # the worker says what is wrong with it
            role_index = -1
        if 0 <= role_index < ROLE_GROUPS:
            group = role_group(role_index)
            found = self.actor.call_method_sync.options(concurrency_group=group)
        else:
            found = self.actor.call_method
        if len(self._plain) < 1024:  # a role has a few methods
            self._plain[key] = found
        return found

    def call_n(self, method: WorkerMethod, n: int, /, *args: Any) -> list[Any]:
        found = self._returning.get((method, n))
        if found is None:
            found = self._returning[method, n] = getattr(self.actor, method).options(num_returns=n)
        refs: list[Any] = found.remote(*args)
        return refs

    def cancel(self, ref: Any) -> None:
        """``ray.cancel(ref)``: Ray cancels an async actor's task on the actor's loop (its
        coroutine sees ``CancelledError``) and fails ``ref`` with ``TaskCancelledError`` once
        it has ended. It sends the request and returns, like submitting a call."""
        try:
            ray.cancel(ref.ref if isinstance(ref, Result) else ref)
        except Exception as exc:  # an ended call, a dead actor: nothing to cancel
            _log.debug("cancel_failed", actor=repr(self), error=describe(exc))


def _terminate(handle: Handle) -> Result:
    """Ray's graceful exit of ``handle``'s actor."""
    assert isinstance(handle, RayHandle)
    return Result(handle.actor.__ray_terminate__.remote())


def actor_options(config: ExecutorConfig) -> dict[str, Any]:
    """Ray actor options for one worker of ``config``."""
    resources = dict(config.resources_per_worker)
    options: dict[str, Any] = {
        "num_cpus": resources.pop("CPU", 0),
        "num_gpus": resources.pop("GPU", 0),
        "resources": resources,
    }
    memory = resources.pop("memory", 0)
    if memory:
        options["memory"] = memory
    if config.runtime_env is not None:
        options["runtime_env"] = dict(config.runtime_env)
    return options


def worker_class(config: ExecutorConfig) -> Any:
    """The actor class of ``config``'s workers: the threaded one when the group has roles and
    none has a coroutine method (its plain calls then cost what a sync Ray actor's do), else
    the async one (a pool's workers exist before roles are known: async)."""
    return ThreadedWorkerActor if plain_only(config.roles) else WorkerActor


class RayCluster:
    """Workers as Ray actors (see the module's docstring). A process has one Ray: every
    ``RayCluster`` is the same cluster (equal)."""

    def __repr__(self) -> str:
        return "<Ray's cluster>"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, RayCluster)

    def __hash__(self) -> int:
        return hash(RayCluster)

    async def connect(self, address: str | None) -> None:
        await ensure_ray(address)

    async def driver_node(self) -> str | None:
        node: str = ray.get_runtime_context().get_node_id()
        return node

    async def parent(self) -> Any:
        return current_parent()  # a thread-local: read on the loop's thread

    async def place(
        self, bundles: list[dict[str, float]], strategy: str, parent: Any, log: Any
    ) -> Placement:
        # bounded by Ray: requests to the GCS, in a thread that a deadline would not cut
        with anyio.CancelScope(shield=True):  # once made, it is returned (to be released)
            made = await anyio.to_thread.run_sync(create_placement, bundles, strategy, parent, log)
        return made

    async def wait_placed(self, placement: Placement | None, timeout_s: float) -> None:
        if placement is not None:
            await wait_placement_ready(placement, timeout_s, self.available)

    async def release(self, placement: Placement | None) -> None:
        if placement is not None:
            # bounded by Ray: one request to the GCS, in a thread that a deadline would not cut
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(placement.remove)

    async def bundle_nodes(self, placement: Placement) -> list[str]:
        return await anyio.to_thread.run_sync(_bundle_nodes, placement)

    # Workers ----------------------------------------------------------------------------------

    async def spawn(
        self, config: ExecutorConfig, placement: Placement | None, bundles: Sequence[int | None]
    ) -> list[Spawned]:
        """Create a worker in each of ``bundles`` and ask each to describe itself, without
        waiting, in a thread (the first actor of a class in a process exports it synchronously,
        and the first call on an actor that is still being created waits for its handle).
        Shielded: the workers made are returned, to be killed.

        Raises:
            ConfigurationError: Ray refused the options (a resource amount below its precision,
                a fractional amount of a whole-unit accelerator, a runtime_env it cannot read).
        """
        # bounded by Ray: requests to the GCS, in a thread that a deadline would not cut
        with anyio.CancelScope(shield=True):
            made = await anyio.to_thread.run_sync(_spawn, config, placement, bundles)
        return made

    async def start_workers(
        self,
        config: ExecutorConfig,
        placement: Placement | None,
        bundles: Sequence[int | None],
        timeout_s: float,
        *,
        track: list[Handle] | None = None,
    ) -> list[tuple[Handle, WorkerMetadata]]:
        return await described(self, await self.spawn(config, placement, bundles), timeout_s, track)

    async def kill(
        self,
        handles: Sequence[Handle],
        placement: Placement | None = None,
        deaths: Sequence[Any] = (),
        timeout_s: float = 0.0,
        *,
        patience_s: float = 0.0,
    ) -> None:
        """See ``Cluster.kill``. The graceful exit: each worker's ``close`` (Ray's exit of an
        async actor with a call pending stalls until it is killed), then Ray's own
        (``__ray_terminate__``: the process ends after the calls before it, its exit handlers
        run); a cancelled wait for it goes on to the kill, and the cancellation is raised
        after."""

        def kill() -> None:
            for handle in handles:
                try:  # a dead actor is killed without complaint: an error here is news
                    ray.kill(handle.actor, no_restart=True)  # type: ignore[attr-defined]
                except Exception as exc:
                    _log.warning("kill_failed", actor=repr(handle), error=describe(exc))
            if placement is not None:
                try:
                    placement.remove()
                except Exception as exc:
                    _log.warning("placement_remove_failed", error=describe(exc))

        try:
            if patience_s > 0 and handles:
                with anyio.move_on_after(patience_s):
                    await settle([h.call("close") for h in handles])  # (ends wait_closed calls)
                    await settle([_terminate(h) for h in handles])
        finally:
            # bounded: kill requests in a thread (as above), the deaths' wait by timeout_s
            with anyio.CancelScope(shield=True):
                await anyio.to_thread.run_sync(kill)
                if deaths:
                    with anyio.move_on_after(timeout_s):
                        await settle(deaths)

    # The node table ---------------------------------------------------------------------------

    async def node_alive(self, node_id: str | None) -> bool:
        return await node_alive(node_id)

    async def available(self) -> dict[str, float] | None:
        with anyio.move_on_after(LOOKUP_TIMEOUT_S):
            try:
                found: dict[str, float] = await anyio.to_thread.run_sync(
                    ray.available_resources, abandon_on_cancel=True
                )
            except Exception:  # the GCS did not answer (an error message says "unknown")
                return None
            return found
        return None

    async def live_nodes(self) -> set[str] | None:
        with anyio.move_on_after(LOOKUP_TIMEOUT_S):
            try:
                return await anyio.to_thread.run_sync(_alive, abandon_on_cancel=True)
            except Exception:  # the GCS did not answer (its callers go on without an answer)
                return None
        return None

    async def free_nodes(
        self, bundle: Mapping[str, float], placement: Placement | None, held: Mapping[str, int]
    ) -> list[dict[str, float]] | None:
        with anyio.move_on_after(LOOKUP_TIMEOUT_S):
            return await anyio.to_thread.run_sync(
                _free_now, bundle, placement, held, abandon_on_cancel=True
            )
        return None

    async def draining(self) -> dict[str, float | None] | None:
        with anyio.move_on_after(LOOKUP_TIMEOUT_S):
            return await anyio.to_thread.run_sync(_draining, abandon_on_cancel=True)
        return None

    async def preempted(self, node_ids: Collection[str]) -> set[str]:
        with anyio.move_on_after(LOOKUP_TIMEOUT_S):
            return await anyio.to_thread.run_sync(_preempted, set(node_ids), abandon_on_cancel=True)
        return set()

    async def stacks(self, workers: Sequence[tuple[int, Handle, WorkerMetadata]]) -> dict[int, str]:
        ordered = sorted(workers, key=lambda w: w[0])
        texts = await dump_processes([(m.node_id, m.pid) for _, _, m in ordered])
        return {rank: text for (rank, _, _), text in zip(ordered, texts, strict=True)}

    async def put(self, value: Any) -> Any:
        return await anyio.to_thread.run_sync(ray.put, value)

    async def data_context(self) -> Any:
        """The driver's Ray Data context, when the driver uses Ray Data (never imported
        otherwise: it is heavy, and workers that do not need it must not pay for it)."""
        import sys

        if "ray.data" not in sys.modules:
            return None
        from ray.data import DataContext

        return DataContext.get_current()


def _spawn(
    config: ExecutorConfig, placement: Placement | None, bundles: Sequence[int | None]
) -> list[Spawned]:
    """:meth:`RayCluster.spawn`'s work (blocking)."""
    options = actor_options(config)
    cls = worker_class(config)
    actors: list[ActorHandle] = []
    try:
        with CREATING:
            for bundle in bundles:
                strategy = {}
                if placement is not None:  # its bundle (any bundle of a parent's, or None)
                    strategy = {"scheduling_strategy": placement.strategy(bundle)}
                actors.append(cls.options(**options, **strategy).remote())
    except Exception as exc:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        raise ConfigurationError(f"Ray refused the worker options: {describe(exc)}") from exc
    return [Spawned(RayHandle(a), a.describe.remote()) for a in actors]


def _bundle_nodes(placement: Placement) -> list[str]:
    table = ray.util.placement_group_table(placement.group)
    by_index = table["bundles_to_node_id"]
    return [by_index[i] for i in range(len(table["bundles"]))]


def _check_alive(node_id: str, timeout_s: float) -> bool:
    """Whether the node table holds ``node_id`` as alive: one GCS call about that node alone,
    with its own timeout. Blocking. An id that is not a
    node's can be in no table: not alive."""
    try:
        node = NodeID(bytes.fromhex(node_id))
    except ValueError:
        return False
    gcs = ray._private.worker.global_worker.gcs_client
    [alive] = gcs.check_alive([node], timeout=timeout_s)
    return bool(alive)


#: The liveness of the Ray cluster's nodes, asked by every failed call of this process (a
#: process joins one Ray cluster): one look-up at a time per node, shared by the askers meanwhile.
LIVENESS = Liveness(_check_alive, LOOKUP_TIMEOUT_S)


async def node_alive(node_id: str | None) -> bool:
    """Whether Ray's node table holds ``node_id`` as alive (True when it cannot tell in time),
    through :data:`LIVENESS`."""
    return await LIVENESS.alive(node_id)


def _alive() -> set[str]:
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


def _draining() -> dict[str, float | None]:
    """Ray's draining nodes (``DrainNode``, which an autoscaler or a cloud's preemption notice
    sends the GCS), read with the driver's own GCS client (its address and its auth): each
    deadline in seconds since the epoch, None for Ray's 0 (no deadline). Blocking: one GCS call.
    A node leaves the list once it is dead."""
    gcs = ray._private.worker.global_worker.gcs_client
    found: dict[str, int] = gcs.get_draining_nodes(timeout=LOOKUP_TIMEOUT_S)
    return {node: (ms / 1000 if ms > 0 else None) for node, ms in found.items()}


def _preempted(node_ids: set[str]) -> set[str]:
    """Those of ``node_ids`` that Ray's node table holds as dead because a preemption drain
    took them (what sets a dead actor's ``ActorDiedError.preempted``). Blocking."""
    return {
        n["NodeID"]
        for n in ray.nodes()
        if n["NodeID"] in node_ids and not n.get("Alive") and n.get("DeathReason") == _PREEMPTED
    }


def _free_now(
    bundle: Mapping[str, float], placement: Placement | None, held: Mapping[str, int]
) -> list[dict[str, float]]:
    """Each live node's available resources, with the bundles held counted as free. Blocking
    (GCS calls). A node Ray has marked dead is left out (its available resources linger for a
    moment after), and so is a draining one (Ray gives it no new work). A placement group of
    the caller's own counts its bundles as Ray placed them (after a lost node, Ray places the
    lost bundles again, on a node added later, say)."""
    if placement is not None and placement.owned and not placement.removed:
        table = ray.util.placement_group_table(placement.group)
        held = dict(Counter(table.get("bundles_to_node_id", {}).values()))
    alive = _alive()
    draining = _draining()
    available = ray._private.state.available_resources_per_node()
    nodes: list[dict[str, float]] = []
    for node_id, resources in available.items():
        if node_id not in alive or node_id in draining:
            continue
        free = {k: float(v) for k, v in resources.items()}
        for key, amount in bundle.items():
            free[key] = free.get(key, 0.0) + amount * held.get(node_id, 0)
        nodes.append(free)
    return nodes
