r"""Local mode: workers in threads of the driver's process instead of Ray actors.

:class:`LocalCluster` is the seam's second implementation (see ``_base``): its workers are
:class:`LocalWorker`\ s, each hosting the worker's own code (the actor class, undecorated) on an
event loop in a thread of its own, as Ray hosts an async actor's methods on the actor's loop;
``worker.call(method, ...)`` schedules the method there and returns an awaitable, as an
``ObjectRef`` is one. So the group, the run's pumps, health checks, stops and closes are the same
code in both modes, and the user's function runs in a thread of its own, exactly as on an actor
(see ``_worker._session``).

What Ray provides and a thread cannot is absent, and said so in the docs: no process isolation
(module-level state is shared by the ranks and the driver), no devices or resources enforced, no
``runtime_env``, no backend (a framework's process group is per process), no datasets, pools,
reservations, spares, elastic sizes or weight channels. A function that does not stop cannot be
killed: its thread is left to end on its own (a daemon thread, it does not hold the process at
exit). Nothing here imports or starts Ray.

Each local worker's calls run in a context whose :data:`~..._worker.PLACE` is the
worker's own, so ``get_context()``, ``report()`` and ``get_checkpoint()`` find that worker's
state in the function's thread, in ``execute()`` calls and in the threads they start through
``asyncio`` (threads started by hand carry no context: see the docs).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import itertools
import os
import socket
import sys
import threading
import traceback
import weakref
from collections.abc import Awaitable, Generator, Sequence
from typing import TYPE_CHECKING, Any

from ..._wire._interface import WorkerInterface, WorkerMethod
from ..._wire._protocol import WorkerMetadata
from ..._worker import PLACE, Place, WorkerCode
from .._config import ExecutorConfig
from ._base import Handle, Spawned
from ._inprocess import InProcessCluster
from ._placement import Placement

__all__ = ["LOCAL_NODE", "LocalCallCancelled", "LocalCluster", "LocalWorker", "LocalWorkerGone"]

#: The node id of every local worker (they all run in the driver's process).
LOCAL_NODE = "local"
_numbers = itertools.count()


class LocalWorkerGone(Exception):
    """A call on a local worker that was closed (the stand-in for Ray's dead-actor error)."""


class LocalCallCancelled(Exception):
    """A call on a local (or simulated) worker that the driver cancelled (the stand-in for
    Ray's ``TaskCancelledError``)."""


class _ThreadWorker(WorkerCode):
    """The actor's code, describing a thread of this process instead of a Ray worker."""

    async def describe(self) -> WorkerMetadata:
        return WorkerMetadata(
            node_id=LOCAL_NODE,
            node_ip="127.0.0.1",
            hostname=socket.gethostname(),
            pid=os.getpid(),
            accelerator_ids={},
        )


if TYPE_CHECKING:  # a local worker's methods are the interface's (mypy checks them)
    _IMPLEMENTS: type[WorkerInterface] = _ThreadWorker


class _Ref:
    """A pending call on a local worker: awaitable from any event loop, like an ``ObjectRef``.

    Awaiting it and being cancelled does not cancel the call (a cancelled wait on a Ray call
    leaves the actor's method running too); :meth:`LocalWorker.cancel` does. ``task`` and
    ``cancelled`` are read and written on the worker's loop only.

    A call awaited many times (a worker's death call, awaited by every run's watch) is wrapped
    once per event loop: each wait shields that one future, and a wait that is cancelled leaves
    nothing behind (a wrapper per wait stayed on the call until it ended: for a death call, one
    per run for as long as the worker lived)."""

    __slots__ = ("_future", "_waits", "cancelled", "task")

    def __init__(self, future: concurrent.futures.Future[Any] | None = None) -> None:
        self._future: concurrent.futures.Future[Any] = future or concurrent.futures.Future()
        self._waits: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Future[Any]]
        self._waits = weakref.WeakKeyDictionary()
        self.task: asyncio.Task[Any] | None = None
        self.cancelled = False

    def __await__(self) -> Generator[Any, None, Any]:
        loop = asyncio.get_running_loop()
        call = self._waits.get(loop)
        if call is None:
            call = self._waits[loop] = asyncio.wrap_future(self._future, loop=loop)
            call.add_done_callback(_retrieve)  # its error is not "never retrieved" unawaited
        return asyncio.shield(call).__await__()

    def loop_future(self) -> None:
        return None  # (settled from the worker's thread: awaited as it is)


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def _cancel(ref: _Ref) -> None:
    """On the worker's loop: cancel ``ref``'s task, or mark it to end as it starts."""
    ref.cancelled = True
    if ref.task is not None:
        ref.task.cancel()


class LocalWorker:
    """One worker in threads of this process: an event loop for its methods (the actor's loop)
    and, during a run, the thread of the user's function."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.place = Place()
        self._worker: _ThreadWorker | None = _ThreadWorker()
        self._loop = asyncio.new_event_loop()
        self._gone = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(
            target=self._serve, name=f"asyncexec-local {label} #{next(_numbers)}", daemon=True
        )
        self._thread.start()

    def __repr__(self) -> str:
        return f"<LocalWorker {self.label} {'gone' if self._gone else 'live'}>"

    @property
    def key(self) -> str:
        return self._thread.name

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()
            # Gone: what the worker held (its run's session, its roles' instances) is let go
            # of, as a Ray worker's process ends, though an error's traceback (a driver's frame
            # that held the group) may keep this handle for as long as the application keeps
            # the error.
            self._worker = None
            self.place = Place()

    def call(self, name: WorkerMethod, /, *args: Any, **kwargs: Any) -> _Ref:
        """Schedule the worker's method ``name`` on its loop; a closed worker's call fails."""
        if name == "call_method_sync":  # one loop here: a plain method goes to a thread
            name = "call_method"
        with self._lock:
            if not self._gone:
                method = getattr(self._worker, name)
                ref = _Ref()
                coro = self._in_place(method(*args, **kwargs), ref)
                ref._future = asyncio.run_coroutine_threadsafe(coro, self._loop)
                return ref
        failed: concurrent.futures.Future[Any] = concurrent.futures.Future()
        failed.set_exception(LocalWorkerGone(f"the local worker {self.label} was closed"))
        return _Ref(failed)

    async def _in_place(self, call: Awaitable[Any], ref: _Ref) -> Any:
        # This task's context (a copy) carries the worker's place to what the call starts.
        PLACE.set(self.place)
        ref.task = asyncio.current_task()
        try:
            if ref.cancelled:  # cancelled before it started
                raise asyncio.CancelledError
            return await call
        except asyncio.CancelledError:
            # Raised below, outside this block: as its context, the cancellation's traceback
            # would hold the call's frames (the worker's code, its session) for as long as
            # the driver keeps the error (a worker's death call keeps it for the group's life).
            pass
        finally:
            if inspect.iscoroutine(call):
                call.close()  # never started (cancelled first): no "never awaited" warning
        if ref.cancelled:
            raise LocalCallCancelled(f"the call was cancelled on {self.label}")
        raise LocalWorkerGone(f"the local worker {self.label} was closed")

    def cancel(self, ref: Any) -> None:
        """Cancel the call of ``ref`` on the worker's loop, as Ray cancels an async actor's
        task: its coroutine sees ``CancelledError``, and ``ref`` fails with
        :class:`LocalCallCancelled` when it has ended."""
        if isinstance(ref, _Ref):
            with contextlib.suppress(RuntimeError):  # the loop has closed: nothing runs
                self._loop.call_soon_threadsafe(_cancel, ref)

    def kill(self) -> None:
        """Close the worker at once, from any thread: its run's function is told to stop, its
        pending calls fail with :class:`LocalWorkerGone`, its loop ends. A function that does
        not stop runs on in its (daemon) thread until it ends or reports."""
        with self._lock:
            if self._gone:
                return
            self._gone = True
        session = self.place.session
        if session is not None:
            session.halt()
        with contextlib.suppress(RuntimeError):  # the loop has already closed
            asyncio.run_coroutine_threadsafe(self._shut(), self._loop)

    async def _shut(self) -> None:
        here = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not here]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        asyncio.get_running_loop().stop()

    def stacks(self) -> str:
        """The stacks of this worker's threads (its loop's, and its function's during a run),
        read in this process: Python's own frames, for the errors of hung ranks."""
        threads = [self._thread]
        session = self.place.session
        if session is not None:
            threads.append(session.thread)
        frames = sys._current_frames()
        parts = []
        for thread in threads:
            frame = frames.get(thread.ident) if thread.ident is not None else None
            if frame is None:
                continue
            stack = "".join(traceback.format_stack(frame)).rstrip()
            parts.append(f'Thread {thread.ident} "{thread.name}"\n{stack}')
        return "\n\n".join(parts) or "no live thread"

    def call_n(self, name: WorkerMethod, n: int, /, *args: Any) -> list[Any]:
        raise NotImplementedError("a local worker's results are not references (no channels)")


class LocalCluster(InProcessCluster):
    """The seam in local mode: every worker a :class:`LocalWorker` of this process, on one node
    (:data:`LOCAL_NODE`), no placement, no resources, nothing to start or join."""

    def __repr__(self) -> str:
        return "<local cluster: threads of this process>"

    async def driver_node(self) -> str | None:
        return LOCAL_NODE

    async def bundle_nodes(self, placement: Placement) -> list[str]:
        return [LOCAL_NODE] * len(placement.bundles)

    def make_workers(self, config: ExecutorConfig, count: int) -> list[Spawned]:
        workers = [LocalWorker(config.name) for _ in range(count)]
        return [Spawned(w, w.call("describe")) for w in workers]

    def end(self, handles: Sequence[Handle]) -> None:
        for handle in handles:
            assert isinstance(handle, LocalWorker)
            handle.kill()

    async def live_nodes(self) -> set[str] | None:
        return {LOCAL_NODE}

    async def stacks(self, workers: Sequence[tuple[int, Handle, WorkerMetadata]]) -> dict[int, str]:
        # The workers are threads of this process: their stacks are read here.
        return {
            rank: handle.stacks()
            for rank, handle, _ in sorted(workers, key=lambda w: w[0])
            if isinstance(handle, LocalWorker)
        }
