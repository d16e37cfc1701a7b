"""What a call's arguments and results cost and how they fail: merges that fail after the call
(the ranks' results kept), metadata replicated by scatter(), arguments that do not pickle or are
not a method, the size that decides how a part travels, and what is copied and pickled on the
way (once, off the driver's loop, a part's own bytes only)."""

from __future__ import annotations

import pickle
from typing import Any

import numpy as np
import pytest

import asyncexec
from asyncexec._dispatch import plan_call
from asyncexec._split import split

CPU = {"CPU": 0.25}


class Learner:
    """A learner whose step returns scalar metrics, as most do."""

    def __init__(self) -> None:
        self.rank = asyncexec.get_context().world_rank
        self.steps = 0

    def step(self, batch: Any):  # type: ignore[no-untyped-def]  # not annotated: found after
        self.steps += 1
        return {"loss": float(len(batch["obs"])), "rank": self.rank}

    def annotated_step(self, batch: Any) -> dict[str, float]:
        self.steps += 1
        return {"loss": 1.0}

    def meta(self, batch: dict[str, Any]) -> dict[str, Any]:
        return {"rows": len(batch["obs"]), "meta": batch["meta"], "step": batch["step"]}

    def taken(self) -> int:
        return self.steps


# Merges and metadata (item 16) -----------------------------------------------------------------


@pytest.mark.timeout(60)
async def test_a_merge_that_fails_after_the_call_keeps_each_ranks_result(mode: str) -> None:
    batch = {"obs": np.arange(5)}
    async with asyncexec.Executor(2, resources_per_worker=CPU, roles=Learner) as ex:
        with pytest.raises(asyncexec.MergeError) as info:
            await ex.call(Learner.step, asyncexec.scatter(batch), merge=asyncexec.concat)
        assert await ex.call(Learner.taken) == [1, 1]  # every rank ran the step
    error = info.value
    assert error.results == [{"loss": 3.0, "rank": 0}, {"loss": 2.0, "rank": 1}]
    assert error.ranks == [0, 1]
    assert isinstance(error, TypeError)  # what concat() raises, as before
    assert isinstance(error.__cause__, TypeError)
    first = str(error).splitlines()[0]
    assert "Learner.step" in first and "concat" in first and "float" in first
    again = pickle.loads(pickle.dumps(error))
    assert again.results == error.results and str(again) == str(error)


def test_a_merge_that_cannot_fit_the_annotated_results_is_refused_before_sending() -> None:
    batch = {"obs": np.arange(4)}
    roles = [asyncexec.Role(Learner)]
    with pytest.raises(asyncexec.ConfigurationError, match=r"concat.*dict\[str, float\]"):
        plan_call(
            Learner.annotated_step,
            [asyncexec.scatter(batch)],
            {},
            2,
            roles=roles,
            merge=asyncexec.concat,
        )
    # Results that concatenate, or no annotation, are left to the merge.
    plan_call(Learner.meta, [asyncexec.scatter(batch)], {}, 2, roles=roles, merge=asyncexec.concat)
    plan_call(Learner.step, [asyncexec.scatter(batch)], {}, 2, roles=roles, merge=asyncexec.concat)


def test_scatter_replicates_the_fields_of_a_mapping_that_cannot_split() -> None:
    batch = {
        "obs": np.arange(5),
        "meta": {"temperature": 0.7, "eos": 2},  # as verl's DataProto.meta_info
        "step": 3,
        "name": "rollout",
        "scale": np.float32(0.5),  # a 0-d value
    }
    parts = split(batch, 2)
    assert [p["obs"].tolist() for p in parts] == [[0, 1, 2], [3, 4]]
    for part in parts:
        assert part["meta"] == {"temperature": 0.7, "eos": 2}
        assert (part["step"], part["name"], part["scale"]) == (3, "rollout", np.float32(0.5))
    with pytest.raises(asyncexec.ConfigurationError, match="lockstep"):
        split({"obs": np.arange(5), "act": [1, 2], "step": 3}, 2)  # what splits, still in step


@pytest.mark.timeout(60)
async def test_a_scattered_batch_with_metadata_reaches_every_rank(mode: str) -> None:
    batch = {"obs": np.arange(3), "meta": {"temperature": 0.7}, "step": 9}
    async with asyncexec.Executor(2, resources_per_worker=CPU, roles=Learner) as ex:
        out = await ex.call(Learner.meta, asyncexec.scatter(batch))
    assert out == [
        {"rows": 2, "meta": {"temperature": 0.7}, "step": 9},
        {"rows": 1, "meta": {"temperature": 0.7}, "step": 9},
    ]
