"""Preemption as an event, not a crash: a node drained with Ray's real ``DrainNode`` (reason
preemption, with a deadline) is noticed by the run and its workers, the function checkpoints on
notice, and after the node is gone the run goes on from that checkpoint under a budget of its
own; a drain that is rejected, or replaced by one without a deadline, changes nothing; local mode
has none of it. The pure parts (marks, notices, the policy's budget) are tested without Ray."""

from __future__ import annotations

import os
import pickle
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import ray
import tenacity
from ray.core.generated import autoscaler_pb2
from structlog.testing import capture_logs

import asyncexec
from asyncexec._driver._restart import PreemptionsSpent
from asyncexec._driver.run._preemption import mark, notice_of
from asyncexec.testing import metrics_enabled

PREEMPTION = "DRAIN_NODE_REASON_PREEMPTION"
IDLE = "DRAIN_NODE_REASON_IDLE_TERMINATION"
#: Looks at the drain state this often in the tests (1 s by default).
CHECK_S = 0.05
TWO_NODES = [{"num_cpus": 2}, {"num_cpus": 2}]


# Without Ray ----------------------------------------------------------------------------------


def test_marks_follow_the_groups_drained_nodes_and_keep_a_deadline_that_a_later_drain_drops() -> (
    None
):
    marked: dict[str, float | None] = {}
    mark(marked, {"other": 5.0}, {"a", "b"})
    assert marked == {}  # a node without a worker of the group is none of its business
    mark(marked, {"a": 10.0}, {"a", "b"})
    assert marked == {"a": 10.0}
    mark(marked, {"a": None}, {"a", "b"})  # an idle termination's drain replaced it
    assert marked == {"a": 10.0}
    mark(marked, {"a": 12.0, "b": None}, {"a", "b"})  # a new deadline, a drain without one
    assert marked == {"a": 12.0, "b": None}
    mark(marked, {}, {"a", "b"})  # dead nodes leave the list: the failure is on its way
    assert marked == {"a": 12.0, "b": None}
    mark(marked, {}, {"b"})  # the group has no worker on "a" any more
    assert marked == {"b": None}


def test_one_notice_covers_every_marked_node_with_the_earliest_deadline() -> None:
    notice = notice_of({"n2": 20.0, "n1": None, "n3": 15.0}, [5, 1, 3], 7.0)
    assert notice == asyncexec.PreemptionNotice(15.0, ("n1", "n2", "n3"), (1, 3, 5), 7.0)
    assert notice_of({"n1": None}, [0], 7.0).deadline is None
    assert pickle.loads(pickle.dumps(notice)) == notice
    assert notice.seconds_left() == 0.0  # 15 s after the epoch is long past
    assert notice_of({"n1": None}, [0], 7.0).seconds_left() is None
    ahead = asyncexec.PreemptionNotice(time.time() + 60, ("n",), (0,), time.time())
    left = ahead.seconds_left()
    assert left is not None and 50 < left <= 60


@pytest.mark.parametrize(
    "options",
    [
        {"max_preemptions": -1},
        {"max_preemptions": 1.5},
        {"max_preemptions": True},
        {"preemption_check_interval_s": 0},
        {"preemption_check_interval_s": -1.0},
        {"preemption_check_interval_s": float("nan")},
        {"preemption_check_interval_s": float("inf")},
        {"preemption_check_interval_s": "1"},
    ],
)
def test_restart_policy_refuses_a_bad_preemption_budget_or_interval(options: Any) -> None:
    with pytest.raises(asyncexec.ConfigurationError):
        asyncexec.RestartPolicy(**options)


async def test_a_spent_preemption_budget_is_never_restarted_whatever_retry_if_says() -> None:
    policy = asyncexec.RestartPolicy(retry_if=lambda exc: True, max_preemptions=0)
    assert policy.max_preemptions == 0
    assert asyncexec.RestartPolicy().max_preemptions is None  # no bound by default
    failure = asyncexec.NodeLostError(1, node_id="n" * 20, attempt=1, detail="gone")
    tries = 0
    with pytest.raises(PreemptionsSpent) as info:
        async for attempt in policy.retrying(before_sleep=lambda state: None):
            with attempt:
                tries += 1
                raise PreemptionsSpent(failure, 1, 0)
    assert tries == 1
    assert "max_preemptions=0" in info.value.note


def test_get_preemption_info_outside_a_worker_refuses() -> None:
    with pytest.raises(asyncexec.ExecutorStateError, match="inside an asyncexec worker"):
        asyncexec.get_preemption_info()


class _Free:
    """The part of a cluster that a move before the deadline asks: what is free off the
    draining nodes (``free``, with the group's own bundles counted as free), and what is alive."""

    def __init__(self, free: list[dict[str, float]]) -> None:
        self.free = free
        self.measured = anyio.Event()

    async def free_nodes(self, bundle: Any, placement: Any, held: Any) -> list[dict[str, float]]:
        self.measured.set()
        return self.free

    async def live_nodes(self) -> set[str]:
        return {"a", "b"}


async def _moves(free: list[dict[str, float]], **options: Any) -> bool:
    """Whether a group of ``options`` on nodes "a" (drained) and "b" moves once a checkpoint
    becomes the latest under the notice, when ``free`` is what is free off "a"."""
    from types import SimpleNamespace

    import structlog

    from asyncexec._driver._config import ExecutorConfig
    from asyncexec._driver._observe import Observer
    from asyncexec._driver.run._preemption import PreemptionWatch

    config = ExecutorConfig.build(2, resources_per_worker={"CPU": 1}, **options)
    cluster = _Free(free)

    async def told(method: str, notice: Any) -> None:
        return None

    workers = [
        SimpleNamespace(
            rank=rank,
            metadata=SimpleNamespace(node_id=node),
            handle=SimpleNamespace(key=f"w{rank}", call=told),
        )
        for rank, node in enumerate(["a", "b"])
    ]
    group = SimpleNamespace(
        workers=workers, config=config, pool=None, placement=SimpleNamespace(owned=True)
    )
    watch = PreemptionWatch(
        cluster,  # type: ignore[arg-type]
        asyncexec.RestartPolicy(),
        Observer(),
        structlog.get_logger(),
    )
    await watch._update(group, {}, {"a": time.time() + 60})  # type: ignore[arg-type]
    assert watch.current is not None
    moved = anyio.Event()
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch.move_when_saved, group, moved.set)
            await anyio.wait_all_tasks_blocked()
            watch.saved()  # a checkpoint became the latest under the notice
            await cluster.measured.wait()
            await anyio.wait_all_tasks_blocked()
            tg.cancel_scope.cancel()
    return moved.is_set()


@pytest.mark.timeout(10)
async def test_a_group_with_spares_moves_only_where_its_spares_fit_too() -> None:
    """Defect: the room for a move before the deadline was counted for the workers alone, but
    the new group's placement holds its standby spares too: a group of 2 workers and a spare
    left its nodes for a placement that the nodes left could not hold (2 bundles free, 3
    asked), giving up the time left before the deadline to wait at the placement."""
    two, three = [{"CPU": 2.0}], [{"CPU": 3.0}]
    assert await _moves(two)  # no spare: 2 workers fit
    assert not await _moves(two, spares=1)
    assert await _moves(three, spares=1)


# The function and the drains ----------------------------------------------------------------


def _save(step: int) -> asyncexec.Checkpoint:
    directory = tempfile.mkdtemp()
    (Path(directory) / "step").write_text(str(step))
    return asyncexec.Checkpoint.from_directory(directory)


def until_noticed(config: dict[str, Any]) -> asyncexec.PreemptionNotice | None:
    """Report a step every ``sleep`` seconds; rank 0 checkpoints after step ``early`` and again
    at the first step that sees a preemption notice (unless ``save_on_notice`` is false). A
    restart goes on from its checkpoint for ``after`` steps. Returns the first notice the rank
    saw."""
    ctx = asyncexec.get_context()
    start = 0
    checkpoint = asyncexec.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            start = int((Path(directory) / "step").read_text())
    end = config["steps"] if start == 0 else start + config["after"]
    noticed: asyncexec.PreemptionNotice | None = None
    for i in range(start, end):
        time.sleep(config["sleep"])
        info = asyncexec.get_preemption_info()
        first = info is not None and noticed is None and config.get("save_on_notice", True)
        noticed = noticed or info
        saved = None
        if ctx.world_rank == 0 and (first or i == config["early"]):
            saved = _save(i + 1)
        asyncexec.report({"i": i, "start": start, "noticed": info is not None}, checkpoint=saved)
    return noticed


def _drain(node_id: str, reason: str, deadline: float) -> tuple[bool, str]:
    """Ray's own drain call, through the driver's GCS client (as an autoscaler makes it);
    ``deadline`` in seconds since the epoch, 0 for none."""
    gcs = ray._private.worker.global_worker.gcs_client
    code = autoscaler_pb2.DrainNodeReason.Value(reason)
    accepted, why = gcs.drain_node(node_id, code, "test", int(deadline * 1000), timeout=10)
    return bool(accepted), str(why)


async def drain(node_id: str, reason: str, deadline: float) -> tuple[bool, str]:
    return await anyio.to_thread.run_sync(_drain, node_id, reason, deadline)


async def draining() -> dict[str, int]:
    gcs = ray._private.worker.global_worker.gcs_client
    found: dict[str, int] = await anyio.to_thread.run_sync(gcs.get_draining_nodes, 10)
    return found


async def remove_after(cluster: Any, node: Any, deadline: float) -> None:
    """What the cloud does: take the node once its deadline has passed (Ray itself does nothing
    at the deadline). Off the loop: the removal waits for the node's processes."""
    await anyio.sleep(max(0.0, deadline - time.time()))
    await anyio.to_thread.run_sync(lambda: cluster.remove_node(node, allow_graceful=False))


def _spread(policy: asyncexec.RestartPolicy, storage: Path) -> asyncexec.Executor:
    """Two workers, one on each node (the driver's, rank 0, first)."""
    return asyncexec.Executor(
        2,
        resources_per_worker={"CPU": 0.5},
        placement_strategy="SPREAD",
        restart=policy,
        storage_path=storage,
        name="spot",
    )


@pytest.fixture
def registry() -> Iterator[Any]:
    """Metrics on, in a registry of their own; off again afterwards, for the other tests."""
    pytest.importorskip("prometheus_client")
    with metrics_enabled() as own:
        yield own


# On two nodes -------------------------------------------------------------------------------


@pytest.mark.multinode
@pytest.mark.timeout(120)
async def test_group_moves_before_the_deadline_from_the_checkpoint_taken_on_notice(
    make_cluster: Callable[[list[dict[str, Any]]], Any], tmp_path: Path, registry: Any
) -> None:
    """A node drained with a deadline 60 s ahead: the run and both workers see the notice, rank
    0 checkpoints on it, and the group moves to the other node at once (it has room), while the
    drained node is still alive: the next attempt goes on from that checkpoint (not the earlier
    one), charged to the preemption budget with no failure; no restart is counted, and the
    policy allows none."""
    cluster = make_cluster(TWO_NODES)
    (node,) = cluster.worker_nodes
    policy = asyncexec.RestartPolicy(max_restarts=0, preemption_check_interval_s=CHECK_S)
    config = {"steps": 400, "after": 5, "sleep": 0.05, "early": 2}
    async with _spread(policy, tmp_path) as ex:
        (doomed,) = [w.world_rank for w in ex.workers if w.node_id == node.node_id]
        head = ex.workers[1 - doomed].node_id
        run = ex.run(until_noticed, config)
        steps: list[asyncexec.Step] = []
        deadline = drained = moved_at = 0.0
        with capture_logs() as logs:
            async for step in run:
                steps.append(step)
                if step.attempt == 1 and step.index == config["early"] + 1:
                    drained, deadline = time.time(), time.time() + 60.0
                    assert await drain(node.node_id, PREEMPTION, deadline) == (True, "")
                if step.attempt == 2 and not moved_at:
                    moved_at = time.time()
        result, stats = run.result, ex.statistics()
        assert {w.node_id for w in ex.workers} == {head}
    (notice,) = result.preemption_notices
    assert notice.node_ids == (node.node_id,) and notice.ranks == (doomed,)
    assert notice.deadline == pytest.approx(deadline, abs=0.002)
    assert drained <= notice.noticed < moved_at < deadline  # on the other node in time
    first = [s for s in steps if s.attempt == 1]
    second = [s for s in steps if s.attempt == 2]
    assert all(s.preemption == notice for s in first if s.preemption is not None)
    assert second and all(s.preemption is None for s in second)
    # Rank 0 checkpointed on the notice, and the next attempt went on from that checkpoint.
    (on_notice,) = [s for s in first if s.checkpoint and s.metrics["noticed"]]
    start = second[0].metrics["start"]
    assert start == on_notice.metrics["i"] + 1 > config["early"] + 1
    assert [s.metrics["i"] for s in second] == list(range(start, start + config["after"]))
    assert result.return_values == [None, None]  # the new group has no notice
    # A planned move: no failure, charged to the preemption budget, not to the restart policy.
    assert result.failures == []
    assert result.attempts == 2
    assert (stats.restarts, stats.preemptions) == (0, 1)
    (moved,) = [e for e in logs if e["event"] == "moving_before_preemption"]
    assert moved["attempt"] == 2 and moved["seconds_left"] > 30
    events = [e["event"] for e in logs]
    assert events.count("preemption_noticed") == 1
    assert "restarting_after_preemption" not in events and "restarting" not in events
    # A stage that did not happen has its series at 0 (made with the executor label value).
    for stage, count in (("noticed", 1.0), ("moved", 1.0), ("restarted", 0.0)):
        labels = {"executor": "spot", "stage": stage}
        assert registry.get_sample_value("asyncexec_preemptions_total", labels) == count


@pytest.mark.multinode
@pytest.mark.timeout(120)
async def test_drained_node_gone_before_a_checkpoint_restarts_from_the_latest_one(
    make_cluster: Callable[[list[dict[str, Any]]], Any], tmp_path: Path, registry: Any
) -> None:
    """A node drained with a deadline 2 s ahead, whose workers' function does not checkpoint on
    notice: nothing moves, the node goes after its deadline, and the run goes on on the other
    node from the latest checkpoint, charged to the preemption budget: no restart is counted,
    and the policy allows none."""
    cluster = make_cluster(TWO_NODES)
    (node,) = cluster.worker_nodes
    policy = asyncexec.RestartPolicy(max_restarts=0, preemption_check_interval_s=CHECK_S)
    config = {"steps": 400, "after": 5, "sleep": 0.05, "early": 2, "save_on_notice": False}
    async with _spread(policy, tmp_path) as ex:
        (doomed,) = [w.world_rank for w in ex.workers if w.node_id == node.node_id]
        head = ex.workers[1 - doomed].node_id
        run = ex.run(until_noticed, config)
        steps: list[asyncexec.Step] = []
        deadline = 0.0
        removing = False
        with capture_logs() as logs:
            async for step in run:
                steps.append(step)
                if step.attempt == 1 and step.index == config["early"] + 1:
                    deadline = time.time() + 2.0
                    assert await drain(node.node_id, PREEMPTION, deadline) == (True, "")
                if step.attempt == 1 and step.metrics["noticed"] and not removing:
                    removing = True
                    await remove_after(cluster, node, deadline)
        result, stats = run.result, ex.statistics()
        assert {w.node_id for w in ex.workers} == {head}
    (notice,) = result.preemption_notices
    first = [s for s in steps if s.attempt == 1]
    second = [s for s in steps if s.attempt == 2]
    seen = [s for s in first if s.preemption is not None]
    assert seen and all(s.preemption == notice for s in seen)
    assert all(s.preemption is None for s in first if s.index <= config["early"] + 1)
    for rank in (0, 1):  # every rank's function saw it
        assert any(s.reports[rank].metrics["noticed"] for s in first), rank
    # The latest checkpoint was the early one: the next attempt goes on from there.
    assert second[0].metrics["start"] == config["early"] + 1
    assert result.return_values == [None, None]
    (lost,) = result.failures
    assert isinstance(lost, asyncexec.NodeLostError | asyncexec.WorkerCrashedError), lost
    assert (lost.rank, lost.node_id, lost.attempt) == (doomed, node.node_id, 1)
    assert result.attempts == 2
    assert (stats.restarts, stats.preemptions) == (0, 1)
    events = [e["event"] for e in logs]
    assert events.count("restarting_after_preemption") == 1
    assert "restarting" not in events and "moving_before_preemption" not in events
    # A stage that did not happen has its series at 0 (made with the executor label value).
    for stage, count in (("noticed", 1.0), ("restarted", 1.0), ("moved", 0.0)):
        labels = {"executor": "spot", "stage": stage}
        assert registry.get_sample_value("asyncexec_preemptions_total", labels) == count
    restarts = [
        sample
        for metric in registry.collect()
        if metric.name == "asyncexec_restarts"
        for sample in metric.samples
        if sample.labels.get("executor") == "spot"
    ]
    assert restarts == []


@pytest.mark.multinode
@pytest.mark.timeout(120)
async def test_preemption_beyond_the_budget_ends_the_run_even_unseen_by_the_watch(
    make_cluster: Callable[[list[dict[str, Any]]], Any], tmp_path: Path
) -> None:
    """With the drain checks off, the lost node's cause of death in Ray's node table makes the
    loss a preemption; with ``max_preemptions=0`` it ends the run at once (the restart policy,
    which allows two restarts, is not asked), and the error says why."""
    cluster = make_cluster(TWO_NODES)
    (node,) = cluster.worker_nodes
    policy = asyncexec.RestartPolicy(
        max_restarts=2,
        max_preemptions=0,
        preemption_check_interval_s=None,
        wait=tenacity.wait_none(),
    )
    config = {"steps": 400, "after": 5, "sleep": 0.05, "early": 2}
    async with _spread(policy, tmp_path) as ex:
        (doomed,) = [w.world_rank for w in ex.workers if w.node_id == node.node_id]
        run = ex.run(until_noticed, config)
        steps: list[asyncexec.Step] = []
        with pytest.raises(asyncexec.RestartsExhaustedError) as info:
            async for step in run:
                steps.append(step)
                if step.index == config["early"] + 1:
                    deadline = time.time() + 0.5
                    assert await drain(node.node_id, PREEMPTION, deadline) == (True, "")
                    await remove_after(cluster, node, deadline)
        stats = ex.statistics()
    error = info.value
    assert "preemption 1 is beyond RestartPolicy.max_preemptions=0" in "".join(error.__notes__)
    (lost,) = error.failures
    assert isinstance(lost, asyncexec.NodeLostError | asyncexec.WorkerCrashedError), lost
    assert (lost.rank, lost.node_id) == (doomed, node.node_id)
    assert error.attempts == 1 and error.__cause__ is lost
    assert {s.attempt for s in steps} == {1}
    assert all(s.preemption is None for s in steps)  # the watch was off: no notice
    assert (stats.restarts, stats.preemptions, stats.runs_failed) == (0, 0, 1)


@pytest.mark.multinode
@pytest.mark.timeout(120)
async def test_rejected_drain_and_one_without_deadline_change_nothing(
    make_cluster: Callable[[list[dict[str, Any]]], Any], tmp_path: Path
) -> None:
    """An idle-termination drain of the node that holds a worker is rejected by Ray: no notice.
    A preemption drain is noticed once; the idle termination that then replaces it (Ray has no
    cancel: its deadline becomes 0) leaves that notice as it was, and the run ends as usual."""
    cluster = make_cluster(TWO_NODES)
    (node,) = cluster.worker_nodes
    policy = asyncexec.RestartPolicy(max_restarts=0, preemption_check_interval_s=CHECK_S)
    # No checkpoint on notice: the group stays (a move would need one).
    config = {"steps": 60, "after": 0, "sleep": 0.05, "early": -1, "save_on_notice": False}
    async with _spread(policy, tmp_path) as ex:
        run = ex.run(until_noticed, config)
        steps: list[asyncexec.Step] = []
        deadline = 0.0
        replaced = None
        async for step in run:
            steps.append(step)
            if step.index == 2:
                accepted, why = await drain(node.node_id, IDLE, 0)
                assert not accepted and "no longer idle" in why
            if step.index == 12:  # ten steps (about ten looks at the drain state) later
                deadline = time.time() + 60
                assert await drain(node.node_id, PREEMPTION, deadline) == (True, "")
            if step.preemption is not None and replaced is None:
                assert await drain(node.node_id, IDLE, 0) == (True, "")
                assert (await draining())[node.node_id] == 0
                replaced = step.index
        result, stats = run.result, ex.statistics()
    assert replaced is not None and replaced < config["steps"] - 20
    (notice,) = result.preemption_notices
    assert notice.deadline == pytest.approx(deadline, abs=0.002)
    assert all(s.preemption is None for s in steps[:13])
    assert all(s.preemption == notice for s in steps[replaced:])
    assert result.return_values == [notice, notice]  # what each rank's function saw
    assert (result.attempts, result.failures) == (1, [])
    assert (stats.restarts, stats.preemptions) == (0, 0)


def rank_until_noticed(config: dict[str, Any]) -> str:
    """Independent ranks: a rank named in a notice checkpoints once; a rank that starts from a
    checkpoint reports ``after`` steps more. Returns the node it ran on."""
    ctx = asyncexec.get_context()
    start = 0
    checkpoint = asyncexec.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as directory:
            start = int((Path(directory) / "step").read_text())
    end = config["steps"] if start == 0 else start + config["after"]
    saved = False
    for i in range(start, end):
        time.sleep(config["sleep"])
        info = asyncexec.get_preemption_info()
        mine = info is not None and ctx.world_rank in info.ranks and not saved
        asyncexec.report({"i": i, "start": start}, checkpoint=_save(i + 1) if mine else None)
        saved = saved or mine
    return ctx.node_id


@pytest.mark.multinode
@pytest.mark.timeout(120)
async def test_independent_rank_lost_to_a_preemption_is_renewed_under_the_budget(
    make_cluster: Callable[[list[dict[str, Any]]], Any], tmp_path: Path
) -> None:
    """Independent ranks: the rank on the drained node checkpoints on notice and, once its node
    is gone, is renewed on the head from that checkpoint, charged to the preemption budget; the
    other rank runs on."""
    cluster = make_cluster(TWO_NODES)
    (node,) = cluster.worker_nodes
    policy = asyncexec.RestartPolicy(max_restarts=0, preemption_check_interval_s=CHECK_S)
    config = {"steps": 80, "after": 5, "sleep": 0.05}
    async with _spread(policy, tmp_path) as ex:
        (doomed,) = [w.world_rank for w in ex.workers if w.node_id == node.node_id]
        run = ex.run(rank_until_noticed, config, independent=True)
        deadline = 0.0
        steps: list[asyncexec.Step] = []
        async for step in run:
            steps.append(step)
            if step.index == 4:
                deadline = time.time() + 1.0
                assert await drain(node.node_id, PREEMPTION, deadline) == (True, "")
            if step.rank == doomed and step.attempt == 1 and step.checkpoint:
                await remove_after(cluster, node, deadline)
        result, stats = run.result, ex.statistics()
    renewed = [s for s in steps if s.rank == doomed and s.attempt == 2]
    (on_notice,) = [s for s in steps if s.rank == doomed and s.checkpoint]
    assert renewed and renewed[0].metrics["start"] == on_notice.metrics["i"] + 1
    assert result.return_values[doomed] == cluster.head_node.node_id
    assert (stats.restarts, stats.preemptions) == (0, 1)


# Anywhere -----------------------------------------------------------------------------------


async def test_without_a_drain_there_is_no_notice(mode: str, tmp_path: Path) -> None:
    """On Ray (no node drained) and in local mode (nothing to drain) a run sees no notice."""
    policy = asyncexec.RestartPolicy(preemption_check_interval_s=CHECK_S)
    config = {"steps": 10, "after": 0, "sleep": 0.02, "early": 3}
    async with asyncexec.Executor(
        2, resources_per_worker={"CPU": 0.5}, restart=policy, storage_path=tmp_path
    ) as ex:
        run = ex.run(until_noticed, config)
        steps = [s async for s in run]
        assert [s.preemption for s in steps] == [None] * 10
        assert run.result.return_values == [None, None]
        assert run.result.preemption_notices == []
        assert ex.statistics().preemptions == 0
        assert await ex.execute(asyncexec.get_preemption_info) == [None, None]
    assert os.environ.get("ASYNCEXEC_LOCAL") == ("1" if mode == "local" else None)
