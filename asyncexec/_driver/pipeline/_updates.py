"""A pipeline's weight updates: one at a time, each around the rollouts in flight (pause them
as the mode says, push, resume), each emitted once as it pauses and as it ends (``_events``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

import anyio
import anyio.abc

from ..._errors import ExecutorStateError, describe
from ..._wire._tracing import as_calls, spanned
from .._observe import Observer
from .._taskgroups import task_group, teardown
from ._admission import Admission, Item
from ._budget import Budget
from ._events import UpdateEnded, UpdatePaused
from ._servers import Servers

if TYPE_CHECKING:
    from ..channel import WeightChannel

__all__ = ["Updates", "update"]

#: How long a failed update waits for the servers to resume.
_RESUME_TIMEOUT_S = 10.0


class Updates:
    """The weight updates of one pipeline (``Pipeline.update_weights``)."""

    def __init__(
        self,
        servers: Servers,
        channel: WeightChannel | None,
        budget: Budget[Item],
        admission: Admission,
        observer: Observer,
    ) -> None:
        self.servers, self.channel, self.budget, self.admission = (
            servers,
            channel,
            budget,
            admission,
        )
        self.observer = observer
        self.updating = False
        #: Set when the update going on in the background ends (None: none was started).
        self._ended: anyio.Event | None = None
        self.error: Exception | None = None  # what it failed with, until raised

    async def run(
        self,
        mode: Literal["keep", "wait", "abort"],
        state: Any,
        going_on: anyio.abc.TaskGroup | None = None,
    ) -> None:
        """One update (the arguments checked); with ``going_on``, the group where it goes on
        once the learner's state is read (see ``Pipeline.update_weights(wait=False)``).

        Raises:
            ExecutorStateError: strict mode and no batch was taken at this version; or
                another update is going on.
            ChannelError: the push failed (the servers are resumed first); or, first, the
                update that went on in the background failed.
        """
        await self.settled()
        if self.updating:
            raise ExecutorStateError("update_weights() is already going on")
        self.budget.check_update()
        self.updating = True
        if going_on is None:
            try:
                await self._one(mode, state, None)
            finally:
                self.updating = False
            return
        read, self._ended = anyio.Event(), anyio.Event()
        going_on.start_soon(self._going_on, mode, state, read)
        await read.wait()
        self.check()  # the pause or the read failed

    async def _one(
        self, mode: Literal["keep", "wait", "abort"], state: Any, on_read: Callable[[], Any] | None
    ) -> None:
        with spanned("asyncexec.pipeline.update", mode=mode) as span:
            pause_s, push_s, in_flight = await update(
                self.servers, self.channel, self.budget, self.admission, mode, state, on_read
            )
            if span is not None:
                span.set_attribute("version", self.budget.version)
        version = self.budget.version
        self.observer.emit(UpdateEnded(mode, version, pause_s, push_s, in_flight))

    async def _going_on(
        self, mode: Literal["keep", "wait", "abort"], state: Any, read: anyio.Event
    ) -> None:
        """An update whose caller went on once the state was read: its error is kept for the
        pipeline's next batch or update (:meth:`check`)."""
        try:
            await self._one(mode, state, read.set)
        except Exception as exc:
            self.error = exc
        finally:
            self.updating = False
            read.set()
            if self._ended is not None:
                self._ended.set()

    def check(self) -> None:
        """Raise what an update that went on in the background failed with (once)."""
        error, self.error = self.error, None
        if error is not None:
            raise error

    async def ended(self) -> None:
        """Until an update going on in the background has ended."""
        if self._ended is not None:
            await self._ended.wait()

    def close(self, exc: BaseException | None) -> None:
        """The pipeline closes with ``exc`` raised (None: nothing is): raise what an update
        that went on in the background failed with, not raised yet; with ``exc``, add it to
        ``exc`` as a note instead."""
        error, self.error = self.error, None
        if error is None:
            return
        if exc is None:
            raise error
        exc.add_note(
            "a weight update that went on in the background (update_weights(wait=False)) "
            f"failed too: {describe(error)}"
        )

    async def settled(self) -> None:
        """Until an update going on in the background has ended; then :meth:`check`."""
        await self.ended()
        self.check()


async def update(
    servers: Servers,
    channel: WeightChannel | None,
    budget: Budget[Item],
    admission: Admission,
    mode: Literal["keep", "wait", "abort"],
    state: Any,
    on_read: Callable[[], Any] | None = None,
) -> tuple[float, float, int]:
    """Stop admitting; ``"wait"``: let what is in flight finish, then push; ``"abort"``: the
    servers end their generations at the next pause point, and the push goes on while they
    come back (their prompts requeued at the head before anything new is admitted);
    ``"keep"``: the servers park them at the next pause point, then the push; or, where each
    server holds its generation for its own load (``Servers.keep_without_pause``), the push
    alone. Count the version, resume the servers and admission. With ``on_read`` (a
    channel's push), the version is counted once the learner's state is read, and
    ``on_read()`` called then; the delivery and the resume go on after it.

    Returns:
        (the pause without the push, the push, the generations in flight at the pause).
    """
    started = time.monotonic()
    admission.open = False
    paused = False
    try:
        if mode == "wait":
            in_flight = budget.in_flight_count
            await as_calls("asyncexec.pipeline.pause", _drained(budget, admission), mode=mode)
        elif mode == "keep" and servers.keep_without_pause:
            # Generation goes on while the learner's state is read and delivered; each
            # server's chunks (or engine) wait for its own load only.
            in_flight = budget.in_flight_count
        else:
            paused = True
            in_flight = await as_calls("asyncexec.pipeline.pause", servers.pause(mode), mode=mode)
        pushing = time.monotonic()
        admission.observer.emit(UpdatePaused(mode, started, pushing, in_flight))
        if mode == "abort":
            # The aborted samples come back while the push goes on (no chunk runs: the
            # servers are paused to abort); admission reopens only once they are requeued.
            async with task_group() as tg:
                tg.start_soon(_drained, budget, admission)
                pushed = _push(servers, channel, budget, admission, state, on_read)
                await as_calls("asyncexec.pipeline.push", pushed)
                push_s = time.monotonic() - pushing
        else:
            pushed = _push(servers, channel, budget, admission, state, on_read)
            await as_calls("asyncexec.pipeline.push", pushed)
            push_s = time.monotonic() - pushing
        if on_read is None:
            budget.advance()
        if paused:
            await as_calls("asyncexec.pipeline.resume", servers.resume())
            paused = False  # (only now: a resume cut short is done again below)
    finally:
        if paused:  # the push failed, or the update was cancelled (its resume too): the
            # servers go on with the weights they hold
            with teardown("servers_resume", _RESUME_TIMEOUT_S):
                await servers.resume()
        admission.open = True
        admission.notify()
    return time.monotonic() - started - push_s, push_s, in_flight


async def _drained(budget: Budget[Item], admission: Admission) -> None:
    """Until every prompt in flight has come back (finished, or aborted and requeued)."""
    while budget.in_flight_count:
        await admission.wait_changed()


async def _push(
    servers: Servers,
    channel: WeightChannel | None,
    budget: Budget[Item],
    admission: Admission,
    state: Any,
    on_read: Callable[[], Any] | None = None,
) -> None:
    target = budget.version + 1
    if channel is None:
        await servers.install(state, target)
        return
    # Samples back meanwhile with a chunk made on this push wait for its mark (generation may
    # go on through the push: ``Servers.keep_without_pause``).
    admission.pushing = True
    try:
        if on_read is None:
            pushed = await channel.push()
        else:
            pushed, delivered = await channel._push_read()
        # The channel's numbering may have run ahead (pushes by others, or failed ones): this
        # push is ``target``, the chunks made before it keep the versions they had.
        admission.mark(pushed, target)
    finally:
        admission.pushing = False
        admission.notify()
    if on_read is not None:
        # The next batch may be handed: its samples' versions are the servers'. Admission,
        # closed until the resume, counts from the version they hold: after a delivery that
        # failed, the one before (its prompts would be counted as made by a version that
        # made none of them).
        budget.advance(delivered=False)
        on_read()
        await delivered()
        budget.deliver(target)
