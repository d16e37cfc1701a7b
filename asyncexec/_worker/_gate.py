"""A rollout server's gate: the pause point between chunks, shared by its generations (on its
event loop) and the installs of weights (in threads of the worker). See
:mod:`asyncexec._worker._rollout` for what a pause, an abort and an install do.

Light imports only: this module runs in Ray's worker processes (``tests/worker/test_boundary.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from typing import Any, Literal

from .._wire._rollout import Sample

__all__ = ["Gate", "PauseMode"]

PauseMode = Literal["keep", "abort"]
_Waiter = tuple[asyncio.AbstractEventLoop, "asyncio.Future[None]"]


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Gate:
    """The pause point between chunks, shared by a server's generations (on its event loop) and
    the installs of weights (in threads): one lock, futures woken on their own loops."""

    def __init__(self) -> None:
        self.lock = threading.Condition()
        self.mode: PauseMode | None = None
        self.installing = 0  # installs waiting or loading
        self.loading = False  # an install's ``load`` runs (one at a time)
        self.running = 0  # chunks running now
        self.generations = 0  # generations started and not ended
        self.version: int | None = None
        #: The engine said it is paused (``pause_point = "engine"``): no step runs in it, though
        #: a chunk may be waiting for its next output.
        self.engine_at_rest = False
        self.parked: list[_Waiter] = []  # generations parked at the pause point
        self.resting: list[_Waiter] = []  # pause() calls waiting until no chunk runs
        #: ``abort()`` is collecting the aborted samples for its reply.
        self.collecting = False
        self.handed: list[Sample] = []  # the samples it collected so far
        self.emptied: list[_Waiter] = []  # abort() calls waiting until no generation is left
        self.held: list[_Waiter] = []  # handed generations whose replies wait for resume()
        self.installed: list[_Waiter] = []  # an engine's resume() waiting for an install's end

    @staticmethod
    def _wake_all(waiters: list[_Waiter]) -> None:
        for loop, future in waiters:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits there
                loop.call_soon_threadsafe(_wake, future)
        waiters.clear()

    async def enter(self) -> bool:
        """Wait at the pause point until a chunk may run (True), or the generation is to end
        (False: aborted). Counts the chunk as running when it returns True."""
        loop = asyncio.get_running_loop()
        while True:
            with self.lock:
                if self.mode == "abort":
                    return False
                if self.mode is None and not self.installing:
                    self.running += 1
                    return True
                future: asyncio.Future[None] = loop.create_future()
                self.parked.append((loop, future))
            try:
                await future
            finally:
                with self.lock, contextlib.suppress(ValueError):
                    self.parked.remove((loop, future))

    def leave(self) -> None:
        """A chunk ended (or raised)."""
        with self.lock:
            self.running -= 1
            if self.running == 0:
                self.lock.notify_all()
                self._wake_all(self.resting)

    async def wait_at_rest(self) -> None:
        """Until no chunk runs."""
        loop = asyncio.get_running_loop()
        with self.lock:
            if self.running == 0:
                return
            future: asyncio.Future[None] = loop.create_future()
            self.resting.append((loop, future))
        await future

    def pause(self, mode: PauseMode, *, collect: bool = False) -> int:
        with self.lock:
            self.mode = mode
            self.collecting = collect
            self._wake_all(self.parked)  # parked ones look again (an abort ends them)
            return self.generations

    def began(self) -> None:
        with self.lock:
            self.generations += 1

    def ended(self, sample: Sample | None, aborted: bool) -> int | None:
        """A generation ended with ``sample`` (None: it raised): its place among the samples
        ``abort()`` collects when it collects it (the sample goes back in its reply; this
        generation's own reply waits for the resume), else None."""
        with self.lock:
            handed = None
            if sample is not None and aborted and self.collecting:
                handed = len(self.handed)
                self.handed.append(sample)
            self.generations -= 1
            if self.generations == 0:
                self._wake_all(self.emptied)
            return handed

    async def wait_empty(self) -> None:
        """Until no generation is left (each ended, or was collected by ``abort()``)."""
        await self._wait_for(lambda: self.generations == 0, self.emptied)

    async def wait_resumed(self) -> None:
        """Until the server is no longer paused (``resume()``)."""
        await self._wait_for(lambda: self.mode is None, self.held)

    async def wait_loaded(self) -> None:
        """Before an engine's resume (``pause_point = "engine"``): until no install loads into
        the paused engine (none waits either, while it is paused: each loads before the
        resume, as parked chunks wait for them); from then on none starts on the pause."""

        def done() -> bool:
            return not self.loading and (not self.installing or not self.engine_at_rest)

        def then() -> None:
            self.engine_at_rest = False

        await self._wait_for(done, self.installed, then)

    def rest_kept(self) -> None:
        """An engine's resume failed (or was cancelled): the gate counts the engine as still
        paused, as the server is (``resume()`` again resumes it)."""
        with self.lock:
            if self.mode is not None:
                self.engine_at_rest = True
                self.lock.notify_all()

    async def _wait_for(
        self,
        done: Callable[[], bool],
        waiters: list[_Waiter],
        then: Callable[[], None] | None = None,
    ) -> None:
        """Until ``done()``; ``then()`` runs at once after it, under the same hold of the lock."""
        loop = asyncio.get_running_loop()
        while True:
            with self.lock:
                if done():
                    if then is not None:
                        then()
                    return
                future: asyncio.Future[None] = loop.create_future()
                waiters.append((loop, future))
            try:
                await future
            finally:
                with self.lock, contextlib.suppress(ValueError):
                    waiters.remove((loop, future))

    def collected(self) -> list[Sample]:
        """Stop collecting: the samples ``abort()`` hands back."""
        with self.lock:
            self.collecting = False
            handed, self.handed = self.handed, []
            return handed

    def rested(self) -> None:
        """The engine is paused: installs may go on while chunks wait for its output."""
        with self.lock:
            self.engine_at_rest = True
            self.lock.notify_all()

    def resume(self) -> None:
        with self.lock:
            self.mode = None
            self.engine_at_rest = False
            self._wake_all(self.held)
            if not self.installing:
                self._wake_all(self.parked)

    def install(self, load: Any, state: Any, version: int) -> None:
        """Run ``load(state, version)`` once no chunk runs, with none starting meanwhile, and
        no other install loading: installs load one at a time, and a version not newer than
        the one held (also one installed while this one waited) is skipped. Blocking: runs in
        a thread (never on the loop the chunks run on)."""
        with self.lock:
            if self._stale(version):
                return
            self.installing += 1
        try:
            with self.lock:
                self.lock.wait_for(
                    lambda: not self.loading and (self.running == 0 or self.engine_at_rest)
                )
                if self._stale(version):
                    return
                self.loading = True
            try:
                load(state, version)
                with self.lock:
                    self.version = version
            finally:
                with self.lock:
                    self.loading = False
        finally:
            with self.lock:
                self.installing -= 1
                self.lock.notify_all()  # an install waiting for this one's load
                self._wake_all(self.installed)
                if not self.installing and self.mode is None:
                    self._wake_all(self.parked)

    def _stale(self, version: int) -> bool:
        """Whether ``version`` is not newer than the one held (under the lock)."""
        return self.version is not None and version <= self.version
