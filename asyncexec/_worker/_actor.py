"""The actor that runs on each worker. The only place that defines it.

It is an async actor: its methods run on the actor's event loop, which stays free while the user's
function runs in a thread of its own (see ``_session``). A group whose roles have only plain
methods runs this same code on a threaded sync actor instead (``_threaded``). It imports nothing
heavy, so a worker process costs about what a plain Ray actor costs.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import os
import socket
import sys
import threading
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import ray

from .._wire._interface import WorkerInterface, as_outcome, method_key, unpacked
from .._wire._protocol import (
    Outcome,
    Poll,
    PreemptionNotice,
    RoleMethod,
    RunStart,
    WorkerContext,
    WorkerMetadata,
)
from .._wire._tracing import Carried, carried, split
from . import _channel, _outcomes, _place, _roles, _session

__all__ = ["ROLE_GROUPS", "WorkerActor", "WorkerCode", "in_ray_worker", "role_group"]


def in_ray_worker() -> bool:
    """Whether this process is a Ray worker (the package's root asks, to import the light worker
    side alone there). Ray connects a worker, which sets its mode, before the worker runs any
    code of the application (unpickling an actor class or a function is what imports asyncexec
    there); a process that has not imported Ray is not a worker."""
    ray_worker = sys.modules.get("ray._private.worker")
    if ray_worker is None:
        return False
    return bool(ray_worker.global_worker.mode == ray_worker.WORKER_MODE)


class _Worker:
    def __init__(self) -> None:
        # Set when the driver closes this worker: it ends the pending ``wait_closed`` calls.
        self._closed: asyncio.Event | None = None
        self._session: _session.Session | None = None
        # The environment the process started with (Ray's device variables included): a pooled
        # worker gets it back at the end of each lease.
        self._environ = dict(os.environ)

    def _closed_event(self) -> asyncio.Event:
        if self._closed is None:
            self._closed = asyncio.Event()
        return self._closed

    async def describe(self) -> WorkerMetadata:
        runtime = ray.get_runtime_context()
        ids = {k: tuple(v) for k, v in runtime.get_accelerator_ids().items() if v}
        return WorkerMetadata(
            node_id=runtime.get_node_id(),
            node_ip=ray.util.get_node_ip_address(),
            hostname=socket.gethostname(),
            pid=os.getpid(),
            accelerator_ids=ids,
        )

    async def setup(
        self,
        env: Mapping[str, str],
        context: WorkerContext,
        init_hook: Callable[[], object] | None,
        data_context: Any = None,
    ) -> Outcome:
        """Apply the environment (shared devices), install the context and the driver's Ray Data
        context, run the init hook."""
        # The user's function runs in a thread of its own, where ray.get is fine: Ray's warning
        # about blocking calls inside async actors does not apply.
        os.environ.setdefault("RAY_WARN_BLOCKING_GET_INSIDE_ASYNC", "0")
        os.environ.update(env)
        _place.set_group_context(context)
        if data_context is not None:
            from ray.data import DataContext

            DataContext._set_current(data_context)
        if init_hook is None:
            return Outcome("ok")
        return await _call(init_hook, (), {})

    async def execute(
        self, fn: Callable[..., Any] | Carried, /, *args: Any, **kwargs: Any
    ) -> Outcome:
        """Run ``fn``: an ``async def`` on this loop, a plain function in a thread. Arguments
        are passed as Ray passes them, so ``ObjectRef`` arguments arrive resolved."""
        if isinstance(fn, Carried):  # the function, with the call's trace context
            return await carried(fn.context, _call, fn.value, args, kwargs)
        return await _call(fn, args, kwargs)

    # Roles (see ``_roles``): the instances of the group's worker classes.

    async def make_roles(
        self,
        payload: bytes,
        checkpoint: Any = None,
        context: Callable[[], AbstractContextManager[Any]] | None = None,
    ) -> Outcome:
        """Make this worker's instances of its roles (dropping those it held), in role order,
        each ``__init__`` in a thread; call ``restore(checkpoint)`` after each when a checkpoint
        is given. ``payload`` is the roles pickled once for all ranks; ``context`` is the
        backend's function context, entered around the roles' code. A failure is an error
        outcome whose ``value`` is a ``RoleFailure``."""
        return await _roles.make(payload, checkpoint, context)

    async def call_method(
        self, key: str | Carried | list[Any], /, *args: Any, **kwargs: Any
    ) -> Any:
        """Call the method ``key`` (``_interface.method_key``: the role's index and the
        method's name in one argument) of this worker's instance of its role: an ``async def``
        on this loop, a plain method in a thread, as ``execute`` runs a function. Its value
        when it is of a bare type (``_interface.BARE_TYPES``: nothing wrapped or pickled here),
        else how it ended, as an outcome. Arguments are passed as Ray passes them, so
        ``ObjectRef`` arguments (the parts of a scattered argument) arrive resolved; the key
        and the arguments may come as one list (``_interface.packed``), and the key with the
        call's trace context (``_tracing.carry``)."""
        lead, args = unpacked(key, args)
        lead, context = split(lead)
        if context is not None:
            return await carried(context, _roles.call, lead, args, kwargs)
        return await _roles.call(lead, args, kwargs)

    async def call_method_sync(
        self, key: str | Carried | list[Any], /, *args: Any, **kwargs: Any
    ) -> Any:
        """Call the plain method ``key`` of this worker's instance of its role right here, with
        no hop to a thread: the driver sends this call to the role's own concurrency group
        (``ROLE_GROUPS``: a thread and event loop of Ray's, one call at a time), so the actor's
        loop stays free while the method runs, and the role's plain calls run one after another
        as ``call_method`` runs them under a limit of one. An ``async def`` found under that
        name runs on the group's loop. Answers as ``call_method`` does (its arguments too)."""
        lead, args = unpacked(key, args)
        lead, context = split(lead)
        if context is not None:
            return await carried(context, _roles.call_here, lead, args, kwargs)
        return await _roles.call_here(lead, args, kwargs)

    async def call_role(self, role_index: int, name: str, /, *args: Any, **kwargs: Any) -> Outcome:
        """``call_method`` of method ``name`` of role ``role_index``, answered as an outcome."""
        return as_outcome(await self.call_method(method_key(role_index, name), *args, **kwargs))

    async def start_run(self, payload: bytes, start: RunStart) -> None:
        """Start the run's function in its own thread and return at once; reports are taken
        with ``poll``. ``payload`` is the function and its config, pickled once for all ranks;
        a ``RoleMethod`` in place of the function is the method of this worker's instance.
        The payload is unpickled in a thread: a large config, or a function whose module
        imports slowly, would hold this loop (health checks, calls) meanwhile."""
        from ray import cloudpickle

        if self._session is not None and not self._session.finished:
            raise RuntimeError("a run is still in progress on this worker")
        fn, config = await asyncio.to_thread(cloudpickle.loads, payload)
        # (Asked again: another start_run may have started a run while this one unpickled.)
        if self._session is not None and not self._session.finished:
            raise RuntimeError("a run is still in progress on this worker")
        if self._session is not None:
            _session.end_session(self._session)
        if isinstance(fn, RoleMethod):
            fn = _roles.method(fn.role_index, fn.name)
        self._session = _session.Session(fn, config, start, asyncio.get_running_loop())
        self._session.start()

    async def poll(self, ack: int, max_items: int) -> Poll:
        if self._session is None:
            raise RuntimeError("poll() before start_run()")
        return await self._session.poll(ack, max_items)

    async def salvage(self) -> Poll | None:
        """What the last poll held, when Ray could not send it (see ``Session.salvage``)."""
        return None if self._session is None else self._session.salvage()

    async def buffered(self) -> int:
        """Reports of the current run waiting in this worker for a poll (0 without a run)."""
        return 0 if self._session is None else self._session.reports.buffered()

    async def stop_run(self, timeout_s: float) -> bool:
        """Stop the current run; return whether its function ended within ``timeout_s``."""
        if self._session is None:
            return True
        return await self._session.stop(timeout_s)

    async def reset(
        self, stop_timeout_s: float, reset_hook: Callable[[], object] | None
    ) -> Outcome:
        """End a lease (a pooled worker going back to its pool): nothing of asyncexec's state
        carries over to the next lease. A run still in progress is stopped (within
        ``stop_timeout_s``); the run's session, the group's context, the Ray Data context and the
        torch process group are dropped, and the environment is the one the process started
        with. The user's module-level state stays, as in Ray's reused workers; ``reset_hook`` is
        where the user clears it.

        The torch process group is destroyed in a thread, within ``stop_timeout_s`` (a
        destroy can hang on a collective that waits for a peer: this loop answers meanwhile).

        Fails (as an outcome) when the run's function did not stop, a role instance's
        ``close()`` failed (see ``_roles.drop``), or the process group was not destroyed: such
        a worker is not reused."""
        if self._session is not None:
            if not await self._session.stop(stop_timeout_s):
                return Outcome("error", error=RuntimeError("the run's function did not stop"))
            _session.end_session(self._session)
            self._session = None
        closing = await _roles.drop()
        _place.set_group_context(None)
        _place.current_place().preemption = None
        _channel.reset()
        if "ray.data" in sys.modules:
            from ray.data import DataContext

            DataContext._set_current(None)
        destroyed = await _destroy_process_group(stop_timeout_s)
        os.environ.clear()
        os.environ.update(self._environ)
        if destroyed is not None:  # the process group may still be there: not to reuse
            return _outcomes.error_outcome(destroyed)
        if closing:  # what the instances held may still be held: not a worker to reuse
            return _outcomes.error_outcome(closing[0])
        if reset_hook is None:
            return Outcome("ok")
        return await _call(reset_hook, (), {})

    # Weight channels (see ``_channel``): each call runs in a thread, beside the run's function.

    async def channel_read(self, name: str, timeout_s: float, mapping: bool) -> tuple[str, Any]:
        """This rank's state for an object-store push: the driver calls this with two return
        values, awaits the first (the state's type, once it is read) and passes the second,
        which stays in this node's object store, to the receivers by reference."""
        state = await asyncio.to_thread(_channel.read_state, name, timeout_s, mapping=mapping)
        return type(state).__name__, state

    async def channel_receive(self, name: str, version: int, *shards: Any) -> None:
        """Install the shards of ``version``: the driver passes their object-store references
        as the call's own arguments, so Ray fetches them before the call runs (a ``ray.get``
        of references passed in a list cost a thread's blocking fetch besides)."""
        await asyncio.to_thread(_channel.install_state, name, version, _channel.merge([*shards]))

    async def channel_port(self, name: str, group_id: str, timeout_s: float) -> tuple[str, int]:
        return await asyncio.to_thread(_channel.reserve_store, name, group_id, timeout_s)

    async def channel_cuda(self) -> bool:
        return await asyncio.to_thread(_channel.cuda_available)

    async def channel_join(
        self,
        name: str,
        group_id: str,
        address: str,
        port: int,
        rank: int,
        size: int,
        backend: str,
        timeout_s: float,
    ) -> None:
        await asyncio.to_thread(
            _channel.join_group, name, group_id, address, port, rank, size, backend, timeout_s
        )

    async def channel_snapshot(self, name: str, version: int, timeout_s: float) -> Any:
        return await asyncio.to_thread(_channel.snapshot, name, version, timeout_s)

    async def channel_send(self, name: str, version: int, group_id: str) -> int:
        return await asyncio.to_thread(_channel.send, name, version, group_id)

    async def channel_receive_torch(
        self, name: str, version: int, parts: list[Any], device: str, reuse: bool
    ) -> int:
        return await asyncio.to_thread(_channel.receive, name, version, parts, device, reuse)

    async def channel_close(self, name: str) -> None:
        """Forget the channel (its process groups and buffers): in a thread, as it waits for an
        install still running (which holds the channel's lock)."""
        await asyncio.to_thread(_channel.close, name)

    async def notify_preemption(self, notice: PreemptionNotice | None) -> None:
        """Hold the driver's word on the preemption of the group's nodes (None: no notice, or
        no longer), for ``get_preemption_info()``."""
        _place.current_place().preemption = notice

    async def ping(self) -> int:
        return os.getpid()

    async def wait_closed(self) -> None:
        """Return when the driver closes this worker; fails at once if the process dies, which
        is how the driver notices a dead worker without polling for it. A pooled worker has one
        such call for its whole life, which its pool and every group that leases it await."""
        await self._closed_event().wait()

    async def close(self) -> None:
        """Before a graceful exit: drop the roles' instances (each one's ``close()``, where its
        class has one: see ``_roles.drop``; the driver's patience bounds it), then end the
        pending ``wait_closed`` calls (Ray's graceful exit of an async actor with a call still
        pending stalls until the actor is killed)."""
        try:
            await _roles.drop()
        finally:
            self._closed_event().set()


async def _destroy_process_group(timeout_s: float) -> BaseException | None:
    """Destroy this process's torch process group, if it has one, in a daemon thread (a
    destroy that hangs is left there: a thread cannot be stopped, and the worker is not reused);
    what went wrong, or None (destroyed, or none to destroy). Imports nothing: a process that
    never imported ``torch.distributed`` has no group."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    loop = asyncio.get_running_loop()
    ended: asyncio.Future[BaseException | None] = loop.create_future()

    def settle(error: BaseException | None) -> None:
        if not ended.done():
            ended.set_result(error)

    def destroy() -> None:
        error: BaseException | None = None
        try:
            dist.destroy_process_group()
        except BaseException as exc:  # handed to the loop, which returns it
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody waits
            loop.call_soon_threadsafe(settle, error)

    threading.Thread(target=destroy, name="asyncexec-torch-destroy", daemon=True).start()
    try:
        return await asyncio.wait_for(ended, timeout_s)
    except TimeoutError:
        return TimeoutError(
            f"the torch process group was not destroyed within {timeout_s:g} s "
            "(a collective still waiting?)"
        )


async def _call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Outcome:
    """Call ``fn`` and return how it ended (errors as data, with a clean traceback)."""
    try:
        if inspect.iscoroutinefunction(fn):
            result = await fn(*args, **kwargs)
        else:
            result = await asyncio.to_thread(fn, *args, **kwargs)
            if inspect.isawaitable(result):
                result = await result
    except Exception as exc:
        return _outcomes.error_outcome(exc)
    except asyncio.CancelledError as exc:
        if _outcomes.cancelled_by_caller():
            raise
        return _outcomes.error_outcome(exc)
    return _outcomes.value_outcome(result)


#: The roles whose plain calls can take the fast path: role ``i`` (``i < ROLE_GROUPS``) has a
#: concurrency group of its own, ``role_group(i)``, of one call at a time (Ray runs each group's
#: calls on a thread and event loop of its own, beside the actor's loop). The others, and roles
#: that allow several plain calls at once, go through ``call_role``.
ROLE_GROUPS = 4


def role_group(role_index: int) -> str:
    """The name of role ``role_index``'s concurrency group (see :data:`ROLE_GROUPS`)."""
    return f"role{role_index}"


# max_restarts=0: a dead worker is replaced by a gang restart, never by Ray restarting one actor.
WorkerActor = ray.remote(
    max_restarts=0,
    max_task_retries=0,
    concurrency_groups={role_group(i): 1 for i in range(ROLE_GROUPS)},
)(_Worker)
#: The worker's code, undecorated (a local worker hosts it in a thread: see the driver's seam).
WorkerCode = _Worker
if TYPE_CHECKING:  # the worker's methods are the interface's (mypy checks them)
    _IMPLEMENTS: type[WorkerInterface] = _Worker
