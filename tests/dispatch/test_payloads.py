"""What a call's arguments and results cost and how they fail: merges that fail after the call
(the ranks' results kept), metadata replicated by scatter(), arguments that do not pickle or are
not a method, the size that decides how a part travels, and what is copied and pickled on the
way (once, off the driver's loop, a part's own bytes only)."""

from __future__ import annotations

import dataclasses
import pickle
import threading
from typing import Any

import numpy as np
import pytest
import torch

import asyncexec
from asyncexec._dispatch._plan import plan_call
from asyncexec._dispatch._split import split

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

    def apply(self, batch: Any) -> None:
        self.steps += 1

    def maybe_loss(self, batch: Any) -> float | None:
        return None


# Merges and metadata (item 16) -----------------------------------------------------------------


@pytest.mark.timeout(30)
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


@pytest.mark.timeout(10)
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


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("method", "annotated"),
    [(Learner.apply, "None"), (Learner.maybe_loss, r"float \| None")],
)
def test_a_merge_of_results_annotated_none_or_optional_scalars_is_refused_before_sending(
    method: Any, annotated: str
) -> None:
    roles = [asyncexec.Role(Learner)]
    with pytest.raises(asyncexec.ConfigurationError, match=rf"concat.*\(annotated {annotated}\)"):
        plan_call(method, [asyncexec.scatter([1, 2])], {}, 2, roles=roles, merge=asyncexec.concat)


@pytest.mark.timeout(10)
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


@pytest.mark.timeout(30)
async def test_a_scattered_batch_with_metadata_reaches_every_rank(mode: str) -> None:
    batch = {"obs": np.arange(3), "meta": {"temperature": 0.7}, "step": 9}
    async with asyncexec.Executor(2, resources_per_worker=CPU, roles=Learner) as ex:
        out = await ex.call(Learner.meta, asyncexec.scatter(batch))
    assert out == [
        {"rows": 2, "meta": {"temperature": 0.7}, "step": 9},
        {"rows": 1, "meta": {"temperature": 0.7}, "step": 9},
    ]


# Arguments that cannot travel (item 17) --------------------------------------------------------


class Echo:
    def take(self, value: Any) -> int:
        return 1

    def takes(self, batch: list[Any]) -> int:
        return len(batch)


@pytest.mark.ray_only
@pytest.mark.timeout(30)
async def test_an_argument_that_does_not_pickle_is_named(mode: str) -> None:
    async with asyncexec.Executor(2, resources_per_worker=CPU, roles=Echo) as ex:
        with pytest.raises(asyncexec.ConfigurationError) as info:
            await ex.call(Echo.take, threading.Lock())
        message = str(info.value)
        assert "argument 'value'" in message and "lock" in message and "pickle" in message
        assert "\x1b[" not in message and "_Worker" not in message and len(message) < 400
        with pytest.raises(asyncexec.ConfigurationError, match=r"argument 'batch'.*pickle"):
            await ex.call(Echo.takes, asyncexec.scatter([1, threading.Lock()]))
        big = [b"x" * 1024] * 100 + [threading.Lock()]  # over 64 KiB: put in the object store
        with pytest.raises(asyncexec.ConfigurationError, match=r"argument 'value'.*pickle"):
            await ex.call(Echo.take, big)
        assert await ex.call(Echo.take, 1) == [1, 1]  # the group is unharmed


@pytest.mark.timeout(10)
def test_a_class_called_instead_of_a_method_says_what_is_expected() -> None:
    roles = [asyncexec.Role(Echo)]
    with pytest.raises(asyncexec.ConfigurationError, match=r"class Echo.*Echo\.take"):
        plan_call(Echo, [1], {}, 2, roles=roles)
    with pytest.raises(asyncexec.ConfigurationError, match="class Learner"):
        plan_call(Learner, [], {}, 2)


# The size that decides how a part travels (item 10) --------------------------------------------


@dataclasses.dataclass
class Columns:
    obs: np.ndarray
    rewards: np.ndarray


class Plain:
    def __init__(self) -> None:
        self.obs = np.zeros(100_000)
        self.name = "plain"


class Slotted:
    __slots__ = ("obs",)

    def __init__(self) -> None:
        self.obs = np.zeros(100_000)


@pytest.mark.timeout(10)
def test_the_size_of_a_frame_a_dataclass_and_a_plain_object_is_estimated() -> None:
    from asyncexec._dispatch._split import estimated_nbytes

    pandas = pytest.importorskip("pandas")
    frame = pandas.DataFrame({"a": np.zeros(100_000), "b": np.ones(100_000)})
    assert estimated_nbytes(frame) >= 1_600_000
    assert estimated_nbytes(Columns(np.zeros(100_000), np.zeros(100_000))) >= 1_600_000
    assert estimated_nbytes(Plain()) >= 800_000
    assert estimated_nbytes(Slotted()) >= 800_000
    assert estimated_nbytes({"batch": [Columns(np.zeros(10_000), np.zeros(10))]}) >= 80_000
    assert estimated_nbytes(1) < 1024 and estimated_nbytes(Learner) < 1024  # a class: small
    nested: list[Any] = []
    nested.append(nested)  # a cycle, and depth, are bounded
    assert estimated_nbytes(nested) < 1024


class Sent:
    """Counts how often it is pickled where it is pickled (here: the driver)."""

    count = 0

    def __reduce__(self) -> tuple[Any, ...]:
        Sent.count += 1
        return (Sent, ())


@dataclasses.dataclass
class Batch:
    obs: np.ndarray
    sent: Sent


@pytest.mark.ray_only
@pytest.mark.timeout(30)
async def test_a_large_dataclass_argument_is_put_once_not_pickled_per_rank(mode: str) -> None:
    batch = Batch(np.zeros(200_000), Sent())  # 1.6 MB, no nbytes or len of its own
    async with asyncexec.Executor(2, resources_per_worker=CPU, roles=Echo) as ex:
        Sent.count = 0
        assert await ex.call(Echo.take, batch) == [1, 1]
        assert Sent.count == 1  # put in the object store once; it was pickled once per rank


# Pickled once, copied off the loop, a part's own bytes only (item 9) ----------------------------


class Counted:
    """Counts its picklings on the instance that made it (in the worker)."""

    def __init__(self, counter: list[int]) -> None:
        self.counter = counter

    def __reduce__(self) -> tuple[Any, ...]:
        self.counter[0] += 1
        return (Counted, ([],))


class Rows:
    """A batch that splits itself into views of its tensor."""

    def __init__(self, data: torch.Tensor, meta: dict[str, Any]) -> None:
        self.data = data
        self.meta = meta

    def __len__(self) -> int:
        return len(self.data)

    def __asyncexec_split__(self, n: int) -> list[Rows]:
        return [Rows(part, self.meta) for part in self.data.tensor_split(n)]


class Holder:
    def __init__(self) -> None:
        self.pickles = [0]

    def make(self) -> Counted:
        return Counted(self.pickles)

    def pickled(self) -> int:
        return self.pickles[0]

    def lock(self) -> threading.Lock:
        return threading.Lock()

    def storage(self, rows: Any) -> int:
        data = rows.data if isinstance(rows, Rows) else rows
        return int(data.untyped_storage().nbytes())

    def array(self, n: int) -> np.ndarray:
        return np.arange(n)


@pytest.mark.ray_only
@pytest.mark.timeout(30)
async def test_a_return_value_is_pickled_once_on_the_worker(mode: str) -> None:
    async with asyncexec.Executor(1, resources_per_worker=CPU, roles=Holder) as ex:
        await ex.call(Holder.make)
        assert await ex.call(Holder.pickled) == [1]  # it was dumped to be tested, then sent
        with pytest.raises(asyncexec.WorkerRaisedError, match="return value cannot be pickled"):
            await ex.call(Holder.lock)
        big = await ex.call(Holder.array, 1_000_000, on=asyncexec.rank(0))  # out of band
        assert big.tolist() == list(range(1_000_000))


@pytest.mark.timeout(30)
async def test_a_splittable_batch_of_views_sends_each_rank_its_part_only(mode: str) -> None:
    async with asyncexec.Executor(2, resources_per_worker=CPU, roles=Holder) as ex:
        large = Rows(torch.zeros(40_000), {"step": 1})  # 160 KB: parts put in the object store
        assert await ex.call(Holder.storage, asyncexec.scatter(large)) == [80_000, 80_000]
        small = Rows(torch.zeros(1_000), {"step": 1})  # parts inline with the call
        assert await ex.call(Holder.storage, asyncexec.scatter(small)) == [2_000, 2_000]
        views = torch.zeros(40_000)
        assert await ex.call(Holder.storage, asyncexec.scatter(views)) == [80_000, 80_000]


@pytest.mark.timeout(30)
async def test_large_parts_are_compacted_off_the_event_loop(
    mode: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy of a large part's view (a 4 GB scatter: 4 GB copied) is made in a thread; it
    was made on the event loop when the call was planned."""
    on_loop: list[bool] = []
    clone = torch.Tensor.clone

    def recorded(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if tensor.numel() == 50_000:  # a part of this test's tensor
            on_loop.append(threading.current_thread() is threading.main_thread())
        return clone(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "clone", recorded)
    async with asyncexec.Executor(2, resources_per_worker=CPU, roles=Holder) as ex:
        data = torch.zeros(100_000)  # 400 KB: two parts of 200 KB, each a view
        assert await ex.call(Holder.storage, asyncexec.scatter(data)) == [200_000, 200_000]
    assert on_loop == [False, False]


@dataclasses.dataclass(frozen=True)
class Frozen:
    data: torch.Tensor
    rows: tuple[torch.Tensor, ...]
    name: str


@pytest.mark.timeout(10)
def test_compact_copies_views_inside_objects_and_leaves_the_rest_alone() -> None:
    from asyncexec._dispatch._split import compact

    storage = torch.zeros(1000)
    part = Frozen(storage[:10], (storage[10:20], torch.ones(3)), "p")
    out = compact({"batch": part, "plain": [1, 2, 3]})
    assert out["batch"] is not part and out["batch"].name == "p"
    assert out["batch"].data.untyped_storage().nbytes() == 40
    assert out["batch"].rows[0].untyped_storage().nbytes() == 40
    assert torch.equal(out["batch"].data, storage[:10])
    assert part.data.untyped_storage().nbytes() == 4000  # the original is untouched
    whole = {"x": torch.ones(5), "y": [np.zeros(3)], "z": Plain()}
    assert compact(whole) is whole  # nothing to copy: the very same objects
