"""The scenario records: every kind of fault, a drawn :class:`Scenario`, where it runs
(:class:`Env`) and what it saw (:class:`Outcome`)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "CANCEL_WINDOW_S",
    "FAST_KINDS",
    "GROUP_KINDS",
    "KINDS",
    "NODE_KINDS",
    "Env",
    "Outcome",
    "Scenario",
    "draw_one",
    "draw_scenarios",
]

#: The kinds of one executor's faults, with what each does.
_SINGLE: dict[str, str] = {
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
#: The kinds of what several groups share (pools, spares, reservations, weight channels,
#: independent ranks, elastic sizes, named runs). Each is cancelled at a random moment in a third
#: of its scenarios (``Scenario.cancel_s``).
GROUP_KINDS: dict[str, str] = {
    "pool_leased": "SIGKILL a worker leased from a WorkerPool mid-run: restart on live workers",
    "pool_idle": "SIGKILL an idle pool worker between leases: no lease hands it out",
    "pool_closing": "SIGKILL a leased worker while its executor closes: the pool refills",
    "spares": "SIGKILL a rank beside a standby spare (then the refilled spare's rank, if drawn)",
    "reservation": "SIGKILL a rank of one of two executors on a Reservation: the other goes on",
    "channel_source": "SIGKILL a weight channel's source rank during a push",
    "channel_target": "SIGKILL a weight channel's target rank during a push",
    "independent": "SIGKILL a rank of a run of independent ranks: it alone restarts",
    "elastic": "remove the node of half an elastic group, then add it back: shrink, grow back",
    "driver_killed": "SIGKILL a named run's driver process (or cancel it); a new driver resumes",
}
#: Every kind of fault the runner injects, with what it does.
KINDS: dict[str, str] = {**_SINGLE, **GROUP_KINDS}
#: The kinds that add a node to the cluster and remove it (not with ``--no-nodes``).
NODE_KINDS = ("node_lost", "elastic")
#: The kinds that need no cluster of several nodes and take a few seconds each.
FAST_KINDS = tuple(k for k in KINDS if k not in (*NODE_KINDS, "hang_gil"))
#: The seconds within which a group kind's cancellation is drawn: about its scenario's length,
#: so that a cancel lands in start-up, in the run, in recovery or in teardown.
CANCEL_WINDOW_S: dict[str, float] = {
    "pool_leased": 3.0,
    "pool_idle": 3.5,
    "pool_closing": 3.5,
    "spares": 3.0,
    "reservation": 3.5,
    "channel_source": 5.0,
    "channel_target": 5.0,
    "independent": 3.0,
    "elastic": 10.0,
    "driver_killed": 1.0,  # from the run's start in the first driver
}


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
    #: Group kinds: cancel the scenario's task this many seconds after it starts (None: not).
    cancel_s: float | None = None
    #: Group kinds: a second kind-specific choice (see :meth:`describe`).
    alt: bool = False

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
            "pool_leased": f" pool_extra={int(self.flag)}",
            "pool_idle": f" lease_at_once={self.flag}",
            "pool_closing": f" kill_after={self.delay_s:.2f}s",
            "spares": f" second_kill_rank={self.rank2 if self.flag else None} pooled={self.alt}",
            "reservation": f" victim={'b' if self.flag else 'a'}",
            "channel_source": f" transport={self.transport} independent_target={self.flag} "
            f"kill_at={self.delay_s:+.2f}s",
            "channel_target": f" transport={self.transport} independent_target={self.flag} "
            f"kill_at={self.delay_s:+.2f}s",
            "independent": f" spares={int(self.alt)}",
            "elastic": f" fresh_group={self.alt}",
            "driver_killed": "",
        }.get(self.kind, "")
        cancel = f" cancel_after={self.cancel_s:.2f}s" if self.cancel_s is not None else ""
        return (
            f"#{self.number} {self.kind} seed={self.seed} workers={self.workers} "
            f"steps={self.steps} every={self.every} buffer={self.buffer} at={self.at} "
            f"rank={self.rank}{extra}{cancel}{' slow_consumer' if self.slow else ''}"
        )

    @property
    def transport(self) -> Literal["object_store", "torch"]:
        """A channel kind's transport: torch when ``alt`` is drawn."""
        return "torch" if self.alt else "object_store"


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
    drawn = Scenario(
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
    if kind not in GROUP_KINDS:
        return drawn
    # Drawn after the fields above, so that adding group kinds changed no other kind's draw.
    cancel_s = rng.uniform(0.0, CANCEL_WINDOW_S[kind]) if rng.random() < 1 / 3 else None
    changes: dict[str, Any] = {"cancel_s": cancel_s, "alt": rng.random() < 0.5}
    if kind == "pool_closing":
        changes["delay_s"] = rng.uniform(0.0, 0.3)
    if kind in ("channel_source", "channel_target"):
        # Before the push starts (negative: the push meets a restarting group), or during it.
        changes["delay_s"] = rng.uniform(-1.5, 0.45)
    if kind == "spares":
        # Room for the second kill: the consumer holds attempt 2's first step while the spare
        # is refilled, and the ranks must still have steps to take after the window fills.
        changes["at"] = min(drawn.at, drawn.steps - 9)
    if kind in ("elastic", "driver_killed"):
        changes.update(workers=2, rank=drawn.rank % 2, rank2=1 - drawn.rank % 2)
    return replace(drawn, **changes)


@dataclass
class Env:
    """Where scenarios run: a storage root, and the cluster when node loss can be injected."""

    root: Path
    cluster: Any = None
    #: The node a node_lost or elastic scenario removes, added before the scenario starts.
    node: Any = None
    #: The scenario's event-loop heartbeat (a kind that must block the loop excuses that stall).
    beat: Any = None


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

    def record(self, problems: Sequence[tuple[str, str]]) -> None:
        """Record each problem a check found."""
        self.problems += problems
