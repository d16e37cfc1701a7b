"""A command's run: a fresh executor, the live view fed with each step, and what is printed
when the run ends (the summary, and the demo's story of its recovery)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import anyio

from .._driver._config import CheckpointConfig
from .._driver.run import RunResult
from .._errors import describe
from ._heap import frozen_heap
from ._target import RunOptions
from ._views import Tracker, View

__all__ = ["demo_story", "drive", "summary"]

#: Redraws of the live view per second.
_REFRESH_HZ = 8


async def drive(
    fn: Callable[..., Any], config: Any, options: RunOptions, tracker: Tracker, view: View
) -> RunResult:
    """Run ``fn`` on a fresh executor, feeding the view; return the run's result.

    Raises:
        AsyncExecError: the run failed (after the restarts the policy allows).
    """
    import tenacity

    from .._driver._executor import Executor
    from .._driver._restart import RestartPolicy

    policy = RestartPolicy(max_restarts=options.max_restarts)
    if options.restart_wait_s is not None:
        policy = replace(policy, wait=tenacity.wait_fixed(options.restart_wait_s))
    async with (
        Executor(
            options.num_workers,
            resources_per_worker=options.resources,
            restart=policy,
            storage_path=options.storage_path,
            checkpoint=CheckpointConfig(keep_runs=True),
            address=options.address,
            runtime_env=options.runtime_env,
            name="cli",
            local=options.local,
            timeline=options.timeline is not None,
        ) as executor,
        frozen_heap(),
    ):
        run = executor.run(fn, config)
        tracker.run_id = run.run_id
        tracker.state = "running"
        error: BaseException | None = None
        async with anyio.create_task_group() as tg:
            tg.start_soon(_refresh_loop, run, tracker, view)
            try:
                async for step in run:
                    tracker.add(step)
                    view.on_step(step)
            except Exception as exc:  # re-raised below, outside the task group
                error = exc
            finally:
                tg.cancel_scope.cancel()
        tracker.state = run.state.value
        if executor.timeline is not None and options.timeline:  # also when the run failed
            # On stderr: with --json, stdout carries the steps only.
            where = await anyio.Path(options.timeline).resolve()
            try:
                executor.timeline.export(options.timeline, "asyncexec run")
            except (OSError, ImportError) as exc:  # said; the run's own outcome stands
                print(f"asyncexec: could not write the timeline to {where}: {exc}", file=sys.stderr)
            else:
                print(f"timeline written to {where}", file=sys.stderr)
        if error is not None:
            raise error
        return run.result


async def _refresh_loop(run: Any, tracker: Tracker, view: View) -> None:
    seen_attempt = 1
    while True:
        tracker.state = run.state.value
        tracker.attempt = max(tracker.attempt, run.attempt)
        if run.attempt != seen_attempt:
            seen_attempt = run.attempt
            ckpt = run.latest_checkpoint
            origin = f"from {ckpt.path}" if ckpt is not None else "from the start (no checkpoint)"
            view.note(f"attempt {run.attempt}: the group restarted; resuming {origin}")
        tracker.sample()
        view.refresh()
        await anyio.sleep(1 / _REFRESH_HZ)


def summary(result: RunResult, tracker: Tracker, *, removed: bool = False) -> str:
    """What is printed when the run has finished; ``removed``: its checkpoints are about to be
    removed with the demo's temporary folder."""
    restarts = result.attempts - 1
    lines = [
        f"finished: {result.steps} steps in {result.attempts} attempt(s) "
        f"({restarts} restart{'s' if restarts != 1 else ''}), {tracker.elapsed:.1f} s",
    ]
    for i, failure in enumerate(result.failures, 1):
        lines.append(f"  failure {i}: {describe(failure)}")
    if result.checkpoint is not None:
        gone = " (removed with the demo's temporary folder; --storage-path keeps it)"
        lines.append(f"  latest checkpoint: {result.checkpoint.path}{gone if removed else ''}")
    values = repr(result.return_values)
    lines.append(f"  returned: {values if len(values) <= 400 else values[:399] + '…'}")
    return "\n".join(lines)


def demo_story(result: RunResult, crash_step: int | None = None, steps: int | None = None) -> str:
    """What happened in the demo, from its result (and the step it was to crash at, of its
    ``steps``)."""
    if not result.failures:
        if crash_step is not None and steps is not None and crash_step >= steps:
            return (
                f"no crash: the crash comes at step {crash_step} (--crash-step), after the last "
                f"of --steps {steps}; nothing to recover from"
            )
        return "no crash was injected; nothing to recover from"
    failure = result.failures[0]
    rank = getattr(failure, "rank", "?")
    resumed = sorted({v["resumed_from"] for v in result.return_values if isinstance(v, dict)})
    if resumed and resumed[0]:
        how = f"resumed every rank from the checkpoint of step {resumed[0] - 1}"
    else:  # the crash came before the first checkpoint
        how = "started every rank again from step 0 (no checkpoint had been saved yet)"
    return (
        f"recovered: rank {rank} was killed on attempt 1 ({type(failure).__name__}); attempt "
        f"{result.attempts} {how} and finished"
    )
