"""A weight update around the rollouts in flight: pause them as the mode says, push, resume."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Literal

import anyio

from ._admission import Admission, Item
from ._budget import Budget
from ._servers import Servers

if TYPE_CHECKING:
    from ..channel import WeightChannel

__all__ = ["update"]

#: How long a failed update waits for the servers to resume.
_RESUME_TIMEOUT_S = 10.0


async def update(
    servers: Servers,
    channel: WeightChannel | None,
    budget: Budget[Item],
    admission: Admission,
    mode: Literal["keep", "wait", "abort"],
    state: Any,
) -> tuple[float, float, int]:
    """Stop admitting; ``"wait"``: let what is in flight finish; ``"abort"``: the servers end
    their generations at the next pause point, and the driver waits for them to come back
    (their prompts requeued at the head before anything new is admitted); ``"keep"``: the
    servers park them at the next pause point. Then push the next version, count it, resume
    the servers and admission.

    Returns:
        (the pause without the push, the push, the generations in flight at the pause).
    """
    started = time.monotonic()
    admission.open = False
    paused = False
    try:
        if mode == "wait":
            in_flight = budget.in_flight_count
        else:
            paused = True
            in_flight = await servers.pause(mode)
        if mode != "keep":
            while budget.in_flight_count:
                await admission.wait_changed()
        pushing = time.monotonic()
        await _push(servers, channel, budget, admission, state)
        push_s = time.monotonic() - pushing
        budget.advance()
        if paused:
            paused = False
            await servers.resume()
    finally:
        if paused:  # the push failed: generation goes on with the weights it had
            with anyio.CancelScope(shield=True), anyio.move_on_after(_RESUME_TIMEOUT_S):
                await servers.resume()
        admission.open = True
        admission.notify()
    return time.monotonic() - started - push_s, push_s, in_flight


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
