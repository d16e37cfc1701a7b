"""Starting Ray for the driver, and the blocking Ray calls that must run off the event loop.

Ray's own processes (GCS, raylet, monitor, dashboard, log monitor) are started by ``ray.init``
with the parent-death signal set, and on Linux that signal follows the *thread* that started them,
not the process. So ``ray.init`` must never run in a thread that can end: an anyio worker thread
ends after 10 s idle, and Ray would die with it (its processes become zombies, the next Ray call
hangs, and at exit ``ray.shutdown`` waits a minute for a GCS that is gone). Ray is started here in
one daemon thread that lives as long as the process. When the event loop runs in the main thread,
Ray's SIGTERM handler (exit, so that ``atexit`` shuts Ray down) is installed as ``ray.init``
would have installed it there.

``ray.init`` holds the GIL for a good part of its start, which no thread can hide from the event
loop: a program that cannot afford that stall calls ``ray.init()`` before its loop starts.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import ray

from ..._errors import StartupError, describe
from ._join import dead_cluster

__all__ = ["ensure_ray"]

T = TypeVar("T")

_lock = threading.Lock()
_jobs: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]] | None = None


def _serve(
    jobs: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]]],
) -> None:
    while True:
        fn, future = jobs.get()
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(fn())
        except BaseException as exc:  # handed to the caller
            future.set_exception(exc)


def _submit(fn: Callable[[], T]) -> concurrent.futures.Future[T]:
    """Run ``fn`` in the lifelong Ray thread."""
    global _jobs
    with _lock:
        if _jobs is None:
            _jobs = queue.SimpleQueue()
            threading.Thread(
                target=_serve, args=(_jobs,), name="asyncexec-ray", daemon=True
            ).start()
        future: concurrent.futures.Future[T] = concurrent.futures.Future()
        _jobs.put((fn, future))
    return future


class _NotMainThread(logging.Filter):
    """Drops Ray's warning that it set no SIGTERM handler: it is set below, on the main thread."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "SIGTERM handler is not set" not in record.getMessage()


def _init(address: str | None) -> None:
    if ray.is_initialized():
        return
    ray_logger = logging.getLogger("ray._private.worker")
    quiet = _NotMainThread()
    ray_logger.addFilter(quiet)
    try:
        why = dead_cluster(address)
        if why is not None:
            raise StartupError(f"could not start Ray: {why}")
        try:
            ray.init(address=address, ignore_reinit_error=True)
        except Exception as exc:  # ray.init's errors are not one family: say what failed
            raise StartupError(f"could not start Ray: {describe(exc)}") from exc
    finally:
        ray_logger.removeFilter(quiet)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    """Ray's own driver handler: exit, so that ``atexit`` shuts Ray down cleanly."""
    sys.exit(signum)


def _install_sigterm_handler() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)


async def ensure_ray(address: str | None) -> None:
    """Start a local Ray, or join ``address``, unless Ray is already initialized. ``ray.init``
    runs in the lifelong Ray thread (see the module's docstring), never on the event loop.

    Raises:
        StartupError: Ray could not be started or joined (naming why; Ray's own error is the
            cause).
    """
    if ray.is_initialized():
        return
    await asyncio.wrap_future(_submit(lambda: _init(address)))
    _install_sigterm_handler()
