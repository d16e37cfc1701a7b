"""Data-parallel training with torch DistributedDataParallel on CPU, checkpointed and resumable.

A small MLP learns a fixed random function from synthetic data on every rank; the gradients are
averaged by DDP over a gloo process group that TorchBackend sets up. Rank 0 checkpoints the model,
the optimizer and the step counter every few steps; after a restart (a worker died) every rank
resumes from the latest checkpoint and recomputes the steps since, so the final parameters are
the same as those of a run that never failed.

    python examples/torch_ddp.py [--workers N] [--steps N] [--checkpoint-every K]

The batch of step ``s`` on rank ``r`` is drawn from a generator seeded with ``(seed, s, r)``,
never from a running random state, which is what makes the run reproducible across restarts.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import asyncexec
from asyncexec.backends import TorchBackend

if TYPE_CHECKING:
    import torch

IN_FEATURES = 8
HIDDEN = 16
STATE_FILE = "state.pt"


def make_config(
    *,
    steps: int = 20,
    checkpoint_every: int = 5,
    seed: int = 0,
    lr: float = 0.1,
    batch_size: int = 32,
) -> dict[str, Any]:
    """The training configuration passed to :func:`train_loop`."""
    return {
        "steps": steps,
        "checkpoint_every": checkpoint_every,
        "seed": seed,
        "lr": lr,
        "batch_size": batch_size,
    }


def make_model(seed: int) -> torch.nn.Module:
    """The model, initialised from ``seed`` (DDP also copies rank 0's parameters to all ranks)."""
    import torch

    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(IN_FEATURES, HIDDEN), torch.nn.Tanh(), torch.nn.Linear(HIDDEN, 1)
    )


def make_batch(
    seed: int, step: int, rank: int, batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s batch on ``rank``: a pure function of its arguments. The target is a
    smooth function fixed by ``seed``."""
    import torch

    truth = torch.Generator().manual_seed(seed)
    w = torch.randn(IN_FEATURES, 1, generator=truth)
    # Distinct for every (step, rank) pair while step < 1_000_003 and rank < 65_537.
    g = torch.Generator().manual_seed(((seed * 1_000_003) + step) * 65_537 + rank)
    x = torch.randn(batch_size, IN_FEATURES, generator=g)
    y = torch.tanh(x @ w / IN_FEATURES**0.5) + 0.01 * torch.randn(batch_size, 1, generator=g)
    return x, y


def flat_parameters(model: torch.nn.Module) -> list[float]:
    """All parameters as one list of floats (compared exactly across runs)."""
    return [v for p in model.parameters() for v in p.detach().flatten().tolist()]


def train_loop(config: dict[str, Any]) -> list[float]:
    """The function every worker runs: DDP training with checkpoints; returns the parameters."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)  # small tensors; and several workers share a few cores
    ctx = asyncexec.get_context()
    model = make_model(config["seed"])
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    start = 0
    checkpoint = asyncexec.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as path:
            state = torch.load(os.path.join(path, STATE_FILE), weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = int(state["step"]) + 1
    ddp = DistributedDataParallel(model)
    loss_fn = torch.nn.MSELoss()
    steps, every = config["steps"], config["checkpoint_every"]
    for step in range(start, steps):
        x, y = make_batch(config["seed"], step, ctx.world_rank, config["batch_size"])
        optimizer.zero_grad()
        loss = loss_fn(ddp(x), y)
        loss.backward()
        optimizer.step()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        metrics = {"step": step, "loss": mean_loss.item() / ctx.world_size}
        if ctx.world_rank == 0 and ((step + 1) % every == 0 or step + 1 == steps):
            tmp = tempfile.mkdtemp(prefix="torch_ddp_")
            try:
                state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
                torch.save({**state, "step": step}, os.path.join(tmp, STATE_FILE))
                # report() persists the files under the run's storage path before it returns.
                asyncexec.report(metrics, checkpoint=asyncexec.Checkpoint.from_directory(tmp))
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
        else:
            asyncexec.report(metrics)
    return flat_parameters(model)


@dataclass(frozen=True)
class Summary:
    """What a training run produced.

    Attributes:
        losses: ``(training step, attempt, mean loss)`` per delivered step, in order.
        parameters: rank 0's final parameters.
        attempts: how many attempts ran.
        checkpoint: the path of the last checkpoint.
    """

    losses: list[tuple[int, int, float]]
    parameters: list[float]
    attempts: int
    checkpoint: str | None


async def main(
    workers: int = 2,
    steps: int = 20,
    *,
    checkpoint_every: int = 5,
    seed: int = 0,
    cpus_per_worker: float = 1.0,
    storage_path: str | os.PathLike[str] | None = None,
    restart: asyncexec.RestartPolicy | None = None,
    verbose: bool = True,
) -> Summary:
    """Train on ``workers`` CPU workers for ``steps`` steps and return the summary."""
    config = make_config(steps=steps, checkpoint_every=checkpoint_every, seed=seed)
    losses: list[tuple[int, int, float]] = []
    async with asyncexec.Executor(
        workers,
        resources_per_worker={"CPU": cpus_per_worker},
        backend=TorchBackend(backend="gloo"),
        restart=restart or asyncexec.RestartPolicy(max_restarts=2),
        checkpoint=asyncexec.CheckpointConfig(keep_runs=True),  # the last one outlives it
        storage_path=storage_path,
    ) as executor:
        async for step in executor.run(train_loop, config):
            losses.append((step.metrics["step"], step.attempt, step.metrics["loss"]))
            if verbose:
                saved = "  checkpoint" if step.checkpoint is not None else ""
                print(
                    f"step {step.metrics['step']:3d} (attempt {step.attempt}) "
                    f"loss {step.metrics['loss']:.5f}{saved}"
                )
        result = executor.result
    checkpoint = result.checkpoint.path if result.checkpoint is not None else None
    if verbose:
        print(f"done after {result.attempts} attempt(s); last checkpoint {checkpoint}")
    return Summary(losses, result.return_values[0], result.attempts, checkpoint)


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--checkpoint-every", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpus-per-worker", type=float, default=1.0)
    parser.add_argument("--storage-path", default=None)
    args = parser.parse_args()
    # Refused here, before Ray starts, rather than with a traceback from the run.
    lows = {"workers": 1, "steps": 1, "checkpoint_every": 1}
    for name, value in ((name, getattr(args, name)) for name in lows):
        if not value >= lows[name]:
            parser.error(f"--{name.replace('_', '-')} must be at least {lows[name]}, got {value}")
    if not args.cpus_per_worker > 0:
        parser.error(f"--cpus-per-worker must be positive, got {args.cpus_per_worker}")
    return args


if __name__ == "__main__":
    args = _parse()
    asyncio.run(
        main(
            args.workers,
            args.steps,
            checkpoint_every=args.checkpoint_every,
            seed=args.seed,
            cpus_per_worker=args.cpus_per_worker,
            storage_path=args.storage_path,
        )
    )
