"""A learner rank for tests/backends/test_engines_learner.py: a ``CausalLMLearner`` under DDP
(gloo, a short timeout: a rank left waiting fails in seconds, not in gloo's 30 minutes) that
makes one update per entry of ``COUNTS`` (``count`` groups on each rank, comma-separated: the
rank's own by its place; rank r's groups are ``GROUPS[r]``), and writes one JSON line per update:
what it returned, the sum of its weights, and of its gradients and their squares.

    python tests/backends/learner_ranks_driver.py MODEL INIT_FILE RANK COUNTS...
"""

from __future__ import annotations

import datetime
import json
import sys

import torch

from asyncexec.engines import CausalLMLearner, Group

DIGITS = list(range(4, 14))
#: Each rank's group: two completions of a prompt, their rewards apart (a group that teaches
#: something).
GROUPS = (
    Group((1, 5, 6, 7, 8), ((5, 5, 6), (7, 8, 9)), ((-2.3,) * 3, (-2.3,) * 3), (1.0, 0.0)),
    Group((1, 9, 4), ((4, 12, 13, 6), (11,)), ((-2.1,) * 4, (-2.5,)), (0.0, 1.0)),
)


def gradient_sums(model: torch.nn.Module) -> list[float]:
    """The sum of the gradients of ``model``'s parameters, and of their squares."""
    grads = [p.grad.double() for p in model.parameters() if p.grad is not None]
    return [float(sum(g.sum() for g in grads)), float(sum((g * g).sum() for g in grads))]


def main(model: str, init: str, rank: int, counts: list[list[int]]) -> None:
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"file://{init}",
        rank=rank,
        world_size=len(counts[0]),
        timeout=datetime.timedelta(seconds=15),
    )
    learner = CausalLMLearner(model, allowed_token_ids=DIGITS)
    for count in counts:
        done = learner.update([GROUPS[rank]] * count[rank])
        weights = sum(float(v.double().sum()) for v in learner.weights().values())
        grads = gradient_sums(learner.model)
        print(json.dumps({**done, "weights": weights, "grads": grads}), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    model, init, rank, *counts = sys.argv[1:]
    main(model, init, int(rank), [[int(c) for c in count.split(",")] for count in counts])
