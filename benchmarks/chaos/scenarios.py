"""The scenario records: every kind of fault, a drawn :class:`Scenario`, where it runs
(:class:`Env`) and what it saw (:class:`Outcome`)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["FAST_KINDS", "KINDS", "Env", "Outcome", "Scenario", "draw_one", "draw_scenarios"]

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
