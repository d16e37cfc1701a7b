"""Worker classes (roles) and dispatch, against a real Ray and in local mode: instances made once
per rank and kept between calls, each dispatch form (the same arguments, scatter with uneven
parts, mesh axes, the least-loaded rank under a cap, merged and streamed results), data moving
once, a method as a run's function beside calls on the same instances, colocated roles,
restarts that make the instances again and restore them, pools and spares, failures, and bad
input refused before anything is sent."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import tenacity

import asyncexec
import asyncexec.testing

CPU = {"CPU": 0.25}
NO_WAIT = tenacity.wait_none()


class Counter:
    """A stateful worker class: what it saw stays on the instance between calls."""

    def __init__(self, scale: float = 1.0) -> None:
        self.scale = scale
        self.rank = asyncexec.get_context().world_rank
        self.seen: list[Any] = []  # parts taken
        self.steps: list[int] = []  # steps a run made on this instance
        self.restored: str | None = None
        self.in_flight = 0
        self.most_in_flight = 0

    def take(self, part: Any) -> dict[str, Any]:
        self.seen.append(part)
        return {"rank": self.rank, "part": _as_list(part)}

    def nbytes(self, part: Any) -> int:
        return int(part.nbytes)

    def total(self) -> int:
        return sum(len(p) for p in self.seen)

    def count(self) -> int:
        return len(self.steps)

    def pid(self) -> int:
        return os.getpid()

    def scaled(self, values: list[float]) -> list[float]:
        return [v * self.scale for v in values]

    async def slow(self, seconds: float) -> int:
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(seconds)
        self.in_flight -= 1
        return self.rank

    async def slow_part(self, part: list[float]) -> int:
        return await self.slow(part[0])

    def most(self) -> int:
        return self.most_in_flight

    def restore(self, checkpoint: asyncexec.Checkpoint) -> None:
        self.restored = Path(checkpoint.path).name

    def restored_from(self) -> str | None:
        return self.restored

    def train(self, config: dict[str, Any]) -> int:
        """A run's function: counts from the checkpoint; a rank dies once when asked."""
        ctx = asyncexec.get_context()
        start = 0
        if (checkpoint := asyncexec.get_checkpoint()) is not None:
            start = json.loads((Path(checkpoint.path) / "n.json").read_text())["n"] + 1
        for n in range(start, config["steps"]):
            if n == config.get("die_at") and ctx.attempt == 1 and ctx.world_rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            saved = None
            if (ctx.world_rank == 0 or config.get("every_rank_saves")) and n % 2 == 0:
                tmp = tempfile.mkdtemp()
                (Path(tmp) / "n.json").write_text(json.dumps({"n": n}))
                saved = asyncexec.Checkpoint.from_directory(tmp)
            self.steps.append(n)
            asyncexec.report({"n": n}, checkpoint=saved)
            time.sleep(config.get("sleep", 0))
        return len(self.steps)


class Critic:
    def __init__(self) -> None:
        self.rank = asyncexec.get_context().world_rank

    def value(self, x: float) -> float:
        return x + self.rank


class Stranger:
    def method(self) -> None: ...


def _as_list(part: Any) -> list[Any]:
    return part.tolist() if hasattr(part, "tolist") else list(part)


# Dispatch forms -----------------------------------------------------------------------------


@pytest.mark.smoke
async def test_instances_are_made_once_per_rank_and_keep_their_state(mode: str) -> None:
    async with asyncexec.Executor(
        3, resources_per_worker=CPU, roles=asyncexec.Role(Counter, 2.0)
    ) as ex:
        first = await ex.call(Counter.take, [1, 2])  # the same arguments to every rank
        assert [r["rank"] for r in first] == [0, 1, 2]
        await ex.call(Counter.take, [3])
        assert await ex.call(Counter.total) == [3, 3, 3]
        assert await ex.call(Counter.scaled, [1.5]) == [[3.0]] * 3  # the constructor's argument


async def test_scatter_splits_unevenly_and_each_rank_gets_only_its_part(mode: str) -> None:
    async with asyncexec.Executor(4, resources_per_worker=CPU, roles=Counter) as ex:
        out = await ex.call(Counter.take, asyncexec.scatter(list(range(10))))
        assert [r["part"] for r in out] == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]
        out = await ex.call(Counter.take, asyncexec.scatter(np.arange(3)))  # fewer than ranks
        assert [r["part"] for r in out] == [[0], [1], [2], []]
        merged = await ex.call(Counter.scaled, asyncexec.scatter([1.0] * 6), merge=asyncexec.concat)
        assert merged == [1.0] * 6


async def test_a_mesh_splits_along_one_axis_replicates_along_the_other_and_collects(
    mode: str,
) -> None:
    mesh = asyncexec.Mesh({"dp": 2, "tp": 2}, collect={"tp": 0})
    async with asyncexec.Executor(4, resources_per_worker=CPU, roles=Counter) as ex:
        out = await ex.call(Counter.take, asyncexec.scatter([10, 20, 30, 40], axis="dp"), on=mesh)
        assert [(r["rank"], r["part"]) for r in out] == [(0, [10, 20]), (2, [30, 40])]
        # Every rank got its dp part: ranks 0 and 1 (dp=0) the first, 2 and 3 the second.
        assert await ex.call(Counter.total) == [2, 2, 2, 2]
        everyone = asyncexec.Mesh({"dp": 2, "tp": 2})
        parts = await ex.call(Counter.take, asyncexec.scatter([1, 2, 3, 4]), on=everyone)
        assert [r["part"] for r in parts] == [[1], [2], [3], [4]]


async def test_least_loaded_spreads_calls_and_holds_the_cap(mode: str) -> None:
    async with asyncexec.Executor(2, resources_per_worker=CPU, roles=Counter) as ex:
        one = asyncexec.least_loaded(max_in_flight=1)
        async with anyio.create_task_group() as tg:
            ranks: list[int] = []

            async def send() -> None:
                ranks.append(await ex.call(Counter.slow, 0.2, on=one))

            for _ in range(6):
                tg.start_soon(send)
        assert sorted(ranks) == [0, 0, 0, 1, 1, 1]  # spread by load
        assert await ex.call(Counter.most) == [1, 1]  # never two at once on a rank
        assert await ex.call(Counter.take, [5], on=asyncexec.rank(1)) == {"rank": 1, "part": [5]}


async def test_stream_yields_each_ranks_result_as_it_is_ready(mode: str) -> None:
    async with asyncexec.Executor(3, resources_per_worker=CPU, roles=Counter) as ex:
        seen = [
            (rank, value)
            async for rank, value in ex.stream(Counter.slow_part, asyncexec.scatter([0.6, 0, 0.3]))
        ]
        # slow_part() sleeps its own part's seconds: rank 1 first, then 2, then 0.
        assert seen == [(1, 1), (2, 2), (0, 0)]


async def test_colocated_roles_share_a_process_and_answer_by_class(mode: str) -> None:
    async with asyncexec.Executor(
        2, resources_per_worker=CPU, roles=[asyncexec.Role(Counter), Critic]
    ) as ex:
        assert await ex.call(Critic.value, 1.0) == [1.0, 2.0]
        assert await ex.call(Counter.pid) == [w.pid for w in ex.workers]


async def test_bad_calls_are_refused_before_anything_is_sent(mode: str) -> None:
    async with asyncexec.Executor(2, resources_per_worker=CPU, roles=Counter) as ex:
        with pytest.raises(asyncexec.ConfigurationError, match="Stranger"):
            await ex.call(Stranger.method)
        with pytest.raises(asyncexec.ConfigurationError, match="take"):
            await ex.call(Counter.take, 1, 2)  # take() takes one part
        with pytest.raises(asyncexec.ConfigurationError, match=r"multiply|world size"):
            await ex.call(Counter.total, on=asyncexec.Mesh({"dp": 3}))
        with pytest.raises(asyncexec.ConfigurationError, match="split"):
            await ex.call(Counter.take, asyncexec.scatter({1, 2, 3}))
        assert await ex.call(Counter.total) == [0, 0]  # nothing reached the workers


# Data moves once ------------------------------------------------------------------------------


@pytest.mark.usefixtures("ray_local")
async def test_a_scattered_array_reaches_each_rank_as_its_own_part_only() -> None:
    data = np.ones(4 * 100_000, dtype=np.float64)  # 3.2 MB: put once, by part
    async with asyncexec.Executor(4, resources_per_worker=CPU, roles=Counter) as ex:
        received = await ex.call(Counter.nbytes, asyncexec.scatter(data))
        assert received == [data.nbytes // 4] * 4


# A method as a run's function, restarts, pools and spares -------------------------------------


@pytest.mark.usefixtures("ray_local")
async def test_a_method_runs_as_a_run_and_restarts_make_instances_again_restored(
    tmp_path: Path,
) -> None:
    policy = asyncexec.RestartPolicy(max_restarts=1, wait=NO_WAIT)
    async with asyncexec.Executor(
        2, resources_per_worker=CPU, roles=Counter, restart=policy, storage_path=tmp_path
    ) as ex:
        before = [w.pid for w in ex.workers]
        # buffer_size=1: a report waits for the one before it to be taken, so the steps before
        # the kill (and a checkpoint among them) reach the driver.
        run = ex.run(Counter.train, {"steps": 8, "die_at": 5}, buffer_size=1)
        steps = [s async for s in run]
        assert {s.attempt for s in steps} == {1, 2}
        assert steps[-1].metrics["n"] == 7
        resumed_at = min(s.metrics["n"] for s in steps if s.attempt == 2)
        assert resumed_at > 0  # attempt 2 went on from a checkpoint, not from the start
        # New processes, new instances, restored from the checkpoint the attempt started from.
        assert [w.pid for w in ex.workers] != before
        restored = await ex.call(Counter.restored_from)
        assert restored[0] is not None and restored[0] == restored[1]
        saved = [s.checkpoint for s in steps if s.attempt == 1 and s.checkpoint is not None]
        assert restored[0] == Path(saved[-1].path).name
        # The instances are the run's: each counted the steps its attempt made.
        assert ex.result.return_values == await ex.call(Counter.count)


@pytest.mark.usefixtures("ray_local")
async def test_calls_reach_the_run_s_instances_while_it_runs() -> None:
    async with asyncexec.Executor(2, resources_per_worker=CPU, roles=Counter) as ex:
        # buffer_size=1: a rank is at most two steps ahead of the step the driver took.
        run = ex.run(Counter.train, {"steps": 40, "sleep": 0.02}, buffer_size=1)
        for _ in range(3):
            taken = await run.__anext__()
        counts = await ex.call(Counter.count)
        # The run's own instances: each made the steps the driver took, and few more (a fresh
        # instance, or one of another run, would count 0 or 40).
        assert all(taken.index + 1 <= c <= taken.index + 3 for c in counts), counts
        await run.aclose()


@pytest.mark.usefixtures("ray_local")
async def test_a_pooled_worker_drops_its_instances_when_it_goes_back() -> None:
    async with asyncexec.WorkerPool(2, resources_per_worker=CPU) as pool:
        async with asyncexec.Executor(2, pool=pool, roles=Counter) as ex:
            await ex.call(Counter.take, [1])
            pids = await ex.call(Counter.pid)
        async with asyncexec.Executor(2, pool=pool, roles=Counter) as ex:
            assert sorted(await ex.call(Counter.pid)) == sorted(pids)  # the same processes
            assert await ex.call(Counter.total) == [0, 0]  # fresh instances
        async with asyncexec.Executor(2, pool=pool) as ex:
            with pytest.raises(asyncexec.ConfigurationError, match="not a role"):
                await ex.call(Counter.total)  # refused before anything is sent


class Closes:
    """A role that holds something to let go of: its ``close()`` writes a line to ``path`` (the
    worker may be another process), or raises when told to."""

    def __init__(self, path: str, name: str, fail: bool = False) -> None:
        self.path, self.name, self.fail = path, name, fail
        self.rank = asyncexec.get_context().world_rank

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        with open(self.path, "a") as f:
            f.write(f"{self.rank} {self.name} {os.getpid()}\n")
        if self.fail:
            raise RuntimeError("the engine would not stop")


class AsyncCloses(Closes):
    async def close(self) -> None:  # on the worker's loop
        await asyncio.sleep(0)
        super().close()


def closed(path: Path) -> list[list[str]]:
    return [line.split() for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.timeout(60)
async def test_a_roles_close_is_called_when_its_worker_drops_it(mode: str, tmp_path: Path) -> None:
    """Defect: a worker dropped its roles' instances without a word (a pooled worker going back,
    roles made again, in local mode the group's end): whatever an instance held stayed held, a
    ``VLLMServer``'s engine with its processes and memory while another was made beside it. Each
    instance's ``close()`` is called now, in reverse role order."""
    log = tmp_path / "closed"
    roles = [asyncexec.Role(Closes, str(log), "plain"), asyncexec.Role(AsyncCloses, str(log), "a")]
    async with asyncexec.Executor(2, resources_per_worker=CPU, roles=roles) as ex:
        pids = await ex.call(asyncexec.method(Closes, Closes.pid))
        assert closed(log) == []
    by_rank = {r: [name for rank, name, _ in closed(log) if int(rank) == r] for r in (0, 1)}
    assert by_rank == {0: ["a", "plain"], 1: ["a", "plain"]}
    assert {(int(rank), int(pid)) for rank, _, pid in closed(log)} == {(0, pids[0]), (1, pids[1])}


class Meets:
    """A role whose calls wait for one another: ``n`` of them meet at a barrier."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n, timeout=10)

    def meet(self) -> int:
        try:
            return self.barrier.wait()
        except threading.BrokenBarrierError:
            return -1


#: More than the threads of a worker's default pool (at most 32, fewer with fewer CPUs).
MEETING = 36


@pytest.mark.timeout(60)
async def test_max_concurrency_plain_calls_run_at_once_however_many_cpus(mode: str) -> None:
    """Defect: a role's ``max_concurrency=k`` plain calls ran in the worker's default thread
    pool, of a few threads per CPU (6 on 2 CPUs, 32 at most), and shared with every other
    thread of the worker: fewer than k ran at once, so k calls that wait for one another never
    met (and they held up ``execute()`` and weight installs meanwhile). Each instance's plain
    calls have threads of their own now, k of them."""
    role = asyncexec.Role(Meets, MEETING).options(max_concurrency=MEETING)
    async with asyncexec.Executor(1, resources_per_worker=CPU, roles=role) as ex:
        met = await asyncio.gather(*[ex.call(Meets.meet) for _ in range(MEETING)])
    assert sorted(rank0 for [rank0] in met) == list(range(MEETING))


class BusyCloses:
    """A role whose ``close()`` writes to ``path`` whether a call of ``work`` was running."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.busy = False
        self.started = threading.Event()

    def work(self, seconds: float) -> None:
        self.busy = True
        self.started.set()
        time.sleep(seconds)  # a call that runs on after its caller stopped waiting
        self.busy = False

    def wait_started(self) -> bool:
        return self.started.wait(10)

    def close(self) -> None:
        Path(self.path).write_text(f"busy={self.busy}")


@pytest.mark.timeout(60)
async def test_a_roles_close_waits_for_its_plain_calls_still_running(
    mode: str, tmp_path: Path
) -> None:
    """Defect: a plain call whose caller stopped waiting runs to its end (a thread cannot be
    stopped), but the worker's close called the instance's ``close()`` meanwhile: an engine let
    go of what the call was still using. The close waits for such calls to end first."""
    log = tmp_path / "closed"
    role = asyncexec.Role(BusyCloses, str(log)).options(max_concurrency=2)
    async with asyncexec.Executor(1, resources_per_worker=CPU, roles=role) as ex:
        call = asyncio.ensure_future(ex.call(BusyCloses.work, 1.0))
        assert await ex.call(BusyCloses.wait_started) == [True]
        call.cancel()
        await asyncio.gather(call, return_exceptions=True)
    assert log.read_text() == "busy=False"


class FailsToStart:
    def __init__(self) -> None:
        raise RuntimeError("no engine")


@pytest.mark.timeout(60)
async def test_instances_made_before_a_role_that_fails_to_start_are_closed(
    mode: str, tmp_path: Path
) -> None:
    """Defect: when a role's ``__init__`` raised, the instances of the roles before it on that
    worker were forgotten without their ``close()`` (a ``VLLMServer``'s engine kept its
    processes and memory; in local mode for as long as the program ran). They are closed now."""
    log = tmp_path / "closed"
    roles = [asyncexec.Role(Closes, str(log), "a"), asyncexec.Role(FailsToStart)]
    with pytest.raises(asyncexec.StartupError, match="no engine"):
        async with asyncexec.Executor(1, resources_per_worker=CPU, roles=roles):
            pass
    assert [name for _, name, _ in closed(log)] == ["a"]


async def pooled_closes(tmp_path: Path, cluster: Any = None) -> None:
    """A pooled worker closes its instances before it goes back: its next lease finds nothing
    held; a worker whose instance failed to close is replaced, not given back (what the
    instance held may be held still)."""
    log = tmp_path / "closed"
    async with asyncexec.WorkerPool(1, resources_per_worker=CPU, cluster=cluster) as pool:
        async with asyncexec.Executor(1, pool=pool, roles=asyncexec.Role(Closes, str(log), "a")):
            assert closed(log) == []
        assert [name for _, name, _ in closed(log)] == ["a"]
        role = asyncexec.Role(Closes, str(log), "b", fail=True)
        async with asyncexec.Executor(1, pool=pool, roles=role) as ex:
            [pid] = await ex.call(Closes.pid)
        assert [name for _, name, _ in closed(log)] == ["a", "b"]
        async with asyncexec.Executor(1, pool=pool) as ex:
            if cluster is None:  # (simulated workers all run in this process)
                assert [w.pid for w in ex.workers] != [pid]
        assert pool.statistics().replaced == 1


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("ray_local")
async def test_a_pooled_worker_closes_its_instances_before_it_goes_back(tmp_path: Path) -> None:
    await pooled_closes(tmp_path)


@pytest.mark.timeout(30)
async def test_a_pooled_simulated_worker_closes_its_instances_before_it_goes_back(
    tmp_path: Path,
) -> None:
    await pooled_closes(tmp_path, asyncexec.testing.SimCluster())


@pytest.mark.usefixtures("ray_local")
async def test_a_spare_that_takes_a_rank_has_the_roles(tmp_path: Path) -> None:
    policy = asyncexec.RestartPolicy(max_restarts=1, wait=NO_WAIT)
    async with asyncexec.Executor(
        2, resources_per_worker=CPU, roles=Counter, spares=1, restart=policy, storage_path=tmp_path
    ) as ex:
        run = ex.run(Counter.train, {"steps": 8, "die_at": 5}, buffer_size=1)
        steps = [s async for s in run]
        assert {s.attempt for s in steps} == {1, 2}
        assert await ex.call(Counter.pid) == [w.pid for w in ex.workers]
        assert (await ex.call(Counter.restored_from))[1] is not None


class Reducer:
    """A role made after the backend set up: torch.distributed is ready in ``__init__``."""

    def __init__(self) -> None:
        import torch.distributed as dist

        assert dist.is_initialized()
        self.world = dist.get_world_size()

    def summed(self, part: list[float]) -> float:
        import torch
        import torch.distributed as dist

        total = torch.tensor([sum(part)])
        dist.all_reduce(total)
        return float(total.item())


@pytest.mark.usefixtures("ray_local")
@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="needs torch")
async def test_instances_are_made_once_the_backend_has_set_up() -> None:
    from asyncexec.backends import TorchBackend

    async with asyncexec.Executor(
        2, resources_per_worker={"CPU": 0.5}, backend=TorchBackend(), roles=Reducer
    ) as ex:
        # Each rank sums its own part; all_reduce gives every rank the sum of both.
        assert await ex.call(Reducer.summed, asyncexec.scatter([1.0, 2.0, 3.0])) == [6.0, 6.0]


@pytest.mark.usefixtures("ray_local")
async def test_roles_on_a_reservation_and_on_an_elastic_executor() -> None:
    async with (
        asyncexec.Reservation(2, {"CPU": 0.25}) as reservation,
        asyncexec.Executor(
            2, reservation=reservation, resources_per_worker=CPU, roles=Counter
        ) as ex,
    ):
        assert await ex.call(Counter.take, asyncexec.scatter([1, 2, 3])) == [
            {"rank": 0, "part": [1, 2]},
            {"rank": 1, "part": [3]},
        ]
    async with asyncexec.Executor((1, 2), resources_per_worker=CPU, roles=Counter) as ex:
        size = len(ex.workers)
        assert await ex.call(Counter.count) == [0] * size
        parts = await ex.call(Counter.take, asyncexec.scatter(list(range(4))))
        assert sum(len(p["part"]) for p in parts) == 4


@pytest.mark.usefixtures("ray_local")
async def test_an_independent_rank_renewed_has_its_instance_restored(tmp_path: Path) -> None:
    policy = asyncexec.RestartPolicy(max_restarts=1, wait=NO_WAIT)
    async with asyncexec.Executor(
        2, resources_per_worker=CPU, roles=Counter, restart=policy, storage_path=tmp_path
    ) as ex:
        before = [w.pid for w in ex.workers]
        config = {"steps": 8, "die_at": 5, "every_rank_saves": True}
        run = ex.run(Counter.train, config, independent=True, buffer_size=1)
        steps = [s async for s in run]
        assert {s.attempt for s in steps if s.rank == 1} == {1, 2}
        assert {s.attempt for s in steps if s.rank == 0} == {1}  # rank 0 went on
        after = [w.pid for w in ex.workers]
        assert after[0] == before[0] and after[1] != before[1]
        # The renewed rank's new instance was restored from that rank's own latest checkpoint;
        # rank 0 kept its instance, never restored.
        restored = await ex.call(Counter.restored_from)
        own = [s.checkpoint for s in steps if s.rank == 1 and s.attempt == 1 and s.checkpoint]
        assert restored == [None, Path(own[-1].path).name]


async def test_the_worker_classes_example(mode: str) -> None:
    from examples import worker_classes

    out = await worker_classes.main()
    assert out["sizes"] == [3, 3, 2, 2]
    assert out["totals"] == [2.0 * sum(p) for p in ([0, 1, 2], [3, 4, 5], [6, 7], [8, 9])]
    assert sorted(out["order"]) == [0, 1, 2, 3]  # type: ignore[call-overload]
    ranks = [rank for rank, _ in out["answers"]]  # type: ignore[attr-defined]
    assert len(ranks) == 8 and set(ranks) == {0, 1, 2, 3}  # spread by load


# Failures -------------------------------------------------------------------------------------


@pytest.mark.usefixtures("ray_local")
async def test_a_call_to_a_dead_rank_names_it_and_an_idempotent_one_goes_elsewhere() -> None:
    async with asyncexec.Executor(
        2, resources_per_worker=CPU, roles=Counter, restart=asyncexec.RestartPolicy.never()
    ) as ex:
        pids = await ex.call(Counter.pid)
        os.kill(pids[0], signal.SIGKILL)
        with anyio.fail_after(30), pytest.raises(asyncexec.WorkerCrashedError) as info:
            await ex.call(Counter.take, [1], on=asyncexec.rank(0))
        assert info.value.rank == 0
        # Outside a run the dead rank gets a fresh process; the other keeps its own.
        after = await ex.call(Counter.pid)
        assert after[0] != pids[0] and after[1] == pids[1]
    async with asyncexec.Executor(2, resources_per_worker=CPU, roles=Counter) as ex:
        pids = await ex.call(Counter.pid)
        os.kill(pids[0], signal.SIGKILL)
        retry = asyncexec.least_loaded(retry=True)
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                # A call in flight on the survivor is not disturbed by its neighbour's death.
                tg.start_soon(_expect_rank, ex, 1)
                # Rank 0 is chosen (no calls by load in flight: the lowest), is dead, and the
                # idempotent call goes to rank 1.
                assert await ex.call(Counter.slow, 0.0, on=retry) == 1
        assert (await ex.call(Counter.pid))[1] == pids[1]


async def _expect_rank(ex: asyncexec.Executor, rank: int) -> None:
    assert await ex.call(Counter.slow, 1.0, on=asyncexec.rank(rank)) == rank


class SlowToStart:
    """A role whose constructor, once ``marker`` exists, waits until ``release`` exists (60 s at
    most): a fresh process that starts as slowly as an engine does, for as long as a test holds
    it."""

    def __init__(self, marker: str, release: str) -> None:
        if os.path.exists(marker):
            deadline = time.monotonic() + 60.0
            while not os.path.exists(release) and time.monotonic() < deadline:
                time.sleep(0.02)

    def pid(self) -> int:
        return os.getpid()

    async def wait(self, seconds: float) -> int:
        await asyncio.sleep(seconds)
        return os.getpid()


@pytest.mark.usefixtures("ray_local")
async def test_a_call_whose_rank_dies_fails_at_once_and_the_next_waits_for_the_fresh_process(
    tmp_path: Path,
) -> None:
    """The error of a call whose worker died does not wait for the fresh process put in its
    place (an engine's start: tens of seconds; here, held until the test lets it go);
    meanwhile a call to another rank is answered, and one to the dying rank waits for its
    fresh process."""
    marker, release = tmp_path / "started", tmp_path / "released"
    role = asyncexec.Role(SlowToStart, str(marker), str(release))
    never = asyncexec.RestartPolicy.never()
    async with asyncexec.Executor(2, resources_per_worker=CPU, roles=role, restart=never) as ex:
        pids = await ex.call(SlowToStart.pid)
        marker.touch()
        waiting = asyncio.ensure_future(ex.call(SlowToStart.wait, 60.0, on=asyncexec.rank(1)))
        await asyncio.sleep(0)  # sent
        os.kill(pids[1], signal.SIGKILL)
        with anyio.fail_after(5), pytest.raises(asyncexec.WorkerCrashedError) as info:
            await waiting
        assert info.value.rank == 1
        fresh = asyncio.ensure_future(ex.call(SlowToStart.pid, on=asyncexec.rank(1)))
        with anyio.fail_after(5):
            assert await ex.call(SlowToStart.pid, on=asyncexec.rank(0)) == pids[0]
        assert not fresh.done()  # its process is still held in its constructor
        release.touch()
        with anyio.fail_after(60):
            assert await fresh not in pids
            assert (await ex.call(SlowToStart.pid))[0] == pids[0]


@pytest.mark.usefixtures("ray_local")
async def test_a_call_in_flight_when_the_executor_restarts_fails_and_never_hangs(
    tmp_path: Path,
) -> None:
    policy = asyncexec.RestartPolicy(max_restarts=1, wait=NO_WAIT)
    async with asyncexec.Executor(
        2, resources_per_worker=CPU, roles=Counter, restart=policy, storage_path=tmp_path
    ) as ex:
        run = ex.run(Counter.train, {"steps": 200, "sleep": 0.05, "die_at": 3})
        errors: list[BaseException] = []

        async def long_call() -> None:
            try:
                await ex.call(Counter.slow, 30.0, on=asyncexec.rank(0))
            except asyncexec.WorkerError as exc:
                errors.append(exc)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                tg.start_soon(long_call)
                async for step in run:
                    if step.attempt == 2:
                        break
        assert len(errors) == 1 and isinstance(errors[0], asyncexec.WorkerCrashedError)
        assert "replaced its group" in "\n".join(getattr(errors[0], "__notes__", []))


# Threads of the test's own process, for local mode -------------------------------------------


def test_the_dispatch_names_are_public() -> None:
    for name in ("Role", "scatter", "Splittable", "Mesh", "least_loaded", "rank", "concat"):
        assert name in asyncexec.__all__
    assert threading.current_thread() is threading.main_thread()
