"""A learner rank for tests/backends/test_engines_learner.py: a ``CausalLMLearner`` under DDP
(gloo, a short timeout: a rank left waiting fails in seconds, not in gloo's 30 minutes) that
makes one update per entry of ``COUNTS`` (``count`` groups on each rank, comma-separated: the
rank's own by its place), and writes one JSON line per update: what it returned, and the sum of
its weights.

    python tests/backends/learner_ranks_driver.py MODEL INIT_FILE RANK COUNTS...
"""

from __future__ import annotations

import datetime
import json
import sys

import torch

from asyncexec.engines import CausalLMLearner, Group

DIGITS = list(range(4, 14))
#: Two completions of a prompt, their rewards apart: a group that teaches something.
GROUP = Group((1, 5, 6, 7, 8), ((5, 5, 6), (7, 8, 9)), ((-2.3,) * 3, (-2.3,) * 3), (1.0, 0.0))


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
        done = learner.update([GROUP] * count[rank])
        weights = sum(float(v.double().sum()) for v in learner.weights().values())
        print(json.dumps({**done, "weights": weights}), flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    model, init, rank, *counts = sys.argv[1:]
    main(model, init, int(rank), [[int(c) for c in count.split(",")] for count in counts])
