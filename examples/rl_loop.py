"""An asynchronous RL loop: rollout workers stream experience step by step, the learner in the
driver updates the policy and pushes the new weights to the same live workers, and the event loop
stays free for other work the whole time.

    pip install -e ".[examples]"      # numpy, which asyncexec itself does not need
    python examples/rl_loop.py --workers 2 --steps 200 --staleness 2

The task is a one-step control problem: observe ``x`` in [-1, 1], act ``a``, get the reward
``-(a - (2x - 0.5))**2``. The policy is linear and Gaussian, ``a ~ N(w0 * x + w1, sigma)``, trained
with REINFORCE and a mean baseline; its expected reward, ``-((w0 - 2)**2 / 3 + (w1 + 0.5)**2 +
sigma**2)``, rises from about -1.8 (``w = 0``) to ``-sigma**2`` (``w = [2, -0.5]``).

How the pieces fit:

- ``executor.run(rollout_fn, config, buffer_size=K)`` starts the rollout loop on every worker, in a
  thread of its own; each step, every worker reports a batch of experience with the version of the
  weights it acted with.
- ``await executor.execute(set_weights, version, weights)`` runs ``set_weights`` on every live
  worker (a plain function runs in a thread of the worker, an ``async def`` on its event loop)
  while ``rollout_fn`` keeps running; it stores the weights in a module-level holder that the
  rollout loop reads before each step.
- Staleness is bounded by the report buffer: with ``buffer_size=K`` a worker has at most K reports
  that the learner has not taken, and ``report()`` waits beyond that. The learner pushes new
  weights after every step it takes and awaits the push before taking the next, so the weights a
  worker acts with are never more than K versions behind the learner's:
  ``step_version >= learner_version - K``. The summary counts any step that breaks it.
- Another coroutine does small units of work every 5 ms on the same event loop and measures how
  late it wakes up (its loop lag): p50, p99 and max are printed at the end, over the whole run
  and after start-up.

After a restart (a worker lost), fresh worker processes start from the config's initial weights
until the learner's next push.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray

import asyncexec

# The worker side --------------------------------------------------------------------------------


class PolicyHolder:
    """The weights a worker process acts with, and their version.

    One per worker process (module-level): the rollout loop reads it in the function's thread,
    ``set_weights`` writes it in a thread of ``execute()``.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._version = -1
        self._weights = np.zeros(2)

    def set(self, version: int, weights: np.ndarray) -> None:
        with self._lock:
            if version > self._version:  # a late, older push never replaces a newer one
                self._version, self._weights = version, weights

    def get(self, initial: np.ndarray) -> tuple[int, np.ndarray]:
        """The latest pushed weights, or ``initial`` as version 0 before any push."""
        with self._lock:
            if self._version < 0:
                return 0, initial
            return self._version, self._weights


POLICY = PolicyHolder()


def set_weights(version: int, weights: list[float]) -> int:
    """Install new weights on this worker; the learner calls it with ``executor.execute()``."""
    POLICY.set(version, np.asarray(weights, dtype=np.float64))
    return version


def target_action(x: np.ndarray) -> np.ndarray:
    """The best action for each observation."""
    return 2.0 * x - 0.5


def rollout_fn(config: dict[str, Any]) -> int:
    """The rollout loop of one worker: act with the latest weights, report experience, repeat.

    Returns:
        The last weights version this worker acted with.
    """
    ctx = asyncexec.get_context()
    rng = np.random.default_rng([config["seed"], ctx.world_rank])
    initial = np.asarray(config["initial_weights"], dtype=np.float64)
    sigma, batch = float(config["sigma"]), int(config["batch"])
    version = 0
    for _ in range(int(config["steps"])):
        version, w = POLICY.get(initial)
        obs = rng.uniform(-1.0, 1.0, batch)
        actions = w[0] * obs + w[1] + sigma * rng.standard_normal(batch)
        rewards = -((actions - target_action(obs)) ** 2)
        if config["env_step_s"]:
            time.sleep(config["env_step_s"])  # a slower environment
        asyncexec.report({"version": version, "obs": obs, "actions": actions, "rewards": rewards})
    return version


# The driver side --------------------------------------------------------------------------------


def expected_reward(w: np.ndarray, sigma: float) -> float:
    """The policy's exact expected reward (x uniform on [-1, 1])."""
    return -float((w[0] - 2.0) ** 2 / 3.0 + (w[1] + 0.5) ** 2 + sigma**2)


def policy_gradient(
    reports: Sequence[Any], w: np.ndarray, sigma: float
) -> tuple[np.ndarray, float]:
    """REINFORCE with a mean baseline over every rank's batch; also the batch's mean reward."""
    obs = np.concatenate([r.metrics["obs"] for r in reports])
    actions = np.concatenate([r.metrics["actions"] for r in reports])
    rewards = np.concatenate([r.metrics["rewards"] for r in reports])
    mean = w[0] * obs + w[1]
    score = (rewards - rewards.mean()) * (actions - mean) / sigma**2
    grad = np.array([np.mean(score * obs), np.mean(score)])
    return grad, float(rewards.mean())


class LoopLag:
    """Other work on the same event loop: a unit of work every ``interval_s``, and how late each
    wake-up was (the loop's lag)."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.lags: list[float] = []
        self.digest = hashlib.sha256()
        self.stepping_from: int | None = None

    def mark_stepping(self) -> None:
        """Note that start-up is over: the first step has arrived."""
        if self.stepping_from is None:
            self.stepping_from = len(self.lags)

    async def run(self, stop: asyncio.Event) -> None:
        block = os.urandom(1024)
        while not stop.is_set():
            t0 = time.perf_counter()
            await asyncio.sleep(self.interval_s)
            self.lags.append(max(0.0, time.perf_counter() - t0 - self.interval_s))
            self.digest.update(block)  # the unit of work (hashing 1 KiB)

    def percentiles_ms(self, *, stepping_only: bool = False) -> tuple[float, float, float]:
        """p50, p99 and max lag in milliseconds, over the whole run or after start-up."""
        samples = self.lags[self.stepping_from or 0 :] if stepping_only else self.lags
        if not samples:
            return 0.0, 0.0, 0.0
        lags = np.asarray(samples) * 1000.0
        return (
            float(np.percentile(lags, 50)),
            float(np.percentile(lags, 99)),
            float(lags.max()),
        )


@dataclass(frozen=True)
class Summary:
    """What a run of the loop did."""

    steps: int
    workers: int
    staleness_bound: int
    max_staleness: int
    violations: int
    learner_version: int
    worker_versions: list[int]
    initial_expected_reward: float
    final_expected_reward: float
    first_batch_reward: float
    last_batch_reward: float
    weights: tuple[float, float]
    ticks: int
    lag_p50_ms: float
    lag_p99_ms: float
    lag_max_ms: float
    stepping_lag_p99_ms: float
    stepping_lag_max_ms: float
    seconds: float

    def report(self) -> str:
        """A few lines for people."""
        return "\n".join(
            [
                f"{self.steps} steps on {self.workers} workers in {self.seconds:.2f} s "
                f"({self.steps / self.seconds:.0f} steps/s), {self.learner_version} weight pushes",
                f"expected reward {self.initial_expected_reward:.3f} -> "
                f"{self.final_expected_reward:.3f} (best {-(0.5**2):.3f} at sigma 0.5), "
                f"weights [{self.weights[0]:.3f}, {self.weights[1]:.3f}] (best [2, -0.5])",
                f"staleness: at most {self.max_staleness} versions behind the learner "
                f"(bound {self.staleness_bound}), {self.violations} steps over the bound",
                f"other coroutine: {self.ticks} units of work; loop lag p50 "
                f"{self.lag_p50_ms:.2f} ms, p99 {self.lag_p99_ms:.2f} ms, max "
                f"{self.lag_max_ms:.2f} ms (after start-up: p99 {self.stepping_lag_p99_ms:.2f} "
                f"ms, max {self.stepping_lag_max_ms:.2f} ms)",
            ]
        )


async def main(
    *,
    workers: int = 2,
    steps: int = 200,
    staleness: int = 2,
    batch: int = 64,
    lr: float = 0.05,
    sigma: float = 0.5,
    env_step_s: float = 0.0,
    seed: int = 0,
    storage_path: str | os.PathLike[str] | None = None,
    verbose: bool = False,
) -> Summary:
    """Run the RL loop and return what it did.

    Args:
        workers: rollout workers (Ray actors of 0.5 CPU each).
        steps: rollout steps of every worker (one learner update each).
        staleness: the bound K: workers act with weights at most K versions old (the run's
            ``buffer_size``).
        batch: experience per worker per step.
        lr: the learner's step size.
        sigma: the policy's exploration noise.
        env_step_s: seconds the environment takes per step (0: as fast as numpy goes).
        seed: the workers' random seed.
        storage_path: the executor's storage path.
        verbose: print progress every 20 steps.
    """
    w = np.zeros(2)
    version = 0
    max_staleness = violations = 0
    batch_rewards: list[float] = []
    worker_versions: list[int] = []
    config = {
        "steps": steps,
        "batch": batch,
        "sigma": sigma,
        "seed": seed,
        "env_step_s": env_step_s,
        "initial_weights": w.tolist(),
    }
    lag = LoopLag()
    stop = asyncio.Event()
    t0 = time.perf_counter()
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(lag.run(stop))
        try:
            async with asyncexec.Executor(
                workers, resources_per_worker={"CPU": 0.5}, storage_path=storage_path
            ) as executor:
                run = executor.run(rollout_fn, config, buffer_size=staleness)
                async for step in run:
                    lag.mark_stepping()
                    for report in step.reports:
                        behind = version - int(report.metrics["version"])
                        max_staleness = max(max_staleness, behind)
                        violations += behind > staleness
                    grad, reward = policy_gradient(step.reports, w, sigma)
                    batch_rewards.append(reward)
                    w = w + lr * grad
                    version += 1
                    # The workers act with these from their next step on; awaiting the push
                    # before taking the next step is what bounds staleness by buffer_size.
                    await executor.execute(set_weights, version, w.tolist())
                    if verbose and version % 20 == 0:
                        print(
                            f"step {step.index}: batch reward {reward:.3f}, expected "
                            f"{expected_reward(w, sigma):.3f}, version {version}, "
                            f"staleness {version - 1 - int(step.metrics['version'])}"
                        )
                worker_versions = list(run.result.return_values)
        finally:
            stop.set()
    seconds = time.perf_counter() - t0
    p50, p99, worst = lag.percentiles_ms()
    _, stepping_p99, stepping_worst = lag.percentiles_ms(stepping_only=True)
    head = batch_rewards[: max(1, len(batch_rewards) // 10)]
    tail = batch_rewards[-max(1, len(batch_rewards) // 10) :]
    return Summary(
        steps=len(batch_rewards),
        workers=workers,
        staleness_bound=staleness,
        max_staleness=max_staleness,
        violations=violations,
        learner_version=version,
        worker_versions=worker_versions,
        initial_expected_reward=expected_reward(np.zeros(2), sigma),
        final_expected_reward=expected_reward(w, sigma),
        first_batch_reward=float(np.mean(head)) if head else 0.0,
        last_batch_reward=float(np.mean(tail)) if tail else 0.0,
        weights=(float(w[0]), float(w[1])),
        ticks=len(lag.lags),
        lag_p50_ms=p50,
        lag_p99_ms=p99,
        lag_max_ms=worst,
        stepping_lag_p99_ms=stepping_p99,
        stepping_lag_max_ms=stepping_worst,
        seconds=seconds,
    )


def cli(argv: Sequence[str] | None = None) -> int:
    """The command line: parse ``argv``, run the loop, print the summary; 0 when no step broke
    the staleness bound."""
    parser = argparse.ArgumentParser(description="An async RL loop on asyncexec.")
    parser.add_argument("--workers", type=int, default=2, help="rollout workers (default 2)")
    parser.add_argument("--steps", type=int, default=200, help="rollout steps (default 200)")
    parser.add_argument(
        "--staleness", type=int, default=2, help="bound on the weights' age in versions (2)"
    )
    parser.add_argument("--batch", type=int, default=64, help="experience per worker per step")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    parser.add_argument(
        "--env-step-s", type=float, default=0.0, help="seconds per environment step (default 0)"
    )
    parser.add_argument("--storage-path", default=None, help="the executor's storage path")
    parser.add_argument("--quiet", action="store_true", help="print the summary only")
    args = parser.parse_args(argv)
    # Refused here, before Ray starts, rather than with a traceback from the run.
    lows = {"workers": 1, "steps": 0, "staleness": 1, "batch": 1, "env_step_s": 0}
    for name, value in ((name, getattr(args, name)) for name in lows):
        if not value >= lows[name]:
            parser.error(f"--{name.replace('_', '-')} must be at least {lows[name]}, got {value}")
    asyncexec.configure_logging("console", "warning")
    if not ray.is_initialized():
        # Before the event loop starts: ray.init blocks for seconds, and in the main thread Ray
        # can install its signal handlers.
        ray.init(include_dashboard=False, logging_level=logging.WARNING)
    summary = asyncio.run(
        main(
            workers=args.workers,
            steps=args.steps,
            staleness=args.staleness,
            batch=args.batch,
            lr=args.lr,
            env_step_s=args.env_step_s,
            storage_path=args.storage_path,
            verbose=not args.quiet,
        )
    )
    print(summary.report())
    return 0 if summary.violations == 0 else 1


if __name__ == "__main__":
    # Run as a script, this file is the module __main__, whose functions cloudpickle sends by
    # value: rollout_fn and set_weights would each carry a copy of POLICY, and pushes would never
    # reach the rollout loop. Import it under its own name instead, so that the workers import it
    # too (from PYTHONPATH, set before Ray starts) and share one POLICY per process.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, here)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    import rl_loop

    sys.exit(rl_loop.cli())
