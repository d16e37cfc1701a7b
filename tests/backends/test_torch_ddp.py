"""The DDP example against a real Ray and real torch: it trains to the end with the loss going
down, and a worker SIGKILLed mid-run resumes from the checkpoint to the same final parameters."""

from __future__ import annotations

import importlib
import os
import signal
import sys
from pathlib import Path

import pytest
import tenacity

import asyncexec
from asyncexec.backends import TorchBackend

# The examples are a namespace package at the repository root (on the workers' PYTHONPATH too).
_root = str(Path(__file__).resolve().parents[2])
if _root not in sys.path:
    sys.path.insert(0, _root)
torch_ddp = importlib.import_module("examples.torch_ddp")

STEPS = 10
EVERY = 3
NO_WAIT = tenacity.wait_none()


def _state_file_exists(path: str) -> bool:
    return Path(path, torch_ddp.STATE_FILE).is_file()


def test_batches_are_a_pure_function_of_seed_step_and_rank() -> None:
    import torch

    x, y = torch_ddp.make_batch(0, 3, 1, 4)
    again = torch_ddp.make_batch(0, 3, 1, 4)
    assert torch.equal(x, again[0])
    assert torch.equal(y, again[1])
    assert not torch.equal(x, torch_ddp.make_batch(0, 4, 1, 4)[0])
    assert not torch.equal(x, torch_ddp.make_batch(0, 3, 0, 4)[0])


@pytest.mark.usefixtures("ray_local")
async def test_ddp_example_trains_to_the_end_with_loss_going_down(tmp_path: Path) -> None:
    summary = await torch_ddp.main(
        2, STEPS, checkpoint_every=EVERY, cpus_per_worker=0.5, storage_path=tmp_path, verbose=False
    )
    assert [(step, attempt) for step, attempt, _ in summary.losses] == [
        (s, 1) for s in range(STEPS)
    ]
    losses = [loss for *_, loss in summary.losses]
    assert sum(losses[-3:]) / 3 < sum(losses[:2]) / 2 / 3, losses
    assert summary.attempts == 1
    assert summary.checkpoint is not None
    assert _state_file_exists(summary.checkpoint)
    assert len(summary.parameters) == sum(p.numel() for p in torch_ddp.make_model(0).parameters())


@pytest.mark.usefixtures("ray_local")
@pytest.mark.timeout(240)
async def test_sigkilled_worker_resumes_from_checkpoint_to_the_same_final_parameters(
    tmp_path: Path,
) -> None:
    clean = await torch_ddp.main(
        2,
        STEPS,
        checkpoint_every=EVERY,
        cpus_per_worker=0.5,
        storage_path=tmp_path / "clean",
        verbose=False,
    )
    clean_loss = {step: loss for step, _, loss in clean.losses}

    config = torch_ddp.make_config(steps=STEPS, checkpoint_every=EVERY)
    kill_after = 4  # the training step after which rank 1 is killed; a checkpoint is at step 2
    seen: list[tuple[int, int, float, bool]] = []
    async with asyncexec.Executor(
        2,
        resources_per_worker={"CPU": 0.5},
        backend=TorchBackend(backend="gloo"),
        # The survivor's collective fails ("connection closed by peer") as fast as Ray reports
        # the death; the executor blames the dead rank, so the default policy restarts.
        restart=asyncexec.RestartPolicy(max_restarts=2, wait=NO_WAIT),
        storage_path=tmp_path / "killed",
    ) as ex:
        pids = await ex.execute(os.getpid)
        assert pids == [w.pid for w in ex.workers]
        # buffer_size=1: the workers stay at most a step ahead, so the kill lands mid-run.
        async for step in ex.run(torch_ddp.train_loop, config, buffer_size=1):
            seen.append(
                (step.metrics["step"], step.attempt, step.metrics["loss"], bool(step.checkpoint))
            )
            if step.attempt == 1 and step.metrics["step"] == kill_after:
                os.kill(pids[1], signal.SIGKILL)
        result = ex.result

    assert result.attempts == 2, seen
    assert len(result.failures) == 1
    failure = result.failures[0]
    assert isinstance(failure, asyncexec.WorkerCrashedError), repr(failure)
    assert failure.rank == 1
    first = [s for s in seen if s[1] == 1]
    second = [s for s in seen if s[1] == 2]
    assert first[-1][0] < STEPS - 1, "the first attempt finished before the kill took effect"
    last_saved = max(step for step, _, _, saved in first if saved)
    # Attempt 2 starts right after the last checkpoint of attempt 1 and runs to the end.
    assert [s[0] for s in second] == list(range(last_saved + 1, STEPS))
    assert second[0][0] <= first[-1][0], "no step was recomputed"
    # Every step (recomputed ones included) has exactly the loss of the undisturbed run.
    assert all(loss == clean_loss[step] for step, _, loss, _ in seen)
    assert result.return_values[0] == clean.parameters
    assert result.return_values[1] == clean.parameters
