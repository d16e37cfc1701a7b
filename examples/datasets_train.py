"""Train a linear regression by SGD on a Ray Data dataset split across several workers.

    python examples/datasets_train.py [--workers 3] [--epochs 5] [--rows 4096]

The rows are made lazily by Ray Data (``ray.data.range`` mapped to features ``x`` and a target
``y = x . w + b + noise``). Every epoch is one run: each rank reads its own part of the training
set (``streaming_split`` under the hood: disjoint, equal parts) and takes SGD steps with numpy
from the averaged model, reporting its loss at every step; the driver then averages the ranks'
models (local SGD with model averaging, one exchange per epoch). The validation set is not split:
every rank reads it whole, and each epoch starts by measuring the incoming model on it.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
from typing import Any

import numpy as np
import ray

import asyncexec
from asyncexec import DataConfig

W_TRUE = np.array([2.0, -3.0, 0.5, 1.0])
B_TRUE = 0.7


def make_rows(batch: dict[str, np.ndarray], offset: int = 0) -> dict[str, np.ndarray]:
    """Features and target for a batch of ids (seeded by the ids: the same rows every epoch;
    ``offset`` makes another set of rows)."""
    ids = batch["id"] + offset
    rng = np.random.default_rng(ids.tolist())
    x = rng.normal(size=(len(ids), len(W_TRUE)))
    y = x @ W_TRUE + B_TRUE + 0.01 * rng.normal(size=len(ids))
    return {"x": x, "y": y}


def mse(w: np.ndarray, b: float, x: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean((x @ w + b - y) ** 2))


def train_epoch(config: dict[str, Any]) -> dict[str, Any]:
    """One epoch on this rank's part of "train", from the model in ``config``."""
    ctx = asyncexec.get_context()
    w = np.array(config["w"], dtype=float)
    b = float(config["b"])
    lr = config["lr"]
    valid = [
        mse(w, b, batch["x"], batch["y"]) * len(batch["y"])
        for batch in asyncexec.get_dataset_shard("valid").iter_batches(
            batch_size=256, batch_format="numpy"
        )
    ]
    valid_rows = config["valid_rows"]
    shard = asyncexec.get_dataset_shard("train")
    for step, batch in enumerate(
        shard.iter_batches(batch_size=config["batch_size"], batch_format="numpy")
    ):
        x, y = batch["x"], batch["y"]
        err = x @ w + b - y
        w -= lr * 2 * (x.T @ err) / len(y)
        b -= lr * 2 * float(np.mean(err))
        asyncexec.report({"epoch": config["epoch"], "step": step, "loss": float(np.mean(err**2))})
    return {"w": w.tolist(), "b": b, "valid_loss": sum(valid) / valid_rows, "rank": ctx.world_rank}


async def main(
    *,
    num_workers: int = 3,
    epochs: int = 5,
    rows: int = 4096,
    valid_rows: int = 512,
    batch_size: int = 128,
    lr: float = 0.1,
    quiet: bool = False,
) -> list[dict[str, Any]]:
    """Train; return one record per epoch (mean train loss of its steps, the validation loss of
    the model it started from, and the distance of the averaged weights from the true ones)."""
    say = (lambda *a: None) if quiet else print
    train = ray.data.range(rows).map_batches(make_rows, batch_format="numpy")
    valid = ray.data.range(valid_rows).map_batches(
        functools.partial(make_rows, offset=10**9), batch_format="numpy"
    )
    datasets = {"train": train, "valid": valid}
    data_config = DataConfig(datasets_to_split=["train"])
    w, b = np.zeros(len(W_TRUE)), 0.0
    history: list[dict[str, Any]] = []
    async with asyncexec.Executor(num_workers, resources_per_worker={"CPU": 0.5}) as executor:
        for epoch in range(epochs):
            config = {
                "w": w.tolist(),
                "b": b,
                "lr": lr,
                "epoch": epoch,
                "batch_size": batch_size,
                "valid_rows": valid_rows,
            }
            run = executor.run(train_epoch, config, datasets=datasets, data_config=data_config)
            losses = []
            async for step in run:
                loss = float(np.mean([r.metrics["loss"] for r in step.reports]))
                losses.append(loss)
                say(f"epoch {epoch} step {step.index:3d}: loss {loss:.5f}")
            outs = run.result.return_values
            w = np.mean([o["w"] for o in outs], axis=0)
            b = float(np.mean([o["b"] for o in outs]))
            record = {
                "epoch": epoch,
                "steps": len(losses),
                "train_loss": float(np.mean(losses)),
                "valid_loss": outs[0]["valid_loss"],
                "weight_error": float(np.linalg.norm(w - W_TRUE) + abs(b - B_TRUE)),
            }
            history.append(record)
            say(
                f"epoch {epoch}: train loss {record['train_loss']:.5f}, valid loss (start) "
                f"{record['valid_loss']:.5f}, |w - w_true| + |b - b_true| "
                f"{record['weight_error']:.4f}"
            )
    return history


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--rows", type=int, default=4096)
    args = parser.parse_args()
    for name in ("workers", "epochs", "rows"):  # refused before Ray starts
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    # Ray Data's read tasks take a whole CPU each, next to the workers' half CPUs: on a machine
    # with few cores, declare a few logical CPUs more so that reading never waits for a CPU
    # that the workers hold for the whole run.
    ray.init(num_cpus=max(os.cpu_count() or 1, args.workers + 2))
    asyncio.run(main(num_workers=args.workers, epochs=args.epochs, rows=args.rows))
