"""RestartPolicy: which failures restart the group, how often, and how long to wait. On tenacity.

``max_restarts=N`` allows exactly N restarts after the first attempt (N+1 attempts in all);
``None`` allows any number. The wait between attempts is exponential backoff with jitter by
default. Any tenacity ``stop`` or ``wait`` strategy can replace the defaults, and the sleep
function is injectable so tests never sleep for real. Which failures restart is said one way:
``retry_if``, a predicate over the failure (``restart_on_user_error=True`` is the shorthand for
the most common change of it).

A preemption is not a failure of the run: a worker lost with a node that the cluster had marked
for preemption restarts under a budget of its own (``max_preemptions``), without waiting and
without counting against ``max_restarts`` or ``stop``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import tenacity
from tenacity import RetryCallState
from tenacity.stop import stop_base
from tenacity.wait import wait_base

from .._errors import (
    ConfigurationError,
    NodeLostError,
    StartupError,
    WorkerCrashedError,
    WorkerHungError,
    WorkerRaisedError,
    WorkerUnreachableError,
)
from ._config import check_count

__all__ = ["PreemptionsSpent", "RestartPolicy", "is_restartable"]


_RESTARTABLE = (
    WorkerCrashedError,
    NodeLostError,
    WorkerHungError,
    WorkerUnreachableError,
    StartupError,
)


class PreemptionsSpent(Exception):  # a signal from a run's attempts to its driver, not an error
    """A preemption came after ``max_preemptions`` of them: the run ends with ``failure``.
    Never restarted by the policy (see :meth:`RestartPolicy.retrying`)."""

    def __init__(self, failure: BaseException, preemptions: int, budget: int) -> None:
        super().__init__(failure)
        self.failure = failure
        self.preemptions = preemptions
        self.budget = budget

    @property
    def note(self) -> str:
        """What the run's error says of it."""
        return (
            f"preemption {self.preemptions} is beyond RestartPolicy.max_preemptions="
            f"{self.budget}: a node of the group was drained and its workers are gone"
        )


def is_restartable(exc: BaseException) -> bool:
    """The default predicate: a crashed, lost, hung or unreachable worker, a failed start-up."""
    return isinstance(exc, _RESTARTABLE)


@dataclass(frozen=True)
class RestartPolicy:
    """When and how a run restarts its worker group after a failure.

    Which failures restart: by default a crashed worker, a lost node, a hung worker and a failed
    start-up (:func:`is_restartable`), not an exception of the user's function. To change that,
    pass ``retry_if``; ``restart_on_user_error=True`` is the shorthand that adds the user's
    exceptions. Giving both is refused: one says it all.

    Args:
        max_restarts: restarts allowed after the first attempt; ``None`` for no bound.
        restart_on_user_error: also restart when the user's function raises.
        retry_if: a predicate over the failure (an ``AsyncExecError``): True to restart. It
            replaces the default choice entirely.
        wait: tenacity wait strategy between attempts; exponential backoff with jitter
            (0.5 s doubling to 30 s, plus up to 0.5 s of jitter) by default.
        stop: tenacity stop strategy; replaces ``max_restarts`` when given, for example
            ``stop_after_attempt(5) | stop_after_delay(600)``.
        sleep: the coroutine function that waits; tests inject one that returns at once.
        max_preemptions: restarts allowed after a preemption (the group moved off a node
            marked as draining once a checkpoint was taken on notice, or a worker lost with a
            node that the cluster had marked as draining, or that its node table says a
            preemption took), counted apart from ``max_restarts`` (and from ``stop``), never
            waited for; ``None``
            (the default) for no bound: each one needs the cluster to take a node away. A
            preemption beyond it ends the run with :class:`RestartsExhaustedError` (a note says
            so). In a run of independent ranks, each rank renewed counts once.
        preemption_check_interval_s: how often the driver asks the cluster which of the
            group's nodes are being drained (one cheap look-up); ``None`` to never ask: a
            preemption is then only known by its cause of death, and the function gets no
            notice.
        backoff_after_progress: wait before a restart also when the attempt that failed had
            completed a step since it started. Off by default: the first restart after progress
            starts at once (backoff is for failures that repeat without progress, as in a crash
            loop), so a run that loses a worker after hours of work does not sit idle.
        reuse_survivors: after a crashed or hung rank, replace only that rank with a fresh
            process in its bundle and keep the others, whose functions are stopped (they restart
            from the checkpoint like every rank). Faster (one process to start, not N), but the
            survivors keep their module-level state. Falls back to replacing the whole group when
            a survivor does not stop in time, for a lost node, and with a backend (a framework's
            process group must be rebuilt by fresh processes). Off by default.
    """

    max_restarts: int | None = 3
    restart_on_user_error: bool = False
    retry_if: Callable[[BaseException], bool] | None = None
    wait: wait_base | Callable[[RetryCallState], float] = field(
        # wait_exponential_jitter(initial=...) warns on tenacity 9.1+, and its replacement
        # (multiplier=) does not exist on 9.0: the same wait, composed.
        default_factory=lambda: (
            tenacity.wait_exponential(multiplier=0.5, max=30) + tenacity.wait_random(0, 0.5)
        )
    )
    stop: stop_base | Callable[[RetryCallState], bool] | None = None
    sleep: Callable[[float], Awaitable[None]] = anyio.sleep
    reuse_survivors: bool = False
    backoff_after_progress: bool = False
    max_preemptions: int | None = None
    preemption_check_interval_s: float | None = 1.0

    def __post_init__(self) -> None:
        check_count("max_restarts", self.max_restarts, minimum=0, allow_none=True)
        check_count("max_preemptions", self.max_preemptions, minimum=0, allow_none=True)
        interval = self.preemption_check_interval_s
        if interval is not None and (
            isinstance(interval, bool)
            or not isinstance(interval, int | float)
            or not 0 < interval < math.inf
        ):
            raise ConfigurationError(
                "RestartPolicy.preemption_check_interval_s must be a positive number of seconds "
                f"or None, got {interval!r}"
            )
        for name in ("retry_if", "wait", "stop", "sleep"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise ConfigurationError(f"RestartPolicy.{name} must be callable, got {value!r}")
        if self.retry_if is not None and self.restart_on_user_error:
            raise ConfigurationError(
                "RestartPolicy takes retry_if or restart_on_user_error=True, not both: "
                "retry_if decides alone (include WorkerRaisedError in it to restart on user errors)"
            )

    @classmethod
    def never(cls) -> RestartPolicy:
        """No restarts: the first failure ends the run."""
        return cls(max_restarts=0)

    @classmethod
    def unbounded(cls, **options: Any) -> RestartPolicy:
        """Restart after every restartable failure, without a bound."""
        return cls(max_restarts=None, **options)

    def should_restart(self, exc: BaseException) -> bool:
        """Whether ``exc`` is a failure this policy restarts after (ignoring the stop rule)."""
        if self.retry_if is not None:
            return bool(self.retry_if(exc))
        if isinstance(exc, WorkerRaisedError):
            return self.restart_on_user_error
        return is_restartable(exc)

    def _ends_after(
        self, exc: BaseException, attempts: int, state: RetryCallState | None = None
    ) -> bool:
        """Whether the run ends after ``attempts`` attempts, the last failed with ``exc``,
        as far as it is known before tenacity decides: a failure it does not restart after,
        ``max_restarts`` spent, or a ``stop`` of the caller's that says so now (asked with a
        copy of the attempt's ``state`` that holds the failure; False without one)."""
        if isinstance(exc, PreemptionsSpent) or not self.should_restart(exc):
            return True
        if self.stop is None:
            return self.max_restarts is not None and attempts >= self.max_restarts + 1
        if state is None:
            return False
        trial = copy.copy(state)
        trial.set_exception((type(exc), exc, exc.__traceback__))
        try:
            return bool(self.stop(trial))
        except Exception:  # a strategy that needs more than a failed attempt: tenacity asks it
            return False

    def retrying(
        self,
        before_sleep: Callable[[RetryCallState], None],
        progressed: Callable[[], bool] | None = None,
    ) -> tenacity.AsyncRetrying:
        """The tenacity controller for one run. ``progressed`` tells whether the attempt that
        just failed completed a step: then the restart does not wait (unless
        ``backoff_after_progress``)."""
        stop: Any = self.stop
        if stop is None:
            stop = (
                tenacity.stop_never
                if self.max_restarts is None
                else tenacity.stop_after_attempt(self.max_restarts + 1)
            )
        wait: Any = self.wait
        if progressed is not None and not self.backoff_after_progress:
            backoff = self.wait

            def wait(state: RetryCallState) -> float:
                return 0.0 if progressed() else float(backoff(state))

        def restarts(exc: BaseException) -> bool:
            return not isinstance(exc, PreemptionsSpent) and self.should_restart(exc)

        return tenacity.AsyncRetrying(
            stop=stop,
            wait=wait,
            retry=tenacity.retry_if_exception(restarts),
            sleep=self.sleep,
            before_sleep=before_sleep,
            reraise=False,
        )
