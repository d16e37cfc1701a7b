"""Retention of run folders: the folders of an executor's unnamed runs under its storage path
are removed when it closes (an unnamed run cannot be resumed, and its checkpoints were the
executor's while it was open), unless ``CheckpointConfig(keep_runs=True)``. A named run's folder
is kept: it is how a later driver resumes it.

A driver that is killed runs no close: each unnamed run on a local storage path has a marker
naming its driver (host, pid and the process's start) in the path's ``.asyncexec-runs`` folder,
and an executor that closes also removes the runs whose driver, on this host, is gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path

import anyio

from .._errors import describe
from .._logging import Logger
from .._wire._checkpoint import is_uri, join_path, remove_directory
from ._config import ExecutorConfig
from ._taskgroups import teardown

__all__ = ["Retention"]

#: The folder under a storage path that holds a marker for each unnamed run (``<run_id>.json``,
#: naming its driver): beside the runs' folders, not in them.
MARKERS = ".asyncexec-runs"


class Retention:
    """The unnamed runs of one executor, whose folders go when it closes."""

    def __init__(self, config: ExecutorConfig, log: Logger) -> None:
        self.config = config
        self.log = log
        self.unnamed: list[str] = []

    def started(self, run_id: str, *, named: bool) -> None:
        if not named and not self.config.checkpoint.keep_runs:
            self.unnamed.append(run_id)

    async def mark(self, run_id: str) -> None:
        """Write the marker of an unnamed run (local storage only), in a thread: what lets a
        later executor remove its folder if this driver is killed."""
        if run_id not in self.unnamed or is_uri(self.config.storage_path):
            return
        marker = Path(self.config.storage_path, MARKERS, f"{run_id}.json")
        try:
            await anyio.to_thread.run_sync(_write_marker, marker)
        except OSError as exc:  # a storage path that cannot be written fails the run itself
            self.log.debug("run_marker_not_written", run_id=run_id, error=describe(exc))

    async def remove(self) -> None:
        """Remove the folders of the unnamed runs, and those of drivers on this host that were
        killed (once; shielded, bounded by the shutdown timeout, in a thread: a remote
        storage's removal blocks)."""
        run_ids, self.unnamed = self.unnamed, []
        storage = self.config.storage_path
        if not run_ids and is_uri(storage):
            return
        paths = [join_path(storage, run_id) for run_id in run_ids]

        def remove_all() -> list[str]:
            failed: list[Exception] = []
            for run_id, path in zip(run_ids, paths, strict=True):
                try:
                    remove_directory(path)
                except Exception as exc:  # the others still go; this one is logged below
                    failed.append(exc)
                    continue
                if not is_uri(storage):  # (its marker stays with a folder that stays)
                    Path(storage, MARKERS, f"{run_id}.json").unlink(missing_ok=True)
            orphans = [] if is_uri(storage) else _remove_orphans(Path(storage))
            if failed:
                raise failed[0]
            return orphans

        with teardown("runs_removed", self.config.shutdown_timeout_s):
            try:
                orphans = await anyio.to_thread.run_sync(remove_all, abandon_on_cancel=True)
            except Exception as exc:
                # The storage went away or refused (a remote one's errors need not be OSErrors:
                # gcsfs raises its HttpError): tidying up never fails the close, nor hides the
                # error that is leaving the executor's block.
                self.log.warning("runs_not_removed", runs=run_ids, error=describe(exc))
                return
            if run_ids:
                self.log.debug("runs_removed", runs=run_ids)
            if orphans:
                self.log.info("orphaned_runs_removed", runs=orphans)


def _driver() -> dict[str, object]:
    """This process as a marker names it."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": _start_time(os.getpid())}


def _start_time(pid: int) -> str | None:
    """When process ``pid`` started (Linux: its start in clock ticks since boot, which tells a
    reused pid apart), or None where that cannot be read."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _write_marker(marker: Path) -> None:
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps(_driver()))


def _gone(driver: dict[str, object]) -> bool:
    """Whether the driver a marker names ran on this host and has ended."""
    pid = driver.get("pid")
    if driver.get("host") != socket.gethostname() or not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    start = driver.get("start")
    return start is not None and _start_time(pid) not in (None, start)  # the pid was reused


def _remove_orphans(storage: Path) -> list[str]:
    """Remove the runs under ``storage`` whose marker names a driver of this host that has
    ended (their folders, then their markers); their names."""
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for marker in (storage / MARKERS).glob("*.json"):
            try:
                driver = json.loads(marker.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(driver, dict) and _gone(driver):
                try:
                    remove_directory(os.fspath(storage / marker.stem))
                except OSError:  # left with its marker, for the next close to try again
                    continue
                marker.unlink(missing_ok=True)
                removed.append(marker.stem)
    return sorted(removed)
