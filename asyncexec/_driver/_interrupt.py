"""Ctrl-C while executors are open: the interrupt lands at a safe point, never in the middle of
a teardown.

Python raises ``KeyboardInterrupt`` from its SIGINT handler wherever the main thread happens to
be: ``asyncio.run`` turns the first Ctrl-C into a cancellation of the main task (safe), but the
second one is raised inside whatever code runs then, often the middle of the teardown that the
first one started (a run's task submitting a call to Ray, anyio's own bookkeeping of a cancel
scope), which then fails with an exception group of chained errors or a broken cancel scope.

While an executor is open in the main thread, SIGINT is handled here:

- the first Ctrl-C goes to the handler that was there: ``asyncio.run``'s cancels the main task,
  and the executor stops the run and tears its group down (shielded, bounded), after which
  ``asyncio.run`` raises ``KeyboardInterrupt``;
- the second hurries that teardown instead of breaking into it: the graceful parts (waiting for
  the functions to stop, the backend's shutdown, the workers' patience) are cancelled and the
  workers are killed at once, so the program ends as after one Ctrl-C, only sooner;
- a third raises ``KeyboardInterrupt`` at once, as Python's own handler does.

Without ``asyncio.run``'s handler (a loop run by hand, Python's own handler in place), a Ctrl-C
is raised from the event loop itself, between callbacks, where no task is half-way through
anything. The previous handler is put back when the last executor closes. A handler of the
program's own (a service's graceful shutdown, installed with ``signal.signal`` or
``loop.add_signal_handler``) is left in place: the program decides what a Ctrl-C does.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import signal
import threading
from collections.abc import Iterator
from typing import Any

import anyio

__all__ = ["defer_interrupts", "hurried_away", "restore_interrupts"]


class _Deferral:
    """The handler installed while executors are open in the main thread (one per process)."""

    def __init__(self) -> None:
        self.depth = 0
        self.previous: Any = None
        #: Ctrl-C presses so far, counted by one C call (see :meth:`handle`).
        self.presses = itertools.count(1)
        self.loop: asyncio.AbstractEventLoop | None = None
        #: Graceful parts of teardowns in progress (see :func:`hurried_away`), each with the
        #: loop it runs on (an executor may run in a thread of its own, on a loop of its own).
        self.scopes: set[tuple[anyio.CancelScope, asyncio.AbstractEventLoop | None]] = set()
        self.hurried = False

    def enter(self) -> bool:
        """Install the handler (on the main thread, with a running loop); whether it did."""
        if threading.current_thread() is not threading.main_thread():
            return False
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        if self.depth == 0:
            current = signal.getsignal(signal.SIGINT)
            if current is not signal.default_int_handler and not _cancels(current):
                # Ignored, set from outside Python, or the program's own (``signal.signal``,
                # or ``loop.add_signal_handler``, whose Python-level handler is asyncio's
                # no-op): the program decides what a Ctrl-C does, so it is left in place.
                return False
            self.previous, self.presses, self.loop = current, itertools.count(1), loop
            self.hurried = False
            signal.signal(signal.SIGINT, self.handle)
        self.depth += 1
        return True

    def exit(self) -> None:
        self.depth -= 1
        if self.depth == 0:
            if signal.getsignal(signal.SIGINT) == self.handle:
                signal.signal(signal.SIGINT, self.previous)
            self.previous = self.loop = None

    def handle(self, signum: int, frame: Any) -> None:
        # A second Ctrl-C at once runs its handler inside this one, between two of its
        # bytecodes: the press is taken in one C call, and only the local is read after it
        # (with ``self.presses += 1`` and the attribute read back, both handlers saw 2: the
        # run was hurried but never cancelled, and the program hung).
        press = next(self.presses)
        loop = self.loop
        if loop is None or loop.is_closed() or press > 2:
            raise KeyboardInterrupt
        if press == 2:
            loop.call_soon_threadsafe(self.hurry)
        elif _cancels(self.previous):
            self.previous(signum, frame)  # asyncio.run's: cancel the main task
        else:
            loop.call_soon_threadsafe(_interrupt)

    def hurry(self) -> None:
        """Cancel the graceful parts of the teardowns in progress, and of those to come. Runs
        on :attr:`loop`; a scope on another thread's loop is cancelled from that loop (asyncio
        allows no other thread to cancel its tasks)."""
        self.hurried = True
        for scope, loop in list(self.scopes):
            if loop is None or loop is self.loop:
                scope.cancel()
            else:
                with contextlib.suppress(RuntimeError):  # that loop has closed: nothing runs
                    loop.call_soon_threadsafe(scope.cancel)


def _cancels(handler: Any) -> bool:
    """Whether ``handler`` is asyncio.Runner's, which turns a first Ctrl-C into a cancellation."""
    return isinstance(handler, functools.partial) and (
        getattr(handler.func, "__name__", "") == "_on_sigint"
    )


def _interrupt() -> None:
    raise KeyboardInterrupt


_deferral = _Deferral()


@contextlib.contextmanager
def hurried_away() -> Iterator[anyio.CancelScope]:
    """A cancel scope around a graceful part of a teardown (waiting for functions to stop, a
    backend's shutdown, the workers' patience): a second Ctrl-C cancels it, also inside a
    shielded teardown, and one entered after that is cancelled from the start."""
    scope = anyio.CancelScope()
    if _deferral.hurried:
        scope.cancel()
    try:
        loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:  # (not on asyncio)
        loop = None
    entry = (scope, loop)
    _deferral.scopes.add(entry)
    try:
        with scope:
            yield scope
    finally:
        _deferral.scopes.discard(entry)


def defer_interrupts() -> bool:
    """Defer SIGINT as above until the matching :func:`restore_interrupts` (nested calls
    count); whether it did (only in the main thread, on a running loop)."""
    return _deferral.enter()


def restore_interrupts() -> None:
    """Undo one :func:`defer_interrupts` that returned True."""
    _deferral.exit()
