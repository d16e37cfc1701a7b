"""A pipeline's weight updates: one at a time, each around the rollouts in flight (pause them
as the mode says, push, resume), each emitted once as it pauses and as it ends (``_events``)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Literal

from ..._errors import ExecutorStateError
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

    async def run(self, mode: Literal["keep", "wait", "abort"], state: Any) -> None:
        """One update (the arguments checked).

        Raises:
            ExecutorStateError: strict mode and no batch was taken at this version; or
                another update is going on.
            ChannelError: the push failed (the servers are resumed first).
        """
        if self.updating:
            raise ExecutorStateError("update_weights() is already going on")
        self.budget.check_update()
        self.updating = True
        try:
            with spanned("asyncexec.pipeline.update", mode=mode) as span:
                pause_s, push_s, in_flight = await update(
                    self.servers, self.channel, self.budget, self.admission, mode, state
                )
                if span is not None:
                    span.set_attribute("version", self.budget.version)
        finally:
            self.updating = False
        version = self.budget.version
        self.observer.emit(UpdateEnded(mode, version, pause_s, push_s, in_flight))


async def update(
    servers: Servers,
    channel: WeightChannel | None,
    budget: Budget[Item],
    admission: Admission,
    mode: Literal["keep", "wait", "abort"],
    state: Any,
) -> tuple[float, float, int]:
    """Stop admitting; ``"wait"``: let what is in flight finish, then push; ``"abort"``: the
    servers end their generations at the next pause point, and the push goes on while they
    come back (their prompts requeued at the head before anything new is admitted);
    ``"keep"``: the servers park them at the next pause point, then the push. Count the
    version, resume the servers and admission.

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
                pushed = _push(servers, channel, budget, admission, state)
                await as_calls("asyncexec.pipeline.push", pushed)
                push_s = time.monotonic() - pushing
        else:
            pushed = _push(servers, channel, budget, admission, state)
            await as_calls("asyncexec.pipeline.push", pushed)
            push_s = time.monotonic() - pushing
        budget.advance()
        if paused:
            paused = False
            await as_calls("asyncexec.pipeline.resume", servers.resume())
    finally:
        if paused:  # the push failed: generation goes on with the weights it had
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
) -> None:
    target = budget.version + 1
    if channel is None:
        await servers.install(state, target)
        return
    pushed = await channel.push()
    # Versions pushed by others meanwhile shift the numbering: the latest push is ``target``.
    admission.offset = pushed - target
