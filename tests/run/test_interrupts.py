"""Ctrl-C in a program that runs an executor, against a real Ray: a driver process interrupted
with SIGINT once, and twice in a row, ends with a plain KeyboardInterrupt."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import ray

pytestmark = [pytest.mark.usefixtures("ray_local"), pytest.mark.timeout(120)]

DRIVER = os.path.join(os.path.dirname(__file__), "interrupted_driver.py")


def _interrupt(presses: int, gap_s: float, mode: str = "fast") -> tuple[int, str]:
    """Run the driver, press Ctrl-C ``presses`` times ``gap_s`` apart once steps flow; its exit
    status and what it printed on stderr."""
    env = dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address)
    env["MODE"] = mode
    driver = subprocess.Popen(
        [sys.executable, DRIVER], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    assert driver.stdout is not None
    try:
        for line in driver.stdout:
            if "READY" in line:
                break
        for _ in range(presses):
            driver.send_signal(signal.SIGINT)
            time.sleep(gap_s)  # the fault's timing (how fast the user presses), not a sync
        try:
            _, err = driver.communicate(timeout=40)
        except subprocess.TimeoutExpired:
            driver.send_signal(signal.SIGUSR1)  # its tasks' stacks, for the failure
            time.sleep(2)
            driver.kill()
            _, err = driver.communicate()
            pytest.fail(f"the driver did not end within 40 s of the Ctrl-C; its tasks:\n{err}")
        return driver.returncode, err
    finally:
        if driver.poll() is None:  # (a failed test leaves no driver streaming on the cluster)
            driver.kill()
            driver.communicate()


def _ends_with_a_plain_interrupt(err: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines and lines[-1] == "KeyboardInterrupt", err
    for noise in ("ExceptionGroup", "cancel scope", "the run failed", "WouldBlock", "| "):
        assert noise not in err, err
    assert err.count("During handling of the above exception") <= 1, err


@pytest.mark.parametrize("stream", ["fast", "slow"])
def test_one_ctrl_c_ends_with_a_keyboard_interrupt(stream: str) -> None:
    """A consumer cancelled while it waited for a step carried anyio's internal WouldBlock as
    its context (about 40 lines)."""
    status, err = _interrupt(1, 0.0, stream)
    assert status == 1
    _ends_with_a_plain_interrupt(err)


@pytest.mark.parametrize("gap_s", [0.0, 0.001])
def test_two_ctrl_c_in_a_row_end_as_one_does(gap_s: float) -> None:
    """The second Ctrl-C was raised inside the teardown the first had started (a run's task
    submitting a call to Ray), which ended in an exception group or a broken cancel scope."""
    status, err = _interrupt(2, gap_s)
    assert status == 1
    _ends_with_a_plain_interrupt(err)


def test_a_second_ctrl_c_hurries_a_teardown_that_waits_for_a_stuck_function() -> None:
    """The first Ctrl-C's teardown waits up to ``stop_timeout_s`` (60 s) for functions that do
    not stop; the second skips that wait and kills the workers, and the program ends as after
    one Ctrl-C (bounded here well below the wait: it would time out otherwise)."""
    status, err = _interrupt(2, 0.5, "stuck")
    assert status == 1
    _ends_with_a_plain_interrupt(err)
