"""Retention of run folders: the folders of an executor's unnamed runs under its storage path
are removed when it closes (an unnamed run cannot be resumed, and its checkpoints were the
executor's while it was open), unless ``CheckpointConfig(keep_runs=True)``. A named run's folder
is kept: it is how a later driver resumes it."""

from __future__ import annotations

import anyio

from .._errors import describe
from .._logging import Logger
from .._wire._checkpoint import join_path, remove_directory
from ._config import ExecutorConfig
from ._taskgroups import teardown

__all__ = ["Retention"]


class Retention:
    """The unnamed runs of one executor, whose folders go when it closes."""

    def __init__(self, config: ExecutorConfig, log: Logger) -> None:
        self.config = config
        self.log = log
        self.unnamed: list[str] = []

    def started(self, run_id: str, *, named: bool) -> None:
        if not named and not self.config.checkpoint.keep_runs:
            self.unnamed.append(run_id)

    async def remove(self) -> None:
        """Remove the folders of the unnamed runs (once; shielded, bounded by the shutdown
        timeout, in a thread: a remote storage's removal blocks)."""
        run_ids, self.unnamed = self.unnamed, []
        if not run_ids:
            return
        paths = [join_path(self.config.storage_path, run_id) for run_id in run_ids]

        def remove_all() -> None:
            for path in paths:
                remove_directory(path)

        with teardown("runs_removed", self.config.shutdown_timeout_s):
            try:
                await anyio.to_thread.run_sync(remove_all, abandon_on_cancel=True)
            except OSError as exc:  # the storage went away: nothing to keep tidy
                self.log.warning("runs_not_removed", runs=run_ids, error=describe(exc))
                return
            self.log.debug("runs_removed", runs=run_ids)
