"""The SIGINT handler of open executors, called as Python calls it: a second Ctrl-C that comes
at once runs its handler inside the first one's, between any two of its bytecodes."""

from __future__ import annotations

import asyncio
import functools
import sys
from types import FrameType
from typing import Any

import pytest

from asyncexec._driver import _interrupt


class _Runner:
    """Stands in for asyncio.Runner: its ``_on_sigint`` is what the handler hands a first
    Ctrl-C to (recognised by name, as asyncio's is)."""

    def __init__(self) -> None:
        self.cancels = 0

    def _on_sigint(self, signum: int, frame: Any, main_task: object) -> None:
        self.cancels += 1


async def _press_twice(at: int) -> tuple[int, int, bool]:
    """Press once, and again inside the first press's handler at its line boundary ``at``:
    the main task's cancellations, the hurries, and whether the second press came (False once
    ``at`` is past the handler's last line)."""
    deferral = _interrupt._Deferral()
    runner = _Runner()
    deferral.previous = functools.partial(runner._on_sigint, main_task=None)
    deferral.loop = asyncio.get_running_loop()
    hurries: list[bool] = []
    deferral.hurry = lambda: hurries.append(True)  # type: ignore[method-assign]
    code = _interrupt._Deferral.handle.__code__
    seen = 0
    nested = False

    def trace(frame: FrameType, event: str, arg: Any) -> Any:
        nonlocal seen, nested
        if frame.f_code is not code:
            return None
        if event == "line" and not nested:
            if seen == at:
                nested = True
                deferral.handle(2, frame)  # the second Ctrl-C, at this boundary
            seen += 1
        return trace

    sys.settrace(trace)
    try:
        deferral.handle(2, None)
    finally:
        sys.settrace(None)
    await asyncio.sleep(0)  # the hurry is called soon, on the loop
    return runner.cancels, len(hurries), nested


@pytest.mark.timeout(10)
async def test_a_second_ctrl_c_inside_the_first_ones_handler_still_cancels_the_main_task() -> None:
    """Defect: the handler counted presses in an attribute and read it back; a second Ctrl-C
    whose handler ran between the count and the read made both handlers see press 2, so the
    teardown was hurried but the main task was never cancelled, and the program hung (one run
    in about 16 on a loaded machine, and in CI). Here the second press is let in at every line
    boundary of the first handler in turn: each time, one press cancels and one hurries."""
    at = 0
    while True:
        cancels, hurries, pressed = await _press_twice(at)
        if not pressed:  # every boundary was tried
            break
        assert (cancels, hurries) == (1, 1), f"second press at line boundary {at}"
        at += 1
    assert at >= 3


def _one_step() -> None:
    import asyncexec

    asyncexec.report({"i": 0})


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["signal.signal", "loop.add_signal_handler"])
async def test_a_programs_own_sigint_handler_is_left_in_place_while_an_executor_is_open(
    how: str,
) -> None:
    """Defect: any Python-level handler was replaced while an executor was open, and a first
    Ctrl-C was raised as KeyboardInterrupt from the event loop instead of reaching it: a
    service's own graceful shutdown (uvicorn's ``signal.signal`` handler, aiohttp's
    ``loop.add_signal_handler``) never ran, and the program ended with a traceback."""
    import signal

    import asyncexec

    loop = asyncio.get_running_loop()
    pressed: list[int] = []
    before = signal.getsignal(signal.SIGINT)
    if how == "signal.signal":
        signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    else:
        loop.add_signal_handler(signal.SIGINT, pressed.append, signal.SIGINT)
    programs = signal.getsignal(signal.SIGINT)
    try:
        async with asyncexec.Executor(2, local=True) as executor:
            async for _ in executor.run(_one_step):
                pass
            assert signal.getsignal(signal.SIGINT) is programs
        assert signal.getsignal(signal.SIGINT) is programs
        if how == "signal.signal":  # (the loop's handler is asyncio's to call)
            assert callable(programs)
            programs(signal.SIGINT, None)
            assert pressed == [signal.SIGINT]
    finally:
        if how == "loop.add_signal_handler":
            loop.remove_signal_handler(signal.SIGINT)
        signal.signal(signal.SIGINT, before)
    assert signal.getsignal(signal.SIGINT) is before


@pytest.mark.timeout(20)
async def test_a_second_ctrl_c_hurries_another_threads_teardown_on_that_threads_loop() -> None:
    """Defect: the hurry (run on the main thread's loop) cancelled the teardown scopes of
    executors in other threads from the main thread, which asyncio does not allow (a task of
    another loop cancelled from a foreign thread: its loop is not woken, and in debug mode
    ``call_soon`` raises). A teardown of another thread is hurried from its own loop."""
    import threading

    import anyio

    entered = threading.Event()
    outcome: dict[str, Any] = {}

    def other_thread() -> None:
        async def teardown() -> None:
            with _interrupt.hurried_away() as scope:
                entered.set()
                await asyncio.sleep(10)  # a graceful part: waiting for functions to stop
            outcome["hurried"] = scope.cancelled_caught

        loop = asyncio.new_event_loop()
        loop.set_debug(True)  # asyncio checks that each call comes from the loop's thread
        try:
            loop.run_until_complete(teardown())
        except BaseException as exc:
            outcome["error"] = exc
        finally:
            loop.close()

    thread = threading.Thread(target=other_thread, daemon=True)
    thread.start()
    await anyio.to_thread.run_sync(entered.wait, 5)
    try:
        _interrupt._deferral.hurry()  # what a second Ctrl-C calls, on the main thread's loop
    finally:
        _interrupt._deferral.hurried = False
    await anyio.to_thread.run_sync(thread.join, 10)
    assert outcome == {"hurried": True}


@pytest.mark.timeout(30)
async def test_an_executor_closed_with_aclose_alone_puts_the_handler_back() -> None:
    """Defect: the SIGINT handler was put back only when the executor's block was left: one
    entered by hand and closed with ``aclose()`` alone (a service's start-up and shutdown
    hooks) left it installed for good, bound to its loop; under a later ``asyncio.run`` a
    first Ctrl-C then broke into whatever code ran instead of cancelling the main task."""
    import signal

    import asyncexec

    before = signal.getsignal(signal.SIGINT)
    executor = asyncexec.Executor(1, local=True)
    await executor.__aenter__()
    try:
        assert signal.getsignal(signal.SIGINT) is not before  # deferred while open
    finally:
        await executor.aclose()
    assert signal.getsignal(signal.SIGINT) is before
