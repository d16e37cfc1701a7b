"""WeightChannel against a real Ray: both transports deliver equal bytes to every target rank
while both runs go on, versions ride on reports, a rank that joins after a restart gets the latest
version before its function starts, and the channel survives SIGKILLs of either side."""

from __future__ import annotations

import gc
import hashlib
import logging
import os
import pickle
import signal
import threading
import time
from collections.abc import Mapping
from typing import Any

import anyio
import pytest

import asyncexec

pytestmark = [pytest.mark.usefixtures("ray_local"), pytest.mark.timeout(180)]

ELEMENTS = 50_000  # 200 KB per tensor: through the object store, not inline


# Worker side ----------------------------------------------------------------------------------

_lock = threading.Lock()
_weights: dict[str, Any] = {}
_installed: list[tuple[int, str]] = []  # (version, digest) in install order, this process
_last_keys: list[str] = []


def _digest(state: Mapping[str, Any]) -> str:
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(key.encode())
        h.update(_as_bytes(state[key]))
    return h.hexdigest()


def _as_bytes(value: Any) -> bytes:
    if hasattr(value, "numpy"):
        value = value.numpy()
    return bytes(memoryview(value).cast("B"))


def learner(config: dict[str, Any]) -> None:
    """Updates its weights every few ms and serves them; reports each update."""
    import torch

    rank = asyncexec.get_context().world_rank
    step = 0
    with _lock:
        _weights["w"] = torch.zeros(ELEMENTS)
        _weights["b"] = torch.zeros(ELEMENTS // 10, dtype=torch.float64)

    def read() -> dict[str, Any]:
        with _lock:
            state = {k: v.clone() for k, v in _weights.items()}
        if config.get("sharded"):
            return {f"{k}.{rank}": v for k, v in state.items()}
        return state

    asyncexec.serve_weights(read)
    while True:
        step += 1
        with _lock:
            _weights["w"] += 1.0 + rank
            _weights["b"] -= 0.5
        asyncexec.report({"step": step})
        time.sleep(0.005)


def rollout(config: dict[str, Any]) -> None:
    """Registers its install function, reports what it holds at start and at each step."""
    start_version = asyncexec.weights_version()

    def install(state: Mapping[str, Any], version: int) -> None:
        with _lock:
            _installed.append((version, _digest(state)))
            _last_keys[:] = sorted(state)

    asyncexec.receive_weights(install)
    step = 0
    while True:
        step += 1
        asyncexec.report({"step": step, "start_version": start_version, "pid": os.getpid()})
        time.sleep(0.005)


def installed() -> list[tuple[int, str]]:
    with _lock:
        return list(_installed)


# Tests ------------------------------------------------------------------------------------------


async def _next(run: Any) -> Any:
    with anyio.fail_after(60):
        return await run.__anext__()


@pytest.mark.smoke
@pytest.mark.parametrize("transport", ["object_store", "torch"])
async def test_pushes_deliver_equal_bytes_to_every_rank_while_both_runs_go_on(
    transport: str, tmp_path: Any
) -> None:
    async with (
        asyncexec.Executor(2, resources_per_worker={"CPU": 0.5}, storage_path=str(tmp_path)) as a,
        asyncexec.Executor(2, resources_per_worker={"CPU": 0.5}, storage_path=str(tmp_path)) as b,
        asyncexec.WeightChannel(a, b, transport=transport) as channel,  # type: ignore[arg-type]
    ):
        learn, roll = a.run(learner, {}), b.run(rollout, {})
        first = await _next(roll)
        assert first.versions == (None, None)
        await _next(learn)
        for expected in (1, 2, 3):
            assert await channel.push() == expected
        # Every rank installed 1, 2, 3 in order, and holds the same bytes at each version.
        per_rank = await b.execute(installed)
        assert [v for v, _ in per_rank[0]] == [1, 2, 3] == [v for v, _ in per_rank[1]]
        assert per_rank[0] == per_rank[1]
        assert len({d for _, d in per_rank[0]}) == 3  # the learner's state moved between pushes
        # Reports after the push carry the version; both runs are still on their first attempt.
        while True:
            step = await _next(roll)
            if step.versions == (3, 3):
                break
        assert [r.version for r in step.reports] == [3, 3]
        assert channel.lag(step) == 0
        assert (await _next(learn)).attempt == 1 and step.attempt == 1
        stats = channel.statistics()
        assert (stats.version, stats.delivered, stats.pushes) == (3, 3, 3)
        assert stats.rebuilds == (1 if transport == "torch" else 0)
        await learn.aclose()
        await roll.aclose()


async def test_sharded_push_installs_the_union_of_every_source_ranks_part(tmp_path: Any) -> None:
    async with (
        asyncexec.Executor(2, resources_per_worker={"CPU": 0.5}, storage_path=str(tmp_path)) as a,
        asyncexec.Executor(1, resources_per_worker={"CPU": 0.5}, storage_path=str(tmp_path)) as b,
        asyncexec.WeightChannel(a, b, transport="torch", sharded=True) as channel,
    ):
        learn, roll = a.run(learner, {"sharded": True}), b.run(rollout, {})
        await _next(learn)
        await _next(roll)
        await channel.push()
        keys = await b.execute(_keys_of_last_install)
        assert keys == [["b.0", "b.1", "w.0", "w.1"]]
        await learn.aclose()
        await roll.aclose()


def _keys_of_last_install() -> list[str]:
    return list(_last_keys)


@pytest.mark.parametrize("transport", ["object_store", "torch"])
async def test_joining_rank_gets_the_latest_version_first_and_the_channel_outlives_sigkills(
    transport: str, tmp_path: Any
) -> None:
    policy = asyncexec.RestartPolicy(max_restarts=2)
    async with (
        asyncexec.Executor(
            2, resources_per_worker={"CPU": 0.5}, restart=policy, storage_path=str(tmp_path)
        ) as a,
        asyncexec.Executor(
            2, resources_per_worker={"CPU": 0.5}, restart=policy, storage_path=str(tmp_path)
        ) as b,
        asyncexec.WeightChannel(a, b, transport=transport) as channel,  # type: ignore[arg-type]
    ):
        learn, roll = a.run(learner, {}), b.run(rollout, {})
        await _next(learn)
        await _next(roll)
        await channel.push()
        await channel.push()
        # SIGKILL a receiving rank: the group restarts, and each of its new ranks holds the
        # latest version before its function starts (it reports the version it started with):
        # version 2 from the object store; with torch the rebuilt groups carry the source's
        # current state as version 3.
        os.kill(b.workers[1].pid, signal.SIGKILL)
        while True:
            step = await _next(roll)
            if step.attempt == 2:
                break
        latest = 2 if transport == "object_store" else 3
        assert channel.version == latest
        assert [r.metrics["start_version"] for r in step.reports] == [latest, latest]
        assert step.versions == (latest, latest)
        assert channel.statistics().joins == 2
        # SIGKILL the sending rank: until the learner is back a push may fail clearly; once it
        # is back, the rebuilt channel delivers the next version.
        os.kill(a.workers[0].pid, signal.SIGKILL)
        while (await _next(learn)).attempt != 2:
            pass
        version = await _push_until_delivered(channel)
        while True:
            step = await _next(roll)
            if step.versions == (version, version):
                break
        per_rank = await b.execute(installed)
        assert per_rank[0][-1][0] == version and per_rank[0][-1] == per_rank[1][-1]
        await learn.aclose()
        await roll.aclose()


async def _push_until_delivered(channel: asyncexec.WeightChannel) -> int:
    for _ in range(20):
        try:
            return await channel.push()
        except asyncexec.ChannelError:
            await anyio.sleep(0.2)
    raise AssertionError("no push delivered after the source restarted")


async def test_bad_channel_arguments_are_refused_before_anything_moves() -> None:
    a, b = asyncexec.Executor(1), asyncexec.Executor(1)  # nothing starts until entered
    with pytest.raises(asyncexec.ConfigurationError, match="must differ"):
        asyncexec.WeightChannel(a, a)
    with pytest.raises(asyncexec.ConfigurationError, match="transport"):
        asyncexec.WeightChannel(a, b, transport="pigeon")  # type: ignore[arg-type]
    with pytest.raises(asyncexec.ConfigurationError, match="max_staleness"):
        asyncexec.WeightChannel(a, b, max_staleness=0)
    with pytest.raises(asyncexec.ExecutorStateError, match="not open"):
        await asyncexec.WeightChannel(a, b).push()
    async with asyncexec.WeightChannel(a, b):
        with pytest.raises(asyncexec.ConfigurationError, match="already receives"):
            async with asyncexec.WeightChannel(asyncexec.Executor(1), b):
                pass
    with pytest.raises(asyncexec.ConfigurationError, match=r"two asyncexec\.Executors"):
        asyncexec.WeightChannel(object(), object())  # type: ignore[arg-type]


def _serves_nothing() -> None:
    while True:
        asyncexec.report({"alive": 1})
        time.sleep(0.01)


async def test_a_cancelled_push_is_cancelled_not_a_channel_error(tmp_path: Any) -> None:
    """A push cancelled while it reads (here: the source's function runs and has not yet
    registered how its state is read) ends with the cancellation; it was turned into a
    ChannelError, so a loop that retries on ChannelError never stopped."""
    async with (
        asyncexec.Executor(1, resources_per_worker={"CPU": 0.5}, storage_path=str(tmp_path)) as a,
        asyncexec.Executor(1, resources_per_worker={"CPU": 0.5}, storage_path=str(tmp_path)) as b,
        asyncexec.WeightChannel(a, b, timeout_s=30) as channel,
    ):
        learn = a.run(_serves_nothing)
        await _next(learn)
        with anyio.move_on_after(1.0) as scope:
            await channel.push()
        assert scope.cancelled_caught
        # Not a failed push; its number is used up (its installs went out with its read).
        assert channel.statistics().failed_pushes == 0 and channel.version == 1
        await learn.aclose()


class ServesNothing:
    """A learner role that forgot ``serve_weights``."""

    def step(self) -> int:
        return 1


async def test_a_source_that_registered_nothing_is_named_at_once_with_what_it_lacks(
    tmp_path: Any,
) -> None:
    """A source whose ranks are up with no function running that could still register one
    (a role that never called ``serve_weights``): the push failed after the channel's whole
    timeout (120 s) with ``no answer within 120 s`` and no word of ``serve_weights``."""
    async with (
        asyncexec.Executor(
            1, resources_per_worker={"CPU": 0.5}, roles=ServesNothing, storage_path=str(tmp_path)
        ) as a,
        asyncexec.Executor(1, resources_per_worker={"CPU": 0.5}, storage_path=str(tmp_path)) as b,
        asyncexec.WeightChannel(a, b, timeout_s=60) as channel,
    ):
        with anyio.fail_after(20), pytest.raises(asyncexec.ChannelError) as failed:
            await channel.push()
    message = str(failed.value)
    assert "serve_weights" in message and "'weights'" in message and "rank 0" in message, message
    assert channel.statistics().failed_pushes == 1


# Defects at the channel's joints ----------------------------------------------------------------


def _versioned_reports(config: dict[str, Any]) -> None:
    """Each report carries the version ``weights_version()`` said just before ``report()``."""
    asyncexec.receive_weights(lambda state, version: None)
    for i in range(config["steps"]):
        asyncexec.report({"i": i, "seen": asyncexec.weights_version()})


def _serve_counter() -> None:
    state = {"n": 0}
    asyncexec.serve_weights(lambda: dict(state))
    while True:
        state["n"] += 1
        asyncexec.report({"n": state["n"]})
        time.sleep(0.01)


async def test_a_report_holds_the_version_held_when_report_was_called(tmp_path: Any) -> None:
    """With buffer_size=1, report() waits for the consumer; a version installed during that
    wait was read as the report's (28 of 30 reports in the issue)."""
    async with (
        asyncexec.Executor(1, resources_per_worker={"CPU": 0.5}, storage_path=str(tmp_path)) as a,
        asyncexec.Executor(2, resources_per_worker={"CPU": 0.5}, storage_path=str(tmp_path)) as b,
        asyncexec.WeightChannel(a, b) as channel,
    ):
        learn = a.run(_serve_counter)
        await _next(learn)
        await channel.push()
        mismatched = 0
        async for step in b.run(_versioned_reports, {"steps": 30}, buffer_size=1):
            for report in step.reports:
                mismatched += report.version != report.metrics["seen"]
            await channel.push()  # installed while the next report() waits for credit
        assert mismatched == 0
        await learn.aclose()


def _reports_its_installs(config: dict[str, Any]) -> None:
    """Reports the versions its own install received (``config["steps"]`` reports); the install
    fails once the function has ended (what it installed into is gone)."""
    got: list[int] = []
    ended = False

    def install(state: Any, version: int) -> None:
        if ended:
            raise RuntimeError("installed into a run whose function has ended")
        got.append(version)

    asyncexec.receive_weights(install)
    try:
        for _ in range(config["steps"]):
            asyncexec.report({"installed": list(got)})
            time.sleep(0.01)
    finally:
        ended = True


@pytest.mark.parametrize("transport", ["object_store", "torch"])
async def test_runs_started_after_pushes_install_the_version_their_ranks_hold(
    transport: str, tmp_path: Any
) -> None:
    """docs/rl-loops.md's order, the first weights pushed and then the rollout's run started:
    every rank of the group the push had reached was taken for one that joins and sent the
    version again (with torch, a second push under a new version number). A run's function
    registers an install of its own: the second run on the target never got the weights (the
    rank held the version an earlier run's install had taken, so the driver sent nothing at
    its start), yet its reports said it had them. A push between the two runs called the
    ended run's install."""
    async with (
        asyncexec.Executor(1, resources_per_worker={"CPU": 0.5}, storage_path=str(tmp_path)) as a,
        asyncexec.Executor(1, resources_per_worker={"CPU": 0.5}, storage_path=str(tmp_path)) as b,
        asyncexec.WeightChannel(a, b, transport=transport) as channel,  # type: ignore[arg-type]
    ):
        learn = a.run(learner, {})
        await _next(learn)
        assert await channel.push() == 1  # held until the first run registers its install
        first = b.run(_reports_its_installs, {"steps": 100_000})
        assert (await _next(first)).reports[0].metrics["installed"] == [1]
        assert await channel.push() == 2  # into the first run's install
        while (await _next(first)).versions != (2,):
            pass
        await first.aclose()
        # Between two runs: the first run's install has ended with its function (it was
        # called, and failed the push); the version is held for the next run's.
        assert await channel.push() == 3
        async for step in b.run(_reports_its_installs, {"steps": 3}):
            [report] = step.reports
            assert (report.metrics["installed"], report.version) == ([3], 3)
        stats = channel.statistics()
        assert (stats.version, stats.pushes, stats.joins) == (3, 3, 0)
        await learn.aclose()


def _serve_any(config: dict[str, Any]) -> None:
    state = config["state"]
    asyncexec.serve_weights(lambda: state)
    while True:
        asyncexec.report({"alive": 1})
        time.sleep(0.01)


_received: list[Any] = []


def _receive_any() -> None:
    asyncexec.receive_weights(lambda state, version: _received.append(state))
    while True:
        asyncexec.report({"alive": 1})
        time.sleep(0.01)


def _received_states() -> list[Any]:
    return list(_received)


async def test_the_object_store_transport_moves_any_picklable_state(tmp_path: Any) -> None:
    """The docs said any picklable state; anything but a mapping was refused."""
    state = ("weights", [1.5, 2.5], {"nested": True})
    async with (
        asyncexec.Executor(1, resources_per_worker={"CPU": 0.5}, storage_path=str(tmp_path)) as a,
        asyncexec.Executor(1, resources_per_worker={"CPU": 0.5}, storage_path=str(tmp_path)) as b,
        asyncexec.WeightChannel(a, b) as channel,
    ):
        learn, roll = a.run(_serve_any, {"state": state}), b.run(_receive_any)
        await _next(learn)
        await _next(roll)
        assert await channel.push() == 1
        assert await b.execute(_received_states) == [[state]]
        await learn.aclose()
        await roll.aclose()


async def test_a_torch_channel_holds_its_rendezvous_port_from_the_moment_it_is_chosen(
    tmp_path: Any,
) -> None:
    """The port was chosen free, closed, and bound again at the join: anyone on the node could
    take it in between."""
    import socket

    async with asyncexec.Executor(1, resources_per_worker={"CPU": 0.5}) as a:
        [worker] = a._slot.group.workers  # type: ignore[union-attr]
        _, port = await worker.handle.call("channel_port", "weights", "g.1/0", 30.0)
        with socket.socket() as other, pytest.raises(OSError, match="in use"):
            other.bind(("", port))


def _serve_when_released(config: dict[str, Any]) -> None:
    """Serves a counter; a read waits while the file ``config["hold"]`` exists."""
    state = {"n": 0}

    def read() -> dict[str, Any]:
        while os.path.exists(config["hold"]):
            time.sleep(0.02)
        return dict(state)

    asyncexec.serve_weights(read)
    while True:
        state["n"] += 1
        asyncexec.report({"n": state["n"]})
        time.sleep(0.01)


def _roll_forever() -> None:
    asyncexec.receive_weights(lambda state, version: None)
    while True:
        asyncexec.report({"pid": os.getpid()})
        time.sleep(0.01)


async def test_a_push_delivers_to_a_target_group_that_restarted_during_its_read(
    tmp_path: Any,
) -> None:
    """The push's targets were fixed before the source's state was read: a group that joined
    during the read got the previous version, and the new one went only to the dead group."""
    hold = str(tmp_path / "hold")
    async with (
        asyncexec.Executor(1, resources_per_worker={"CPU": 0.5}, storage_path=str(tmp_path)) as a,
        asyncexec.Executor(
            2,
            resources_per_worker={"CPU": 0.5},
            storage_path=str(tmp_path),
            restart=asyncexec.RestartPolicy(max_restarts=2),
        ) as b,
        asyncexec.WeightChannel(a, b) as channel,
        anyio.create_task_group() as tg,
    ):
        learn, roll = a.run(_serve_when_released, {"hold": hold}), b.run(_roll_forever)
        await _next(learn)
        await _next(roll)
        assert await channel.push() == 1
        await anyio.Path(hold).touch()  # the next read waits
        pushed: list[int] = []
        done = anyio.Event()

        async def push() -> None:
            pushed.append(await channel.push())
            done.set()

        tg.start_soon(push)
        pid = (await _next(roll)).reports[1].metrics["pid"]
        os.kill(pid, signal.SIGKILL)
        while (step := await _next(roll)).attempt == 1:  # the new group joined, during the read
            pass
        assert step.versions == (1, 1) and not pushed
        await anyio.Path(hold).unlink()
        with anyio.fail_after(60):
            await done.wait()
        assert pushed == [2]
        assert await b.execute(asyncexec.weights_version) == [2, 2]
        await learn.aclose()
        await roll.aclose()


# A push that fails -------------------------------------------------------------------------------


def _parse_fails(state: Any) -> None:
    raise ValueError(f"cannot load {sorted(state)}")


class InstallFails:
    """A target whose install raises, a call below it."""

    def __init__(self) -> None:
        asyncexec.receive_weights(lambda state, version: _parse_fails(state))


class LoadFails(asyncexec.RolloutServer):
    """A rollout server whose ``load_weights`` raises, a call below it."""

    async def chunks(self, prompt: Any) -> Any:
        yield prompt

    def load_weights(self, state: Any, version: int) -> None:
        _parse_fails(state)


class ReadFails:
    """A source whose read raises."""

    def __init__(self) -> None:
        asyncexec.serve_weights(self.read)

    def read(self) -> Any:
        raise RuntimeError("the state is torn")


class ServesOne:
    def __init__(self) -> None:
        asyncexec.serve_weights(lambda: {"w": 1})


@pytest.mark.parametrize("target", [InstallFails, LoadFails])
async def test_a_failed_install_keeps_the_workers_traceback_also_through_pickle(
    target: type,
) -> None:
    """The ChannelError kept the message and dropped the worker's traceback: a copy that
    crossed a process (pickled), or a log of its text, had no word of where it failed. The same
    for an install function and a rollout server's ``load_weights``."""
    cpu = {"CPU": 0.5}
    async with (
        asyncexec.Executor(1, resources_per_worker=cpu, roles=ServesOne) as a,
        asyncexec.Executor(1, resources_per_worker=cpu, roles=target) as b,
        asyncexec.WeightChannel(a, b, timeout_s=30) as channel,
    ):
        with pytest.raises(asyncexec.ChannelError) as failed:
            await channel.push()
    error = failed.value
    assert "cannot load ['w']" in str(error).splitlines()[0]
    for copy in (error, pickle.loads(pickle.dumps(error))):
        assert "_parse_fails" in copy.remote_traceback, copy.remote_traceback
        assert "_parse_fails" in str(copy)
    if target is LoadFails:
        assert "in load_weights" in error.remote_traceback, error.remote_traceback


async def test_a_failed_read_raises_and_logs_no_unhandled_ray_error() -> None:
    """Besides the ChannelError, Ray logged "Unhandled error" with the worker's traceback at
    ERROR level: the state's reference of the failed read was never awaited."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    ray_worker = logging.getLogger("ray._private.worker")
    ray_worker.addHandler(handler)
    cpu = {"CPU": 0.5}
    try:
        async with (
            asyncexec.Executor(1, resources_per_worker=cpu, roles=ReadFails) as a,
            asyncexec.Executor(1, resources_per_worker=cpu) as b,
        ):
            async with asyncexec.WeightChannel(a, b, timeout_s=30) as channel:
                with pytest.raises(asyncexec.ChannelError, match="the state is torn"):
                    await channel.push()
            # Closed, the channel holds no reference: Ray reports an error object that was
            # never read when its last reference goes.
            gc.collect()
            await a.execute(os.getpid)  # a round trip to the source once the refs are freed
            gc.collect()
            await b.execute(os.getpid)
    finally:
        ray_worker.removeHandler(handler)
    unhandled = [r.getMessage()[:200] for r in records if "Unhandled error" in r.getMessage()]
    assert unhandled == []


# A push cancelled while it reads -----------------------------------------------------------------


class HeldRead:
    """A source whose read takes its state at once, then waits for a file (``hold``) before it
    returns it; it says it is reading by making ``reading``."""

    def __init__(self, hold: str, reading: str) -> None:
        self.state = {"w": 1}
        self.hold, self.reading = hold, reading
        asyncexec.serve_weights(self.read)

    def read(self) -> dict[str, int]:
        state = dict(self.state)
        open(self.reading, "w").close()
        while os.path.exists(self.hold):
            time.sleep(0.005)
        return state

    def set(self, w: int) -> None:
        self.state = {"w": w}


class Holds:
    """A target that keeps what it installed last."""

    def __init__(self) -> None:
        self.held: tuple[Any, int] | None = None
        asyncexec.receive_weights(self.install)

    def install(self, state: Any, version: int) -> None:
        self.held = (state, version)

    def get(self) -> tuple[Any, int] | None:
        return self.held


async def test_a_push_cancelled_during_its_read_does_not_leave_its_state_under_the_next_version(
    tmp_path: Any,
) -> None:
    """The installs go out with the read (by reference), so a push cancelled while its read
    ran still installed that read's state once it ended, as version 1, while the channel stayed
    at version 0: the next push was numbered 1 again, every target skipped it as a version it
    held, and went on with the cancelled push's older state while the channel said it had the
    new one."""
    hold, reading = str(tmp_path / "hold"), str(tmp_path / "reading")
    await anyio.Path(hold).touch()
    cpu = {"CPU": 0.5}
    async with (
        asyncexec.Executor(
            1, resources_per_worker=cpu, roles=asyncexec.Role(HeldRead, hold, reading)
        ) as a,
        asyncexec.Executor(2, resources_per_worker=cpu, roles=Holds) as b,
        asyncexec.WeightChannel(a, b, timeout_s=60) as channel,
    ):
        with anyio.fail_after(30), anyio.CancelScope() as scope:

            async def cancel_once_reading() -> None:
                while not await anyio.Path(reading).exists():  # noqa: ASYNC110 - a worker's file
                    await anyio.sleep(0.01)
                scope.cancel()

            async with anyio.create_task_group() as tg:
                tg.start_soon(cancel_once_reading)
                await channel.push()
        assert scope.cancel_called
        await a.call(asyncexec.method(HeldRead, HeldRead.set), 2)
        await anyio.Path(hold).unlink()  # the cancelled push's read returns {"w": 1}
        get = asyncexec.method(Holds, Holds.get)
        with anyio.fail_after(30):
            while None in await b.call(get):  # noqa: ASYNC110 - until its installs landed
                await anyio.sleep(0.01)
            version = await channel.push()  # reads {"w": 2}
        held = await b.call(get)
        assert held == [({"w": 2}, version)] * 2, (held, version)


class DiesReading:
    """A source whose process dies while its state is read."""

    def __init__(self) -> None:
        asyncexec.serve_weights(lambda: os._exit(1))


async def test_a_source_that_dies_while_read_fails_the_push_naming_the_source() -> None:
    """The installs go out with the read and fail with its error when it fails; a dead
    source's error, taken as the installs' own, would read as every target dead, each
    skipped, and the push would return as if delivered."""
    cpu = {"CPU": 0.5}
    async with (
        asyncexec.Executor(1, resources_per_worker=cpu, roles=DiesReading, name="src") as a,
        asyncexec.Executor(2, resources_per_worker=cpu, name="dst") as b,
        asyncexec.WeightChannel(a, b, timeout_s=30) as channel,
    ):
        with anyio.fail_after(30), pytest.raises(asyncexec.ChannelError) as failed:
            await channel.push()
        assert await b.execute(asyncexec.weights_version) == [None, None]
    assert "reading version 1" in str(failed.value), failed.value
    assert isinstance(failed.value.__cause__, asyncexec.WorkerCrashedError), failed.value
    assert channel.statistics().delivered == 0


_reserved: list[tuple[str, int]] = []  # the store servers reserved on this source rank


def _no_port_on_rank_1() -> None:
    """On the source's rank 1, the store server of the torch transport's port call cannot be
    made; rank 0 keeps the address and port of each store server it makes."""
    import torch.distributed as dist

    made = dist.TCPStore

    def fails(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no port here")

    def kept(host: str, *args: Any, **kwargs: Any) -> Any:
        store = made(host, *args, **kwargs)
        _reserved.append((host, store.port))
        return store

    rank = asyncexec.get_context().world_rank
    dist.TCPStore = fails if rank == 1 else kept  # type: ignore[misc, assignment]


def _listening() -> list[bool]:
    """Whether each store server this rank reserved still takes connections."""
    import socket

    listening = []
    for address, port in _reserved:
        with socket.socket() as probe:
            probe.settimeout(5)
            listening.append(probe.connect_ex((address, port)) == 0)
    return listening


@pytest.mark.timeout(120)
async def test_a_sharded_torch_set_up_that_fails_closes_the_store_servers_it_reserved() -> None:
    """Defect: the set-up reserved a store server on a source rank and started that rank's
    group's joins before the next source's port call; when that call failed, the push raised
    but the first group formed after it, holding its store server (a listening socket and a
    thread) and its ranks' sockets until the next set-up or the channel's close. The set-up
    now reserves every source's server before any join, and one that fails closes the
    servers it reserved before it raises."""
    cpu = {"CPU": 0.5}
    async with (
        asyncexec.Executor(2, resources_per_worker=cpu) as a,
        asyncexec.Executor(1, resources_per_worker=cpu) as b,
        asyncexec.WeightChannel(a, b, transport="torch", sharded=True, timeout_s=30) as channel,
    ):
        await a.execute(_no_port_on_rank_1)
        with pytest.raises(asyncexec.ChannelError, match="no port here"):
            await channel.push()
        assert await a.execute(_listening) == [[False], []]
