"""This process's own Ray, for the command line: start (or join) it before the event loop runs,
shut it down, whether it runs, and Ray's notice of a worker the demo kills on purpose kept out of
the demo's output.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from ._join import dead_cluster

__all__ = ["init_ray", "quiet_planned_crash", "ray_is_initialized", "shutdown_ray"]


def ray_is_initialized() -> bool:
    """Whether this process is connected to Ray."""
    import ray

    return bool(ray.is_initialized())


def init_ray(address: str | None) -> bool:
    """Start (or join) Ray, quietly; return whether this call did. Called before the event loop
    starts (``ray.init`` blocks for seconds), in the main thread, where Ray can install its
    signal handlers."""
    import ray

    if ray.is_initialized():
        return False
    why = dead_cluster(address)
    if why is not None:
        raise ConnectionError(why)
    ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    return True


def shutdown_ray() -> None:
    """Disconnect this process from Ray (and stop the Ray it started). Blocking."""
    import ray

    ray.shutdown()


#: How the raylet's notice of a dead worker begins (Ray 2.60's ``node_manager``).
_WORKER_DIED_NOTICE = "A worker died or was killed"


@contextlib.contextmanager
def quiet_planned_crash() -> Iterator[None]:
    """Keep Ray's notice of the demo's own SIGKILL out of the demo's output, while it runs.

    When a worker process dies, the raylet publishes a paragraph ("A worker died or was killed
    while executing a task by an unexpected system error ... the OOM killer ...") that the
    driver's error listener thread (``ray._private.worker.listen_error_messages``) prints on
    stdout behind a ``(raylet)`` prefix. ``ray.init(log_to_driver=False)`` does not stop it: that
    only stops forwarding the workers' own output. The demo kills a worker on purpose and tells
    the story itself (the ``worker_failed`` event, the summary), so this drops that one notice
    and nothing else; the workers' forwarded output and Ray's other notices still print.
    ``asyncexec run`` does not use it: there a dead worker is news.
    """
    import ray._private.worker as ray_worker

    original = getattr(ray_worker, "print_to_stdstream", None)
    if original is None:  # a Ray without that hook: print as it does
        yield
        return

    def print_to_stdstream(data: dict[str, Any], ignore_prefix: bool) -> None:
        if data.get("pid") == "raylet":
            lines = [line for line in data.get("lines", []) if _WORKER_DIED_NOTICE not in line]
            if not lines:
                return
            data = {**data, "lines": lines}
        original(data, ignore_prefix)

    # The listener thread looks the function up at each message; the handler that forwards the
    # workers' output was bound to the original when Ray connected, so it is not affected.
    ray_worker.print_to_stdstream = print_to_stdstream
    try:
        yield
    finally:
        if ray_worker.print_to_stdstream is print_to_stdstream:
            ray_worker.print_to_stdstream = original
