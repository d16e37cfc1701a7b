"""``asyncexec.testing`` doing its job: a user's loops tested without Ray. An executor's run read
step by step, a rank crashed mid-run and the run restarted, a pipeline with a router over
stand-in rollout servers (weights pushed as states, every prompt consumed once), and a run's
metrics read in a registry of the test's own, all on simulated workers in the fast tier; the
stand-in server alone, and behind a router on Ray and in local mode; and the module's public
names."""

from __future__ import annotations

import asyncio
import pickle
import re
import threading
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import anyio
import pytest
import ray
import tenacity

import asyncexec
import asyncexec.testing
from asyncexec.testing import (
    Script,
    ScriptedServer,
    SimCluster,
    SimLoad,
    metrics_enabled,
    simulated,
)

# The user's code under test -------------------------------------------------------------------


def train() -> None:
    """The user's training function (on simulated workers, the cluster's load reports instead)."""


async def mean_per_step(executor: asyncexec.Executor) -> list[float]:
    """A user's loop over a run's steps: the mean of the ranks' ``i`` per step."""
    means = []
    async for step in executor.run(train):
        means.append(sum(r.metrics["i"] for r in step.reports) / len(step.reports))
    return means


async def rl_loop(pipe: asyncexec.Pipeline) -> tuple[list[Hashable], list[int]]:
    """A user's RL loop: train on each batch, push the new weights; the ids trained on and the
    staleness of every sample."""
    ids: list[Hashable] = []
    staleness: list[int] = []
    async for batch in pipe:
        ids += [s.id for s in batch.samples]
        staleness += list(batch.staleness)
        await pipe.update_weights({"step": batch.version + 1})
    return ids, staleness


# Tests ------------------------------------------------------------------------------------------


@pytest.mark.timeout(30)
async def test_a_users_loop_over_a_run_is_tested_on_simulated_workers() -> None:
    cluster = SimCluster(SimLoad(reports=6, rate=500.0), ranks_per_node=4)
    async with asyncexec.Executor(8, cluster=cluster) as executor:
        means = await mean_per_step(executor)
        assert executor.result is not None
        assert executor.result.return_values == list(range(8))  # each rank's rank
        assert [w.node_id for w in executor.workers[::4]] == ["sim-node-0", "sim-node-1"]
    assert means == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    assert cluster.statistics().reports == 6 * 8
    assert not ray.is_initialized()


@pytest.mark.timeout(30)
async def test_a_crashed_rank_restarts_the_run_under_the_policy() -> None:
    """``SimCluster.crash`` kills a rank as a SIGKILL kills an actor: the run restarts (attempt
    2) and ends; the crash is among the result's failures."""
    policy = asyncexec.RestartPolicy(max_restarts=1, wait=lambda _: 0.0)
    with simulated(SimCluster(SimLoad(reports=10, rate=500.0))) as cluster:
        async with asyncexec.Executor(4, restart=policy) as executor:
            crashed = executor.workers[2].pid
            async for step in executor.run(train):
                if step.index == 3:
                    cluster.crash(crashed)
            result = executor.result
            assert result is not None and result.attempts == 2
            assert [type(f) for f in result.failures] == [asyncexec.WorkerCrashedError]
            assert result.failures[0].rank == 2  # type: ignore[attr-defined]
            assert crashed not in [w.pid for w in executor.workers]  # a fresh worker
            with pytest.raises(LookupError, match=str(crashed)):
                cluster.crash(crashed)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "policy",
    [
        asyncexec.RestartPolicy(max_restarts=0),
        asyncexec.RestartPolicy(max_restarts=2, retry_if=lambda exc: False),
        asyncexec.RestartPolicy(stop=tenacity.stop_after_attempt(1)),
    ],
    ids=["no-restart-left", "not-restarted-after", "stopped-by-its-stop"],
)
async def test_a_failure_that_ends_the_run_swaps_in_no_spare_and_counts_no_restart(
    policy: asyncexec.RestartPolicy,
) -> None:
    """Defect: a crash with no restart left (``max_restarts=0``, or a ``stop=`` strategy that
    stops there), or one the policy does not restart after, still swapped the standby spare into
    the rank's place (stopping the survivors and setting the spare up, for nothing) and counted
    a restart."""
    cluster = SimCluster(SimLoad(reports=200, rate=200.0), gpus=False)
    async with asyncexec.Executor(2, cluster=cluster, spares=1, restart=policy) as executor:
        made = cluster.statistics().workers  # the 2 ranks and the spare
        with pytest.raises(asyncexec.AsyncExecError):
            async for step in executor.run(train):
                if step.index == 5:
                    cluster.crash(executor.workers[1].pid)
        assert executor.statistics().restarts == 0
        assert cluster.statistics().workers == made  # no spare owed, none made


@pytest.mark.timeout(30)
async def test_a_spare_that_took_a_rank_is_started_again_on_simulated_workers() -> None:
    """Defect: on a ``SimCluster`` a standby spare that took a crashed rank's place was never
    started again (it has no placement group, and the new spare was only started in a bundle of
    one): a second crash replaced the whole group, where on Ray the new spare takes it."""
    cluster = SimCluster(SimLoad(reports=2000, rate=2000.0), gpus=False)
    policy = asyncexec.RestartPolicy(max_restarts=2, wait=lambda _: 0.0)
    async with asyncexec.Executor(2, cluster=cluster, spares=1, restart=policy) as executor:
        crashed = 0
        async for step in executor.run(train):
            # The second crash once the new spare is there (a fourth worker made).
            if (crashed, step.index) == (0, 10) or (crashed == 1 and made(cluster) == 4):
                cluster.crash(executor.workers[1].pid)
                crashed += 1
        assert crashed == 2, "no new spare was started after the first crash"
        stats = executor.statistics()
        assert (stats.group_starts, stats.restarts) == (1, 2)  # both taken by a spare


def made(cluster: SimCluster) -> int:
    """How many simulated workers ``cluster`` made so far."""
    return cluster.statistics().workers


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (lambda: SimLoad(reports=-1), "reports"),
        (lambda: SimLoad(rate=float("nan")), "rate"),
        (lambda: SimLoad(rate=0), "rate"),
        (lambda: SimLoad(slow={1: float("nan")}), "slow"),
        (lambda: SimLoad(slow_from=-1), "slow_from"),
        (lambda: SimCluster(ranks_per_node=0), "ranks_per_node"),
    ],
    ids=["negative-reports", "nan-rate", "zero-rate", "nan-factor", "negative-from", "no-ranks"],
)
def test_a_load_or_cluster_that_cannot_run_is_refused_when_made(
    make: Callable[[], object], named: str
) -> None:
    """Defect: ``SimLoad(reports=-1)`` or a NaN rate made ranks that never finished (the run
    hung), a zero rate failed the run with a ZeroDivisionError, and ``ranks_per_node=0`` the
    executor's start with one."""
    with pytest.raises(asyncexec.ConfigurationError, match=f"{named}="):
        make()


class Forgetful(asyncexec.RolloutServer):
    """A server whose ``__init__`` forgets ``super().__init__()``."""

    def __init__(self) -> None:
        self.ready = True

    async def chunks(self, prompt: Any) -> Any:
        yield prompt

    def load_weights(self, state: Any, version: int) -> None:
        pass


@pytest.mark.timeout(30)
async def test_a_server_that_skips_super_init_fails_the_groups_start_as_on_ray() -> None:
    """Defect: simulated workers did not check a ``RolloutServer``'s made instance, as Ray's and
    local mode's workers do: the group started, and only its first ``generate`` failed."""
    with pytest.raises(asyncexec.StartupError, match=r"super\(\)\.__init__\(\)"):
        async with asyncexec.Executor(2, roles=Forgetful, cluster=SimCluster()):
            pass


@pytest.mark.timeout(30)
async def test_a_role_class_made_on_simulated_workers_keeps_its_own_methods() -> None:
    """Defect: making a role's instances on simulated workers unpickled its class, which
    cloudpickle sends by value when it is defined in a function or in ``__main__``; cloudpickle
    gave the driver's own class back with its attributes set again from the pickle, so its
    methods were copies after, and a call with a method taken before (``fn = Counter.rank``, or
    ``Counter.rank`` in a call that waited for a crashed rank's replacement) was refused with a
    ConfigurationError as no role's method. On Ray the class is unpickled in the workers."""

    class Counter:
        def rank(self) -> int:
            return asyncexec.get_context().world_rank

    rank = Counter.rank
    async with asyncexec.Executor(2, roles=Counter, cluster=SimCluster()) as executor:
        assert Counter.rank is rank
        assert await executor.call(rank) == [0, 1]


@pytest.mark.timeout(30)
async def test_simulated_ranks_send_back_what_ray_sends_back() -> None:
    """Defect: a simulated worker pickled its answers with plain pickle, which cannot pickle a
    class or function defined in a function (Ray's cloudpickle can): an ``async def`` method
    that returned such a value, or raised such an exception, never answered (the call hung,
    "Task exception was never retrieved"), and a plain method that raised one failed the call
    with an AttributeError instead of the rank's WorkerRaisedError."""

    class Point:
        def __init__(self, x: int) -> None:
            self.x = x

    class Refused(Exception):
        pass

    class Shapes:
        async def point(self) -> Point:
            return Point(1)

        async def maker(self) -> Callable[[], int]:
            return lambda: 2

        async def refuse(self) -> None:
            raise Refused("async")

        def refuse_plainly(self) -> None:
            raise Refused("plain")

    async with asyncexec.Executor(1, roles=Shapes, cluster=SimCluster()) as executor:
        with anyio.fail_after(10):
            assert (await executor.call(Shapes.point, on=asyncexec.rank(0))).x == 1
            assert (await executor.call(Shapes.maker, on=asyncexec.rank(0)))() == 2
            for method in (Shapes.refuse, Shapes.refuse_plainly):
                with pytest.raises(asyncexec.WorkerRaisedError) as info:
                    await executor.call(method, on=asyncexec.rank(0))
                assert type(info.value.__cause__).__name__ == "Refused"


def take(value: object) -> int:
    """A function that ``execute()`` sends with its argument."""
    return 1


class Taker:
    def take(self, value: object) -> int:
        return 1


@pytest.mark.timeout(30)
async def test_an_argument_that_does_not_pickle_is_refused_on_simulated_workers_as_on_ray() -> None:
    """Defect: simulated workers took any argument as it was: ``call()``, ``execute()`` and
    ``execute_single()`` with an argument that Ray cannot send (a lock) ran on them, where Ray
    refuses it with a ConfigurationError that names it (the docs: local mode alone pickles
    nothing)."""
    lock = threading.Lock()
    async with asyncexec.Executor(2, roles=Taker, cluster=SimCluster()) as executor:
        calls = [
            lambda: executor.call(Taker.take, lock),
            lambda: executor.execute(take, lock),
            lambda: executor.execute_single(0, take, value=lock),
        ]
        for call in calls:
            with pytest.raises(asyncexec.ConfigurationError, match="argument 'value'"):
                await call()
        assert await executor.call(Taker.take, [lock.locked()]) == [1, 1]


@pytest.mark.timeout(30)
async def test_a_pipeline_with_a_router_over_scripted_servers() -> None:
    """The user's RL loop over 3 stand-in servers behind a router: every prompt trained on once,
    no sample staler than S, each server holding the last state pushed; the calls spread over
    the servers under the router's cap."""
    prompts = [Script(chunks=1 + i % 4) for i in range(24)]
    with simulated():
        async with (
            asyncexec.Executor(3, roles=asyncexec.Role(ScriptedServer)) as servers,
            asyncexec.Router(servers, max_in_flight=2) as router,
            asyncexec.Pipeline(router, prompts, batch_size=4, staleness=1) as pipe,
        ):
            with anyio.fail_after(20):
                ids, staleness = await rl_loop(pipe)
            assert await servers.call(ScriptedServer.weights) == [{"step": 6}] * 3
            served = await servers.call(ScriptedServer.served)
            stats = router.statistics()
    assert len(ids) == 24 and set(ids) == set(range(24))  # each prompt once
    assert max(staleness) <= 1
    assert sum(served) == 24 and min(served) > 0
    assert max(stats.in_flight_max) <= 2


@pytest.mark.timeout(30)
async def test_scripted_prompts_say_how_a_generation_goes() -> None:
    """A ``Script`` sets the chunks and the failure; other prompts get the server's defaults;
    the failure reaches the caller as the rank's ``WorkerRaisedError``."""
    with simulated():
        async with (
            asyncexec.Executor(2, roles=asyncexec.Role(ScriptedServer, 2)) as servers,
            asyncexec.Router(servers, max_in_flight=1) as router,
        ):
            plain = await router.generate(asyncexec.RolloutRequest("plain", "any prompt"))
            assert plain.output == [0, 1] and plain.versions == (None, None)
            long = await router.generate(asyncexec.RolloutRequest("long", Script(chunks=5)))
            assert long.output == [0, 1, 2, 3, 4]
            with pytest.raises(asyncexec.WorkerRaisedError) as info:
                await router.generate(asyncexec.RolloutRequest("bad", Script(3, fail_at=1)))
            assert isinstance(info.value.__cause__, RuntimeError)
            assert "before chunk 1" in str(info.value.__cause__)


@pytest.mark.timeout(10)
async def test_a_scripted_server_made_in_the_test_tags_chunks_with_weights() -> None:
    """Outside any worker (rank 0), installed weights are kept and tag the chunks after them."""
    server = ScriptedServer(chunks=2, slow={0: 2.0})
    first = await server.generate(asyncexec.RolloutRequest(0, "p"))
    await server.install_weights({"w": 1}, 1)
    second = await server.generate(asyncexec.RolloutRequest(1, Script(chunks=3)))
    assert first.versions == (None, None) and second.versions == (1, 1, 1)
    assert server.weights() == {"w": 1} and server.served() == 2
    assert server.factor == 2.0


@pytest.mark.timeout(30)
async def test_metrics_enabled_counts_a_tests_run_and_turns_off_after() -> None:
    pytest.importorskip("prometheus_client")
    with metrics_enabled() as registry, simulated(SimCluster(SimLoad(reports=2, rate=500.0))):
        async with asyncexec.Executor(2, name="trainer") as executor:
            async for _ in executor.run(train):
                pass
        labels = {"executor": "trainer", "outcome": "finished"}
        assert registry.get_sample_value("asyncexec_runs_total", labels) == 1
        with pytest.raises(asyncexec.ExecutorStateError, match="on already"), metrics_enabled():
            pass
    with metrics_enabled() as again:  # off after the block: a second one starts afresh
        assert again is not registry
        assert again.get_sample_value("asyncexec_runs_total", labels) is None


@pytest.mark.timeout(60)
async def test_the_scripted_server_serves_behind_a_router(mode: str) -> None:
    """The same stand-in on Ray actors and on local mode's threads: samples by script, states
    installed on every server."""
    role = asyncexec.Role(ScriptedServer, 2, 0.001, slow={1: 3.0})
    async with (
        asyncexec.Executor(2, resources_per_worker={"CPU": 0.25}, roles=role) as servers,
        asyncexec.Router(servers, max_in_flight=2) as router,
    ):
        with anyio.fail_after(40):
            samples = [
                await router.generate(asyncexec.RolloutRequest(i, Script(chunks=3)))
                for i in range(4)
            ]
            await servers.call(ScriptedServer.install_weights, {"w": 1}, 1)
            after = await router.generate(asyncexec.RolloutRequest("after", "plain"))
            assert await servers.call(ScriptedServer.weights) == [{"w": 1}, {"w": 1}]
    assert [s.output for s in samples] == [[0, 1, 2]] * 4
    assert after.output == [0, 1] and after.versions == (1, 1)


#: docs/testing.md, whose examples are tests.
PAGE = Path(__file__).resolve().parents[2] / "docs" / "testing.md"


@pytest.mark.timeout(30)
async def test_the_examples_of_the_docs_page_pass() -> None:
    """docs/testing.md's code blocks, run in order as one module (as the page reads), and each
    ``async def test_*`` they define awaited."""
    pytest.importorskip("prometheus_client")
    namespace: dict[str, Any] = {}
    ran = []
    for block in re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S):
        exec(compile(block, str(PAGE), "exec"), namespace)
        tests = [name for name in namespace if name.startswith("test_") and name not in ran]
        for name in tests:
            await namespace[name]()
            ran.append(name)
    assert len(ran) == 3, ran


def test_the_public_names_are_asyncexec_testings_and_pickle_by_it() -> None:
    names = asyncexec.testing.__all__
    assert names == sorted(names) and set(dir(asyncexec.testing)) == set(names)
    for name in names:
        assert getattr(asyncexec.testing, name).__module__ == "asyncexec.testing", name
    load = SimLoad(reports=3, slow={1: 2.0})
    assert pickle.loads(pickle.dumps(load)) == load
    assert b"asyncexec.testing" in pickle.dumps(Script(2))


class Awaiter:
    """A role with an ``async def`` method that ends in a ``CancelledError`` of its own."""

    async def awaits_a_cancelled_future(self) -> None:
        future = asyncio.get_running_loop().create_future()
        future.cancel()
        await future  # a CancelledError of the method's own: the driver cancelled nothing

    async def answers(self) -> int:
        return 1


@pytest.mark.timeout(30)
async def test_a_method_that_ends_in_its_own_cancelled_error_raises_on_simulated_workers() -> None:
    """Defect: an ``async def`` method that ended in a ``CancelledError`` the driver did not ask
    for (it awaited a future or task that was cancelled) never answered on a simulated worker:
    the call hung for ever, where Ray's and local mode's workers fail it with the rank's
    WorkerRaisedError (the CancelledError its cause), as any other error of the method."""
    async with asyncexec.Executor(1, roles=Awaiter, cluster=SimCluster()) as executor:
        with anyio.fail_after(5), pytest.raises(asyncexec.WorkerRaisedError) as info:
            await executor.call(Awaiter.awaits_a_cancelled_future, on=asyncexec.rank(0))
        assert type(info.value.__cause__).__name__ == "CancelledError"
        assert await executor.call(Awaiter.answers) == [1]  # the rank serves on


@pytest.mark.timeout(30)
async def test_simulated_as_a_decorator_puts_an_async_tests_executors_on_simulated_workers() -> (
    None
):
    """Defect: ``@simulated()`` on an ``async def`` function (a test) set the default cluster
    only while the coroutine was made, not while it ran: its executors went to Ray without a
    word (a simulated test that started Ray, or failed where Ray was not there)."""

    @simulated()
    async def users_test() -> tuple[object, list[int]]:
        async with asyncexec.Executor(2, roles=Taker) as executor:
            return executor.cluster, await executor.call(Taker.take, None)

    cluster, taken = await users_test()
    assert isinstance(cluster, SimCluster) and taken == [1, 1]
    assert not isinstance(asyncexec.Executor(1).cluster, SimCluster)  # not past the block

    given = SimCluster()
    calls = simulated(given)(lambda: asyncexec.Executor(1).cluster)
    assert calls() is given and calls() is given  # each call a block of its own
    assert not ray.is_initialized()
