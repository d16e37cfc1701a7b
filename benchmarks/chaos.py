"""Chaos runner: seeded fault scenarios against a real Ray, and the invariants checked after each.

    python benchmarks/chaos.py --seed 1 --scenarios 30     # every kind, node loss included
    python benchmarks/chaos.py --seed 7 --kinds kill_step,cancel --scenarios 6
    python benchmarks/chaos.py --seed 1 --only 12          # replay scenario #12 of seed 1 alone

Each scenario is drawn from the seed (its kind cycles through a shuffled list of every kind; its
parameters come from a generator seeded by the seed and its number, so ``--only N`` replays it
exactly), runs a deterministic checkpointing counter on a group of workers, injects one fault, and
checks what asyncexec promises:

- the steps delivered are exactly those the semantics allow: ``Step.index`` counts 0, 1, 2, ...
  across attempts; within an attempt the function's steps are consecutive (none lost, none
  duplicated); attempt ``a + 1`` resumes right after the latest checkpoint any delivered step
  carried; every rank's state at every step equals an undisturbed run's; every step the function
  made appears; the final return values equal an undisturbed run's;
- the attempts and failures are those the restart policy allows (``max_restarts=N``: at most N
  restarts, then ``RestartsExhaustedError(attempts=N + 1)``), each failure of the kind injected and
  naming the rank;
- recovery (fault to the next attempt's first step) and cancellation finish within a bound;
- the event loop is never frozen (a heartbeat beside every scenario);
- nothing is left in the cluster: no live ``_Worker`` actor, no placement group that is not removed.

It prints one table (per kind: run, passed, failed, recovery p50/max; failures by invariant; each
failure with its parameters) and exits with status 1 on any failure. Ray runs as a
``ray.cluster_utils.Cluster`` (a head node of 4 CPUs; node-loss scenarios add a node and remove
it), or as a plain local Ray with ``--no-nodes``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import groupby
from pathlib import Path
from typing import Any

import anyio
import ray
import tenacity

import asyncexec

try:
    from benchmarks._probes import Heartbeat, live_placement_groups, live_workers, percentile
except ImportError:  # run as a script: benchmarks/ itself is on sys.path
    from _probes import (  # type: ignore[no-redef,import-not-found,unused-ignore]
        Heartbeat,
        live_placement_groups,
        live_workers,
        percentile,
    )

__all__ = [
    "FAST_KINDS",
    "KINDS",
    "Env",
    "Outcome",
    "Scenario",
    "check_complete",
    "check_stream",
    "counter",
    "draw_scenarios",
    "expected_total",
    "leftovers",
    "render_table",
    "run_scenario",
]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

#: Every kind of fault the runner injects, with what it does.
KINDS: dict[str, str] = {
    "kill_step": "SIGKILL one rank from the driver when the consumer sees a random step",
    "kill_two": "SIGKILL two ranks at the same moment",
    "kill_complete": "a rank kills itself once every rank has reported step k-1: exactly 0..k-1",
    "kill_startup": "SIGKILL a rank inside the init hook of the executor's first start-up",
    "kill_restart": "SIGKILL a rank, then one in the restart's start-up (armed in the wait)",
    "kill_shutdown": "SIGKILL a rank at a random moment while the executor shuts down mid-run",
    "kill_end": "SIGKILL a rank when the consumer sees the last step (a restart is optional)",
    "kill_idle": "SIGKILL a rank between runs; execute() then run() (probing first, when drawn)",
    "kill_neighbour": "SIGKILL a rank of one of two executors in one loop: the other is untouched",
    "hang_startup": "SIGKILL a rank, then hold an init hook in the restart: start-up deadline",
    "exhaust": "a rank dies on every attempt: max_restarts restarts, then RestartsExhaustedError",
    "hang_step": "a rank stops reporting: the step deadline declares it hung",
    "hang_gil": "a rank holds the GIL in C code: health checks declare it hung",
    "cancel": "the consumer is cancelled at a random moment (after a kill, half the time)",
    "user_error": "the function raises on a rank (retried or not, drawn)",
    "node_lost": "the node of a rank is removed from the cluster",
}
#: The kinds that need no cluster of several nodes and take a few seconds each.
FAST_KINDS = tuple(k for k in KINDS if k not in ("node_lost", "hang_gil"))

#: Bound on the time from a fault to the first step of the attempt that replaces it, per fault.
RECOVERY_BOUND_S = 30.0
#: Bound on the time a cancelled consumer or a shutdown takes to return.
STOP_BOUND_S = 30.0
#: Bound on one scenario; past it the scenario fails with invariant ``no_hang``.
SCENARIO_TIMEOUT_S = 180.0
#: The longest event-loop stall tolerated (2-core machines stall for scheduling noise).
LOOP_LAG_BOUND_S = 1.0
#: How long a rank that faults after a barrier waits for the others' reports to reach the driver.
BARRIER_MARGIN_S = 0.5
#: The seconds each step of the counter sleeps.
STEP_SLEEP_S = 0.02
#: The seconds a slow consumer spends on each step.
SLOW_CONSUMER_S = 0.1
#: The seconds each step sleeps in node-loss scenarios.
NODE_STEP_SLEEP_S = 0.25


# The worker side: a deterministic counter, its faults, and a gated init hook -----------------


def expected_total(rank: int, step: int) -> int:
    """The counter's state of ``rank`` after ``step``, as an undisturbed run computes it."""
    return (rank + 1) * step * (step + 1) // 2


def counter(config: dict[str, Any]) -> int:
    """Each rank sums ``step * (rank + 1)``, checkpoints every ``every`` steps and resumes from the
    checkpoint it is given; the fault in ``config["fault"]`` strikes on its rank and step.

    Reports ``{"step", "total", "attempt"}``; returns the final total.
    """
    ctx = asyncexec.get_context()
    rank, attempt = ctx.world_rank, ctx.attempt or 1
    start, total = 0, 0
    checkpoint = asyncexec.get_checkpoint()
    if checkpoint is not None:
        state = json.loads((Path(checkpoint.path) / f"rank{rank}.json").read_text())
        start, total = state["step"] + 1, state["total"]
    fault: dict[str, Any] | None = config.get("fault")
    for step in range(start, config["steps"]):
        if fault is not None and fault["rank"] == rank:
            _strike(fault, config, ctx.world_size, attempt, step)
        total += step * (rank + 1)
        time.sleep(config["sleep"])
        saved = None
        if step % config["every"] == 0:
            tmp = Path(tempfile.mkdtemp(dir=config["dir"]))
            (tmp / f"rank{rank}.json").write_text(json.dumps({"step": step, "total": total}))
            saved = asyncexec.Checkpoint.from_directory(tmp)
        asyncexec.report({"step": step, "total": total, "attempt": attempt}, checkpoint=saved)
        if fault is not None and fault.get("barrier") and attempt == 1 and step == fault["at"] - 1:
            Path(config["dir"], f"reported-r{rank}").touch()
    return total


def _strike(
    fault: dict[str, Any], config: dict[str, Any], world: int, attempt: int, step: int
) -> None:
    kind = fault["kind"]
    if kind == "die_always":
        if step >= fault["at"]:
            _mark_fault(config, attempt)
            os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
        return
    if attempt != 1 or step != fault["at"]:
        return
    if fault.get("barrier"):
        # Every rank has reported step at-1; the margin lets those reports reach the driver, so
        # every step before this one is complete there when the fault strikes.
        deadline = time.monotonic() + 30
        directory = Path(config["dir"])
        while time.monotonic() < deadline:
            if len(list(directory.glob("reported-r*"))) >= world:
                break
            time.sleep(0.005)
        time.sleep(BARRIER_MARGIN_S)
    _mark_fault(config, attempt)
    if kind == "die":
        os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(60)
    elif kind == "raise":
        raise ValueError(f"chaos: bad batch at step {step} on rank {fault['rank']}")
    elif kind == "hang":
        time.sleep(3600)
    elif kind == "gil":
        # Catastrophic backtracking in the C regex engine: the GIL is held for minutes.
        re.match(r"(a+)+$", "a" * 64 + "b")


def _mark_fault(config: dict[str, Any], attempt: int) -> None:
    Path(config["dir"], f"fault-a{attempt}-{os.getpid()}.time").write_text(repr(time.time()))


def gate_hook(directory: str) -> None:
    """An init hook that announces the worker (``hook-<pid>.json``) and waits until the driver's
    :class:`Gate` releases it (``go-<pid>``) or kills it."""
    ctx = asyncexec.get_context()
    pid = os.getpid()
    tmp = Path(directory, f".hook-{pid}.tmp")
    tmp.write_text(json.dumps({"rank": ctx.world_rank, "pid": pid}))
    tmp.replace(Path(directory, f"hook-{pid}.json"))
    go = Path(directory, f"go-{pid}")
    deadline = time.monotonic() + 60
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(0.005)


# The driver side ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    """One drawn scenario. ``seed`` and ``number`` reproduce it; the rest is drawn from them."""

    seed: int
    number: int
    kind: str
    workers: int
    steps: int
    every: int
    buffer: int
    at: int
    rank: int
    rank2: int
    max_restarts: int
    delay_s: float
    flag: bool
    slow: bool = False

    def describe(self) -> str:
        extra = {
            "kill_two": f" ranks={self.rank},{self.rank2}",
            "exhaust": f" max_restarts={self.max_restarts}",
            "cancel": f" cancel_after={self.delay_s:.2f}s kill_first={self.flag}",
            "kill_shutdown": f" kill_after={self.delay_s:.2f}s",
            "user_error": f" retried={self.flag}",
            "kill_idle": f" execute_first={self.flag}",
            "hang_startup": f" hold_rank={self.rank2}",
            "kill_restart": f" startup_rank={self.rank2}",
        }.get(self.kind, "")
        return (
            f"#{self.number} {self.kind} seed={self.seed} workers={self.workers} "
            f"steps={self.steps} every={self.every} buffer={self.buffer} at={self.at} "
            f"rank={self.rank}{extra}{' slow_consumer' if self.slow else ''}"
        )


def draw_scenarios(seed: int, count: int, kinds: Sequence[str] = tuple(KINDS)) -> list[Scenario]:
    """Draw ``count`` scenarios from ``seed``: kinds cycle through a shuffled list of ``kinds``
    (so every kind appears once ``count >= len(kinds)``); parameters come from a generator seeded
    by ``seed`` and the scenario's number."""
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"unknown scenario kinds {unknown!r}; known: {', '.join(KINDS)}")
    order = list(kinds)
    random.Random(seed).shuffle(order)
    return [draw_one(seed, number, order[number % len(order)]) for number in range(count)]


def draw_one(seed: int, number: int, kind: str) -> Scenario:
    """Scenario ``number`` of ``seed``, of ``kind``."""
    rng = random.Random(f"{seed}/{number}")
    workers = 2 if kind == "node_lost" else rng.choice((2, 3))
    steps = rng.randrange(12, 25)
    rank = rng.randrange(workers)
    if kind == "node_lost":
        rank = 1  # the rank on the added node: the driver's node holds rank 0
    return Scenario(
        seed=seed,
        number=number,
        kind=kind,
        workers=workers,
        steps=steps,
        every=rng.randrange(2, 6),
        buffer=rng.randrange(2, 5),
        at=rng.randrange(0 if kind in ("kill_step", "kill_two", "cancel") else 1, steps - 4),
        rank=rank,
        rank2=(rank + rng.randrange(1, workers)) % workers,
        max_restarts=rng.randrange(0, 3),
        delay_s=rng.uniform(0.0, 0.3) if kind == "kill_shutdown" else rng.uniform(0.0, 1.5),
        flag=rng.random() < 0.5,
        slow=rng.random() < 0.5,
    )


@dataclass
class Env:
    """Where scenarios run: a storage root, and the cluster when node loss can be injected."""

    root: Path
    cluster: Any = None
    #: The node a node_lost scenario removes, added before the scenario starts.
    node: Any = None


@dataclass
class Outcome:
    """What one scenario saw and which invariants it broke."""

    scenario: Scenario
    problems: list[tuple[str, str]] = field(default_factory=list)
    recovery_s: list[float] = field(default_factory=list)
    seconds: float = 0.0
    max_lag_s: float = 0.0
    steps: int = 0
    attempts: int = 0
    note: str = ""

    @property
    def passed(self) -> bool:
        return not self.problems

    def fail(self, invariant: str, detail: str) -> None:
        self.problems.append((invariant, detail))


Problem = tuple[str, str]


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
    problems: list[Problem] = []
    indices = [s.index for s in steps]
    if indices != list(range(len(steps))):
        problems.append(("step_index", f"indices {_ranges(indices)}, expected 0-{len(steps) - 1}"))
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
        if {r.metrics["attempt"] for r in s.reports} != {s.attempt}:
            problems.append(
                (
                    "attempt_number",
                    f"step {s.index} of attempt {s.attempt} came "
                    f"from attempt(s) {sorted({r.metrics['attempt'] for r in s.reports})}",
                )
            )
        for r in s.reports:
            if r.metrics["total"] != expected_total(r.rank, value):
                problems.append(
                    (
                        "state",
                        f"rank {r.rank} at step {value}: total "
                        f"{r.metrics['total']}, expected {expected_total(r.rank, value)}",
                    )
                )
        if (s.checkpoint is not None) != (value % every == 0):
            problems.append(
                (
                    "checkpoint",
                    f"step {s.index} (function step {value}) "
                    f"{'has' if s.checkpoint else 'lacks'} a checkpoint",
                )
            )
    if problems:
        return problems
    latest = first - 1
    seen: list[int] = []
    for attempt, group in groupby(steps, key=lambda s: s.attempt):
        batch = list(group)
        if attempt in seen or (seen and attempt < seen[-1]):
            problems.append(("attempt_order", f"attempt {attempt} after attempts {seen}"))
        seen.append(attempt)
        values = [s.reports[0].metrics["step"] for s in batch]
        if values[0] != latest + 1:
            problems.append(
                (
                    "resume",
                    f"attempt {attempt} started at step {values[0]}; the latest "
                    f"delivered checkpoint was step {latest}",
                )
            )
        if values != list(range(values[0], values[0] + len(values))):
            problems.append(("consecutive", f"attempt {attempt} delivered steps {_ranges(values)}"))
        for s in batch:
            if s.checkpoint is not None:
                latest = s.reports[0].metrics["step"]
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


def leftovers() -> str:
    """Live ``_Worker`` actors and placement groups not removed, described; empty when none.
    Blocking (it asks the GCS): call it off the event loop."""
    actors, groups = live_workers(), live_placement_groups()
    if not actors and not groups:
        return ""
    return (
        f"{len(actors)} worker actor(s) {[a['State'] for a in actors]}, "
        f"{len(groups)} placement group(s) {[g['state'] for g in groups]}"
    )


async def wait_no_leftovers(timeout_s: float = 15.0) -> str:
    """Wait until nothing is left in the cluster; return what is still there after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = await anyio.to_thread.run_sync(leftovers)
        if not found or time.monotonic() > deadline:
            return found
        await anyio.sleep(0.1)


class Gate:
    """The driver's side of :func:`gate_hook`: releases every worker's init hook, except that of
    the armed rank, which it kills with SIGKILL (or, with ``hold``, never releases), once."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.armed: int | None = None
        self.hold = False
        self.kills: list[float] = []
        self._seen: set[str] = set()

    def arm(self, rank: int, *, hold: bool = False) -> None:
        self.armed, self.hold = rank, hold

    def hook(self) -> Callable[[], None]:
        return functools.partial(gate_hook, str(self.directory))

    def _scan(self) -> None:
        for name in sorted(os.listdir(self.directory)):
            if not (name.startswith("hook-") and name.endswith(".json")) or name in self._seen:
                continue
            self._seen.add(name)
            info = json.loads((self.directory / name).read_text())
            if self.armed is not None and info["rank"] == self.armed:
                self.armed = None
                if not self.hold:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(info["pid"], signal.SIGKILL)
                self.kills.append(time.time())
            else:
                (self.directory / f"go-{info['pid']}").touch()

    async def serve(self) -> None:
        """Release or kill hooks as they appear; runs until cancelled."""
        while True:
            await anyio.to_thread.run_sync(self._scan)
            await anyio.sleep(0.01)


@dataclass
class _Seen:
    """What the consumer saw: the steps, when each arrived, and how the stream ended."""

    steps: list[asyncexec.Step] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    error: BaseException | None = None
    ended: float = 0.0


async def _consume(
    run: asyncexec.Run,
    seen: _Seen,
    on_step: Callable[[asyncexec.Step], Awaitable[bool]] | None = None,
    slow: bool = False,
) -> None:
    """Read ``run`` into ``seen``; ``on_step`` returning True breaks out of the loop; a ``slow``
    consumer spends SLOW_CONSUMER_S on each step (so that the driver waits on it with steps in
    hand). An error that ends the stream is recorded, not raised."""
    try:
        async for step in run:
            seen.steps.append(step)
            seen.times.append(time.time())
            if on_step is not None and await on_step(step):
                break
            if slow:
                await anyio.sleep(SLOW_CONSUMER_S)
    except Exception as exc:
        seen.error = exc
    finally:
        seen.ended = time.time()


def _config(sc: Scenario, directory: Path, fault: dict[str, Any] | None) -> dict[str, Any]:
    return {
        "steps": sc.steps,
        "every": sc.every,
        # A removed node's workers outlive its raylet for a moment and keep reporting until the
        # cluster declares the node dead (about a second): slow steps keep the run going past it.
        "sleep": NODE_STEP_SLEEP_S if sc.kind == "node_lost" else STEP_SLEEP_S,
        "dir": str(directory),
        "fault": fault,
    }


def _executor(sc: Scenario, env: Env, **options: Any) -> asyncexec.Executor:
    defaults: dict[str, Any] = {
        "resources_per_worker": {"CPU": 0.5},
        "storage_path": env.root / "storage",
        "buffer_size": sc.buffer,
        "restart": asyncexec.RestartPolicy(max_restarts=3, wait=tenacity.wait_none()),
        "stop_timeout_s": 5.0,
        "shutdown_timeout_s": 10.0,
        "graceful_patience_s": 2.0,
        "name": f"chaos{sc.number}",
    }
    defaults.update(options)
    return asyncexec.Executor(sc.workers, **defaults)


def _worker_faults(directory: Path) -> list[float]:
    return sorted(float(p.read_text()) for p in directory.glob("fault-a*.time"))


def _kill(pid: int) -> bool:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def _first_of_attempt_after(seen: _Seen, attempt: int) -> float | None:
    """When the first step of an attempt later than ``attempt`` arrived (or the stream ended)."""
    for step, t in zip(seen.steps, seen.times, strict=True):
        if step.attempt > attempt:
            return t
    return seen.ended if seen.ended else None


def _check_failures(
    out: Outcome,
    failures: Sequence[BaseException],
    expected: Sequence[tuple[type[BaseException], frozenset[int] | None]],
) -> None:
    """Each failure of the expected kind, naming an expected rank, with attempts 1, 2, ..."""
    got = [type(f).__name__ for f in failures]
    want = [t.__name__ for t, _ in expected]
    if len(failures) != len(expected):
        out.fail("restarts", f"failures {got}, expected {want}")
        return
    for number, (failure, (kind, ranks)) in enumerate(zip(failures, expected, strict=True), 1):
        if not isinstance(failure, kind):
            detail = str(failure).splitlines()[0] if str(failure) else ""
            out.fail(
                "failure_kind",
                f"failure {number} is {type(failure).__name__} ({detail}), "
                f"expected {kind.__name__}",
            )
            continue
        if isinstance(failure, asyncexec.WorkerError):
            if ranks is not None and failure.rank not in ranks:
                out.fail(
                    "failure_rank",
                    f"failure {number} names rank {failure.rank}, expected {sorted(ranks)}",
                )
            if failure.attempt != number:
                out.fail("failure_attempt", f"failure {number} says attempt {failure.attempt}")


def _check_result(
    out: Outcome,
    sc: Scenario,
    ex: asyncexec.Executor,
    seen: _Seen,
    expected: Sequence[tuple[type[BaseException], frozenset[int] | None]],
    *,
    optional: bool = False,
) -> None:
    """A run that must finish: no error, the stream and result whole, the failures expected
    (or, with ``optional``, none at all: the fault may have come too late to matter)."""
    for problem in check_stream(seen.steps, workers=sc.workers, every=sc.every):
        out.fail(*problem)
    if seen.error is not None:
        out.fail(
            "finished",
            f"the run ended with {type(seen.error).__name__}: "
            f"{str(seen.error).splitlines()[0] if str(seen.error) else ''}",
        )
        return
    result = ex.result
    out.attempts = result.attempts
    if optional and result.attempts == 1:
        expected = []
    for problem in check_complete(
        seen.steps, result.return_values, workers=sc.workers, total=sc.steps
    ):
        out.fail(*problem)
    if result.attempts != len(expected) + 1:
        out.fail("restarts", f"{result.attempts} attempts, expected {len(expected) + 1}")
    _check_failures(out, result.failures, expected)
    if ex.statistics().restarts != len(expected):
        out.fail(
            "restarts",
            f"statistics().restarts is {ex.statistics().restarts}, expected {len(expected)}",
        )
    if result.steps != len(seen.steps):
        out.fail("step_count", f"result.steps is {result.steps}, {len(seen.steps)} delivered")


def _recovery(
    out: Outcome, fault_time: float | None, seen: _Seen, attempt: int, faults: int
) -> None:
    if fault_time is None:
        out.fail("fault_injected", "the fault was never injected")
        return
    back = _first_of_attempt_after(seen, attempt)
    if back is None:
        return
    took = max(0.0, back - fault_time)
    out.recovery_s.append(took)
    if took > RECOVERY_BOUND_S * faults:
        out.fail("recovery_time", f"{took:.1f} s from the fault to the next attempt's first step")


# Scenarios ------------------------------------------------------------------------------------


async def _kill_from_driver(sc: Scenario, env: Env, out: Outcome, directory: Path) -> None:
    """kill_step, kill_two and kill_end: SIGKILL when the consumer sees step ``at`` (the last
    step for kill_end, after which the run may finish without a restart) of attempt 1."""
    targets = (sc.rank, sc.rank2) if sc.kind == "kill_two" else (sc.rank,)
    at = sc.steps - 1 if sc.kind == "kill_end" else sc.at
    fault_time: list[float] = []
    seen = _Seen()
    async with _executor(sc, env) as ex:

        async def on_step(step: asyncexec.Step) -> bool:
            if step.attempt == 1 and step.index == at and not fault_time:
                pids = [ex.workers[r].pid for r in targets]
                fault_time.append(time.time())
                for pid in pids:
                    _kill(pid)
            return False

        await _consume(ex.run(counter, _config(sc, directory, None)), seen, on_step, sc.slow)
        if not fault_time and seen.error is None:
            # The step was never seen (the run is shorter than the draw): nothing to check.
            out.fail("fault_injected", f"step {at} was never delivered")
        _check_result(
            out,
            sc,
            ex,
            seen,
            [(asyncexec.WorkerCrashedError, frozenset(targets))],
            optional=sc.kind == "kill_end",
        )
    out.steps = len(seen.steps)
    if out.attempts != 1 or sc.kind != "kill_end":
        _recovery(out, fault_time[0] if fault_time else None, seen, 1, 1)


async def _kill_complete(sc: Scenario, env: Env, out: Outcome, directory: Path) -> None:
    """A rank kills itself before step ``at`` once every rank reported ``at - 1``: attempt 1
    delivers exactly steps 0..at-1 (every complete step, no partial one)."""
    fault = {"kind": "die", "rank": sc.rank, "at": sc.at, "barrier": True}
    seen = _Seen()
    async with _executor(sc, env) as ex:
        await _consume(ex.run(counter, _config(sc, directory, fault)), seen, None, sc.slow)
        _check_result(out, sc, ex, seen, [(asyncexec.WorkerCrashedError, frozenset({sc.rank}))])
    first = [s.reports[0].metrics["step"] for s in seen.steps if s.attempt == 1]
    if first != list(range(sc.at)):
        out.fail(
            "complete_steps_delivered",
            f"attempt 1 delivered steps {_ranges(first)}, "
            f"expected 0-{sc.at - 1} (every rank reported them before the kill)",
        )
    out.steps = len(seen.steps)
    faults = await anyio.to_thread.run_sync(_worker_faults, directory)
    _recovery(out, faults[0] if faults else None, seen, 1, 1)


async def _kill_startup(sc: Scenario, env: Env, out: Outcome, directory: Path) -> None:
    """SIGKILL a rank in the first start-up's init hook: entering fails with a StartupError and
    leaves nothing; a second executor then runs the whole function."""
    gate = Gate(directory)
    gate.arm(sc.rank)
    seen = _Seen()
    async with anyio.create_task_group() as tg:
        tg.start_soon(gate.serve)
        try:
            async with _executor(sc, env, init_hook=gate.hook()):
                out.fail("startup_error", "the executor started although a worker was killed")
        except asyncexec.StartupError as exc:
            if not str(exc):
                out.fail("clear_error", "the StartupError has no message")
        except Exception as exc:
            out.fail("startup_error", f"entering raised {type(exc).__name__}: {exc}")
        found = await wait_no_leftovers()
        if found:
            out.fail("nothing_left", f"after the failed start-up: {found}")
        async with _executor(sc, env, init_hook=gate.hook()) as ex:
            await _consume(ex.run(counter, _config(sc, directory, None)), seen, None, sc.slow)
            _check_result(out, sc, ex, seen, [])
        tg.cancel_scope.cancel()
    out.steps = len(seen.steps)
    if gate.kills and seen.times:
        took = seen.times[0] - gate.kills[0]
        out.recovery_s.append(took)
        if took > RECOVERY_BOUND_S:
            out.fail(
                "recovery_time", f"{took:.1f} s from the kill to the new executor's first step"
            )
    elif not gate.kills:
        out.fail("fault_injected", "the init hook was never reached")


async def _kill_restart(sc: Scenario, env: Env, out: Outcome, directory: Path) -> None:
    """SIGKILL a rank at step ``at``; while the policy waits, check the failed group is gone and
    arm the gate, which kills a rank in the restart's start-up (hang_startup: holds its init hook
    past the start-up deadline): three attempts in all."""
    hold = sc.kind == "hang_startup"
    second: type[BaseException] = asyncexec.StartupTimeoutError if hold else asyncexec.StartupError
    options: dict[str, Any] = {"start_timeout_s": 5.0} if hold else {}
    gate = Gate(directory)
    fault_time: list[float] = []
    seen = _Seen()
    waits: list[str] = []

    async def sleep(seconds: float) -> None:
        waits.append(await anyio.to_thread.run_sync(leftovers))
        if len(waits) == 1:
            gate.arm(sc.rank2, hold=hold)

    policy = asyncexec.RestartPolicy(max_restarts=3, wait=tenacity.wait_none(), sleep=sleep)
    async with anyio.create_task_group() as tg:
        tg.start_soon(gate.serve)
        async with _executor(sc, env, init_hook=gate.hook(), restart=policy, **options) as ex:

            async def on_step(step: asyncexec.Step) -> bool:
                if step.attempt == 1 and step.index == sc.at and not fault_time:
                    pid = ex.workers[sc.rank].pid
                    fault_time.append(time.time())
                    _kill(pid)
                return False

            await _consume(ex.run(counter, _config(sc, directory, None)), seen, on_step, sc.slow)
            _check_result(
                out,
                sc,
                ex,
                seen,
                [
                    (asyncexec.WorkerCrashedError, frozenset({sc.rank})),
                    (second, None),
                ],
            )
        tg.cancel_scope.cancel()
    if waits and waits[0]:
        out.fail("group_gone_in_wait", f"while the policy waited: {waits[0]}")
    out.steps = len(seen.steps)
    _recovery(out, fault_time[0] if fault_time else None, seen, 1, 2)


async def _kill_shutdown(sc: Scenario, env: Env, out: Outcome, directory: Path) -> None:
    """Break out of the run at step ``at`` and leave the executor; SIGKILL a rank ``delay_s``
    later, while the shutdown is under way. The exit must be clean and bounded."""
    broke = anyio.Event()
    seen = _Seen()
    pids: list[int] = []
    holder: list[asyncexec.Executor] = []
    timing: dict[str, float] = {}

    async def killer() -> None:
        await broke.wait()
        await anyio.sleep(sc.delay_s)
        timing["kill"] = time.time()
        if not _kill(pids[sc.rank]):
            out.note = "the kill came after the worker had exited"

    async with anyio.create_task_group() as tg:
        tg.start_soon(killer)
        try:
            async with _executor(sc, env) as ex:
                holder.append(ex)
                pids.extend(w.pid for w in ex.workers)

                async def on_step(step: asyncexec.Step) -> bool:
                    return step.index >= sc.at

                await _consume(
                    ex.run(counter, _config(sc, directory, None)), seen, on_step, sc.slow
                )
                timing["break"] = time.time()
                broke.set()
        except Exception as exc:
            out.fail("clean_exit", f"leaving the executor raised {type(exc).__name__}: {exc}")
        timing["closed"] = time.time()
        tg.cancel_scope.cancel()
    if not holder:
        return
    ex = holder[0]
    for problem in check_stream(seen.steps, workers=sc.workers, every=sc.every):
        out.fail(*problem)
    if seen.error is not None:
        out.fail("finished", f"the run failed before the break: {type(seen.error).__name__}")
    if ex.state is not asyncexec.ExecutorState.CLOSED:
        out.fail("clean_exit", f"the executor is {ex.state.value} after leaving it")
    took = timing["closed"] - timing.get("break", timing["closed"])
    if took > STOP_BOUND_S:
        out.fail("stop_time", f"shutdown took {took:.1f} s")
    out.steps = len(seen.steps)


async def _exhaust(sc: Scenario, env: Env, out: Outcome, directory: Path) -> None:
    """A rank dies at step >= ``at`` on every attempt: ``max_restarts`` restarts, then
    RestartsExhaustedError(attempts=max_restarts + 1) with every failure."""
    fault = {"kind": "die_always", "rank": sc.rank, "at": sc.at}
    seen = _Seen()
    policy = asyncexec.RestartPolicy(max_restarts=sc.max_restarts, wait=tenacity.wait_none())
    async with _executor(sc, env, restart=policy) as ex:
        await _consume(ex.run(counter, _config(sc, directory, fault)), seen, None, sc.slow)
        restarts = ex.statistics().restarts
    for problem in check_stream(seen.steps, workers=sc.workers, every=sc.every):
        out.fail(*problem)
    attempts = sc.max_restarts + 1
    error = seen.error
    if not isinstance(error, asyncexec.RestartsExhaustedError):
        out.fail(
            "gives_up",
            f"the run ended with {type(error).__name__}, expected RestartsExhaustedError",
        )
        return
    out.attempts = error.attempts
    if error.attempts != attempts:
        out.fail(
            "restarts", f"RestartsExhaustedError.attempts is {error.attempts}, expected {attempts}"
        )
    if restarts != sc.max_restarts:
        out.fail("restarts", f"statistics().restarts is {restarts}, expected {sc.max_restarts}")
    _check_failures(
        out, error.failures, [(asyncexec.WorkerCrashedError, frozenset({sc.rank}))] * attempts
    )
    if error.failures and error.__cause__ is not error.failures[-1]:
        out.fail("clear_error", "the last failure is not the error's __cause__")
    if any(s.reports[0].metrics["step"] >= sc.at for s in seen.steps):
        out.fail("no_partial_step", f"a step at or past {sc.at} was delivered")
    out.steps = len(seen.steps)


async def _hang(sc: Scenario, env: Env, out: Outcome, directory: Path) -> None:
    """A rank stops (sleeps, or holds the GIL) at step ``at``: WorkerHungError, one restart."""
    if sc.kind == "hang_step":
        fault = {"kind": "hang", "rank": sc.rank, "at": sc.at}
        options: dict[str, Any] = {"step_timeout_s": 1.0}
        needle = "step deadline"
    else:
        fault = {"kind": "gil", "rank": sc.rank, "at": sc.at}
        options = {"health_check_interval_s": 0.5, "health_check_timeout_s": 2.0}
        needle = "health check"
    seen = _Seen()
    async with _executor(sc, env, **options) as ex:
        await _consume(ex.run(counter, _config(sc, directory, fault)), seen, None, sc.slow)
        _check_result(out, sc, ex, seen, [(asyncexec.WorkerHungError, frozenset({sc.rank}))])
        failures = ex.result.failures if seen.error is None else []
    if failures and needle not in str(failures[0]):
        out.fail("clear_error", f"the hang is reported as {str(failures[0])!r}, without {needle!r}")
    out.steps = len(seen.steps)
    faults = await anyio.to_thread.run_sync(_worker_faults, directory)
    _recovery(out, faults[0] if faults else None, seen, 1, 1)


async def _cancel(sc: Scenario, env: Env, out: Outcome, directory: Path) -> None:
    """Cancel the task that holds the executor and reads the run ``delay_s`` after it starts
    (after a SIGKILL at step ``at``, when drawn): it returns within a bound, what it saw is a
    valid prefix, and nothing is left."""
    seen = _Seen()
    holder: list[asyncexec.Executor] = []
    t0 = time.time()
    with anyio.move_on_after(sc.delay_s) as scope:
        async with _executor(sc, env) as ex:
            holder.append(ex)

            async def on_step(step: asyncexec.Step) -> bool:
                if sc.flag and step.attempt == 1 and step.index == sc.at:
                    _kill(ex.workers[sc.rank].pid)
                return False

            await _consume(ex.run(counter, _config(sc, directory, None)), seen, on_step, sc.slow)
    took = time.time() - (t0 + sc.delay_s)
    for problem in check_stream(seen.steps, workers=sc.workers, every=sc.every):
        out.fail(*problem)
    if seen.error is not None:
        out.fail("finished", f"the stream ended with {type(seen.error).__name__}: {seen.error}")
    if scope.cancelled_caught:
        out.note = f"cancelled after {len(seen.steps)} step(s)"
        if took > STOP_BOUND_S:
            out.fail("stop_time", f"the cancelled task returned {took:.1f} s after the cancel")
    else:
        out.note = "finished before the cancel"
        expected = [(asyncexec.WorkerCrashedError, frozenset({sc.rank}))] if sc.flag else []
        _check_result(out, sc, holder[0], seen, expected)
    if holder and holder[0].state is not asyncexec.ExecutorState.CLOSED:
        out.fail("clean_exit", f"the executor is {holder[0].state.value} after the cancel")
    out.steps = len(seen.steps)


async def _user_error(sc: Scenario, env: Env, out: Outcome, directory: Path) -> None:
    """The function raises on a rank at step ``at`` (after every rank reported ``at - 1``): not
    retried, the run ends with WorkerRaisedError naming the rank, after exactly steps 0..at-1;
    retried (``restart_on_user_error``), the run finishes after one restart."""
    fault = {"kind": "raise", "rank": sc.rank, "at": sc.at, "barrier": True}
    policy = asyncexec.RestartPolicy(
        max_restarts=3, restart_on_user_error=sc.flag, wait=tenacity.wait_none()
    )
    seen = _Seen()
    async with _executor(sc, env, restart=policy) as ex:
        await _consume(ex.run(counter, _config(sc, directory, fault)), seen, None, sc.slow)
        if sc.flag:
            _check_result(out, sc, ex, seen, [(asyncexec.WorkerRaisedError, frozenset({sc.rank}))])
    first = [s.reports[0].metrics["step"] for s in seen.steps if s.attempt == 1]
    if first != list(range(sc.at)):
        out.fail(
            "complete_steps_delivered",
            f"attempt 1 delivered steps {_ranges(first)}, expected 0-{sc.at - 1}",
        )
    out.steps = len(seen.steps)
    if sc.flag:
        faults = await anyio.to_thread.run_sync(_worker_faults, directory)
        _recovery(out, faults[0] if faults else None, seen, 1, 1)
        return
    for problem in check_stream(seen.steps, workers=sc.workers, every=sc.every):
        out.fail(*problem)
    error = seen.error
    if not isinstance(error, asyncexec.WorkerRaisedError):
        out.fail(
            "clear_error", f"the run ended with {type(error).__name__}, expected WorkerRaisedError"
        )
        return
    if error.rank != sc.rank or error.attempt != 1:
        out.fail("failure_rank", f"the error names rank {error.rank}, attempt {error.attempt}")
    if not isinstance(error.__cause__, ValueError) or "chaos: bad batch" not in str(error):
        out.fail("clear_error", f"the error does not carry the ValueError: {error!r}")
    if "counter" not in error.remote_traceback:
        out.fail("clear_error", "the remote traceback does not show the function")


async def _node_lost(sc: Scenario, env: Env, out: Outcome, directory: Path) -> None:
    """Add a node, spread two workers over it and the head, remove the node at step ``at`` (the
    consumer waits for the removal, so the workers, held by backpressure, cannot finish first):
    NodeLostError for the rank on it, one restart on what is left, the whole result."""
    cluster, node = env.cluster, env.node
    if cluster is None or node is None:
        out.fail("setup", "node_lost needs the cluster (run without --no-nodes)")
        return
    fault_time: list[float] = []
    seen = _Seen()
    try:
        async with _executor(sc, env, placement_strategy="SPREAD") as ex:
            victims = [w.world_rank for w in ex.workers if w.node_id == node.node_id]
            if not victims:
                out.fail("setup", "SPREAD placed no worker on the added node")
                return

            async def on_step(step: asyncexec.Step) -> bool:
                if step.attempt == 1 and step.index == sc.at and not fault_time:
                    fault_time.append(time.time())
                    await anyio.to_thread.run_sync(
                        functools.partial(cluster.remove_node, node, allow_graceful=False)
                    )
                return False

            await _consume(ex.run(counter, _config(sc, directory, None)), seen, on_step, sc.slow)
            _check_result(out, sc, ex, seen, [(asyncexec.NodeLostError, frozenset(victims))])
    finally:
        env.node = None
        if not fault_time:
            await anyio.to_thread.run_sync(cluster.remove_node, node)
    out.steps = len(seen.steps)
    _recovery(out, fault_time[0] if fault_time else None, seen, 1, 1)


async def _kill_idle(sc: Scenario, env: Env, out: Outcome, directory: Path) -> None:
    """SIGKILL a rank while no run is in progress. With ``flag``, ``execute()`` first: it fails
    with WorkerCrashedError naming the rank, and the next ``execute()`` works on a fresh group.
    Then a run finishes whole (restarting once when nothing replaced the dead group yet)."""
    seen = _Seen()
    async with _executor(sc, env) as ex:
        fault_time = time.time()
        _kill(ex.workers[sc.rank].pid)
        replaced = False
        if sc.flag:
            try:
                await ex.execute(os.getpid)
                out.fail("execute_sees_crash", "execute() on a group with a dead rank succeeded")
            except asyncexec.WorkerCrashedError as exc:
                if exc.rank != sc.rank:
                    out.fail("failure_rank", f"execute() blames rank {exc.rank}, not {sc.rank}")
            except Exception as exc:
                out.fail("execute_sees_crash", f"execute() raised {type(exc).__name__}: {exc}")
            try:
                pids = await ex.execute(os.getpid)
                replaced = len(pids) == sc.workers
            except Exception as exc:
                out.fail(
                    "replaced_after_crash",
                    f"execute() after the crash was reported still fails: "
                    f"{type(exc).__name__}: {str(exc).splitlines()[0]}",
                )
        await _consume(ex.run(counter, _config(sc, directory, None)), seen, None, sc.slow)
        expected = [] if replaced else [(asyncexec.WorkerCrashedError, frozenset({sc.rank}))]
        _check_result(out, sc, ex, seen, expected, optional=not sc.flag)
    out.steps = len(seen.steps)
    if seen.times:
        out.recovery_s.append(seen.times[0] - fault_time)


async def _kill_neighbour(sc: Scenario, env: Env, out: Outcome, directory: Path) -> None:
    """Two executors in one event loop; SIGKILL a rank of the first at step ``at``: it restarts
    once and finishes whole, the second finishes whole on its first attempt with its workers."""
    fault_time: list[float] = []
    seen_a, seen_b = _Seen(), _Seen()
    await anyio.Path(directory / "a").mkdir()
    await anyio.Path(directory / "b").mkdir()
    async with (
        _executor(sc, env, name=f"chaos{sc.number}a") as a,
        _executor(sc, env, name=f"chaos{sc.number}b") as b,
    ):
        pids_b = [w.pid for w in b.workers]

        async def on_step(step: asyncexec.Step) -> bool:
            if step.attempt == 1 and step.index == sc.at and not fault_time:
                fault_time.append(time.time())
                _kill(a.workers[sc.rank].pid)
            return False

        async with anyio.create_task_group() as tg:
            tg.start_soon(
                _consume,
                a.run(counter, _config(sc, directory / "a", None)),
                seen_a,
                on_step,
                sc.slow,
            )
            tg.start_soon(
                _consume, b.run(counter, _config(sc, directory / "b", None)), seen_b, None, sc.slow
            )
        _check_result(out, sc, a, seen_a, [(asyncexec.WorkerCrashedError, frozenset({sc.rank}))])
        _check_result(out, sc, b, seen_b, [])
        if [w.pid for w in b.workers] != pids_b:
            out.fail("isolation", "the other executor's workers changed")
    out.steps = len(seen_a.steps) + len(seen_b.steps)
    _recovery(out, fault_time[0] if fault_time else None, seen_a, 1, 1)


_RUNNERS: dict[str, Callable[[Scenario, Env, Outcome, Path], Awaitable[None]]] = {
    "kill_step": _kill_from_driver,
    "kill_two": _kill_from_driver,
    "kill_complete": _kill_complete,
    "kill_startup": _kill_startup,
    "kill_restart": _kill_restart,
    "kill_shutdown": _kill_shutdown,
    "kill_end": _kill_from_driver,
    "kill_idle": _kill_idle,
    "kill_neighbour": _kill_neighbour,
    "hang_startup": _kill_restart,
    "exhaust": _exhaust,
    "hang_step": _hang,
    "hang_gil": _hang,
    "cancel": _cancel,
    "user_error": _user_error,
    "node_lost": _node_lost,
}


async def run_scenario(sc: Scenario, env: Env) -> Outcome:
    """Run one scenario and check every invariant; never raises (a crash of the scenario itself
    is a failure of invariant ``no_crash``)."""
    out = Outcome(sc)
    directory = Path(tempfile.mkdtemp(prefix=f"s{sc.number}-", dir=env.root))
    if sc.kind == "node_lost" and env.cluster is not None:
        # add_node installs signal handlers, which only the main thread may do: it blocks the
        # event loop for a few seconds here, before the heartbeat starts.
        env.node = env.cluster.add_node(num_cpus=2)
        env.cluster.wait_for_nodes()
    beat = Heartbeat()
    t0 = time.perf_counter()
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(beat.run)
            try:
                with anyio.fail_after(SCENARIO_TIMEOUT_S):
                    await _RUNNERS[sc.kind](sc, env, out, directory)
            except TimeoutError:
                out.fail("no_hang", f"the scenario did not end within {SCENARIO_TIMEOUT_S:g} s")
            tg.cancel_scope.cancel()
    except Exception as exc:
        # The scenario itself broke: keep the innermost error, where it was raised.
        inner: BaseException = exc
        while isinstance(inner, BaseExceptionGroup) and len(inner.exceptions) == 1:
            inner = inner.exceptions[0]
        where = traceback.extract_tb(inner.__traceback__)[-1] if inner.__traceback__ else None
        at = f" at {Path(where.filename).name}:{where.lineno}" if where else ""
        out.fail("no_crash", f"{type(inner).__name__}: {inner}{at}")
    out.seconds = time.perf_counter() - t0
    out.max_lag_s = beat.max_gap
    if beat.max_gap > LOOP_LAG_BOUND_S:
        out.fail("event_loop", f"the event loop stalled {beat.max_gap:.2f} s")
    found = await wait_no_leftovers()
    if found:
        out.fail("nothing_left", found)
    await anyio.to_thread.run_sync(functools.partial(shutil.rmtree, directory, ignore_errors=True))
    return out


# The table ------------------------------------------------------------------------------------


def _fmt(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.2f}"


def render_table(outcomes: Sequence[Outcome], seed: int, seconds: float) -> str:
    """The runner's one table: per kind, run/passed/failed and recovery p50/max; then the total,
    the failures by invariant, and each failure with its scenario's parameters."""
    lines = [f"asyncexec chaos: seed {seed}, {len(outcomes)} scenarios, {seconds:.0f} s", ""]
    header = f"{'kind':<15}{'run':>5}{'passed':>8}{'failed':>8}{'recovery p50 s':>16}{'max s':>8}"
    lines += [header, "-" * len(header)]
    kinds = [k for k in KINDS if any(o.scenario.kind == k for o in outcomes)]
    for kind in [*kinds, "total"]:
        rows = [o for o in outcomes if kind in ("total", o.scenario.kind)]
        rec = [r for o in rows for r in o.recovery_s]
        passed = sum(o.passed for o in rows)
        if kind == "total":
            lines.append("-" * len(header))
        lines.append(
            f"{kind:<15}{len(rows):>5}{passed:>8}{len(rows) - passed:>8}"
            f"{_fmt(percentile(rec, 50)):>16}{_fmt(max(rec) if rec else math.nan):>8}"
        )
    lags = [o.max_lag_s for o in outcomes]
    lines.append("")
    lines.append(
        f"event-loop stall, worst per scenario: p50 {_fmt(percentile(lags, 50))} s, "
        f"max {_fmt(max(lags) if lags else math.nan)} s"
    )
    by_invariant: dict[str, list[int]] = {}
    for o in outcomes:
        for invariant in dict.fromkeys(i for i, _ in o.problems):
            by_invariant.setdefault(invariant, []).append(o.scenario.number)
    if by_invariant:
        lines += ["", "failed by invariant:"]
        for invariant, numbers in sorted(by_invariant.items()):
            lines.append(f"  {invariant:<26}{len(numbers):>3}  scenarios {numbers}")
        lines += ["", "failures:"]
        for o in outcomes:
            if o.problems:
                lines.append(f"  {o.scenario.describe()}")
                lines += [f"      {i}: {d}" for i, d in o.problems]
    else:
        lines += ["", "failed by invariant: none"]
    return "\n".join(lines)


# Main -----------------------------------------------------------------------------------------


@contextlib.contextmanager
def _ray(nodes: bool) -> Iterator[Any]:
    """A Ray for the run: a Cluster whose nodes can be added and removed, or a plain local one."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    cluster = None
    if nodes:
        from ray.cluster_utils import Cluster

        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 4,
                "_system_config": {
                    "health_check_initial_delay_ms": 0,
                    "health_check_period_ms": 200,
                    "health_check_failure_threshold": 3,
                },
            },
        )
        ray.init(address=cluster.address, log_to_driver=False)
    else:
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield cluster
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


async def _run_all(scenarios: Sequence[Scenario], env: Env) -> list[Outcome]:
    outcomes = []
    for sc in scenarios:
        out = await run_scenario(sc, env)
        outcomes.append(out)
        status = (
            "ok" if out.passed else "FAILED " + ", ".join(dict.fromkeys(i for i, _ in out.problems))
        )
        rec = "/".join(f"{r:.2f}" for r in out.recovery_s) or "-"
        print(
            f"{sc.describe()}: {status} ({out.seconds:.1f} s, {out.steps} steps, recovery {rec} s"
            f"{', ' + out.note if out.note else ''})",
            file=sys.stderr,
            flush=True,
        )
    return outcomes


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status (1 when any scenario failed)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--scenarios", type=int, default=len(KINDS))
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated kinds to draw")
    parser.add_argument("--only", type=int, default=None, help="run only scenario number N")
    parser.add_argument("--no-nodes", action="store_true", help="plain local Ray, no node loss")
    parser.add_argument("--verbose", action="store_true", help="show asyncexec's warnings")
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    if args.no_nodes:
        kinds = [k for k in kinds if k != "node_lost"]
    try:
        scenarios = draw_scenarios(args.seed, args.scenarios, kinds)
    except ValueError as exc:
        parser.error(str(exc))
    if args.only is not None:
        scenarios = [s for s in scenarios if s.number == args.only]
    import logging

    import structlog

    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.WARNING if args.verbose else logging.CRITICAL
        )
    )
    t0 = time.perf_counter()
    root = Path(tempfile.mkdtemp(prefix="asyncexec-chaos-"))
    try:
        with _ray(not args.no_nodes) as cluster:
            outcomes = anyio.run(_run_all, scenarios, Env(root, cluster))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(render_table(outcomes, args.seed, time.perf_counter() - t0))
    return 0 if all(o.passed for o in outcomes) else 1


if __name__ == "__main__":
    # Run as the module ``benchmarks.chaos`` (not ``__main__``) so that the workers import the
    # counter and the hook by that name (ROOT is on their PYTHONPATH).
    import importlib

    sys.path.insert(0, ROOT)
    raise SystemExit(importlib.import_module("benchmarks.chaos").main())
