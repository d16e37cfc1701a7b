"""Independent ranks against a real Ray: a SIGKILLed rank is replaced on its own (a fresh process
in its bundle, or a standby spare) and resumes from its own checkpoint; the survivors' functions
never stop; the unaligned stream delivers every report once, as it arrives."""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from collections import defaultdict
from typing import Any

import anyio
import pytest

import asyncexec
from asyncexec.backends import TorchBackend

pytestmark = [pytest.mark.usefixtures("ray_local"), pytest.mark.timeout(180)]

TOTAL = 60
_starts = 0  # functions started in this worker process


def rollout(config: dict[str, Any]) -> int:
    """Reports n = start .. TOTAL-1, a checkpoint every 5; starts from its rank's checkpoint."""
    global _starts
    _starts += 1
    rank = asyncexec.get_context().world_rank
    start = 0
    checkpoint = asyncexec.get_checkpoint()
    if checkpoint is not None:
        with open(os.path.join(checkpoint.path, "n.json")) as f:
            start = json.load(f)
    for n in range(start, TOTAL):
        time.sleep(config["delay"])
        metrics = {"rank": rank, "n": n, "pid": os.getpid()}
        if n % 5 == 4:
            with tempfile.TemporaryDirectory() as tmp:
                with open(os.path.join(tmp, "n.json"), "w") as f:
                    json.dump(n + 1, f)
                asyncexec.report(metrics, checkpoint=asyncexec.Checkpoint.from_directory(tmp))
        else:
            asyncexec.report(metrics)
    return rank * 100 + TOTAL


def starts() -> tuple[int, int]:
    return os.getpid(), _starts


@pytest.mark.parametrize("spares", [0, 1])
async def test_a_killed_rank_is_replaced_alone_and_the_survivors_never_stop(
    spares: int, tmp_path: Any
) -> None:
    victim = 2
    async with asyncexec.Executor(
        4,
        resources_per_worker={"CPU": 0.5},
        spares=spares,
        storage_path=str(tmp_path),
        restart=asyncexec.RestartPolicy(max_restarts=1),
    ) as executor:
        pids = [w.pid for w in executor.workers]
        run = executor.run(rollout, {"delay": 0.02}, independent=True)
        per_rank: dict[int, list[int]] = defaultdict(list)
        indices: list[int] = []
        killed_at: int | None = None
        survivors_during_gap = 0
        back = False
        with anyio.fail_after(120):
            async for step in run:
                indices.append(step.index)
                assert len(step.reports) == 1 and step.rank == step.reports[0].rank
                assert step.metrics["rank"] == step.rank
                per_rank[step.rank].append(step.metrics["n"])
                if step.rank == victim and step.attempt == 2:
                    back = True
                if killed_at is None and step.rank == victim and step.metrics["n"] == 12:
                    killed_at = step.index
                    os.kill(pids[victim], signal.SIGKILL)
                elif killed_at is not None and not back and step.rank != victim:
                    survivors_during_gap += 1
                if step.rank != victim:
                    assert step.attempt == 1
        result = executor.result
        # The rank replaced alone counts as a restart (it counted none).
        assert executor.statistics().restarts == 1
        # Survivors went on while the victim was replaced, and none of them started again:
        # same processes, each function started once.
        assert survivors_during_gap > 5
        seen = dict(await executor.execute(starts))
        assert [w.pid for w in executor.workers][:victim] == pids[:victim]
        assert [w.pid for w in executor.workers][victim + 1 :] == pids[victim + 1 :]
        assert executor.workers[victim].pid != pids[victim]
        assert all(count == 1 for count in seen.values())
    # The unaligned stream: every index once, in order; every survivor report once.
    assert indices == list(range(len(indices)))
    for rank in (0, 1, 3):
        assert per_rank[rank] == list(range(TOTAL))
    # The victim resumed from its own latest checkpoint: nothing lost, and only what came
    # after that checkpoint repeated.
    got = per_rank[victim]
    assert sorted(set(got)) == list(range(TOTAL))
    repeated = sorted(n for n in set(got) if got.count(n) > 1)
    assert repeated and repeated[0] % 5 == 0 and repeated == list(range(repeated[0], 13))
    assert result.return_values == [r * 100 + TOTAL for r in range(4)]
    assert result.attempts == 2 and len(result.failures) == 1
    assert isinstance(result.failures[0], asyncexec.WorkerCrashedError)
    assert result.failures[0].rank == victim
    assert len(result.checkpoints) == 4 and all(c is not None for c in result.checkpoints)
    assert all(f"rank_{r}" in c.path for r, c in enumerate(result.checkpoints) if c)


async def test_independent_runs_are_refused_where_ranks_depend_on_each_other(
    tmp_path: Any,
) -> None:
    pytest.importorskip("torch")
    async with asyncexec.Executor(
        1, resources_per_worker={"CPU": 0.5}, backend=TorchBackend(), storage_path=str(tmp_path)
    ) as executor:
        with pytest.raises(asyncexec.ConfigurationError, match="depend on each other"):
            executor.run(rollout, {"delay": 0.0}, independent=True)
