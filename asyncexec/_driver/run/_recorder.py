"""A named run's record, kept beside the run (see ``_resume`` for what it holds and why): read
and decided on when the run starts (a resume), written when a checkpoint becomes the latest, every
:data:`~._resume.RECORD_INTERVAL_S` while steps flow, and when the run ends."""

from __future__ import annotations

from typing import Any

import anyio

from ..._errors import describe
from ..._wire._checkpoint import Checkpoint
from ._context import RunContext
from ._prune import Pruner
from ._resume import (
    RECORD_INTERVAL_S,
    RunRecord,
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
        self._now = anyio.Event()
        ctx.handover.on_checkpoint = lambda: self._now.set()

    async def resume(self) -> None:
        """Resume from the record a dead driver left, or start one.

        Raises:
            ConfigurationError: the run already finished, or was started with another config.
        """
        ctx = self.ctx
        name, storage = ctx.spec.name, ctx.config.storage_path
        assert name is not None
        record = await anyio.to_thread.run_sync(load_record, storage, name)
        fingerprints = ctx.spec.fingerprints
        previous = decide(record, name, fingerprints, ctx.spec.resume)
        if previous is None:
            self.record = RunRecord(name, "running", 0, 0, None, fingerprints[0])
        else:
            # The record takes this config's fingerprint (a legacy one, or a forced resume).
            self.record = previous.advanced(status="running", fingerprint=fingerprints[0])
            await self._go_on_from(previous)
        await self.write("running")

    async def _go_on_from(self, previous: RunRecord) -> None:
        ctx, run = self.ctx, self.ctx.run
        self.attempt_base = run.attempt = previous.attempt
        if previous.checkpoint is not None:
            ctx.latest = Checkpoint(previous.checkpoint)
            run.latest_index = previous.resume_index() - 1
        # What the dead driver kept still counts (and is pruned as newer ones come); what it had
        # dropped but not yet deleted goes now.
        ctx.handover.book.kept = [(Checkpoint(path), m) for path, m in previous.kept]
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

    async def keep(self) -> None:
        """Write the record when a checkpoint becomes the latest, and every
        ``RECORD_INTERVAL_S`` while steps flow (runs until cancelled)."""
        while True:
            with anyio.move_on_after(RECORD_INTERVAL_S):
                await self._now.wait()
            self._now = anyio.Event()
            await self.write("running")

    async def write(self, status: str) -> None:
        record = self.record
        if record is None:
            return
        ctx, run = self.ctx, self.ctx.run
        latest = ctx.checkpoint
        updated = record.advanced(
            status=status,
            steps=self.steps_base + run.delivered,
            attempt=run.attempt,
            checkpoint=latest.path if latest is not None else None,
            checkpoint_index=run.latest_index,
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

    def _kept(self) -> list[list[Any]]:
        """The checkpoints the run keeps, as a record holds them: the path, and the score the
        book ranks them by (only that metric: a record is small)."""
        score = self.ctx.config.checkpoint.score_attribute
        kept = []
        for checkpoint, reported in self.ctx.handover.book.kept:
            value = reported.get(score) if score and isinstance(reported, dict) else None
            kept.append([checkpoint.path, {} if value is None else {score: value}])
        return kept
