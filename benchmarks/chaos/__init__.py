"""Chaos runner: seeded fault scenarios against a real Ray, and the invariants checked after each.

    python -m benchmarks.chaos --seed 1 --scenarios 30     # every kind, node loss included
    python -m benchmarks.chaos --seed 7 --kinds kill_step,cancel --scenarios 6
    python -m benchmarks.chaos --seed 1 --only 12          # replay scenario #12 of seed 1 alone

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

The modules: :mod:`~benchmarks.chaos.scenarios` (the kinds, the drawn records, the outcome),
:mod:`~benchmarks.chaos.worker` (the counter and init hook the workers run, faults included),
:mod:`~benchmarks.chaos.invariants` (the pure checks of a stream and a result, and the bounds),
:mod:`~benchmarks.chaos.harness` (the driver's tools for a scenario),
:mod:`~benchmarks.chaos.faults` (one coroutine per kind) and :mod:`~benchmarks.chaos.runner` (a
scenario, the table, the command line).
"""

from benchmarks.chaos.harness import leftovers
from benchmarks.chaos.invariants import check_complete, check_stream, expected_total
from benchmarks.chaos.runner import main, render_table, run_scenario
from benchmarks.chaos.scenarios import (
    FAST_KINDS,
    KINDS,
    Env,
    Outcome,
    Scenario,
    draw_one,
    draw_scenarios,
)
from benchmarks.chaos.worker import counter

__all__ = [
    "FAST_KINDS",
    "KINDS",
    "Env",
    "Outcome",
    "Scenario",
    "check_complete",
    "check_stream",
    "counter",
    "draw_one",
    "draw_scenarios",
    "expected_total",
    "leftovers",
    "main",
    "render_table",
    "run_scenario",
]
