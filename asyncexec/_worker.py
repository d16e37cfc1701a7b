"""The actor that runs on each worker. The only place that defines it.

It is an async actor: its methods run on the actor's event loop, which stays free while the user's
function runs in a thread of its own (see ``_session``). It imports nothing heavy, so a worker
process costs about what a plain Ray actor costs.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import socket
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import ray

from . import _session
from ._checkpoint import Checkpoint
from ._session import PollResult, Session, WorkerContext

__all__ = ["WorkerActor", "WorkerMetadata"]


@dataclass(frozen=True)
class WorkerMetadata:
    """What a worker tells the driver about itself when it starts."""

    node_id: str
    node_ip: str
    hostname: str
    pid: int
    accelerator_ids: Mapping[str, tuple[str, ...]]


class _Worker:
    def __init__(self) -> None:
        self._closed: asyncio.Event | None = None
        self._session: Session | None = None

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
    ) -> None:
        """Apply the environment (shared devices), install the context and the driver's Ray Data
        context, run the init hook."""
        # The user's function runs in a thread of its own, where ray.get is fine: Ray's warning
        # about blocking calls inside async actors does not apply.
        os.environ.setdefault("RAY_WARN_BLOCKING_GET_INSIDE_ASYNC", "0")
        os.environ.update(env)
        _session.set_group_context(context)
        if data_context is not None:
            from ray.data import DataContext

            DataContext._set_current(data_context)
        if init_hook is not None:
            await _call(init_hook, (), {})

    async def execute(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        """Run ``fn``: an ``async def`` on this loop, a plain function in a thread."""
        return await _call(fn, args, kwargs)

    async def start_run(
        self,
        fn: Callable[..., Any],
        takes_config: bool,
        config: Any,
        context: WorkerContext,
        checkpoint: Checkpoint | None,
        buffer_size: int,
        step_offset: int,
        shards: Mapping[str, Any],
        function_context: Callable[[], AbstractContextManager[Any]] | None = None,
    ) -> None:
        """Start ``fn`` in its own thread and return at once; reports are taken with ``poll``."""
        if self._session is not None and not self._session.finished:
            raise RuntimeError("a run is still in progress on this worker")
        if self._session is not None:
            _session.end_session(self._session)
        self._session = Session(
            fn=fn,
            takes_config=takes_config,
            config=config,
            context=context,
            checkpoint=checkpoint,
            buffer_size=buffer_size,
            step_offset=step_offset,
            shards=shards,
            loop=asyncio.get_running_loop(),
            function_context=function_context,
        )
        self._session.start()

    async def poll(self, ack: int, max_items: int) -> PollResult:
        if self._session is None:
            raise RuntimeError("poll() before start_run()")
        return await self._session.poll(ack, max_items)

    async def stop_run(self, timeout_s: float) -> bool:
        """Stop the current run; return whether its function ended within ``timeout_s``."""
        if self._session is None:
            return True
        return await self._session.stop(timeout_s)

    async def ping(self) -> int:
        return os.getpid()

    async def wait_closed(self) -> None:
        """Return when the driver closes this worker; fails at once if the process dies, which is
        how the driver notices a dead worker without polling for it."""
        await self._closed_event().wait()

    async def close(self) -> None:
        self._closed_event().set()


async def _call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    if inspect.iscoroutinefunction(fn):
        return await fn(*args, **kwargs)
    result = await asyncio.to_thread(fn, *args, **kwargs)
    if inspect.isawaitable(result):
        return await result
    return result


# max_restarts=0: a dead worker is replaced by a gang restart, never by Ray restarting one actor.
WorkerActor = ray.remote(max_restarts=0, max_task_retries=0)(_Worker)
