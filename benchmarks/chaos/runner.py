"""Chaos runner: seeded fault scenarios against a real Ray, and the invariants checked after each.

Running one scenario (:func:`run_scenario`), the table of outcomes (:func:`render_table`) and the
command line (:func:`main`, ``python -m benchmarks.chaos``)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import math
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

from benchmarks._common import LoopBeat, percentile
from benchmarks.chaos import channel, faults, groups, resume
from benchmarks.chaos.harness import wait_no_leftovers
from benchmarks.chaos.invariants import LOOP_LAG_BOUND_S, SCENARIO_TIMEOUT_S
from benchmarks.chaos.scenarios import KINDS, NODE_KINDS, Env, Outcome, Scenario, draw_scenarios

__all__ = ["main", "render_table", "run_scenario"]

#: Every kind's coroutine.
_RUNNERS = {**faults._RUNNERS, **groups.RUNNERS, **channel.RUNNERS, **resume.RUNNERS}
#: The nodes that node-loss kinds add before they start (and remove during).
_NODE_ARGS: dict[str, dict[str, Any]] = {
    "node_lost": {"num_cpus": 2},
    "elastic": {"num_cpus": 2, "resources": {groups.SLOT: 2}},
}


async def run_scenario(sc: Scenario, env: Env) -> Outcome:
    """Run one scenario and check every invariant; never raises (a crash of the scenario itself
    is a failure of invariant ``no_crash``)."""
    out = Outcome(sc)
    directory = Path(tempfile.mkdtemp(prefix=f"s{sc.number}-", dir=env.root))
    if sc.kind in NODE_KINDS and env.cluster is not None:
        # add_node installs signal handlers, which only the main thread may do: it blocks the
        # event loop for a few seconds here, before the heartbeat starts.
        env.node = env.cluster.add_node(**_NODE_ARGS[sc.kind])
        env.cluster.wait_for_nodes()
    beat = env.beat = LoopBeat()
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
    if beat.excused_s:
        excused = f"adding a node blocked the loop {beat.excused_s:.2f} s"
        out.note = f"{out.note}; {excused}" if out.note else excused
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
    header = (
        f"{'kind':<15}{'run':>5}{'passed':>8}{'failed':>8}{'cancelled':>11}"
        f"{'recovery p50 s':>16}{'max s':>8}"
    )
    lines += [header, "-" * len(header)]
    kinds = [k for k in KINDS if any(o.scenario.kind == k for o in outcomes)]
    for kind in [*kinds, "total"]:
        rows = [o for o in outcomes if kind in ("total", o.scenario.kind)]
        rec = [r for o in rows for r in o.recovery_s]
        passed = sum(o.passed for o in rows)
        if kind == "total":
            lines.append("-" * len(header))
        cancelled = sum(o.scenario.cancel_s is not None for o in rows)
        lines.append(
            f"{kind:<15}{len(rows):>5}{passed:>8}{len(rows) - passed:>8}{cancelled:>11}"
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


def _ray(nodes: bool) -> contextlib.AbstractContextManager[Any]:
    """A Ray for the run: a Cluster whose nodes can be added and removed, or a plain local one.
    The harness is imported here: importing it sets the environment Ray's workers inherit,
    which a test that imports this module leaves as it is."""
    from benchmarks import _harness

    if not nodes:
        return _harness.ray_session(num_cpus=4, fresh_workers=False)
    head = {
        "num_cpus": 4,
        "resources": {groups.SLOT: 2},
        "_system_config": {
            "health_check_initial_delay_ms": 0,
            "health_check_period_ms": 200,
            "health_check_failure_threshold": 3,
        },
    }
    return _harness.ray_session(cluster=head)


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
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.chaos", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--scenarios", type=int, default=len(KINDS))
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated kinds to draw")
    parser.add_argument("--only", type=int, default=None, help="run only scenario number N")
    parser.add_argument("--no-nodes", action="store_true", help="plain local Ray, no node loss")
    parser.add_argument("--verbose", action="store_true", help="show asyncexec's warnings")
    args = parser.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    if args.no_nodes:
        kinds = [k for k in kinds if k not in NODE_KINDS]
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
