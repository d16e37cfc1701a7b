"""Reservations: several executors in one placement group, rank i of each on bundle i, against a
real ``ray.cluster_utils.Cluster`` with fake GPUs declared as node resources."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import anyio
import pytest
import ray
from conftest import live_placement_groups, live_workers

import asyncexec

pytestmark = [pytest.mark.multinode, pytest.mark.timeout(240)]

GPU_NODE = {"num_cpus": 4, "num_gpus": 2}


def visible() -> dict[str, Any]:
    ctx = asyncexec.get_context()
    return {
        "rank": ctx.world_rank,
        "pid": os.getpid(),
        "gpu_ids": [str(g) for g in ray.get_runtime_context().get_accelerator_ids()["GPU"]],
        "cvd": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "node": ctx.node_id,
    }


def rollout() -> None:
    """Reports until the run is stopped, so that it is running while the other executor
    restarts."""
    step = 0
    while True:
        asyncexec.report({"step": step, "pid": os.getpid()})
        step += 1
        time.sleep(0.02)


def _reserved_gpus() -> float:
    total = ray.cluster_resources().get("GPU", 0.0)
    return total - ray.available_resources().get("GPU", 0.0)


async def test_two_executors_share_four_fake_gpus_rank_by_rank(
    make_cluster: Callable[[list[dict[str, Any]]], Any],
) -> None:
    make_cluster([GPU_NODE, GPU_NODE])
    half = {"CPU": 0.5, "GPU": 0.5}
    async with asyncexec.Reservation(4, {"CPU": 1, "GPU": 1}, name="rl") as reservation:
        assert await anyio.to_thread.run_sync(_reserved_gpus) == pytest.approx(4.0)
        async with (
            asyncexec.Executor(4, reservation=reservation, resources_per_worker=half) as a,
            asyncexec.Executor(4, reservation=reservation, resources_per_worker=half) as b,
        ):
            seen_a = await a.execute(visible)
            seen_b = await b.execute(visible)
            # Still 4 GPUs reserved: both executors live inside the reservation.
            assert await anyio.to_thread.run_sync(_reserved_gpus) == pytest.approx(4.0)
            for x, y in zip(seen_a, seen_b, strict=True):
                assert x["rank"] == y["rank"]
                assert x["gpu_ids"] == y["gpu_ids"] and len(x["gpu_ids"]) == 1
                assert x["node"] == y["node"]
            # Each executor's device sharing is correct inside it: a node's two ranks see the
            # node's two GPUs, in the same order, in both executors.
            for seen in (seen_a, seen_b):
                by_node: dict[str, set[str]] = {}
                for w in seen:
                    by_node.setdefault(w["node"], set()).update(w["gpu_ids"])
                for w in seen:
                    assert sorted(w["cvd"].split(",")) == sorted(by_node[w["node"]])
            assert len({w["node"] for w in seen_a}) == 2
            assert [w["rank"] for w in seen_a] == [0, 1, 2, 3]
            stats = reservation.statistics()
            assert [c[1] for c in stats.claims] == [4, 4]
            assert all(f == {"CPU": 0.0, "GPU": 0.0} for f in stats.free)
            # Over-asking fails clearly, before anything starts.
            with pytest.raises(asyncexec.ConfigurationError, match=r"has .* left"):
                async with asyncexec.Executor(
                    1, reservation=reservation, resources_per_worker={"CPU": 0.1}
                ):
                    pass
        # Closing the executors gave their claims back.
        assert reservation.statistics().claims == ()
        with pytest.raises(asyncexec.ConfigurationError, match="needs 5 bundles"):
            async with asyncexec.Executor(5, reservation=reservation):
                pass
        with pytest.raises(asyncexec.ConfigurationError, match="do not hold"):
            async with asyncexec.Executor(
                1, reservation=reservation, resources_per_worker={"CPU": 0.5, "TPU": 1}
            ):
                pass
    assert not live_workers() and not live_placement_groups()


async def test_a_restart_of_one_executor_keeps_the_other_running_and_the_reservation(
    make_cluster: Callable[[list[dict[str, Any]]], Any], tmp_path: Any
) -> None:
    make_cluster([{"num_cpus": 4}])
    half = {"CPU": 0.5}
    async with asyncexec.Reservation(2, {"CPU": 1}) as reservation:
        groups_before = [p["placement_group_id"] for p in live_placement_groups()]
        assert len(groups_before) == 1
        async with (
            asyncexec.Executor(
                2,
                reservation=reservation,
                resources_per_worker=half,
                restart=asyncexec.RestartPolicy(max_restarts=1),
                storage_path=str(tmp_path),
            ) as a,
            asyncexec.Executor(
                2, reservation=reservation, resources_per_worker=half, storage_path=str(tmp_path)
            ) as b,
        ):
            b_pids = [w.pid for w in b.workers]
            run_b = b.run(rollout)
            run_a = a.run(rollout)
            killed = False
            attempts_a: set[int] = set()
            async for step in run_a:
                attempts_a.add(step.attempt)
                if not killed:
                    killed = True
                    os.kill(a.workers[1].pid, signal.SIGKILL)
                if step.attempt == 2:
                    break
            await run_a.aclose()
            assert attempts_a == {1, 2}
            # The other executor's run went on on the same processes, without a restart.
            step_b = await run_b.__anext__()
            assert step_b.attempt == 1
            assert [w.pid for w in b.workers] == b_pids
            # The restarted ranks are on their bundles again, in the same reservation.
            assert [p["placement_group_id"] for p in live_placement_groups()] == groups_before
            await run_b.aclose()
            assert run_b.attempt == 1 and not run_b.failures
    assert not live_workers() and not live_placement_groups()


async def test_a_pool_on_a_reservation_leases_rank_i_on_bundle_i(
    make_cluster: Callable[[list[dict[str, Any]]], Any],
) -> None:
    make_cluster([GPU_NODE])
    half = {"CPU": 0.5, "GPU": 0.5}
    async with (
        asyncexec.Reservation(2, {"CPU": 1, "GPU": 1}) as reservation,
        asyncexec.WorkerPool(2, resources_per_worker=half, reservation=reservation) as pool,
    ):
        async with (
            asyncexec.Executor(2, pool=pool) as a,
            asyncexec.Executor(2, reservation=reservation, resources_per_worker=half) as b,
        ):
            seen_a, seen_b = await a.execute(visible), await b.execute(visible)
            assert [x["gpu_ids"] for x in seen_a] == [y["gpu_ids"] for y in seen_b]
            assert seen_a[0]["gpu_ids"] != seen_a[1]["gpu_ids"]
        with pytest.raises(asyncexec.ConfigurationError, match=r"has .* left"):
            async with asyncexec.WorkerPool(
                1, resources_per_worker={"CPU": 0.5, "GPU": 0.6}, reservation=reservation
            ):
                pass
    assert not live_workers() and not live_placement_groups()
