"""A vLLM engine paused as ``AsyncLLM.pause_generation`` pauses it, without its fixed sleep: what
the sleep hopes for is waited for in its place (see :func:`pause`); and the engine's pauses,
resumes and weight loads taking their turns (:class:`Turns`). On the engine's own loop."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any, Literal

__all__ = ["PAUSE_OUTPUTS_S", "UNSENT", "Turns", "pause"]

#: The longest a pause waits for the outputs the engine sent before it paused (to abort, the
#: final outputs of the requests it ended; to keep, those of its last step).
PAUSE_OUTPUTS_S = 5.0
#: The message a pause to abort cancels a request's pump with when the request had not reached
#: the engine yet (its pump ends it as aborted, with no output).
UNSENT = "asyncexec: paused to abort before the request reached the engine"


async def pause(
    engine: Any, pumps: Mapping[str, asyncio.Task[None]], mode: Literal["keep", "abort"]
) -> None:
    """On the engine loop: ``engine.pause_generation(mode=mode, clear_cache=mode == "abort")``,
    but what its fixed sleep hopes for waited for in its place.

    ``AsyncLLM.pause_generation`` (vLLM 0.32) clears the multi-modal cache (to abort),
    pauses the scheduler (``engine_core.pause_scheduler_async``: the core finishes its step,
    to abort also ends every request it holds, sends those outputs, then answers), then
    sleeps 20 ms so that the outputs sent before the answer are likely through vLLM's
    output handling when it returns (the answer does not wait for them: the client's
    socket task takes it, and queues the outputs for the output handler). Here the same
    steps run, and the pause returns once they are through: to abort, once the final
    output of every request the core held reached its ``generate`` loop (a request that
    was still being prepared, and would reach the core after the pause, ended too); to
    keep, once
    the output handler has taken every output queued and the requests' pumps have tagged
    theirs with the version that made them (a load that came first would tag the old
    weights' tokens with the new version). At once when they are, and no later. A vLLM
    without these internals gets its public ``pause_generation``."""
    core = getattr(engine, "engine_core", None)
    internals: tuple[Any, Any, Any] = (
        getattr(getattr(engine, "renderer", None), "clear_mm_cache_async", None),
        getattr(core, "pause_scheduler_async", None),
        # The requests sent to the core, by the ids they were given.
        getattr(getattr(engine, "output_processor", None), "external_req_ids", None),
    )
    if any(x is None for x in internals) or not hasattr(engine, "output_handler"):
        await engine.pause_generation(mode=mode, clear_cache=mode == "abort")
        return
    clear_mm_cache, pause_scheduler, held = internals
    if mode == "keep":
        await pause_scheduler(mode="keep", clear_cache=False)
        await _outputs_through(engine, core)
        return
    await clear_mm_cache()
    # No wait between this and the pause's message (one loop): vLLM records a request and
    # sends it to the core in one step, and the core, which takes its input in order, ends
    # each of these.
    ending = [pump for request_id, pump in pumps.items() if request_id in held]
    preparing = [request_id for request_id in pumps if request_id not in held]
    await pause_scheduler(mode="abort", clear_cache=True)
    # One turn: a pump whose request vLLM finished before the pause (no longer recorded, its
    # last output in its collector) has taken that output and ended (the pause's round trip
    # to the core let it already; this makes it sure), so it is not taken for one unsent.
    await asyncio.sleep(0)
    # A request whose pump was still preparing it (vLLM renders a prompt in a thread pool)
    # reaches the core after the pause, and the core holds what it gets while paused until a
    # resume: its generation would wait through the pause (an ``abort()`` for ever). One
    # recorded since is aborted (its final output ends its generation), one not yet is
    # stopped before it is sent.
    for request_id in preparing:
        pump = pumps.get(request_id)
        if pump is None:  # it ended meanwhile
            continue
        if request_id in held:
            await engine.abort(request_id)
        else:
            pump.cancel(UNSENT)
        ending.append(pump)
    if ending:
        # Plain asyncio: the pumps are tasks of this loop that their requests own; this
        # only watches them end (at the bound, they go on and the pause returns).
        await asyncio.wait(ending, timeout=PAUSE_OUTPUTS_S)


class Turns:
    """A vLLM engine's pauses, resumes and weight loads, one at a time on the engine loop (a load
    into a running engine pauses it and resumes it after, which must neither undo a pause that
    came meanwhile nor be undone by a resume), and what a request's pump waits for before it
    reaches the engine. ``pumps``: the pump of each request in flight, by request id."""

    def __init__(self, engine: Any, pumps: Mapping[str, asyncio.Task[None]]) -> None:
        self.engine = engine
        self.pumps = pumps
        self.lock = asyncio.Lock()
        #: The engine is paused to abort: a request's pump that starts now ends at once,
        #: aborted, rather than wait in the paused engine for a resume.
        self.aborting = False
        #: Set while weights go into an engine with no request in it, which is not paused for
        #: the load: a request's pump that starts meanwhile waits for the load's end.
        self.idle_load: asyncio.Event | None = None

    async def admit(self) -> bool:
        """In a request's pump, before the request reaches the engine: after a load into the
        idle engine going on; False when the request ends unsent (a pause to abort came
        first)."""
        while self.idle_load is not None:
            await self.idle_load.wait()
        return not self.aborting

    async def pause(self, mode: Literal["keep", "abort"]) -> None:
        """The engine paused (see :func:`pause`), after a load going on."""
        async with self.lock:
            self.aborting = mode == "abort"
            await pause(self.engine, self.pumps, mode)

    async def resume(self) -> None:
        """The engine resumed, after a load going on."""
        async with self.lock:
            await self.engine.resume_generation()
            self.aborting = False

    @contextlib.asynccontextmanager
    async def loading(self) -> AsyncIterator[None]:
        """Around a load of weights into the engine. A running engine is paused to keep for it
        (a load between two of its steps would tag the tokens sampled before the server learns
        the new version with the old one) and resumed after, unless the load fails (its weights
        are torn: see ``VLLMServer.load_weights``). An engine with no request in it is not
        paused: the requests that come during the load wait for its end instead, which spares
        the engine's core three round trips (whether it is paused, the pause, the resume) and a
        wait for the last step's outputs."""
        async with self.lock:
            held = None if self.pumps else asyncio.Event()
            running = held is None and not await self.engine.is_paused()
            if running:
                await pause(self.engine, self.pumps, "keep")
            self.idle_load = held  # (idle: in the same step as the look at the pumps)
            try:
                yield
            except Exception:
                running = False  # not resumed
                raise
            finally:
                if running:
                    await self.engine.resume_generation()
                if held is not None:
                    self.idle_load = None
                    held.set()


async def _outputs_through(engine: Any, core: Any) -> None:
    """Until the engine's output handler waits for outputs with none queued (every output
    the core sent is in its request's collector), then one turn of the loop: the pumps it
    woke meanwhile (queued before this task) have run. Bounded by ``PAUSE_OUTPUTS_S``;
    vLLM's 20 ms sleep where its client lacks the queue looked at."""
    queue = getattr(core, "outputs_queue", None)
    waiting = getattr(queue, "_getters", None)  # the handler's get(), while it waits
    if queue is None or waiting is None:
        await asyncio.sleep(0.02)
        return
    handler = engine.output_handler
    deadline = time.monotonic() + PAUSE_OUTPUTS_S
    while not (queue.empty() and (waiting or handler is None or handler.done())):
        if time.monotonic() > deadline:
            return
        await asyncio.sleep(0)
    await asyncio.sleep(0)
