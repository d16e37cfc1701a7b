"""Drain notice to checkpoint taken: asyncexec beside Ray Train V2, on a ray.cluster_utils.Cluster.

    python benchmarks/preemption.py            # 3 drains a system: about 4 minutes on 2 cores
    python benchmarks/preemption.py --quick    # 1 drain a system: a smoke run

Each trial adds a fresh node to a two-node cluster (the head and it, 2 CPUs each) and runs two
workers of 1 CPU spread over both. Rank 0's function drains the new node with Ray's own
``DrainNode`` (reason preemption, deadline 30 s ahead, as a cloud's notice gives) at a random
time 0.5-5.5 s after it starts (the same for every system in a trial: a drain comes at any
point of a watcher's poll period) and steps on, 10 ms a step; every rank looks for a notice at
each step and, on seeing one, reports a checkpoint (a small directory). Measured in the
function from the drain call (one clock: the nodes share the machine): when rank 0 saw the
notice, and when its ``report()`` with the checkpoint returned (the checkpoint persisted). For
asyncexec also: from the drain call to the first step of the next attempt (from that
checkpoint, on the head, while the drained node is still there: the group moves before the
deadline, a move charged to the preemption budget). Ray Train V2 does not move: its run goes on
on the drained node until the node goes, then restarts as after any failure.

Systems: asyncexec with its default check interval (1 s) and with 0.1 s; Ray Train V2 (its
``PreemptionWatcher``) with its default poll (5 s) and with 1 s
(``RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S``). Ray Train runs in a driver process of its own that
joins the cluster (``import ray.train`` would load Ray Data into this one). Ray Train's
``report()`` with a checkpoint waits for every rank's, asyncexec's does not: that is in the
second figure. Medians over the trials.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import _harness
import ray
from _harness import Result, Row, Table

STEP_S = 0.01
DEADLINE_S = 30.0
AFTER = 3  # steps of the attempt after the move


def drain(node_id: str) -> float:
    """Drain ``node_id`` for a preemption, 30 s ahead; return when the call was made."""
    from ray.core.generated import autoscaler_pb2

    gcs = ray._private.worker.global_worker.gcs_client
    reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")
    t0 = time.time()
    accepted, why = gcs.drain_node(node_id, reason, "bench", int((t0 + DEADLINE_S) * 1000), 10)
    if not accepted:
        raise RuntimeError(f"drain rejected: {why}")
    return t0


def _checkpoint_dir(rank: int) -> str:
    directory = tempfile.mkdtemp()
    Path(directory, f"rank{rank}").write_text("state")
    return directory


# asyncexec ------------------------------------------------------------------------------------


def ae_fn(config: dict[str, Any]) -> None:
    """See the module's docstring. After its checkpoint a rank steps on until its group goes;
    the attempt after the move reports ``AFTER`` steps."""
    import asyncexec

    rank = asyncexec.get_context().world_rank
    if asyncexec.get_checkpoint() is not None:
        for i in range(AFTER):
            asyncexec.report({"i": i, "t": time.time()})
        return
    t0 = None
    saved = False
    i = 0
    start = time.monotonic()
    while True:
        time.sleep(STEP_S)
        if rank == 0 and t0 is None and time.monotonic() - start >= config["drain_after"]:
            t0 = drain(config["node"])
        metrics: dict[str, Any] = {"i": i, "t0": t0}
        if not saved and asyncexec.get_preemption_info() is not None:
            metrics["seen"] = time.time()
            ckpt = asyncexec.Checkpoint.from_directory(_checkpoint_dir(rank))
            asyncexec.report(metrics, checkpoint=ckpt)
            saved = True
            if rank == 0:  # in a file: the move may stop the function before its next report
                Path(config["out"]).write_text(str(time.time()))
        asyncexec.report(metrics)
        i += 1


async def ae_trial(
    cluster: Any, interval: float, storage: str, drain_after: float
) -> dict[str, float]:
    import anyio

    import asyncexec

    node = cluster.add_node(num_cpus=2)
    await anyio.to_thread.run_sync(cluster.wait_for_nodes)
    policy = asyncexec.RestartPolicy(max_restarts=0, preemption_check_interval_s=interval)
    figures: dict[str, float] = {}
    async with asyncexec.Executor(
        2,
        resources_per_worker={"CPU": 1},
        placement_strategy="SPREAD",
        restart=policy,
        storage_path=storage,
    ) as ex:
        assert {w.node_id for w in ex.workers} == {cluster.head_node.node_id, node.node_id}
        t0 = 0.0
        out = os.path.join(storage, "saved")
        config = {"node": node.node_id, "drain_after": drain_after, "out": out}
        async for step in ex.run(ae_fn, config):
            first = step.reports[0].metrics
            t0 = first.get("t0") or t0
            if "seen" in first:
                figures["seen"] = first["seen"] - t0
            if step.attempt == 2 and "moved" not in figures:
                figures["moved"] = first["t"] - t0
        stats = ex.statistics()
        assert (stats.restarts, stats.preemptions) == (0, 1), stats
        assert node.node_id not in {w.node_id for w in ex.workers}
    figures["saved"] = float(await anyio.Path(out).read_text()) - t0
    # The drained node, left idle, goes by itself; what is left of it goes now.
    with contextlib.suppress(Exception):
        await anyio.to_thread.run_sync(lambda: cluster.remove_node(node, False))
    return figures


# Ray Train V2 ---------------------------------------------------------------------------------


def rt_fn(config: dict[str, Any]) -> None:
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    t0 = None
    i = 0
    start = time.monotonic()
    while True:
        time.sleep(STEP_S)
        if rank == 0 and t0 is None and time.monotonic() - start >= config["drain_after"]:
            t0 = drain(config["node"])
        if ray.train.get_preemption_info() is not None:
            seen = time.time()
            ckpt = ray.train.Checkpoint.from_directory(_checkpoint_dir(rank))
            ray.train.report({"i": i}, checkpoint=ckpt)
            saved = time.time()
            if rank == 0:
                assert t0 is not None
                Path(config["out"]).write_text(json.dumps({"seen": seen - t0, "saved": saved - t0}))
            return
        i += 1


def rt_main(address: str, node: str, drain_after: str, out: str) -> None:
    """One Ray Train V2 trial, in a driver process of its own (see the module's docstring)."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer

    ray.init(address=address, log_to_driver=False)
    trainer = DataParallelTrainer(
        rt_fn,
        train_loop_config={"node": node, "out": out, "drain_after": float(drain_after)},
        scaling_config=ScalingConfig(
            num_workers=2, resources_per_worker={"CPU": 1}, placement_strategy="SPREAD"
        ),
        run_config=RunConfig(storage_path=tempfile.mkdtemp(), name="preemption"),
    )
    trainer.fit()
    ray.shutdown()


def rt_trial(cluster: Any, poll_s: float | None, drain_after: float) -> dict[str, float]:
    node = cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    out = os.path.join(tempfile.mkdtemp(), "figures.json")
    env = {**os.environ, "RAY_TRAIN_V2_ENABLED": "1"}
    if poll_s is not None:
        env["RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"] = str(poll_s)
    command = [sys.executable, __file__, "--raytrain", cluster.address, node.node_id]
    command += [str(drain_after), out]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0 or not os.path.exists(out):
        raise RuntimeError(f"Ray Train's trial failed:\n{done.stderr[-3000:]}")
    cluster.remove_node(node, False)
    figures: dict[str, float] = json.loads(Path(out).read_text())
    return figures


# The table ------------------------------------------------------------------------------------


#: The systems: each one's column key, its header and its check interval or poll (s; None: the
#: default). The ratio is asyncexec's default over Ray Train's.
SYSTEMS = (
    ("ae", "asyncexec, check every 1 s (default)", 1.0),
    ("ae_fast", "asyncexec, check every 0.1 s", 0.1),
    ("rt", "Ray Train V2, poll every 5 s (default)", None),
    ("rt_fast", "Ray Train V2, poll every 1 s", 1.0),
)
TABLE = Table([(k, h) for k, h, _ in SYSTEMS], [("rt", "asyncexec / Ray Train (defaults)")])


@dataclass(frozen=True)
class Sizes:
    trials: int  # drains a system


FULL, QUICK = Sizes(3), Sizes(1)


async def run(sizes: Sizes, args: argparse.Namespace) -> Result:
    cluster = args.cluster  # each trial adds a node and drains it
    rows = {
        "seen": Row("notice seen by the function", "ms", measured="ae", reference="rt"),
        "saved": Row("report() with checkpoint returned", "ms", measured="ae", reference="rt"),
        "moved": Row(
            "the next attempt's first step, on another node", "ms", measured="ae", reference="rt"
        ),
    }
    rng = random.Random(26)
    for trial in range(sizes.trials):  # the systems interleaved: the noise falls on all
        after = rng.uniform(0.5, 5.5)
        for key, name, poll in SYSTEMS:
            if key.startswith("ae"):
                assert poll is not None
                figures = await ae_trial(cluster, poll, tempfile.mkdtemp(), after)
            else:
                figures = rt_trial(cluster, poll, after)  # a driver process of its own
            for figure, seconds in figures.items():
                rows[figure].add(key, seconds * 1e3)
            _harness.progress(f"trial {trial + 1}/{sizes.trials} {name}: {figures}")
    return Result(list(rows.values()), TABLE)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--raytrain"]:  # one Ray Train trial, in a driver process of its own
        rt_main(*argv[1:5])
        return 0
    return _harness.main(
        argv,
        doc=__doc__,
        title="Drain notice to checkpoint taken, ms",
        full=FULL,
        quick=QUICK,
        run=run,
        ray={"cluster": {"num_cpus": 2, "include_dashboard": False}},
        options=lambda parser: parser.add_argument("--trials", type=int, help="drains (3)"),
        about=lambda sizes, args: f"medians of {sizes.trials}, from rank 0's drain call",
    )


if __name__ == "__main__":
    sys.exit(main())
