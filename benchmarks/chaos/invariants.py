"""The invariants a delivered stream and a finished run must hold, and the bounds the runner
holds scenarios to. Pure: no Ray, no I/O."""

from __future__ import annotations

from collections.abc import Sequence
from itertools import groupby
from typing import Any

import asyncexec

__all__ = [
    "LOOP_LAG_BOUND_S",
    "RECOVERY_BOUND_S",
    "SCENARIO_TIMEOUT_S",
    "STOP_BOUND_S",
    "Problem",
    "check_attempts",
    "check_checkpoint",
    "check_complete",
    "check_index",
    "check_state",
    "check_stream",
    "expected_total",
]

#: Bound on the time from a fault to the first step of the attempt that replaces it, per fault.
RECOVERY_BOUND_S = 30.0
#: Bound on the time a cancelled consumer or a shutdown takes to return.
STOP_BOUND_S = 30.0
#: Bound on one scenario; past it the scenario fails with invariant ``no_hang``.
SCENARIO_TIMEOUT_S = 180.0
#: The longest event-loop stall tolerated (2-core machines stall for scheduling noise).
LOOP_LAG_BOUND_S = 1.0

#: An invariant broken, and how.
Problem = tuple[str, str]


def expected_total(rank: int, step: int) -> int:
    """The counter's state of ``rank`` after ``step``, as an undisturbed run computes it."""
    return (rank + 1) * step * (step + 1) // 2


def _ranges(values: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 6]`` as ``0-2,5-6``: short enough for a failure line."""
    out: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        out.append(str(values[i]) if i == j else f"{values[i]}-{values[j]}")
        i = j + 1
    return ",".join(out) or "none"


def check_stream(
    steps: Sequence[asyncexec.Step], *, workers: int, every: int, first: int = 0
) -> list[Problem]:
    """Check a delivered stream (whole or a prefix) against the semantics.

    ``Step.index`` counts 0, 1, 2, ... across attempts; every step holds one report per rank, in
    rank order, for the same function step and the step's attempt; every rank's total is an
    undisturbed run's; a step carries a checkpoint exactly when its function step is a multiple
    of ``every``; attempts increase; within an attempt the function's steps are consecutive; the
    first attempt starts at ``first``, each later one right after the latest checkpoint that any
    delivered step carried.
    """
    problems = check_index(steps)
    for s in steps:
        ranks = [r.rank for r in s.reports]
        if ranks != list(range(workers)):
            problems.append(("ranks", f"step {s.index} has reports of ranks {ranks}"))
            continue
        made = {r.metrics["step"] for r in s.reports}
        if len(made) != 1:
            problems.append(("same_step", f"step {s.index} mixes function steps {sorted(made)}"))
            continue
        value = made.pop()
        said = sorted({r.metrics["attempt"] for r in s.reports})
        if said != [s.attempt]:
            problems.append(("attempt_number", f"step {s.index} of {s.attempt} from {said}"))
        for r in s.reports:
            problems += check_state(r, value)
        problems += check_checkpoint(s, value, every, f"step {s.index} (function step {value})")
    if problems:
        return problems
    rows = [(s.attempt, s.reports[0].metrics["step"], s.checkpoint is not None) for s in steps]
    return check_attempts(rows, first=first)


def check_index(steps: Sequence[asyncexec.Step]) -> list[Problem]:
    """``Step.index`` counts 0, 1, 2, ... across the stream."""
    indices = [s.index for s in steps]
    if indices != list(range(len(steps))):
        return [("step_index", f"indices {_ranges(indices)}, expected 0-{len(steps) - 1}")]
    return []


def check_state(report: asyncexec.Report, value: int) -> list[Problem]:
    """The counter's state a report carries at function step ``value``: an undisturbed run's."""
    want = expected_total(report.rank, value)
    if report.metrics["total"] == want:
        return []
    got = report.metrics["total"]
    return [("state", f"rank {report.rank} at step {value}: total {got}, expected {want}")]


def check_checkpoint(s: asyncexec.Step, value: int, every: int, where: str) -> list[Problem]:
    """A step carries a checkpoint exactly when its function step is a multiple of ``every``."""
    if (s.checkpoint is not None) == (value % every == 0):
        return []
    return [("checkpoint", f"{where} {'has' if s.checkpoint else 'lacks'} a checkpoint")]


def check_attempts(
    rows: Sequence[tuple[int, int, bool]], *, first: int = 0, who: str = ""
) -> list[Problem]:
    """Check the order of one stream's function steps, given as (attempt, function step,
    carries a checkpoint) in delivery order: attempts increase; within an attempt the steps are
    consecutive; the first attempt starts at ``first``, each later one right after the latest
    checkpoint delivered before it. ``who`` prefixes the details (``"rank 2: "``)."""
    problems: list[Problem] = []
    latest = first - 1
    seen: list[int] = []
    for attempt, group in groupby(rows, key=lambda row: row[0]):
        batch = list(group)
        if attempt in seen or (seen and attempt < seen[-1]):
            problems.append(("attempt_order", f"{who}attempt {attempt} after attempts {seen}"))
        seen.append(attempt)
        values = [value for _, value, _ in batch]
        if values[0] != latest + 1:
            problems.append(
                (
                    "resume",
                    f"{who}attempt {attempt} started at step {values[0]}; the latest "
                    f"delivered checkpoint was step {latest}",
                )
            )
        if values != list(range(values[0], values[0] + len(values))):
            problems.append(
                ("consecutive", f"{who}attempt {attempt} delivered steps {_ranges(values)}")
            )
        for _, value, checkpointed in batch:
            if checkpointed:
                latest = value
    return problems


def check_complete(
    steps: Sequence[asyncexec.Step], return_values: Sequence[Any], *, workers: int, total: int
) -> list[Problem]:
    """A finished run: every function step was delivered at least once and the return values are
    an undisturbed run's."""
    problems: list[Problem] = []
    made = {s.reports[0].metrics["step"] for s in steps if s.reports}
    lost = sorted(set(range(total)) - made)
    if lost:
        problems.append(("no_step_lost", f"function steps never delivered: {_ranges(lost)}"))
    expected = [expected_total(r, total - 1) for r in range(workers)]
    if list(return_values) != expected:
        problems.append(
            ("final_state", f"return values {list(return_values)}, expected {expected}")
        )
    return problems
