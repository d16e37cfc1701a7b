"""Ray Data datasets per worker: every row read once per epoch in equal parts, unsplit datasets
seen whole, fresh splits after a restart, clear errors, and the driver's DataContext on the
workers. Real Ray Data on the shared local Ray (4 CPUs): workers take 0.5 CPU each, which leaves
CPUs for Ray Data's own read tasks."""

from __future__ import annotations

import gc
import importlib
import json
import os
import pickle
import signal
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
import ray
import ray._private.state as ray_state
import tenacity
from ray.data import DataContext, ExecutionOptions

import asyncexec
from asyncexec import DataConfig
from asyncexec._driver.cluster import make_shards, release_shards, validate_datasets

pytestmark = pytest.mark.usefixtures("ray_local")

CPU = {"CPU": 0.5}


def live_coordinators() -> list[dict[str, Any]]:
    """Ray Data split coordinator actors that are not dead."""
    return [
        a
        for a in ray_state.actors().values()
        if a["ActorClassName"] == "SplitCoordinator" and a["State"] != "DEAD"
    ]


def wait_actor_dead(actor_id: str, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        entry = ray_state.actors(actor_id=actor_id)
        if entry and entry["State"] == "DEAD":
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module", autouse=True)
def fresh_ray_after_the_module() -> Iterator[None]:
    """Ray Data leaves actors of its own (its stats actor, its autoscaling coordinator) and,
    at times, work that holds CPUs in the Ray it ran in: the tests after this module get a
    fresh shared Ray (a later test that holds all but k CPUs found half a CPU missing)."""
    yield
    import conftest

    conftest._shutdown()


@pytest.fixture(autouse=True)
def no_coordinator_left(ray_local: None) -> Iterator[None]:
    """After each test (whose executor has closed), no split coordinator may be left."""
    yield
    # Actor handles are released when their holders are freed; runs and errors form reference
    # cycles, which only the cycle collector frees.
    gc.collect()
    deadline = time.monotonic() + 15
    while live_coordinators():
        if time.monotonic() > deadline:
            pytest.fail(f"split coordinators left behind: {len(live_coordinators())}")
        time.sleep(0.1)


# Functions the workers run --------------------------------------------------------------------


def read_epochs(config: dict[str, Any]) -> dict[str, Any]:
    """Read every dataset of the run for ``epochs`` epochs; return the ids read, by dataset and
    epoch, and what kind of object each shard is."""
    seen: dict[str, list[list[int]]] = {}
    kinds: dict[str, str] = {}
    for name in config["names"]:
        shard = asyncexec.get_dataset_shard(name)
        kinds[name] = type(shard).__name__
        epochs = range(config["epochs"])
        seen[name] = [[int(row["id"]) for row in shard.iter_rows()] for _ in epochs]
    asyncexec.report({"rows": {n: len(e[0]) for n, e in seen.items()}})
    return {"seen": seen, "kinds": kinds}


def read_and_crash_on_first_attempt(config: dict[str, Any]) -> dict[str, Any]:
    """Rank 0 dies mid-epoch on attempt 1 (after writing which coordinator it read from)."""
    ctx = asyncexec.get_context()
    shard = asyncexec.get_dataset_shard("train")
    coordinator = shard._coord_actor._actor_id.hex()
    ids: list[int] = []
    for row in shard.iter_rows():
        ids.append(int(row["id"]))
        if ctx.attempt == 1 and ctx.world_rank == 0 and len(ids) == 10:
            Path(config["dir"], "attempt1.json").write_text(
                json.dumps({"coordinator": coordinator, "ids": ids})
            )
            os.kill(os.getpid(), signal.SIGKILL)
    asyncexec.report({"rows": len(ids)})
    return {"attempt": ctx.attempt, "coordinator": coordinator, "ids": ids}


def read_unknown() -> None:
    asyncexec.get_dataset_shard("test")


def data_context_probe(key: str) -> Any:
    from ray.data import DataContext

    return DataContext.get_current().get_config(key)


def echo_shard() -> Any:
    return asyncexec.get_dataset_shard("train")


class LabelConfig(DataConfig):
    """A configure() override: each rank gets a label instead of a split."""

    def configure(
        self,
        datasets: Any,
        world_size: int,
        worker_handles: Any,
        worker_node_ids: Any,
    ) -> list[dict[str, Any]]:
        assert worker_node_ids is not None
        assert len(worker_node_ids) == world_size
        return [{name: f"{name}-{rank}" for name in datasets} for rank in range(world_size)]


CONFIGURE_CALLS: list[list[str]] = []


class RecordingConfig(DataConfig):
    """The default split, recording the node ids it was given (on the driver)."""

    def configure(
        self,
        datasets: Any,
        world_size: int,
        worker_handles: Any,
        worker_node_ids: Any,
    ) -> list[dict[str, Any]]:
        CONFIGURE_CALLS.append(list(worker_node_ids))
        return super().configure(datasets, world_size, worker_handles, worker_node_ids)


class BrokenConfig(DataConfig):
    def configure(self, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        return []


class ShortConfig(DataConfig):
    """The default split, then one rank's parts too few (a broken override)."""

    def configure(self, *args: Any, **kwargs: Any) -> list[dict[str, Any]]:
        return super().configure(*args, **kwargs)[:-1]


def wait_no_coordinator(timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while live_coordinators():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


# Splitting ------------------------------------------------------------------------------------


async def test_split_dataset_rows_are_read_at_most_once_per_epoch_in_equal_parts() -> None:
    """Three ranks, two epochs, 301 rows: each epoch's parts are disjoint and equal, and only
    the remainder of the uneven split (one row) is left out, as the docs say."""
    ds = ray.data.range(301)
    async with asyncexec.Executor(3, resources_per_worker=CPU) as ex:
        run = ex.run(read_epochs, {"names": ["train"], "epochs": 2}, datasets={"train": ds})
        steps = [s async for s in run]
    assert [r.metrics["rows"]["train"] for r in steps[0].reports] == [100, 100, 100]
    outs = run.result.return_values
    assert {o["kinds"]["train"] for o in outs} == {"StreamSplitDataIterator"}
    for epoch in range(2):
        parts = [o["seen"]["train"][epoch] for o in outs]
        assert [len(p) for p in parts] == [100, 100, 100]
        every = [i for p in parts for i in p]
        assert len(every) == len(set(every)), f"epoch {epoch}: a row was read twice"
        assert set(every) <= set(range(301)), f"epoch {epoch}: a row that is not in the data"


async def test_dataset_not_split_is_seen_whole_by_every_worker() -> None:
    datasets = {"train": ray.data.range(200), "valid": ray.data.range(30)}
    async with asyncexec.Executor(2, resources_per_worker=CPU) as ex:
        run = ex.run(
            read_epochs,
            {"names": ["train", "valid"], "epochs": 1},
            datasets=datasets,
            data_config=DataConfig(datasets_to_split=["train"]),
        )
        [_ async for _ in run]
    outs = run.result.return_values
    for o in outs:
        assert sorted(o["seen"]["valid"][0]) == list(range(30))
    train = [o["seen"]["train"][0] for o in outs]
    assert [len(p) for p in train] == [100, 100]
    assert sorted(i for p in train for i in p) == list(range(200))


async def test_restart_mid_epoch_gives_new_workers_fresh_shards(tmp_path: Path) -> None:
    """A rank killed mid-epoch: the next attempt reads a complete epoch from a new split (a new
    coordinator, split for the new workers' nodes), and the stale coordinator is stopped."""
    CONFIGURE_CALLS.clear()
    policy = asyncexec.RestartPolicy(max_restarts=1, wait=tenacity.wait_none())
    async with asyncexec.Executor(2, resources_per_worker=CPU, restart=policy) as ex:
        run = ex.run(
            read_and_crash_on_first_attempt,
            {"dir": str(tmp_path)},
            datasets={"train": ray.data.range(200)},
            data_config=RecordingConfig(),
        )
        steps = [s async for s in run]
        assert len(CONFIGURE_CALLS) == 2, "the datasets were not split anew for attempt 2"
        assert CONFIGURE_CALLS[1] == [w.node_id for w in ex.workers]
        result = run.result
        assert result.attempts == 2
        assert isinstance(result.failures[0], asyncexec.WorkerCrashedError)
        assert [s.attempt for s in steps] == [2]
        first = json.loads((tmp_path / "attempt1.json").read_text())
        outs = result.return_values
        assert {o["attempt"] for o in outs} == {2}
        assert len({o["coordinator"] for o in outs}) == 1
        assert outs[0]["coordinator"] != first["coordinator"], "attempt 2 reused the old split"
        parts = [o["ids"] for o in outs]
        assert [len(p) for p in parts] == [100, 100]
        every = [i for p in parts for i in p]
        assert len(every) == len(set(every))
        assert set(every) == set(range(200))
        # The first attempt's coordinator was stopped when the second attempt split anew, even
        # though the run (its failures' tracebacks) still references its parts.
        assert wait_actor_dead(first["coordinator"]), "the stale coordinator is still alive"


async def test_each_split_stops_the_previous_one_and_release_stops_the_last() -> None:
    """make_shards with stand-in handles (only node ids and handles are read): every call makes
    a new coordinator and stops the previous one; release_shards stops the last."""
    prepared, config = validate_datasets({"train": ray.data.range(8)}, None)
    node = ray.get_runtime_context().get_node_id()
    handles = [SimpleNamespace(actor=None)] * 2
    first = await make_shards(prepared, config, handles, [node, node])
    second = await make_shards(prepared, config, handles, [node, node])
    assert [sorted(p) for p in second] == [["train"], ["train"]]
    old, new = (s[0]["train"]._coord_actor._actor_id.hex() for s in (first, second))
    assert old != new
    assert await anyio.to_thread.run_sync(wait_actor_dead, old)
    await release_shards(prepared)
    assert await anyio.to_thread.run_sync(wait_actor_dead, new)


# Errors ---------------------------------------------------------------------------------------


async def test_unknown_dataset_name_fails_the_run_with_a_key_error_naming_known_ones() -> None:
    datasets = {"train": ray.data.range(20), "valid": ray.data.range(10)}
    async with asyncexec.Executor(2, resources_per_worker=CPU) as ex:
        with pytest.raises(asyncexec.WorkerRaisedError) as info:
            [_ async for _ in ex.run(read_unknown, datasets=datasets)]
    error = info.value
    assert isinstance(error.__cause__, KeyError)
    text = str(error.__cause__)
    assert "'test'" in text
    assert "train, valid" in text


def test_data_config_rejects_bad_values_and_normalises_names() -> None:
    with pytest.raises(asyncexec.ConfigurationError, match=r"\['train'\]"):
        DataConfig(datasets_to_split="train")
    with pytest.raises(asyncexec.ConfigurationError, match="datasets_to_split"):
        DataConfig(datasets_to_split=[1])  # type: ignore[list-item,unused-ignore]
    with pytest.raises(asyncexec.ConfigurationError, match="execution_options"):
        DataConfig(execution_options={1: ExecutionOptions()})
    with pytest.raises(asyncexec.ConfigurationError, match="enable_shard_locality"):
        DataConfig(enable_shard_locality="yes")  # type: ignore[arg-type]
    config = DataConfig(["train", "valid"])
    assert config.datasets_to_split == ("train", "valid")
    assert pickle.loads(pickle.dumps(config)) == config
    assert DataConfig().datasets_to_split == "all"


def test_validate_datasets_refuses_what_is_not_a_mapping_of_ray_datasets() -> None:
    ds = ray.data.range(10)
    cases: list[tuple[Any, Any, str]] = [
        ([ds], None, "mapping"),
        ({1: ds}, None, "names must be non-empty strings"),
        ({"train": [1, 2, 3]}, None, "'train' is a list"),
        ({"train": ds}, {"datasets_to_split": "all"}, "must be an asyncexec.DataConfig"),
        ({"train": ds}, DataConfig(["valid"]), r"not given: \['valid'\] \(datasets: train\)"),
        ({"train": ds}, DataConfig(execution_options={"valid": ExecutionOptions()}), "valid"),
        ({"train": ds}, DataConfig(execution_options=3), "ExecutionOptions"),
    ]
    for datasets, data_config, message in cases:
        with pytest.raises(asyncexec.ConfigurationError, match=message):
            validate_datasets(datasets, data_config)


def test_validate_datasets_copies_the_callers_datasets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The returned datasets are named copies with their own execution options (by default a
    copy of the driver's); the caller's dataset and the driver's DataContext are left alone."""
    ds = ray.data.range(10)
    before = ds.context.execution_options
    options = ExecutionOptions(preserve_order=True)
    prepared, config = validate_datasets(
        {"train": ds, "valid": ray.data.range(5)},
        DataConfig(execution_options={"train": options}),
    )
    assert isinstance(config, DataConfig)
    assert set(prepared) == {"train", "valid"}
    assert prepared["train"] is not ds
    assert prepared["train"].name == "train"
    assert ds.name is None
    assert ds.context.execution_options is before
    assert prepared["train"].context is not ds.context
    assert prepared["train"].context.execution_options.preserve_order is True
    assert prepared["train"].context.execution_options is not options
    driver = DataContext.get_current().execution_options
    monkeypatch.setattr(driver, "preserve_order", not driver.preserve_order)
    monkeypatch.setattr(driver, "label_selector", {"zone": "a"})
    default, none_config = validate_datasets({"train": ds}, None)
    assert none_config == DataConfig()
    carried = default["train"].context.execution_options
    assert carried is not driver
    assert carried.preserve_order is driver.preserve_order
    assert carried.label_selector == {"zone": "a"}


def test_datasets_without_ray_data_name_the_data_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray.data", None)
    with pytest.raises(asyncexec.ConfigurationError, match=r"asyncexec\[data\]"):
        validate_datasets({"train": object()}, None)


async def test_run_refuses_bad_datasets_before_starting_anything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with asyncexec.Executor(1, resources_per_worker=CPU) as ex:
        with pytest.raises(asyncexec.ConfigurationError, match="'train' is a int"):
            ex.run(read_unknown, datasets={"train": 3})
        with pytest.raises(asyncexec.ConfigurationError, match="not given"):
            ex.run(
                read_unknown,
                datasets={"train": ray.data.range(4)},
                data_config=DataConfig(["valid"]),
            )
        with monkeypatch.context() as patch:
            patch.setitem(sys.modules, "ray.data", None)
            with pytest.raises(asyncexec.ConfigurationError, match=r"asyncexec\[data\]"):
                ex.run(read_unknown, datasets={"train": object()})
        assert ex.statistics().runs_started == 0
        assert ex.state is asyncexec.ExecutorState.READY


async def test_configure_override_assigns_the_parts() -> None:
    """A DataConfig subclass decides what each rank gets; a broken one fails the run clearly."""
    async with asyncexec.Executor(2, resources_per_worker=CPU) as ex:
        run = ex.run(echo_shard, datasets={"train": ray.data.range(4)}, data_config=LabelConfig())
        [_ async for _ in run]
        assert run.result.return_values == ["train-0", "train-1"]
        bad = ex.run(echo_shard, datasets={"train": ray.data.range(4)}, data_config=BrokenConfig())
        with pytest.raises(asyncexec.ConfigurationError, match=r"one mapping of dataset parts"):
            [_ async for _ in bad]


async def test_a_configure_that_returns_too_few_parts_leaves_no_coordinator() -> None:
    """The split it made was never recorded, so the end of the run did not stop its
    coordinator: it lived as long as the error (whose traceback holds the parts)."""
    async with asyncexec.Executor(2, resources_per_worker=CPU) as ex:
        run = ex.run(echo_shard, datasets={"train": ray.data.range(4)}, data_config=ShortConfig())
        with pytest.raises(asyncexec.ConfigurationError, match="one mapping of dataset") as info:
            [_ async for _ in run]
    assert info.value.__traceback__ is not None  # still held, as an application may hold it
    assert await anyio.to_thread.run_sync(wait_no_coordinator), "the coordinator was left"


# The driver's DataContext ---------------------------------------------------------------------


async def test_driver_data_context_is_set_on_every_worker() -> None:
    key = f"asyncexec_probe_{uuid.uuid4().hex[:6]}"
    ctx = DataContext.get_current()
    ctx.set_config(key, "from-the-driver")
    try:
        async with asyncexec.Executor(2, resources_per_worker=CPU) as ex:
            assert await ex.execute(data_context_probe, key) == ["from-the-driver"] * 2
    finally:
        ctx.remove_config(key)


# The example ----------------------------------------------------------------------------------


async def test_datasets_train_example_learns_the_weights() -> None:
    example = importlib.import_module("examples.datasets_train")
    history = await example.main(num_workers=2, epochs=3, rows=1024, batch_size=32, quiet=True)
    assert [h["epoch"] for h in history] == [0, 1, 2]
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert history[-1]["weight_error"] < 0.1
