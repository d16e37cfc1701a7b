"""Several nodes and accelerators, against a real ``ray.cluster_utils.Cluster``: rank maps across
nodes, PACK and SPREAD, visible devices shared per node (fake GPUs and Neuron cores declared as
node resources), a parent placement group that captures child tasks, and the loss of a node in
the middle of a run, with and without room to restart on what is left."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import anyio
import pytest
import ray
import tenacity
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

import asyncexec

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

log = logging.getLogger(__name__)
Strategy = Literal["PACK", "SPREAD"]
DEVICE_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "NEURON_RT_VISIBLE_CORES")


def whereabouts() -> dict[str, Any]:
    """What a worker sees of itself: its context, Ray's view of its node and devices, its env."""
    runtime = ray.get_runtime_context()
    group = get_current_placement_group()
    return {
        "context": asyncexec.get_context(),
        "node_id": runtime.get_node_id(),
        "pid": os.getpid(),
        "ids": {k: list(v) for k, v in runtime.get_accelerator_ids().items() if v},
        "env": {var: os.environ.get(var) for var in DEVICE_VARS},
        "placement_group": None if group is None else group.id.hex(),
    }


def check_rank_map(
    workers: Sequence[asyncexec.WorkerContext],
    seen: Sequence[Mapping[str, Any]],
    driver_node: str,
) -> list[str]:
    """Check the rank map against what each worker saw; return each rank's node id.

    World ranks are 0..n-1 and grouped by node, the driver's node first when it holds workers;
    local ranks count within a node; node ranks number the nodes in order; local world sizes are
    the node's worker count; ``get_context()`` inside each worker agrees with ``ex.workers``.
    """
    n = len(workers)
    nodes = [s["node_id"] for s in seen]
    assert [w.world_rank for w in workers] == list(range(n))
    assert [w.node_id for w in workers] == nodes
    assert [w.pid for w in workers] == [s["pid"] for s in seen]
    assert [s["context"] for s in seen] == list(workers)
    order = list(dict.fromkeys(nodes))
    # Grouped: each node's workers form one contiguous block.
    assert nodes == [node for node in order for _ in range(nodes.count(node))], nodes
    if driver_node in nodes:
        assert order[0] == driver_node
    for w, node in zip(workers, nodes, strict=True):
        assert w.world_size == n
        assert w.node_rank == order.index(node)
        assert w.local_world_size == nodes.count(node)
        assert w.local_rank == nodes[: w.world_rank].count(node)
    return nodes


@pytest.mark.timeout(300)  # two clusters of two nodes, one after the other
async def test_ranks_follow_nodes_driver_node_first_and_placement_strategy_decides_nodes(
    make_cluster: Callable[[list[dict[str, Any]]], Any],
) -> None:
    """3 and 4 workers of CPU 1 on two 2-CPU nodes, PACK and SPREAD: both nodes are used and the
    rank map is grouped by node; 2 workers of CPU 0.5 use one node with PACK, two with SPREAD;
    workers that only fit on the other node rank it first."""
    make_cluster([{"num_cpus": 2}, {"num_cpus": 2, "resources": {"side": 2}}])
    driver_node = ray.get_runtime_context().get_node_id()
    for n in (3, 4):
        strategies: tuple[Strategy, ...] = ("PACK", "SPREAD")
        for strategy in strategies:
            async with asyncexec.Executor(
                n, resources_per_worker={"CPU": 1}, placement_strategy=strategy
            ) as ex:
                nodes = check_rank_map(ex.workers, await ex.execute(whereabouts), driver_node)
                assert len(set(nodes)) == 2, (n, strategy, nodes)
                assert driver_node in nodes
    for strategy, spanned in (("PACK", 1), ("SPREAD", 2)):
        async with asyncexec.Executor(
            2, resources_per_worker={"CPU": 0.5}, placement_strategy=strategy
        ) as ex:
            nodes = check_rank_map(ex.workers, await ex.execute(whereabouts), driver_node)
            assert len(set(nodes)) == spanned, (strategy, nodes)
    async with asyncexec.Executor(2, resources_per_worker={"CPU": 0.5, "side": 1}) as ex:
        nodes = check_rank_map(ex.workers, await ex.execute(whereabouts), driver_node)
        assert driver_node not in nodes
        assert [w.node_rank for w in ex.workers] == [0, 0]
        assert [w.local_rank for w in ex.workers] == [0, 1]


def _device_key(device_id: str) -> int:
    return int(device_id)


def check_devices(
    workers: Sequence[asyncexec.WorkerContext],
    seen: Sequence[Mapping[str, Any]],
    kind: str,
    variables: Sequence[str],
    shared: bool,
    per_worker: float,
) -> dict[str, list[str]]:
    """Check each worker's visible devices of ``kind``; return each node's devices in use.

    Every worker holds the ids Ray gave it (``per_worker`` of them, one for a fraction). Shared:
    every variable is the sorted union of the ids of the workers on its node; not shared: it is
    the worker's own ids, as Ray set them. Within a node, local rank follows the lowest id.
    """
    by_node: dict[str, list[str]] = {}
    for w, s in zip(workers, seen, strict=True):
        own = s["ids"].get(kind, [])
        assert list(w.accelerator_ids.get(kind, ())) == own
        assert len(own) == max(1, int(per_worker)), (per_worker, own)
        by_node.setdefault(w.node_id, []).extend(own)
    union = {node: sorted(set(ids), key=_device_key) for node, ids in by_node.items()}
    for w, s in zip(workers, seen, strict=True):
        own = s["ids"][kind]
        expected = ",".join(union[w.node_id]) if shared else ",".join(own)
        for var in variables:
            assert s["env"][var] == expected, (var, w.world_rank, s["env"], union, shared)
    for node in union:
        lowest = [
            min(map(_device_key, s["ids"][kind]))
            for w, s in sorted(zip(workers, seen, strict=True), key=lambda p: p[0].local_rank)
            if w.node_id == node
        ]
        assert lowest == sorted(lowest), (node, lowest)
    return union


@pytest.mark.timeout(240)  # 31 workers started on two nodes: the heaviest test of the suite
async def test_devices_are_shared_per_node_for_each_kind_unless_switched_off(
    make_cluster: Callable[[list[dict[str, Any]]], Any],
) -> None:
    """Two nodes with 4 fake GPUs and 4 Neuron cores each: 1 to 4 workers of 1, 0.5 and 2 GPUs
    see their node's GPUs (CUDA and HIP); with sharing off each sees its own; Neuron cores are
    shared likewise, and left alone when only GPUs are shared."""
    node = {"num_cpus": 2, "num_gpus": 4, "resources": {"neuron_cores": 4}}
    make_cluster([node, node])
    driver_node = ray.get_runtime_context().get_node_id()
    gpu_vars = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES")
    # Each size once per share, so that the test stays within its bound on 2 cores: SPREAD for
    # the even counts puts workers on both nodes; PACK for the odd ones fills one node first
    # (three 2-GPU workers still need both).
    for per_worker, counts in ((1, (1, 4)), (0.5, (3, 2)), (2, (3, 4))):
        for n in counts:
            strategy: Strategy = "SPREAD" if n % 2 == 0 else "PACK"
            async with asyncexec.Executor(
                n, resources_per_worker={"GPU": per_worker}, placement_strategy=strategy
            ) as ex:
                seen = await ex.execute(whereabouts)
                check_rank_map(ex.workers, seen, driver_node)
                union = check_devices(ex.workers, seen, "GPU", gpu_vars, True, per_worker)
                if n == 4 and strategy == "SPREAD":
                    assert len(union) == 2, union
        if per_worker == 1:
            continue  # sharing off: the fraction and the multiple are the cases that differ
        async with asyncexec.Executor(
            3,
            resources_per_worker={"GPU": per_worker},
            placement_strategy="PACK",
            share_devices=False,
        ) as ex:
            seen = await ex.execute(whereabouts)
            check_rank_map(ex.workers, seen, driver_node)
            check_devices(ex.workers, seen, "GPU", ("CUDA_VISIBLE_DEVICES",), False, per_worker)
            for s in seen:
                assert s["env"]["HIP_VISIBLE_DEVICES"] is None
    neuron = {"CPU": 0.25, "neuron_cores": 1}
    for share, shared in ((True, True), ({"GPU"}, False)):
        async with asyncexec.Executor(
            4, resources_per_worker=neuron, placement_strategy="SPREAD", share_devices=share
        ) as ex:
            seen = await ex.execute(whereabouts)
            check_rank_map(ex.workers, seen, driver_node)
            union = check_devices(
                ex.workers, seen, "neuron_cores", ("NEURON_RT_VISIBLE_CORES",), shared, 1
            )
            assert len(union) == 2, union


def bundle_indices() -> list[int]:
    """The bundles of its placement group that this worker's CPU comes from.

    Ray names a bundle's share of a resource ``CPU_group_<index>_<group id>``. (The
    ``bundle_group_<index>_...`` marker that comes with it may name another bundle when the
    request is for any bundle, so it is not used.)
    """
    raw = ray._private.worker.global_worker.core_worker.resource_ids()
    found = set()
    for name in raw:
        index = name.removeprefix("CPU_group_").split("_", 1)[0]
        if name.startswith("CPU_group_") and index.isdigit():
            found.add(int(index))
    return sorted(found)


def live_group_ids() -> list[str]:
    return [
        pg_id for pg_id, pg in ray.util.placement_group_table().items() if pg["state"] != "REMOVED"
    ]


class _Parent:
    """A Ray actor (as a Tune trial would be) that runs an executor on its own event loop."""

    async def run_executor(self, n: int, timeout_s: float) -> dict[str, Any]:
        async with asyncexec.Executor(
            n, resources_per_worker={"CPU": 0.5}, timeouts=asyncexec.Timeouts(placement_s=timeout_s)
        ) as ex:
            return {
                "parent": (get_current_placement_group().id.hex(), bundle_indices()),
                "workers": ex.workers,
                "seen": await ex.execute(whereabouts),
                "bundles": await ex.execute(bundle_indices),
                "groups": await anyio.to_thread.run_sync(live_group_ids),
            }

    async def try_executor(self, n: int, timeout_s: float) -> BaseException | None:
        try:
            await self.run_executor(n, timeout_s)
        except asyncexec.AsyncExecError as exc:
            return exc
        return None


Parent: Any = ray.remote(num_cpus=0.5)(_Parent)


async def test_parent_placement_group_that_captures_child_tasks_is_used_as_it_is(
    make_cluster: Callable[[list[dict[str, Any]]], Any],
) -> None:
    """An executor inside an actor whose placement group captures child tasks creates no group
    of its own: its workers take the parent's free bundles, and the parent's group outlives it."""
    make_cluster([{"num_cpus": 2}])
    parent_group = ray.util.placement_group([{"CPU": 0.5}] * 3, strategy="PACK")
    await parent_group.ready()
    parent = Parent.options(
        scheduling_strategy=PlacementGroupSchedulingStrategy(
            parent_group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True
        )
    ).remote()
    try:
        out = await parent.run_executor.remote(2, 60)
        group_id = parent_group.id.hex()
        assert out["parent"] == (group_id, [0])
        assert out["groups"] == [group_id], "the executor made a placement group of its own"
        assert [s["placement_group"] for s in out["seen"]] == [group_id, group_id]
        # Bundle 0 holds the parent; the workers take the two free ones.
        assert sorted(out["bundles"]) == [[1], [2]]
        assert [w.world_rank for w in out["workers"]] == [0, 1]
        assert await anyio.to_thread.run_sync(live_group_ids) == [group_id]
        # Three workers do not fit in the two free bundles: the parent's group is ready from the
        # start, so the placement deadline bounds the placing of the workers themselves.
        error = await parent.try_executor.remote(3, 3)
        assert isinstance(error, asyncexec.PlacementTimeoutError), error
        assert "parent placement group has no room" in str(error)
        assert await anyio.to_thread.run_sync(live_group_ids) == [group_id]
    finally:
        ray.kill(parent)
        await anyio.to_thread.run_sync(ray.util.remove_placement_group, parent_group)


def slow_steps(config: Mapping[str, Any]) -> str:
    """Report ``steps`` steps, ``sleep`` seconds apart, each naming the node it ran on."""
    node: str = ray.get_runtime_context().get_node_id()
    for i in range(config["steps"]):
        time.sleep(config["sleep"])
        asyncexec.report({"i": i, "node": node})
    return node


async def _remove(cluster: Any, node: Any, *, graceful: bool) -> tuple[float, float]:
    """Remove ``node`` off the event loop (it waits for the node's processes to die); return
    the wall-clock times (``time.time()``) when the removal began and ended."""
    began = time.time()
    await anyio.to_thread.run_sync(lambda: cluster.remove_node(node, allow_graceful=graceful))
    return began, time.time()


@pytest.mark.timeout(150)
async def test_lost_node_restarts_on_the_rest_or_gives_up_when_workers_no_longer_fit(
    make_cluster: Callable[[list[dict[str, Any]]], Any],
) -> None:
    """A node removed mid-run is noticed as a lost node while the driver waits. Two workers of
    CPU 0.5 spread over two nodes restart both on the head; two of CPU 1.5 no longer fit on the
    head, so each restart times out in placement and the run gives up, naming every failure.

    The first node is killed (its raylet gets SIGKILL: Ray notices through its health checks),
    the second is shut down gracefully (its raylet unregisters). The time from the removal to the
    failure being recorded is logged for the record, never asserted."""
    cluster = make_cluster([{"num_cpus": 2}, {"num_cpus": 2}])
    head = ray.get_runtime_context().get_node_id()
    assert head == cluster.head_node.node_id
    policy = asyncexec.RestartPolicy(max_restarts=2, wait=tenacity.wait_none())
    config: dict[str, Any] = {"steps": 30, "sleep": 0.05}
    kill_at = 5

    (other,) = cluster.worker_nodes
    async with asyncexec.Executor(
        2,
        resources_per_worker={"CPU": 0.5},
        placement_strategy="SPREAD",
        restart=policy,
        timeouts=asyncexec.Timeouts(placement_s=10),
    ) as ex:
        assert {w.node_id for w in ex.workers} == {head, other.node_id}
        lost_rank = next(w.world_rank for w in ex.workers if w.node_id == other.node_id)
        run = ex.run(slow_steps, config)
        steps = []
        removed = (0.0, 0.0)
        resumed = 0.0
        async for step in run:
            steps.append(step)
            if step.attempt == 1 and step.index == kill_at:
                removed = await _remove(cluster, other, graceful=False)
            if step.attempt == 2 and not resumed:
                resumed = time.time()
        result = run.result
        assert result.attempts == 2
        (lost,) = result.failures
        assert isinstance(lost, asyncexec.NodeLostError), lost
        assert (lost.node_id, lost.rank, lost.attempt) == (other.node_id, lost_rank, 1)
        log.info(
            "killed node noticed after %.3f s; first step of the restarted group %.3f s later",
            lost.time - removed[0],
            resumed - lost.time,
        )
        # Steps every rank completed before the loss are delivered, then the second attempt's.
        assert [s.index for s in steps] == list(range(len(steps)))
        first = [s for s in steps if s.attempt == 1]
        second = [s for s in steps if s.attempt == 2]
        assert len(first) > kill_at
        assert steps == first + second
        assert [s.metrics["i"] for s in second] == list(range(config["steps"]))
        assert {r.metrics["node"] for s in second for r in s.reports} == {head}
        assert result.return_values == [head, head]
        assert [(w.node_id, w.local_rank, w.node_rank) for w in ex.workers] == [
            (head, 0, 0),
            (head, 1, 0),
        ]

    # On the loop: Ray's Node installs signal handlers, which only the main thread may do; no
    # executor is open, so nothing else is waiting on the loop meanwhile.
    third = cluster.add_node(num_cpus=2)
    async with asyncexec.Executor(
        2,
        resources_per_worker={"CPU": 1.5},
        placement_strategy="PACK",
        restart=policy,
        timeouts=asyncexec.Timeouts(placement_s=2),
    ) as ex:
        assert {w.node_id for w in ex.workers} == {head, third.node_id}
        lost_rank = next(w.world_rank for w in ex.workers if w.node_id == third.node_id)
        run = ex.run(slow_steps, config)
        steps = []
        with pytest.raises(asyncexec.RestartsExhaustedError) as info:
            async for step in run:
                steps.append(step)
                if step.attempt == 1 and step.index == kill_at:
                    removed = await _remove(cluster, third, graceful=True)
        error = info.value
        assert error.attempts == 3
        # Without the lost node the workers can never fit and nothing can add a node: each
        # later attempt fails at once, without waiting for the placement deadline.
        assert [type(f) for f in error.failures] == [
            asyncexec.NodeLostError,
            asyncexec.PlacementInfeasibleError,
            asyncexec.PlacementInfeasibleError,
        ]
        lost = error.failures[0]
        assert isinstance(lost, asyncexec.NodeLostError)
        assert (lost.node_id, lost.rank, lost.attempt) == (third.node_id, lost_rank, 1)
        log.info("drained node noticed after %.3f s", lost.time - removed[0])
        for infeasible in error.failures[1:]:
            assert isinstance(infeasible, asyncexec.PlacementInfeasibleError)
            assert infeasible.requested == [{"CPU": 1.5}, {"CPU": 1.5}]
            assert infeasible.nodes == [{"CPU": 2.0}]
        assert error.__cause__ is error.failures[-1]
        assert len(steps) > kill_at
        assert {s.attempt for s in steps} == {1}
        assert ex.workers == []
