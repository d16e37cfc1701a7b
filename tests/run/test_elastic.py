"""Elastic size (``num_workers=(min, max)``): the size decision without Ray, bad input, starting
with what fits and growing when capacity frees up on a local Ray, and a node lost and added back
on a ``ray.cluster_utils.Cluster`` (the run goes on with the minimum, then grows back)."""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
import ray
import tenacity
from conftest import cluster_held
from structlog.testing import capture_logs

import asyncexec
import asyncexec.backends
from asyncexec._driver._config import ExecutorConfig
from asyncexec._driver.group import decide_size, fitting_workers

log = logging.getLogger(__name__)
NO_WAIT = tenacity.wait_none()


def sized_counter(config: dict[str, Any]) -> int:
    """Count steps from the latest checkpoint on; report the count, the world size and the
    attempt. Rank 0 checkpoints every step. The function ends after ``after`` steps of an
    attempt at least ``until_attempt`` (or at ``limit`` steps): the test decides when the size
    changes, so the function cannot know its length in advance."""
    ctx = asyncexec.get_context()
    start = 0
    checkpoint = asyncexec.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            start = json.loads((Path(directory) / "count.json").read_text())["i"] + 1
    i = start
    while i < config["limit"]:
        if ctx.attempt >= config["until_attempt"] and i - start >= config["after"]:
            break
        time.sleep(config["sleep"])
        saved = None
        if ctx.world_rank == 0:
            tmp = tempfile.mkdtemp()
            (Path(tmp) / "count.json").write_text(json.dumps({"i": i}))
            saved = asyncexec.Checkpoint.from_directory(tmp)
        metrics = {
            "i": i,
            "world_size": ctx.world_size,
            "attempt": ctx.attempt,
            "t": time.time(),
            "pid": os.getpid(),
        }
        asyncexec.report(metrics, checkpoint=saved)
        i += 1
    return ctx.world_size


def check_counted(steps: list[asyncexec.Step], sizes: dict[int, int]) -> None:
    """Each attempt ran at its expected world size (every rank's report says so) and resumed
    from the latest checkpoint: the counts over all steps are 0, 1, 2, ... without a gap or a
    repeat (every step carried a checkpoint, and the steps completed before each restart were
    delivered)."""
    assert {s.attempt for s in steps} == set(sizes)
    for step in steps:
        assert len(step.reports) == sizes[step.attempt], step
        assert {r.metrics["world_size"] for r in step.reports} == {sizes[step.attempt]}
        assert {r.metrics["attempt"] for r in step.reports} == {step.attempt}
    assert [s.metrics["i"] for s in steps] == list(range(len(steps)))
    assert [s.index for s in steps] == list(range(len(steps)))
    assert [s.attempt for s in steps] == sorted(s.attempt for s in steps)


# The size decision, without Ray ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("strategy", "nodes", "most", "expected"),
    [
        ("PACK", [{"CPU": 2.0}, {"CPU": 2.0}], 4, 4),
        ("PACK", [{"CPU": 2.0}, {"CPU": 2.0}], 3, 3),
        ("SPREAD", [{"CPU": 2.0}], 4, 2),
        ("PACK", [{"CPU": 1.5}, {"CPU": 0.5}], 4, 1),  # whole bundles only
        ("PACK", [{"CPU": 0.99997}], 2, 1),  # below Ray's precision (1e-4): rounding
        ("PACK", [{"GPU": 8.0}], 4, 0),  # no CPU at all
        ("PACK", [], 4, 0),
        ("STRICT_PACK", [{"CPU": 3.0}, {"CPU": 2.0}], 4, 3),
        ("STRICT_SPREAD", [{"CPU": 2.0}, {"CPU": 2.0}, {"CPU": 0.0}], 4, 2),
    ],
)
def test_fitting_workers_counts_whole_bundles_under_the_strategy(
    strategy: str, nodes: list[dict[str, float]], most: int, expected: int
) -> None:
    assert fitting_workers({"CPU": 1.0}, strategy, nodes, most) == expected


def test_fitting_workers_needs_every_resource_of_a_bundle_on_one_node() -> None:
    bundle = {"CPU": 1.0, "GPU": 1.0}
    nodes = [{"CPU": 4.0, "GPU": 1.0}, {"CPU": 0.5, "GPU": 4.0}, {"CPU": 2.0, "GPU": 2.0}]
    assert fitting_workers(bundle, "PACK", nodes, 8) == 3


@pytest.mark.parametrize(("fitting", "expected"), [(0, 2), (1, 2), (2, 2), (3, 3), (4, 4), (9, 4)])
def test_size_is_what_fits_within_the_bounds(fitting: int, expected: int) -> None:
    """Fewer than the minimum fitting: ask for the minimum (the placement deadline applies)."""
    assert decide_size(fitting, 2, 4) == expected


# Bad input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ((0, 2), "two positive ints"),
        ((2,), "two positive ints"),
        ((1, 2, 3), "two positive ints"),
        ((1.0, 2), "two positive ints"),
        ((True, 2), "two positive ints"),
        ((1, None), "two positive ints"),
        ((3, 2), "min <= max, got min 3 > max 2"),
        ([1, 2], "positive int or a \\(min, max\\) tuple"),
        ("1-2", "positive int or a \\(min, max\\) tuple"),
    ],
)
def test_bad_elastic_sizes_are_refused(value: object, match: str) -> None:
    with pytest.raises(asyncexec.ConfigurationError, match=f"num_workers.*{match}"):
        asyncexec.Executor(value)  # type: ignore[arg-type]


def test_elastic_config_keeps_the_bounds_and_aims_for_the_maximum() -> None:
    config = asyncexec.Executor((2, 4)).config
    assert (config.elastic, config.num_workers, config.min_workers, config.max_workers) == (
        True,
        4,
        2,
        4,
    )
    fixed = ExecutorConfig.build((3, 3), resources_per_worker={"CPU": 1})
    assert (fixed.elastic, fixed.num_workers, fixed.min_workers) == (False, 3, None)
    assert asyncexec.Executor((1, 2), elastic_check_interval_s=0.25).config.elastic


@pytest.mark.parametrize("value", [0, -1, float("nan"), "1", None])
def test_bad_check_interval_is_refused(value: object) -> None:
    with pytest.raises(asyncexec.ConfigurationError, match="elastic_check_interval_s"):
        asyncexec.Executor((1, 2), elastic_check_interval_s=value)  # type: ignore[arg-type]


def test_elastic_size_with_spares_pool_or_reservation_is_refused() -> None:
    with pytest.raises(asyncexec.ConfigurationError, match=r"elastic.*no spares"):
        asyncexec.Executor((1, 2), spares=1)
    pool = asyncexec.WorkerPool(2, resources_per_worker={"CPU": 1})
    with pytest.raises(asyncexec.ConfigurationError, match=r"elastic.*no pool"):
        asyncexec.Executor((1, 2), pool=pool)
    reservation = asyncexec.Reservation(2, {"CPU": 1})
    with pytest.raises(asyncexec.ConfigurationError, match=r"elastic.*no reservation"):
        asyncexec.Executor((1, 2), reservation=reservation)


async def test_elastic_size_inside_a_parent_placement_group_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inside a placement group that captures child tasks, the workers would take the parent's
    bundles, which the size decision does not measure."""
    from asyncexec._driver.cluster import RayCluster
    from asyncexec._driver.group import _elastic

    cluster = RayCluster()

    async def parent() -> object:
        return object()

    monkeypatch.setattr(cluster, "parent", parent)
    config = ExecutorConfig.build((1, 2), resources_per_worker={"CPU": 1})
    sizer = _elastic.Sizer(config, cluster, None)
    with pytest.raises(asyncexec.ConfigurationError, match="parent placement group"):
        await sizer.size()


# A local Ray: start with what fits, grow when it frees up ---------------------------------------


@pytest.mark.timeout(120)
@pytest.mark.usefixtures("ray_local")
async def test_starts_with_what_fits_and_grows_when_capacity_frees_up(tmp_path: Path) -> None:
    """On the local Ray of 4 CPUs with 2 held elsewhere, ``(1, 4)`` workers of 1 CPU start as
    2. Once the 2 CPUs are given back, the next check restarts the run on 4 from the latest
    checkpoint: a planned resize, not a failure (no restart counted, no failure recorded)."""
    config = {"limit": 500, "until_attempt": 2, "after": 5, "sleep": 0.05}
    held = cluster_held({"CPU": 2})
    await anyio.to_thread.run_sync(held.__enter__)
    released = False
    try:
        async with asyncexec.Executor(
            (1, 4),
            resources_per_worker={"CPU": 1},
            elastic_check_interval_s=0.2,
            restart=asyncexec.RestartPolicy(max_restarts=0),
            storage_path=str(tmp_path),
        ) as ex:
            assert [w.world_size for w in ex.workers] == [2, 2]
            assert ex.statistics().num_workers == 2
            steps = []
            with capture_logs() as logs:
                async for step in ex.run(sized_counter, config):
                    steps.append(step)
                    if not released and step.index == 3:
                        await anyio.to_thread.run_sync(held.__exit__, None, None, None)
                        released = True
            result = ex.result
            stats = ex.statistics()
            assert (result.attempts, result.failures) == (2, [])
            assert (stats.restarts, stats.resizes, stats.num_workers) == (0, 1, 4)
            assert result.return_values == [4, 4, 4, 4]
            check_counted(steps, {1: 2, 2: 4})
            resized = [e for e in logs if e["event"] == "resized"]
            assert [(e["from_workers"], e["to_workers"], e["planned"]) for e in resized] == [
                (2, 4, True)
            ]
            assert [e["fitting"] for e in logs if e["event"] == "resizing"] == [4]
            assert not [e for e in logs if e["event"] in ("worker_failed", "restarting")]
    finally:
        if not released:
            await anyio.to_thread.run_sync(held.__exit__, None, None, None)


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("ray_local")
async def test_elastic_executor_refuses_independent_runs() -> None:
    async with asyncexec.Executor((1, 2), resources_per_worker={"CPU": 0.5}) as ex:
        assert len(ex.workers) == 2
        with pytest.raises(asyncexec.ConfigurationError, match=r"elastic.*independent"):
            ex.run(sized_counter, {}, independent=True)


# Several nodes: a node lost, then added back -----------------------------------------------------


async def _remove(cluster: Any, node: Any) -> float:
    """Kill ``node`` (its raylet gets SIGKILL: Ray notices through its health checks) off the
    event loop; return the wall-clock time when the removal began."""
    began = time.time()
    await anyio.to_thread.run_sync(lambda: cluster.remove_node(node, allow_graceful=False))
    return began


async def _lose_and_add(
    ex: asyncexec.Executor, cluster: Any, node: Any, config: dict[str, Any]
) -> tuple[list[asyncexec.Step], dict[str, Any]]:
    """Consume the run; kill ``node`` at step 5 and add a node at the first step of attempt 2.
    Returns the steps, and when the node was killed, when the first step at the smaller size
    was reported, and the node added."""
    steps: list[asyncexec.Step] = []
    seen: dict[str, Any] = {}
    async for step in ex.run(sized_counter, config):
        steps.append(step)
        if step.attempt == 1 and step.index == 5 and "removed" not in seen:
            seen["removed"] = await _remove(cluster, node)
        if step.attempt == 2 and "added" not in seen:
            seen["shrunk"] = max(r.metrics["t"] for r in step.reports)  # its ranks reported
            seen["nodes"] = {w.node_id for w in ex.workers}
            # On the loop: Ray's Node installs signal handlers, which only the main thread may
            # do. The run's pumps wait meanwhile (about a second).
            seen["added"] = cluster.add_node(num_cpus=2)
    return steps, seen


@pytest.mark.multinode
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("kept", [True, False], ids=["survivors-kept", "fresh-group"])
async def test_lost_node_goes_on_with_the_minimum_then_grows_back(
    make_cluster: Callable[[list[dict[str, Any]]], Any], tmp_path: Path, kept: bool
) -> None:
    """Two nodes of 2 CPUs and ``(2, 4)`` workers of 1 CPU: the run starts with 4. A node is
    killed: the run goes on with 2 on the node that is left, from the latest checkpoint, instead
    of waiting for the lost capacity: the 2 workers left there (no process starts), or with a
    backend (whose framework group needs fresh processes) a new group of the 2 that fit. A node
    is added back: the next check grows the run to 4 again, from the latest checkpoint. The time
    from the removal to the first step at 2 is logged beside the time Ray took to notice the
    lost node, never asserted."""
    cluster = make_cluster([{"num_cpus": 2}, {"num_cpus": 2}])
    head = ray.get_runtime_context().get_node_id()
    (other,) = cluster.worker_nodes
    config = {"limit": 2000, "until_attempt": 3, "after": 10, "sleep": 0.05}
    async with asyncexec.Executor(
        (2, 4),
        resources_per_worker={"CPU": 1},
        placement_strategy="SPREAD",
        restart=asyncexec.RestartPolicy(max_restarts=1, wait=NO_WAIT),
        elastic_check_interval_s=0.5,
        timeouts=asyncexec.Timeouts(placement_s=20),
        storage_path=str(tmp_path),
        backend=None if kept else asyncexec.backends.Backend(),
    ) as ex:
        assert len(ex.workers) == 4
        assert {w.node_id for w in ex.workers} == {head, other.node_id}
        with capture_logs() as logs:
            steps, seen = await _lose_and_add(ex, cluster, other, config)
        result = ex.result
        stats = ex.statistics()
        assert "added" in seen
        assert seen["nodes"] == {head}
        assert result.attempts == 3
        (lost,) = result.failures
        assert isinstance(lost, asyncexec.NodeLostError), lost
        assert lost.node_id == other.node_id
        assert (stats.restarts, stats.resizes, stats.num_workers) == (1, 2, 4)
        assert result.return_values == [4, 4, 4, 4]
        assert {w.node_id for w in ex.workers} == {head, seen["added"].node_id}
        check_counted(steps, {1: 4, 2: 2, 3: 4})
        # Kept: the 2 workers left on the head went on (no process started for the smaller
        # size). Else a new group started.
        pids = {
            a: {r.metrics["pid"] for s in steps if s.attempt == a for r in s.reports}
            for a in (1, 2, 3)
        }
        assert len(pids[2]) == 2
        assert pids[2] <= pids[1] if kept else not pids[2] & pids[1]
        assert len(pids[3]) == 4
        resized = [e for e in logs if e["event"] == "resized"]
        assert [(e["from_workers"], e["to_workers"], e["planned"]) for e in resized] == [
            (4, 2, False),
            (2, 4, True),
        ]
        assert len([e for e in logs if e["event"] == "group_shrunk"]) == int(kept)
        noticed = lost.time - seen["removed"]
        shrink = seen["shrunk"] - seen["removed"]
        log.warning(
            "%s: node killed: Ray noticed it after %.3f s; first step at the smaller size "
            "%.3f s after the kill (%.2fx the detection time)",
            "survivors kept" if kept else "fresh group",
            noticed,
            shrink,
            shrink / noticed,
        )
