"""Deleting the checkpoints a run no longer keeps, apart from the run.

Which checkpoints a run keeps is the :class:`~asyncexec._wire._checkpoint.CheckpointBook`'s
decision; this deletes the others: a checkpoint is deleted once the step that superseded it has
been handed to the run's iterator, and, in a named run, once the run's record has moved past it
(see ``_recorder``). Deleting is I/O on storage that may
be remote and slow (an object store's ``rm`` can fail or time out), so it never holds the stream and
never fails the run: paths are queued, a task of the run's own deletes them in a thread, one by one,
and a failure is logged (``checkpoint_prune_failed``) and left. When the run ends, what is queued
gets a bounded time to go.
"""

from __future__ import annotations

import math
from typing import Any

import anyio

from ..._errors import describe
from ..._wire import _checkpoint

__all__ = ["Pruner"]


class Pruner:
    """The queue of a run's checkpoints to delete, and the task that deletes them."""

    def __init__(self, log: Any) -> None:
        self.log = log
        self._send, self._receive = anyio.create_memory_object_stream[list[str]](math.inf)

    def submit(self, paths: list[str]) -> None:
        """Queue ``paths`` for deletion (no wait)."""
        if paths:
            try:
                self._send.send_nowait(paths)
            except anyio.ClosedResourceError:  # the run has ended: it is no longer kept either
                self.log.info("checkpoint_prune_skipped", paths=paths)

    def close(self) -> None:
        """No more paths: :meth:`serve` returns once it has deleted what is queued."""
        self._send.close()

    async def serve(self) -> None:
        """Delete what is queued until :meth:`close`; never raises."""
        async with self._receive:
            async for paths in self._receive:
                for path in paths:
                    try:
                        await anyio.to_thread.run_sync(
                            _checkpoint.remove_directory, path, abandon_on_cancel=True
                        )
                    except Exception as exc:
                        self.log.warning("checkpoint_prune_failed", path=path, error=describe(exc))
