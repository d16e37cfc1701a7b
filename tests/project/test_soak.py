"""A small soak (``benchmarks/soak.py`` at a tenth of its size) against the shared local Ray:
executor lifecycles in a row, then several executors at once in one event loop; nothing may be
left in the cluster, and the driver's threads and open file descriptors may not grow beyond a
small tolerance.

The lifecycles in a row are as many as catch a leak of one thread or one descriptor per
lifecycle (more than both tolerances: ``LIFECYCLES``); slower leaks are the full soak's
(``python -m benchmarks.soak``: 200 lifecycles)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import soak

pytestmark = pytest.mark.usefixtures("ray_local")

#: Lifecycles in a row: twice the larger tolerance, so that one thread or one file descriptor
#: kept per lifecycle fails the test. (30 ran before: they also caught a descriptor kept every
#: other lifecycle; such slower leaks are left to the full soak.)
LIFECYCLES = 2 * max(soak.THREAD_TOLERANCE, soak.FD_TOLERANCE)


def _assert_no_growth(phase: soak.Phase) -> None:
    assert phase.end is not None
    report = soak.render([phase])
    assert phase.end.actors == 0, report
    assert phase.end.groups == 0, report
    assert phase.growth["threads"] <= soak.THREAD_TOLERANCE, report
    assert phase.growth["fds"] <= soak.FD_TOLERANCE, report
    assert phase.problems() == [], report


@pytest.mark.timeout(240)  # 32 lifecycles took over 90 s on a slow 2-core CI machine
async def test_lifecycles_in_a_row_leave_nothing_and_grow_nothing(tmp_path: Path) -> None:
    phase = await soak.lifecycles(LIFECYCLES, tmp_path, warmup=2)
    assert len(phase.seconds) == LIFECYCLES
    _assert_no_growth(phase)


@pytest.mark.timeout(240)
async def test_eight_executors_at_once_in_one_loop_leave_nothing_and_grow_nothing(
    tmp_path: Path,
) -> None:
    phase = await soak.concurrent(8, 2, tmp_path, warmup=1)
    assert phase.count == 16 and len(phase.seconds) == 2
    # The service case: the loop keeps serving while eight groups start and stop around it.
    assert phase.max_lag_s < 0.5, soak.render([phase])
    _assert_no_growth(phase)


def test_the_soak_verdict_flags_leftovers_and_growth() -> None:
    phase = soak.Phase("lifecycles", 1)
    phase.start = soak.Snapshot(actors=0, groups=0, threads=4, fds=37, rss_mib=100.0)
    phase.end = soak.Snapshot(
        actors=1, groups=0, threads=4 + soak.THREAD_TOLERANCE + 1, fds=37, rss_mib=400.0
    )
    problems = phase.problems()
    assert any("1 actor(s)" in p for p in problems)
    assert any("threads grew" in p for p in problems)
    assert not any("descriptors" in p for p in problems)
