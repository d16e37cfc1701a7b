"""Role instances and their state, against a real Ray (and in local mode where it applies): how
many calls of one instance's methods run at once, a weight channel opened again on a target that
already holds versions, methods resolved by the class the caller names among colocated roles that
share a base class, and a rank replaced outside a run restored to where the others are."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest

import asyncexec
import asyncexec.testing

CPU = {"CPU": 0.25}


# How many calls of one instance run at once ----------------------------------------------------


class Learner:
    """Counts the calls of its methods that run at once."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = 0
        self.most = 0
        self.overlapped = threading.Event()  # set when a call finds another one running
        self.barrier = threading.Barrier(4)
        self.async_active = 0
        self.async_all_in: asyncio.Event | None = None

    def update(self) -> int:
        """Waits for another call to overlap it (an event, not a sleep), up to 0.2 s."""
        with self.lock:
            self.active += 1
            self.most = max(self.most, self.active)
            if self.active > 1:
                self.overlapped.set()
        self.overlapped.wait(0.2)
        with self.lock:
            self.active -= 1
        return self.most

    def update_together(self) -> int:
        """Returns only once four calls are in it at once."""
        with self.lock:
            self.active += 1
            self.most = max(self.most, self.active)
        self.barrier.wait(timeout=20)
        with self.lock:
            self.active -= 1
        return self.most

    async def generate(self) -> int:
        """Returns only once four calls are in it at once (on the worker's loop)."""
        if self.async_all_in is None:
            self.async_all_in = asyncio.Event()
        self.async_active += 1
        if self.async_active == 4:
            self.async_all_in.set()
        await asyncio.wait_for(self.async_all_in.wait(), timeout=20)
        return self.async_active


async def _four_at_once(ex: asyncexec.Executor, method: Any) -> list[int]:
    results: list[int] = []

    async def one() -> None:
        results.extend(await ex.call(method))

    async with anyio.create_task_group() as tg:
        for _ in range(4):
            tg.start_soon(one)
    return results


@pytest.mark.timeout(30)
async def test_plain_methods_of_one_instance_run_one_at_a_time(mode: str) -> None:
    async with asyncexec.Executor(1, resources_per_worker=CPU, roles=Learner) as ex:
        assert max(await _four_at_once(ex, Learner.update)) == 1


@pytest.mark.timeout(30)
async def test_max_concurrency_lets_plain_methods_of_a_role_run_together(mode: str) -> None:
    role = asyncexec.Role(Learner).options(max_concurrency=4)
    async with asyncexec.Executor(1, resources_per_worker=CPU, roles=role) as ex:
        assert max(await _four_at_once(ex, Learner.update_together)) == 4


@pytest.mark.timeout(30)
async def test_async_methods_of_one_instance_run_together(mode: str) -> None:
    async with asyncexec.Executor(1, resources_per_worker=CPU, roles=Learner) as ex:
        assert await _four_at_once(ex, Learner.generate) == [4, 4, 4, 4]


def test_max_concurrency_is_checked_and_kept() -> None:
    role = asyncexec.Role(Learner)
    assert role.max_concurrency == 1
    four = role.options(max_concurrency=4)
    assert (four.max_concurrency, role.max_concurrency) == (4, 1)
    assert four != role and "max_concurrency=4" in repr(four)
    import pickle

    assert pickle.loads(pickle.dumps(four)).max_concurrency == 4
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(asyncexec.ConfigurationError, match="max_concurrency"):
            role.options(max_concurrency=bad)  # type: ignore[arg-type]


# A weight channel opened again on a target that holds versions --------------------------------

_installs: list[tuple[int, Any]] = []  # (version, state) in install order, this worker


def _serve_counter() -> None:
    pushed = iter(range(1, 1_000_000))
    asyncexec.serve_weights(lambda: {"w": next(pushed)})
    while True:
        asyncexec.report({"alive": 1})
        threading.Event().wait(0.01)


def _receive() -> None:
    asyncexec.receive_weights(lambda state, version: _installs.append((version, state)))
    while True:
        asyncexec.report({"alive": 1})
        threading.Event().wait(0.01)


def _installed() -> list[tuple[int, Any]]:
    return list(_installs)


@pytest.mark.usefixtures("ray_local")
@pytest.mark.timeout(90)
async def test_a_second_channel_to_a_target_delivers_after_the_versions_it_holds(
    tmp_path: Any,
) -> None:
    """A new channel numbered its versions from 1 again: the target, holding 2, skipped every
    push while push() returned and the statistics said delivered."""
    async with (
        asyncexec.Executor(1, resources_per_worker=CPU, storage_path=str(tmp_path)) as a,
        asyncexec.Executor(1, resources_per_worker=CPU, storage_path=str(tmp_path)) as b,
    ):
        learn, roll = a.run(_serve_counter), b.run(_receive)
        with anyio.fail_after(30):
            await learn.__anext__()
            await roll.__anext__()
        async with asyncexec.WeightChannel(a, b) as first:
            assert [await first.push(), await first.push()] == [1, 2]
        async with asyncexec.WeightChannel(a, b) as second:
            version = await second.push()
            assert version == 3
            stats = second.statistics()
            assert (stats.version, stats.delivered, stats.pushes) == (3, 3, 1)
        [installs] = await b.execute(_installed)
        assert installs == [(1, {"w": 1}), (2, {"w": 2}), (3, {"w": 3})]
        await learn.aclose()
        await roll.aclose()


def _receive_held_back(config: dict[str, Any]) -> None:
    """Installs each version once the file ``config["hold"]`` is gone."""

    def install(state: Any, version: int) -> None:
        while os.path.exists(config["hold"]):
            threading.Event().wait(0.01)
        _installs.append((version, state))

    asyncexec.receive_weights(install)
    while True:
        asyncexec.report({"alive": 1})
        threading.Event().wait(0.01)


@pytest.mark.usefixtures("ray_local")
@pytest.mark.timeout(90)
async def test_a_second_channels_version_lag_counts_from_the_version_a_rank_holds(
    tmp_path: Any,
) -> None:
    """The second channel knew the latest version the target's ranks held, but not which rank
    held what: while its first version was on its way, a rank holding 2 showed a lag of 3. Its
    lag series go when it closes."""
    hold = tmp_path / "hold"
    with asyncexec.testing.metrics_enabled() as registry:
        async with (
            asyncexec.Executor(1, resources_per_worker=CPU, name="learner") as a,
            asyncexec.Executor(1, resources_per_worker=CPU, name="servers") as b,
        ):
            learn, roll = a.run(_serve_counter), b.run(_receive_held_back, {"hold": str(hold)})
            with anyio.fail_after(30):
                await learn.__anext__()
                await roll.__anext__()
            async with asyncexec.WeightChannel(a, b) as first:
                assert [await first.push(), await first.push()] == [1, 2]
            hold.touch()
            async with asyncexec.WeightChannel(a, b, max_staleness=2) as second:
                assert await second.push() == 3  # read: its install waits for the file
                lag = {"executor": "servers", "rank": "0"}
                assert registry.get_sample_value("asyncexec_channel_version_lag", lag) == 1
                hold.unlink()
                assert await second.push() == 4  # once 3 is delivered
            # A closed channel's lag is no longer shown (it was, for ever).
            assert registry.get_sample_value("asyncexec_channel_version_lag", lag) is None
            await learn.aclose()
            await roll.aclose()


# Colocated roles that share a base class -------------------------------------------------------


class Base:
    def who(self) -> str:
        return type(self).__name__


class Actor(Base):
    pass


class Ref(Base):
    pass


class Critic:
    def values(self) -> str:
        return type(self).__name__


class SubCritic(Critic):
    pass


class Stranger:
    def values(self) -> str:
        return "stranger"


@pytest.mark.timeout(30)
async def test_an_inherited_method_named_through_its_class_reaches_that_roles_instance(
    mode: str,
) -> None:
    """``Actor.who`` is ``Base.who`` in Python: it was refused with no way to say which role's
    instance was meant."""
    async with asyncexec.Executor(1, resources_per_worker=CPU, roles=[Actor, Ref, Critic]) as ex:
        with pytest.raises(asyncexec.ConfigurationError, match=r"asyncexec\.method\(Actor, "):
            await ex.call(Actor.who)
        assert await ex.call(asyncexec.method(Actor, Actor.who)) == ["Actor"]
        assert await ex.call(asyncexec.method(Ref, Ref.who)) == ["Ref"]
        assert await ex.call(asyncexec.method(Ref, "who"), on=asyncexec.rank(0)) == "Ref"
        assert [v async for _, v in ex.stream(asyncexec.method(Actor, Base.who))] == ["Actor"]
        assert await ex.call(Critic.values) == ["Critic"]
        # ``SubCritic.values`` is ``Critic.values`` in Python, and would run on the Critic
        # instance; named through its class, which is no role, it is refused before it is sent.
        with pytest.raises(asyncexec.ConfigurationError, match=r"SubCritic is not a role"):
            await ex.call(asyncexec.method(SubCritic, SubCritic.values))
        assert await ex.call(asyncexec.method(Critic, Critic.values)) == ["Critic"]


def test_a_method_named_through_a_class_it_does_not_belong_to_is_refused() -> None:
    with pytest.raises(asyncexec.ConfigurationError, match=r"Critic has no method 'nope'"):
        asyncexec.method(Critic, "nope")
    with pytest.raises(asyncexec.ConfigurationError, match=r"is not Critic\.values"):
        asyncexec.method(Critic, Stranger.values)
    with pytest.raises(asyncexec.ConfigurationError, match=r"takes a class"):
        asyncexec.method(Critic(), "values")  # type: ignore[arg-type]


# A rank replaced outside a run is restored where the others are --------------------------------


class Stepper:
    """Its step is its state: a run moves it on (rank 0 saves each), restore() sets it."""

    def __init__(self) -> None:
        self.step = 0

    def restore(self, checkpoint: asyncexec.Checkpoint) -> None:
        self.step = json.loads((Path(checkpoint.path) / "step.json").read_text())["step"]

    def train(self, config: dict[str, Any]) -> int:
        if (checkpoint := asyncexec.get_checkpoint()) is not None:
            self.restore(checkpoint)
        rank = asyncexec.get_context().world_rank
        while self.step < config["to"] + rank * config.get("per_rank", 0):
            self.step += 1
            saved = None
            if rank == 0 or config.get("every_rank_saves"):
                folder = Path(tempfile.mkdtemp())
                (folder / "step.json").write_text(json.dumps({"step": self.step}))
                saved = asyncexec.Checkpoint.from_directory(str(folder))
            asyncexec.report({"step": self.step}, checkpoint=saved)
        return self.step

    def where(self) -> int:
        return self.step

    def pid(self) -> int:
        return os.getpid()


async def _killed_and_renewed(ex: asyncexec.Executor, rank: int) -> None:
    """SIGKILL ``rank`` outside a run; a call finds it dead, and the rank gets a fresh process."""
    pids = await ex.call(Stepper.pid)
    os.kill(pids[rank], signal.SIGKILL)
    with anyio.fail_after(30), pytest.raises(asyncexec.WorkerCrashedError):
        await ex.call(Stepper.where, on=asyncexec.rank(rank))
    with anyio.fail_after(30):
        assert (await ex.call(Stepper.pid))[rank] != pids[rank]


@pytest.mark.usefixtures("ray_local")
@pytest.mark.timeout(90)
async def test_a_rank_renewed_after_runs_is_restored_from_the_last_runs_checkpoint(
    tmp_path: Path,
) -> None:
    """It came back at step 0 (or at an earlier failure's checkpoint) beside ranks at 6."""
    async with asyncexec.Executor(
        2, resources_per_worker=CPU, roles=Stepper, storage_path=str(tmp_path)
    ) as ex:
        first = ex.run(Stepper.train, {"to": 3})
        [s async for s in first]
        second = ex.run(Stepper.train, {"to": 6}, checkpoint=first.result.checkpoint)
        [s async for s in second]
        assert await ex.call(Stepper.where) == [6, 6]
        await _killed_and_renewed(ex, 1)
        assert await ex.call(Stepper.where) == [6, 6]


@pytest.mark.usefixtures("ray_local")
@pytest.mark.timeout(90)
async def test_a_rank_renewed_after_independent_runs_is_restored_from_its_own_checkpoint(
    tmp_path: Path,
) -> None:
    async with asyncexec.Executor(
        2, resources_per_worker=CPU, roles=Stepper, storage_path=str(tmp_path)
    ) as ex:
        config = {"to": 4, "per_rank": 2, "every_rank_saves": True}  # rank 1 goes on to 6
        [s async for s in ex.run(Stepper.train, config, independent=True)]
        assert await ex.call(Stepper.where) == [4, 6]
        await _killed_and_renewed(ex, 1)
        assert await ex.call(Stepper.where) == [4, 6]
