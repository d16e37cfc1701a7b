"""The threaded worker: a group whose worker classes have only plain methods runs on sync Ray
actors whose event loop is a thread of their own (Ray's rule for a sync actor, made per group);
any other group on async actors. On real Ray: which actor a group gets, its plain calls one at a
time, a run of a role's method, a killed worker noticed and replaced with its roles restored,
``execute()`` of an async function (and its cancellation), nothing left after close."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import tempfile
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
import tenacity

import asyncexec
from asyncexec._dispatch._role import plain_only

CPU = {"CPU": 0.25}


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class Plain:
    """Plain methods only: its group's workers are threaded."""

    def __init__(self) -> None:
        self.rank = asyncexec.get_context().world_rank
        self.in_flight = 0
        self.most_in_flight = 0
        self.restored: str | None = None

    def loop_running(self) -> bool:
        """Whether the method's thread runs an event loop (an async actor's group does)."""
        return _loop_running()

    def held(self, seconds: float) -> int:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        time.sleep(seconds)
        self.in_flight -= 1
        return self.rank

    def most(self) -> int:
        return self.most_in_flight

    def pid(self) -> int:
        return os.getpid()

    def restore(self, checkpoint: asyncexec.Checkpoint) -> None:
        self.restored = Path(checkpoint.path).name

    def restored_from(self) -> str | None:
        return self.restored

    def train(self, config: dict[str, Any]) -> int:
        """A run's function: counts from the checkpoint; rank 1 dies once when asked."""
        ctx = asyncexec.get_context()
        start = 0
        if (checkpoint := asyncexec.get_checkpoint()) is not None:
            start = json.loads((Path(checkpoint.path) / "n.json").read_text())["n"] + 1
        for n in range(start, config["steps"]):
            if n == config.get("die_at") and ctx.attempt == 1 and ctx.world_rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            saved = None
            if ctx.world_rank == 0 and n % 2 == 0:
                tmp = tempfile.mkdtemp()
                (Path(tmp) / "n.json").write_text(json.dumps({"n": n}))
                saved = asyncexec.Checkpoint.from_directory(tmp)
            asyncexec.report({"n": n}, checkpoint=saved)
        return n


class Mixed(Plain):
    """One ``async def`` method: its group's workers are async actors."""

    async def later(self) -> int:
        return self.rank


#: Set in a worker process when its ``sleeps_until_cancelled`` was cancelled (the workers
#: import this module by name: one event per process).
CANCELLED = threading.Event()


async def sleeps_until_cancelled() -> None:
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        CANCELLED.set()
        raise


#: Set in a worker process once a cancelled ``cleans_up_slowly`` has ended its clean-up.
CLEANED = threading.Event()


async def cleans_up_slowly() -> None:
    try:
        await asyncio.sleep(60)
    finally:
        await asyncio.sleep(1)  # a clean-up that awaits
        CLEANED.set()


def cleaned() -> bool:
    return CLEANED.is_set()


def was_cancelled() -> bool:
    return CANCELLED.wait(10)


async def sleeps(seconds: float) -> None:
    await asyncio.sleep(seconds)


async def async_pid() -> int:
    await asyncio.sleep(0)
    return os.getpid()


class _Base:
    async def gen(self) -> AsyncIterator[int]:
        yield 1


class _Overridden(_Base):
    def gen(self) -> Any:  # type: ignore[override]
        return iter([1])


class _Static:
    @staticmethod
    async def s() -> None: ...


class _Generator(_Base):
    pass


def test_the_rule_is_rays_each_name_as_the_class_resolves_it() -> None:
    """A group has a threaded worker when it has roles and none has a coroutine method (an
    ``async def``, an async generator, a static one), a plain override of a base's counting
    as plain."""
    assert plain_only([asyncexec.Role(Plain)])
    assert plain_only([asyncexec.Role(_Overridden)])
    assert not plain_only([])
    assert not plain_only([asyncexec.Role(Plain), asyncexec.Role(Mixed)])
    assert not plain_only([asyncexec.Role(_Static)])
    assert not plain_only([asyncexec.Role(_Generator)])


@pytest.mark.usefixtures("ray_local")
@pytest.mark.timeout(90)
async def test_a_plain_only_group_is_threaded_and_runs_its_plain_calls_one_at_a_time() -> None:
    """Its plain methods see no event loop in their thread (an async actor's concurrency group
    runs one); a group with an ``async def`` method still gets async actors. On both, a
    role's plain calls run one at a time per instance."""
    async with (
        asyncexec.Executor(2, resources_per_worker=CPU, roles=Plain) as plain,
        asyncexec.Executor(1, resources_per_worker=CPU, roles=Mixed) as mixed,
    ):
        assert await plain.call(Plain.loop_running) == [False, False]
        assert await mixed.call(Mixed.loop_running) == [True]
        assert await mixed.call(Mixed.later) == [0]
        for ex in (plain, mixed):
            async with anyio.create_task_group() as tg:
                for _ in range(6):
                    tg.start_soon(ex.call, Plain.held, 0.02)
            assert await ex.call(Plain.most) == [1] * len(ex.workers)


@pytest.mark.usefixtures("ray_local")
@pytest.mark.timeout(120)
async def test_a_killed_threaded_worker_is_noticed_and_the_group_restarts_restored(
    tmp_path: Path,
) -> None:
    """A run of a role's method streams its reports; rank 1's process is SIGKILLed mid-run:
    its death is noticed, the group restarts on new processes, still threaded, and the
    instances are restored from the checkpoint the attempt resumed from."""
    policy = asyncexec.RestartPolicy(max_restarts=1, wait=tenacity.wait_none())
    async with asyncexec.Executor(
        2, resources_per_worker=CPU, roles=Plain, restart=policy, storage_path=tmp_path
    ) as ex:
        before = await ex.call(Plain.pid)
        run = ex.run(Plain.train, {"steps": 8, "die_at": 5}, buffer_size=1)
        steps = [s async for s in run]
        assert {s.attempt for s in steps} == {1, 2}
        assert steps[-1].metrics["n"] == 7
        after = await ex.call(Plain.pid)
        assert set(after).isdisjoint(before)
        assert await ex.call(Plain.loop_running) == [False, False]
        restored = await ex.call(Plain.restored_from)
        saved = [s.checkpoint for s in steps if s.attempt == 1 and s.checkpoint is not None]
        assert restored == [Path(saved[-1].path).name] * 2


@pytest.mark.usefixtures("ray_local")
@pytest.mark.timeout(60)
async def test_an_async_function_on_threaded_workers_runs_and_is_cancelled() -> None:
    """``execute()`` and ``call()`` of an ``async def`` run it on the worker's own loop; a
    caller that stops waiting for a call cancels it there (Ray only marks a sync actor's
    running task cancelled: the bridge looks), and the worker answers the next call."""
    async with asyncexec.Executor(2, resources_per_worker=CPU, roles=Plain) as ex:
        pids = await ex.execute(async_pid)
        assert pids == await ex.call(Plain.pid)
        with anyio.move_on_after(0.5):
            await ex.call(sleeps_until_cancelled, on=asyncexec.rank(0))
        assert await ex.call(was_cancelled, on=asyncexec.rank(0))
        assert await ex.call(async_pid) == pids


@pytest.mark.usefixtures("ray_local")
@pytest.mark.timeout(60)
async def test_a_cancelled_async_function_holds_its_place_until_its_clean_up_ends() -> None:
    """Defect: on a threaded worker, a cancelled ``async def`` call ended as soon as its
    coroutine was told, while its clean-up still ran (a ``finally`` that awaits): the call's
    place went to the next call meanwhile, unlike on an async worker, where the call ends with
    the coroutine. It ends with the coroutine now."""
    one = asyncexec.least_loaded(max_in_flight=1)
    async with asyncexec.Executor(1, resources_per_worker=CPU, roles=Plain) as ex:
        with anyio.move_on_after(0.5):
            await ex.call(cleans_up_slowly, on=one)
        assert await ex.call(cleaned, on=one) is True


@pytest.mark.usefixtures("ray_local")
@pytest.mark.timeout(60)
async def test_a_flood_of_control_calls_never_starves_a_health_check() -> None:
    """More ``execute()`` calls than the default group has threads wait on one worker: a ping
    (which still asks the worker's loop) answers at once, from the worker's life group, and the
    worker closes gracefully with its ``wait_closed`` pending."""
    import ray

    from asyncexec._worker import CONTROL_THREADS, ThreadedWorkerActor

    actor = ThreadedWorkerActor.options(num_cpus=0).remote()
    try:
        closed = actor.wait_closed.remote()
        pid = await actor.ping.remote()
        flood = [actor.execute.remote(sleeps, 5.0) for _ in range(CONTROL_THREADS + 8)]
        await asyncio.sleep(0.5)  # the flood holds every thread of the default group now
        with anyio.fail_after(2):
            assert await actor.ping.remote() == pid
        await actor.close.remote()
        with anyio.fail_after(2):
            await closed
    finally:
        ray.kill(actor, no_restart=True)
    del flood
