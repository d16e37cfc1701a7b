"""A named run's record, kept beside the run (see ``_resume`` for what it holds and why): read
and decided on when the run starts (a resume), written when a checkpoint becomes the latest, every
:data:`~._resume.RECORD_INTERVAL_S` while steps flow, and when the run ends.

The checkpoint it records is the latest that the consumer has taken (carried by a step the
iterator yielded), not the latest made: a new driver resumes after it, so the steps between
what the consumer took and a checkpoint made beyond it are made again, never skipped. A
checkpoint the run no longer keeps is deleted only once the record has moved past it."""

from __future__ import annotations

import os
from typing import Any

import anyio

from ..._errors import ConfigurationError, describe
from ..._wire import _checkpoint
from ..._wire._checkpoint import Checkpoint
from ._context import RunContext
from ._prune import Pruner
from ._resume import (
    RECORD_INTERVAL_S,
    RunRecord,
    checkpoint_folders,
    decide,
    load_record,
    save_record,
    stray_checkpoints,
)

__all__ = ["Recorder"]


class Recorder:
    """Keeps one named run's record."""

    def __init__(self, ctx: RunContext, pruner: Pruner) -> None:
        self.ctx = ctx
        self.pruner = pruner
        self.record: RunRecord | None = None
        #: Attempts and stream steps of the run before this driver's (a dead driver's).
        self.attempt_base = 0
        self.steps_base = 0
        #: The checkpoint the record resumes from, and the stream index of its step.
        self.checkpoint: Checkpoint | None = None
        self.checkpoint_index: int | None = None
        #: Paths the run no longer keeps that the record may still resume from, with the index
        #: of the step that carried each (see :meth:`hold`).
        self._held: list[tuple[int, str]] = []
        self._now = anyio.Event()
        ctx.handover.on_checkpoint = lambda: self._now.set()
        ctx.handover.carried = []
        ctx.handover.prune = self.hold

    async def resume(self) -> None:
        """Resume from the record a dead driver left, or start one.

        Raises:
            ConfigurationError: the run already finished, or was started with another config,
                or starts over (``resume="never"``) from a checkpoint of the earlier run.
        """
        ctx = self.ctx
        name, storage = ctx.spec.name, ctx.config.storage_path
        assert name is not None
        record = await anyio.to_thread.run_sync(load_record, storage, name)
        fingerprints = ctx.spec.fingerprints
        previous = decide(record, name, fingerprints, ctx.spec.resume)
        if previous is None:
            if record is not None:  # resume="never": the earlier run's checkpoints go first
                await self._start_over(storage, name)
            self.record = RunRecord(name, "running", 0, 0, None, fingerprints[0])
        else:
            # The record takes this config's fingerprint (a legacy one, or a forced resume).
            self.record = previous.advanced(status="running", fingerprint=fingerprints[0])
            await self._go_on_from(previous)
        await self.write("running")

    async def _start_over(self, storage: str, name: str) -> None:
        """Delete the checkpoint folders an earlier run of this name left: this one writes
        folders of the same names (a step's index and attempt), and would find files of the
        other run's in them. Before the run starts, in a thread; a folder that cannot go is
        logged (``checkpoint_prune_failed``) and left.

        Raises:
            ConfigurationError: the run starts from one of those folders (``run(checkpoint=)``):
                nothing is deleted.
        """
        start = self.ctx.spec.checkpoint

        def remove_all() -> list[tuple[str, BaseException]]:
            folders = checkpoint_folders(storage, name)
            if start is not None and any(_within(start.path, path) for path in folders):
                raise ConfigurationError(
                    f"run {name!r} starts over (resume='never') from a checkpoint of the earlier "
                    f"run of that name, {start.path!r}, whose checkpoints it deletes first: copy "
                    "it elsewhere (checkpoint.to_directory(...)) and start from the copy, or "
                    "give the run another name"
                )
            failed: list[tuple[str, BaseException]] = []
            for path in folders:
                try:
                    _checkpoint.remove_directory(path)
                except Exception as exc:
                    failed.append((path, exc))
            return failed

        try:
            failed = await anyio.to_thread.run_sync(remove_all)
        except OSError as exc:  # the folder could not be listed
            failed = [(name, exc)]
        for path, error in failed:
            self.ctx.log.warning("checkpoint_prune_failed", path=path, error=describe(error))

    async def _go_on_from(self, previous: RunRecord) -> None:
        ctx, run = self.ctx, self.ctx.run
        self.attempt_base = run.attempt = previous.attempt
        if previous.checkpoint is not None:
            # (Run.latest_checkpoint too: a completed step carried it, in the dead driver)
            ctx.latest = run.latest_checkpoint = self.checkpoint = Checkpoint(previous.checkpoint)
            run.latest_index = self.checkpoint_index = previous.resume_index() - 1
        # What the dead driver kept still counts (and is pruned as newer ones come); what it had
        # dropped but not yet deleted goes now.
        ctx.handover.book.kept = [(Checkpoint(path), m) for path, m in previous.kept]
        if self.checkpoint is not None and all(p != self.checkpoint.path for p, _ in previous.kept):
            # The dead driver no longer kept it but held it back for the record: it goes once
            # the record has moved past it, as it would have in that driver (nothing else
            # would ever delete it).
            self._held.append((self.checkpoint_index or 0, self.checkpoint.path))
        storage = ctx.config.storage_path
        try:
            stray = await anyio.to_thread.run_sync(stray_checkpoints, storage, previous)
        except OSError as exc:
            ctx.log.warning("checkpoint_listing_failed", error=describe(exc))
        else:
            self.pruner.submit(stray)
        # The stream goes on from the step after the latest checkpoint: the work the function
        # does from there has the indices it had in the dead driver's stream.
        index = previous.resume_index()
        ctx.handover.steps = self.steps_base = index
        run.handed = run.consumed = run.received_upto = index
        ctx.log.warning(
            "run_resumed",
            index=index,
            delivered=previous.steps,
            attempt=previous.attempt,
            checkpoint=previous.checkpoint,
        )

    async def taken(self) -> None:
        """Until the consumer has taken every step queued: a run whose work is done is not
        finished before then (a driver that dies meanwhile leaves it to resume)."""
        run, handover = self.ctx.run, self.ctx.handover
        while run.consumed < handover.steps:
            await run.wait_consumed()

    async def finish(self) -> None:
        """The run's work is done and every step taken: the record says so, and what it held
        back goes (no driver resumes a finished run)."""
        await self.write("finished")
        held, self._held = self._held, []
        latest = self.ctx.checkpoint  # the result's (a resumed run that made none: its start)
        self.pruner.submit([p for _, p in held if latest is None or p != latest.path])

    async def keep(self) -> None:
        """Write the record when a checkpoint becomes the latest, and every
        ``RECORD_INTERVAL_S`` while steps flow (runs until cancelled)."""
        while True:
            with anyio.move_on_after(RECORD_INTERVAL_S):
                await self._now.wait()
            self._now = anyio.Event()
            await self.write("running")

    def hold(self, paths: list[str]) -> None:
        """Delete ``paths`` (checkpoints the run no longer keeps), each once the record has
        moved past it: one the consumer has not taken yet, or the record's own, may still be
        what a new driver resumes from."""
        waiting = {checkpoint.path: i for i, checkpoint in self.ctx.handover.carried or ()}
        ready = []
        for path in paths:
            if path in waiting:
                self._held.append((waiting[path], path))
            elif self.checkpoint is not None and path == self.checkpoint.path:
                self._held.append((self.checkpoint_index or 0, path))
            else:
                ready.append(path)
        self.pruner.submit(ready)

    def _taken(self) -> None:
        """The record moves to the latest checkpoint whose step the consumer has taken."""
        carried = self.ctx.handover.carried
        taken = self.steps_base + self.ctx.run.delivered  # the stream index of the next step
        while carried and carried[0][0] < taken:
            self.checkpoint_index, self.checkpoint = carried.pop(0)

    def _release(self) -> None:
        """Delete the held paths the record has moved past."""
        if self.checkpoint_index is None:
            return
        past = [(i, p) for i, p in self._held if i < self.checkpoint_index]
        if past:
            self._held = [held for held in self._held if held not in past]
            self.pruner.submit([p for _, p in past])

    async def write(self, status: str) -> None:
        record = self.record
        if record is None:
            return
        ctx, run = self.ctx, self.ctx.run
        self._taken()
        latest = self.checkpoint
        updated = record.advanced(
            status=status,
            steps=self.steps_base + run.delivered,
            attempt=run.attempt,
            checkpoint=latest.path if latest is not None else None,
            checkpoint_index=self.checkpoint_index,
            kept=self._kept(),
        )
        unchanged = (updated.steps, updated.attempt, updated.checkpoint, updated.status) == (
            record.steps,
            record.attempt,
            record.checkpoint,
            record.status,
        )
        if unchanged and status == "running" and record.updated:
            return
        self.record = updated
        try:
            await anyio.to_thread.run_sync(save_record, ctx.config.storage_path, updated)
        except OSError as exc:
            ctx.log.warning("run_record_failed", error=describe(exc))
        else:
            self._release()

    def _kept(self) -> list[list[Any]]:
        """The checkpoints the run keeps, as a record holds them: the path, and the score the
        book ranks them by (only that metric: a record is small)."""
        score = self.ctx.config.checkpoint.score_attribute
        kept = []
        for checkpoint, reported in self.ctx.handover.book.kept:
            value = reported.get(score) if score and isinstance(reported, dict) else None
            kept.append([checkpoint.path, {} if value is None else {score: value}])
        return kept


def _within(path: str, folder: str) -> bool:
    """Whether ``path`` is ``folder`` or inside it (both local, or both URIs)."""
    if not _checkpoint.is_uri(path):
        path, folder = os.path.abspath(path), os.path.abspath(folder)
    path, folder = path.rstrip("/"), folder.rstrip("/")
    return path == folder or path.startswith(folder + "/")
