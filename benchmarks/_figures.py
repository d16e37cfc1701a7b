"""The benchmark's figures (the rows of its table, with the issue's targets) and its sizes.

Free of side effects, so that the test can read the rows it expects without starting anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from _harness import Figure, Table

__all__ = [
    "CHANNEL_KEYS",
    "FULL",
    "QUICK",
    "LIFECYCLE_KEYS",
    "LOCAL_KEYS",
    "OUTLIVE_KEYS",
    "Sizes",
    "TABLE",
    "make_figures",
]

#: run.py's table: the four systems' medians, asyncexec's ratio to Ray Train and to the floor.
TABLE = Table(
    [
        ("raytrain", "Ray Train v1"),
        ("lockstep", "lockstep loop"),
        ("floor", "batched floor"),
        ("asyncexec", "asyncexec"),
    ],
    [("raytrain", "asyncexec / Ray Train"), ("floor", "asyncexec / floor")],
)


@dataclass(frozen=True)
class Sizes:
    """How much each figure measures."""

    repeats: int
    startup_repeats: int
    restart_repeats: int
    run_end_repeats: int
    steps: dict[int, int]  # asyncexec and the batched floor, per worker count
    raytrain_steps: dict[int, int]
    lockstep_steps: dict[int, int]
    lag_steps: int
    raytrain_lag_steps: int
    memory_steps: int
    memory_every: int
    memory_warmup: int
    # Event-loop lag through whole lifecycles (_lifecycle.py): executors of workers each, all in
    # one loop; each streams lifecycle_steps per cycle; rounds interleaved with the floor's.
    lifecycle_executors: int
    lifecycle_workers: int
    lifecycle_steps: int
    lifecycle_cycles: int
    lifecycle_repeats: int
    # Warm workers (_warm.py): lease cycles per lag repeat, the floor's steps beside them.
    warm_cycles: int
    warm_floor_steps: int
    # Weights between executors (_channel.py): the state's bytes and tensors, the repeats of
    # the move, the pushes during the loop's lag, the SIGKILLs and the staleness bound K.
    channel_bytes: int
    channel_parts: int
    channel_repeats: int
    channel_lag_pushes: int
    channel_kills: int
    channel_staleness: int
    # Runs that outlive failures (_outlive.py): independent ranks, repeats; driver-death resumes.
    outlive_workers: int
    outlive_repeats: int
    resume_repeats: int
    worker_counts: tuple[int, ...] = (4, 1, 16)  # the groups of the reports/s rows, in order
    # Unrecorded first rounds of the start-up, local mode and service figures (they pay the
    # one-time costs: imports, exporting the actor classes); none in the quick run, a smoke run.
    warmups: int = 1


FULL = Sizes(
    repeats=3,
    startup_repeats=3,
    restart_repeats=3,
    run_end_repeats=5,
    steps={1: 100_000, 4: 50_000, 16: 10_000},
    raytrain_steps={1: 1000, 4: 500, 16: 300},
    lockstep_steps={1: 1000, 4: 1000, 16: 300},
    lag_steps=50_000,
    raytrain_lag_steps=300,
    memory_steps=100_000,
    memory_every=1000,
    memory_warmup=10_000,
    lifecycle_executors=4,
    lifecycle_workers=2,
    lifecycle_steps=20_000,
    lifecycle_cycles=2,
    lifecycle_repeats=3,
    warm_cycles=10,
    warm_floor_steps=20_000,
    channel_bytes=256 << 20,
    channel_parts=4,
    channel_repeats=5,
    channel_lag_pushes=5,
    channel_kills=20,
    channel_staleness=2,
    outlive_workers=8,
    outlive_repeats=3,
    resume_repeats=3,
)
QUICK = Sizes(
    repeats=1,
    startup_repeats=1,
    restart_repeats=1,
    run_end_repeats=2,
    steps={1: 2000, 4: 2000, 16: 500},
    raytrain_steps={1: 50, 4: 50, 16: 20},
    lockstep_steps={1: 200, 4: 200, 16: 50},
    lag_steps=5000,
    raytrain_lag_steps=50,
    memory_steps=10_000,
    memory_every=500,
    memory_warmup=2000,
    lifecycle_executors=2,
    lifecycle_workers=2,
    lifecycle_steps=10_000,
    lifecycle_cycles=1,
    lifecycle_repeats=1,
    warm_cycles=3,
    warm_floor_steps=5000,
    channel_bytes=16 << 20,
    channel_parts=4,
    channel_repeats=1,
    channel_lag_pushes=3,
    channel_kills=2,
    channel_staleness=2,
    outlive_workers=4,
    outlive_repeats=1,
    resume_repeats=1,
    worker_counts=(4, 1),  # 16 workers (the longest start of the run) in the full run only
    warmups=0,  # a warm-up starts 12 workers and 8 ranks, measured for nothing
)


def _ours(key: str, label: str, unit: str, **options: Any) -> Figure:
    """A row Ray Train has no figure in (its column not expected filled)."""
    return Figure(key, label, unit, raytrain=False, **options)


def _ratio(m: dict[str, float], a: str, b: str) -> float:
    return m[a] / m[b]


def make_figures(sizes: Sizes) -> dict[str, Figure]:
    """Every row of the table, in order, with its target."""
    figs: list[Figure] = []
    for n in sorted(sizes.worker_counts):
        figs.append(
            Figure(
                f"rate{n}",
                f"reports/s, {n} worker{'s' if n > 1 else ''}, tiny reports",
                "reports/s",
                target=">= 100x Ray Train, >= 0.9x floor",
                check=lambda m: (
                    _ratio(m, "asyncexec", "raytrain") >= 100
                    and _ratio(m, "asyncexec", "floor") >= 0.9
                ),
                higher_is_better=True,
            )
        )
    figs += [
        _ours(
            "metrics_cost",
            "reports/s, 4 workers, with Prometheus metrics on (floor: the same run with them off)",
            "reports/s",
            target=">= 0.97x off",
            check=lambda m: _ratio(m, "asyncexec", "floor") >= 0.97,
            higher_is_better=True,
        ),
        Figure(
            "startup",
            "start-up, 4 workers (floor: 4 plain actors ready)",
            "s",
            target="<= 0.6x Ray Train, <= 1.2x plain actors",
            check=lambda m: (
                _ratio(m, "asyncexec", "raytrain") <= 0.6 and _ratio(m, "asyncexec", "floor") <= 1.2
            ),
        ),
        Figure(
            "run_end",
            "last report to the run's end",
            "ms",
            target="< 50 ms",
            check=lambda m: m["asyncexec"] < 50,
        ),
        Figure(
            "restart",
            "SIGKILL of 1 of 4 workers to the next attempt's first step",
            "s",
            target="<= 0.5x Ray Train",
            check=lambda m: _ratio(m, "asyncexec", "raytrain") <= 0.5,
        ),
        Figure(
            "restart_reuse",
            "the same with RestartPolicy(reuse_survivors=True)",
            "s",
            target="<= 0.5x Ray Train",
            check=lambda m: _ratio(m, "asyncexec", "raytrain") <= 0.5,
        ),
        Figure(
            "restart_spare",
            "the same with a standby spare (Executor(spares=1))",
            "s",
            target="<= 150 ms",
            check=lambda m: m["asyncexec"] <= 0.150,
        ),
        Figure(
            "restart_default",
            "the same with the default RestartPolicy() and a fresh group",
            "s",
            target="<= 0.5x Ray Train",
            check=lambda m: _ratio(m, "asyncexec", "raytrain") <= 0.5,
        ),
        Figure(
            "uss",
            "worker memory before fn runs, USS (floor: plain actor)",
            "MiB",
            target="<= 1.1x plain actor",
            check=lambda m: _ratio(m, "asyncexec", "floor") <= 1.1,
        ),
        Figure(
            "rss",
            "worker memory before fn runs, RSS (floor: plain actor)",
            "MiB",
            target="<= 1.1x plain actor",
            check=lambda m: _ratio(m, "asyncexec", "floor") <= 1.1,
        ),
        _ours(
            "driver_mem",
            f"driver RSS growth over {sizes.memory_steps:,} steps (after "
            f"{sizes.memory_warmup:,}), 4 workers",
            "MiB",
            target="flat (< 2 MiB)",
            check=lambda m: m["asyncexec"] < 2.0,
        ),
        Figure(
            "lag_p99",
            "event-loop lag p99 while streaming, 4 workers, 1 ms heartbeat",
            "ms",
            most=2.0,
        ),
        Figure(
            "lag_max",
            "event-loop lag max while streaming, 4 workers",
            "ms",
            most=15.0,
        ),
        Figure(
            "freeze_start",
            "event-loop freeze during start-up, 4 workers (max lag)",
            "ms",
            target="(contrast)",
        ),
    ]
    figs += warm_figures()
    figs += channel_figures(sizes)
    figs += outlive_figures(sizes)
    figs += local_figures()
    figs += lifecycle_figures(sizes)
    return {f.key: f for f in figs}


#: The rows of local mode (``--local-only``).
LOCAL_KEYS = ("local_start", "local_rate")


def local_figures() -> list[Figure]:
    """Local mode (the ranks in threads of the driver's process) beside the same executor on
    Ray actors, the floor: what a debugging or test run costs. Ray Train's first executor has no
    local mode."""
    return [
        _ours(
            "local_start",
            "local mode: entering an executor of 4 ranks (floor: the same executor on 4 Ray "
            "actors)",
            "s",
            target="< 0.1x Ray actors",
            check=lambda m: m["asyncexec"] < 0.1 * m["floor"],
        ),
        _ours(
            "local_rate",
            "local mode: reports/s, 4 ranks, tiny reports (floor: the same executor on 4 Ray "
            "actors)",
            "reports/s",
            target="(contrast: one process, one GIL)",
            higher_is_better=True,
        ),
    ]


#: The rows of runs that outlive their failures (``--outlive-only``).
OUTLIVE_KEYS = ("indep_restarted", "indep_gap", "indep_replaced", "resume")


def outlive_figures(sizes: Sizes) -> list[Figure]:
    """Independent ranks and driver-death resumes (``_outlive.py``)."""
    n = sizes.outlive_workers
    return [
        _ours(
            "indep_restarted",
            f"{n} independent ranks, SIGKILL one: survivors whose function restarted",
            "count",
            target="0",
            check=lambda m: m["asyncexec"] == 0,
        ),
        _ours(
            "indep_gap",
            "the same: longest gap in a survivor's report stream around the kill (floor: the "
            "longest before it, the stream's own pace)",
            "ms",
            target="<= 3x the gap before",
            check=lambda m: m["asyncexec"] <= 3 * m["floor"],
        ),
        _ours(
            "indep_replaced",
            "the same: SIGKILL to the replaced rank's next report, warm spare",
            "ms",
            most=300,
        ),
        _ours(
            "resume",
            "driver SIGKILLed at step k, a new driver with the same run name: process start to "
            "step k+1 (Ray already up)",
            "s",
            most=2.5,
        ),
    ]


def warm_figures() -> list[Figure]:
    """Warm workers leased from a WorkerPool (``_warm.py``; the service row from
    ``_service.py``)."""
    return [
        _ours(
            "warm_enter",
            "entering an executor of 4 workers leased from a warm pool (floor: 4 plain actors, "
            "cold)",
            "ms",
            most=100,
        ),
        _ours(
            "warm_first",
            "run() to the first step, warm executor of 4 workers",
            "ms",
            most=50,
        ),
        _ours(
            "service_first",
            "service: POST /runs to the first SSE step, pool of warm workers (httpx, uvicorn)",
            "ms",
            most=200,
        ),
        _ours(
            "lease_p99",
            "event-loop lag p99 while leasing, returning and refilling (floor: streaming)",
            "ms",
            target="<= 1.0x floor streaming",
            check=lambda m: _ratio(m, "asyncexec", "floor") <= 1.0,
        ),
        _ours(
            "lease_max",
            "event-loop lag max while leasing, returning and refilling (floor: streaming)",
            "ms",
            target="<= 1.0x floor streaming",
            check=lambda m: _ratio(m, "asyncexec", "floor") <= 1.0,
        ),
    ]


#: The rows of the weight channel benchmark (the only ones a ``--channel-only`` run prints).
CHANNEL_KEYS = (
    "channel_torch",
    "channel_store",
    "channel_driver",
    "channel_version_lag",
    "channel_lag_p99_torch",
    "channel_lag_max_torch",
    "channel_lag_p99_store",
    "channel_lag_max_store",
)


def channel_figures(sizes: Sizes) -> list[Figure]:
    """A state moved from a learner executor's rank 0 to the 4 ranks of a rollout executor
    (``_channel.py``): WeightChannel against a hand-written gloo broadcast in the same processes
    and against today's way through the driver; the weight version lag through SIGKILLs; the
    driver's event-loop lag during pushes."""
    mb = f"{sizes.channel_bytes >> 20} MB"
    k = sizes.channel_staleness
    return [
        _ours(
            "channel_torch",
            f"{mb}, rank 0 of 2 to 4 ranks of another executor: WeightChannel torch (gloo) "
            "(floor: hand-written broadcast)",
            "s",
            target=">= 0.8x the floor's speed, faster than through the driver",
            # Times: the floor's time over the channel's is the channel's speed relative to it.
            check=lambda m: _ratio(m, "floor", "asyncexec") >= 0.8 and m["asyncexec"] < m["driver"],
        ),
        _ours(
            "channel_store",
            "the same through the object store (floor: through the driver, today's way)",
            "s",
            target="faster than through the driver",
            check=lambda m: m["asyncexec"] < m["floor"],
        ),
        _ours(
            "channel_driver",
            "the same through the driver: execute_single(), then execute() with the state "
            "(floor: the broadcast)",
            "s",
            target="(contrast)",
        ),
        _ours(
            "channel_version_lag",
            f"weight version lag of rollout reports (max), K={k}, through "
            f"{sizes.channel_kills} SIGKILLs of rollout and learner ranks",
            "versions",
            target=f"<= K ({k})",
            check=lambda m: m["asyncexec"] <= k,
        ),
        _ours(
            "channel_lag_p99_torch",
            f"event-loop lag p99 during {mb} pushes, torch transport (floor: during the broadcast)",
            "ms",
            most=2.0,
        ),
        _ours(
            "channel_lag_max_torch",
            f"event-loop lag max during {mb} pushes, torch transport",
            "ms",
            most=15.0,
        ),
        _ours(
            "channel_lag_p99_store",
            f"event-loop lag p99 during {mb} pushes, object store transport",
            "ms",
            most=2.0,
        ),
        _ours(
            "channel_lag_max_store",
            f"event-loop lag max during {mb} pushes, object store transport",
            "ms",
            most=15.0,
        ),
    ]


#: The rows of the lifecycle benchmark (the only ones a ``--lifecycle-only`` run prints).
LIFECYCLE_KEYS = ("life_p99", "life_max", "life_alone_p99", "life_alone_max")


def lifecycle_figures(sizes: Sizes) -> list[Figure]:
    """Event-loop lag through whole lifecycles (asyncexec column) against the same heartbeat
    beside the batched floor streaming (floor column), as ratios measured in one run."""
    who = f"{sizes.lifecycle_executors} executors x {sizes.lifecycle_workers} workers in one loop"
    return [
        _ours(
            "life_p99",
            f"event-loop lag p99 over whole lifecycles, {who} (floor: streaming)",
            "ms",
            target="<= 1.0x floor streaming",
            check=lambda m: _ratio(m, "asyncexec", "floor") <= 1.0,
        ),
        _ours(
            "life_max",
            "event-loop lag max over whole lifecycles (floor: streaming)",
            "ms",
            target="<= 1.5x floor streaming",
            check=lambda m: _ratio(m, "asyncexec", "floor") <= 1.5,
        ),
        _ours(
            "life_alone_p99",
            "the same, p99 of the lifecycles while streaming alone",
            "ms",
            target="<= 1.0x floor streaming",
            check=lambda m: _ratio(m, "asyncexec", "floor") <= 1.0,
        ),
        _ours(
            "life_alone_max",
            "the same, max of the lifecycles while streaming alone",
            "ms",
            target="<= 1.5x floor streaming",
            check=lambda m: _ratio(m, "asyncexec", "floor") <= 1.5,
        ),
    ]
