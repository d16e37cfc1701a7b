"""Chaos runner: seeded fault scenarios against a real Ray, and the invariants checked after each.

    python -m benchmarks.chaos --seed 1 --scenarios 30     # every kind, node loss included
    python -m benchmarks.chaos --seed 7 --kinds kill_step,cancel --scenarios 6
    python -m benchmarks.chaos --seed 1 --only 12          # replay scenario #12 of seed 1 alone
    python -m benchmarks.chaos --seed 1 --scenarios 40 --kinds pool_leased,pool_idle,...

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

The group kinds (``GROUP_KINDS``) fault what several groups share, and each is cancelled at a
random moment in a third of its scenarios (after which the task returns within a bound, what it
saw is a valid prefix, and nothing is left):

- pools: a leased worker killed mid-run, an idle one between leases, one while its executor
  closes: no lease hands out a dead process, the pool refills to its size with live workers, and
  a lease of every worker then runs whole on its first attempt;
- spares: one kill, or two (the second once the spare was refilled): each spare takes the killed
  rank's place (the ranks' processes are the expected ones) and no new group starts;
- reservations: a kill in one of two executors on one reservation restarts it in its bundles
  while the other's run goes on, on its first attempt and its processes; the placement group
  stays, and closing gives every claim back;
- weight channels: the source's rank or a target rank killed during a push: that push returns or
  raises ``ChannelError``, the next push after recovery goes through, each report carries the
  version its rank held when it reported, no rank's version goes backwards, a report made after
  ``push()`` of v returned holds v, and every version's installed state is the one the driver
  tagged on the source;
- independent ranks: only the killed rank restarts, from its own checkpoint; every survivor's
  function started once and delivered each step once; every rank's result is right;
- elastic sizes: a node of half the group lost and added back: the run goes on smaller from the
  latest checkpoint, then grows back, one size per attempt, every step delivered;
- named runs: the driver process SIGKILLed (or cancelled), its workers gone, and a new driver
  goes on from the step after the latest recorded checkpoint, ``Step.index`` matching the work.

It prints one table (per kind: run, passed, failed, cancelled, recovery p50/max; failures by
invariant; each failure with its parameters) and exits with status 1 on any failure. Ray runs as
a ``ray.cluster_utils.Cluster`` (a head node of 4 CPUs; node-loss and elastic scenarios add a
node and remove it), or as a plain local Ray with ``--no-nodes``.

The modules: :mod:`~benchmarks.chaos.scenarios` (the kinds, the drawn records, the outcome),
:mod:`~benchmarks.chaos.worker` (the functions the workers run, faults included),
:mod:`~benchmarks.chaos.invariants` (the pure checks of a stream and a result, and the bounds),
:mod:`~benchmarks.chaos.group_invariants` (the pure checks of the group kinds),
:mod:`~benchmarks.chaos.harness` (the driver's tools for a scenario),
:mod:`~benchmarks.chaos.faults` (one coroutine per kind of one executor),
:mod:`~benchmarks.chaos.groups`, :mod:`~benchmarks.chaos.channel` and
:mod:`~benchmarks.chaos.resume` (the group kinds; :mod:`~benchmarks.chaos.driver` is the driver
process the named-run kind kills) and :mod:`~benchmarks.chaos.runner` (a scenario, the table, the
command line).
"""

from benchmarks.chaos.group_invariants import (
    Push,
    check_channel,
    check_independent,
    check_pool,
    check_resizes,
    check_resumed,
    check_sized,
    check_ticks,
    independent_complete,
    sized_complete,
)
from benchmarks.chaos.harness import leftovers
from benchmarks.chaos.invariants import check_complete, check_stream, expected_total
from benchmarks.chaos.runner import main, render_table, run_scenario
from benchmarks.chaos.scenarios import (
    CANCEL_WINDOW_S,
    FAST_KINDS,
    GROUP_KINDS,
    KINDS,
    NODE_KINDS,
    Env,
    Outcome,
    Scenario,
    draw_one,
    draw_scenarios,
)
from benchmarks.chaos.worker import counter

__all__ = [
    "CANCEL_WINDOW_S",
    "FAST_KINDS",
    "GROUP_KINDS",
    "KINDS",
    "NODE_KINDS",
    "Env",
    "Outcome",
    "Push",
    "Scenario",
    "check_channel",
    "check_complete",
    "check_independent",
    "check_pool",
    "check_resizes",
    "check_resumed",
    "check_sized",
    "check_stream",
    "check_ticks",
    "counter",
    "draw_one",
    "draw_scenarios",
    "expected_total",
    "independent_complete",
    "leftovers",
    "main",
    "render_table",
    "run_scenario",
    "sized_complete",
]
