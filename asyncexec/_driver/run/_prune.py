"""Deleting the checkpoints a run no longer keeps, apart from the run.

Which checkpoints a run keeps is the :class:`~asyncexec._wire._checkpoint.CheckpointBook`'s
decision; this deletes the others: a checkpoint is deleted once the step that superseded it has
been handed to the run's iterator, and, in a named run, once the run's record has moved past it
(see ``_recorder``). It also deletes what an attempt that ended early (failed, resized, moved off
preempted nodes) persisted for steps it never completed: a rank ahead of the others saved
checkpoints that no step carries, which no book counts and nothing else would delete (see
:meth:`Pruner.sweep`). Deleting is I/O on storage that may
be remote and slow (an object store's ``rm`` can fail or time out), so it never holds the stream and
never fails the run: paths are queued, a task of the run's own deletes them in a thread, one by one,
and a failure is logged (``checkpoint_prune_failed``) and left. When the run ends, what is queued
gets a bounded time to go.
"""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

import anyio

from ..._errors import describe
from ..._wire import _checkpoint
from ._resume import checkpoint_folders

__all__ = ["Pruner"]

#: A persisted checkpoint's folder (see ``_protocol.checkpoint_name``): its step index, attempt.
_CHECKPOINT_DIR = re.compile(r"^checkpoint_(\d+)_a(\d+)$")


class _Sweep(NamedTuple):
    """The checkpoints that ``attempt`` persisted under ``storage/run_id`` for steps from
    ``first`` on (none of which was completed)."""

    storage: str
    run_id: str
    attempt: int
    first: int

    def paths(self) -> list[str]:
        """Blocking: call it in a thread."""
        try:
            folders = checkpoint_folders(self.storage, self.run_id)
        except FileNotFoundError:  # a remote run folder that nothing was written to yet
            return []
        found = []
        for path in folders:
            match = _CHECKPOINT_DIR.match(path.rstrip("/").rsplit("/", 1)[-1])
            if match and int(match[2]) == self.attempt and int(match[1]) >= self.first:
                found.append(path)
        return found


class Pruner:
    """The queue of a run's checkpoints to delete, and the task that deletes them."""

    def __init__(self, log: Any) -> None:
        self.log = log
        self._send, self._receive = anyio.create_memory_object_stream[list[str] | _Sweep](math.inf)

    def submit(self, paths: list[str]) -> None:
        """Queue ``paths`` for deletion (no wait)."""
        if paths:
            self._queue(paths)

    def sweep(self, storage: str, run_id: str, attempt: int, first: int) -> None:
        """Queue the deletion of the checkpoints that ``attempt`` of run ``run_id`` persisted
        for steps from stream index ``first`` on: an attempt that ended with no step of its
        completed from there (no wait; the folder is listed in the deleting task). Call it once
        the attempt's workers are stopped."""
        self._queue(_Sweep(storage, run_id, attempt, first))

    def _queue(self, item: list[str] | _Sweep) -> None:
        try:
            self._send.send_nowait(item)
        except anyio.ClosedResourceError:  # the run has ended: it is no longer kept either
            self.log.info("checkpoint_prune_skipped", paths=item)  # (or the sweep)

    def close(self) -> None:
        """No more paths: :meth:`serve` returns once it has deleted what is queued."""
        self._send.close()

    def release(self) -> None:
        """Let the queue go, at the run's end: also when :meth:`serve` never ran (a run stopped
        or failed before its work began left both ends open, and Python warned of them when
        the run was collected). What is still queued is not deleted."""
        self._send.close()
        self._receive.close()

    async def serve(self) -> None:
        """Delete what is queued until :meth:`close`; never raises."""
        async with self._receive:
            async for item in self._receive:
                if isinstance(item, list):
                    paths = item
                else:
                    try:
                        paths = await anyio.to_thread.run_sync(item.paths, abandon_on_cancel=True)
                    except Exception as exc:
                        self.log.warning("checkpoint_listing_failed", error=describe(exc))
                        continue
                for path in paths:
                    try:
                        await anyio.to_thread.run_sync(
                            _checkpoint.remove_directory, path, abandon_on_cancel=True
                        )
                    except Exception as exc:
                        self.log.warning("checkpoint_prune_failed", path=path, error=describe(exc))
