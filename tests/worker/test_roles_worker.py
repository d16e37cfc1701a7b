"""The worker side of worker classes (roles), against a real worker: a Ray actor, and a local
worker (threads of this process). Instances are made from one payload in role order, inside the
worker's context; their methods are called (plain in a thread, ``async def`` on the loop, errors
as outcomes); a run's function can be a method; a reset drops the instances. A rollout server's
gate loads weights that arrive at once one at a time."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, ClassVar

import pytest
import ray
from conftest import wait_no_local_threads
from ray import cloudpickle

from asyncexec import (
    Checkpoint,
    ExecutorStateError,
    Role,
    RolloutServer,
    WorkerContext,
    get_context,
    receive_weights,
    report,
)
from asyncexec._dispatch._role import roles_payload
from asyncexec._driver.cluster._local import LocalWorker
from asyncexec._wire._protocol import Outcome, RoleFailure, RoleMethod, RunStart
from asyncexec._worker._actor import WorkerActor
from asyncexec._worker._gate import Gate

#: Bounds every wait on a worker.
WAIT_S = 30.0


class Counter:
    """A role with state: made with the worker's context, plain and async methods."""

    def __init__(self, start: int, *, step: int = 1) -> None:
        self.value = start
        self.step = step
        self.rank = get_context().world_rank
        self.init_thread = threading.get_ident()
        self.restored: str | None = None

    def restore(self, checkpoint: Checkpoint) -> None:
        self.restored = checkpoint.path

    def add(self, n: int = 1) -> int:
        self.value += n * self.step
        return self.value

    async def add_async(self, n: int) -> int:
        await asyncio.sleep(0)
        self.value += n
        return self.value

    def state(self) -> dict[str, Any]:
        return {"value": self.value, "rank": self.rank, "restored": self.restored}

    def threads(self) -> tuple[int, int]:
        """The thread of ``__init__`` and of this plain call."""
        return self.init_thread, threading.get_ident()

    async def loop_thread(self) -> int:
        return threading.get_ident()

    def fail(self) -> None:
        raise ValueError("counter refused")

    async def fail_async(self) -> None:
        raise KeyError("async counter refused")

    def meet(self, key: str) -> int:
        """Waits for another call at a barrier of this process: passes only when calls run at
        once."""
        return _barriers[key].wait(timeout=WAIT_S)

    def sizes(self, part: Any, *, other: Any) -> tuple[str, str]:
        return type(part).__name__, type(other).__name__

    def in_context(self) -> bool:
        return getattr(_marks, "inside", False)

    def train(self, config: dict[str, int]) -> int:
        for i in range(config["steps"]):
            self.value += 1
            report({"i": i, "value": self.value, "rank": get_context().world_rank})
        return self.value

    async def train_async(self) -> str:
        report({"async": True})
        return "done"


class Doubler:
    """A second role, made after the first: it sees the worker's context too."""

    def __init__(self) -> None:
        self.world_size = get_context().world_size

    def double(self, x: int) -> int:
        return 2 * x


class LoopSeer:
    """Sees, in ``__init__``, the loop its async methods are called on (as an engine that lives
    on the worker's loop does)."""

    def __init__(self) -> None:
        self.seen = RolloutServer._asyncexec_loop()

    async def seen_is_running(self) -> bool:
        return self.seen is asyncio.get_running_loop()

    def seen_later(self) -> bool:
        """Whether a method called after ``__init__`` sees a loop (it is for ``__init__``)."""
        return RolloutServer._asyncexec_loop() is not None


class Broken:
    def __init__(self) -> None:
        raise RuntimeError("cannot start")


class BadRestore:
    def restore(self, checkpoint: Checkpoint) -> None:
        raise OSError("checkpoint unreadable")


_marks = threading.local()


@contextlib.contextmanager
def _marked() -> Iterator[None]:
    """A stand-in for a backend's function context (the CUDA device): marks the thread."""
    _marks.inside = True
    try:
        yield
    finally:
        _marks.inside = False


async def _call(target: Any, method: str, /, *args: Any, **kwargs: Any) -> Any:
    """Call a method of a worker actor, or of a local worker, and wait for it (bounded)."""
    if not isinstance(target, LocalWorker) or "__getattr__" in vars(LocalWorker):
        ref = getattr(target, method).remote(*args, **kwargs)
    else:
        ref = target.call(method, *args, **kwargs)

    async def wait() -> Any:
        return await ref

    return await asyncio.wait_for(wait(), WAIT_S)


class Handle:
    """A worker set up as a group sets it up (rank 0 of one), called the same way in both
    modes."""

    def __init__(self, target: Any, context: WorkerContext) -> None:
        self.target = target
        self.context = context

    async def __call__(self, method: str, /, *args: Any, **kwargs: Any) -> Any:
        return await _call(self.target, method, *args, **kwargs)


async def _set_up(target: Any) -> Handle:
    meta = await _call(target, "describe")
    context = WorkerContext(
        world_rank=0,
        local_rank=0,
        node_rank=0,
        world_size=1,
        local_world_size=1,
        node_id=meta.node_id,
        node_ip=meta.node_ip,
        pid=meta.pid,
    )
    assert (await _call(target, "setup", {}, context, None)).kind == "ok"
    return Handle(target, context)


@contextlib.asynccontextmanager
async def _local_worker(name: str) -> AsyncIterator[Handle]:
    """A local worker set up as rank 0 of a group of one; after the block it is reset (which
    forgets its channels: local workers share them) and killed, and none of its threads may
    be left."""
    target = LocalWorker(name)
    worker = await _set_up(target)
    try:
        yield worker
    finally:
        await worker("reset", 5.0, None)
        target.kill()
    wait_no_local_threads()


@pytest.fixture
async def worker(mode: str) -> AsyncIterator[Handle]:
    """One worker, set up as rank 0 of a group of one; killed after the test."""
    target: Any = (
        LocalWorker("roles") if mode == "local" else WorkerActor.options(num_cpus=0).remote()
    )
    try:
        yield await _set_up(target)
    finally:
        if mode == "local":
            target.kill()
        else:
            ray.kill(target)


def _payload(*roles: Role[Any]) -> bytes:
    return roles_payload(roles)


async def test_roles_are_made_in_order_inside_the_workers_context(worker: Handle) -> None:
    outcome = await worker("make_roles", _payload(Role(Counter, 5, step=2), Role(Doubler)))
    assert outcome == Outcome("ok")
    assert await worker("call_role", 0, "add", 3) == Outcome("ok", 11)
    assert await worker("call_role", 1, "double", 21) == Outcome("ok", 42)
    assert (await worker("call_role", 0, "state")).value == {
        "value": 11,
        "rank": 0,
        "restored": None,
    }


async def test_plain_methods_run_in_threads_and_async_ones_on_the_loop(worker: Handle) -> None:
    await worker("make_roles", _payload(Role(Counter, 0)))
    init_thread, call_thread = (await worker("call_role", 0, "threads")).value
    loop_thread = (await worker("call_role", 0, "loop_thread")).value
    assert loop_thread not in (init_thread, call_thread)
    assert await worker("call_role", 0, "add_async", 4) == Outcome("ok", 4)


async def test_init_sees_the_loop_its_async_methods_run_on(worker: Handle) -> None:
    await worker("make_roles", _payload(Role(LoopSeer)))
    assert await worker("call_role", 0, "seen_is_running") == Outcome("ok", True)
    assert await worker("call_role", 0, "seen_later") == Outcome("ok", False)


async def test_an_instance_made_outside_a_worker_sees_no_loop() -> None:
    assert LoopSeer().seen is None  # even with a loop running here
    assert await asyncio.to_thread(lambda: LoopSeer().seen) is None


async def test_plain_calls_on_one_instance_run_at_once_up_to_max_concurrency(
    worker: Handle,
) -> None:
    await worker("make_roles", _payload(Role(Counter, 0).options(max_concurrency=2)))
    await worker("execute", _make_barrier, "meet")
    outcomes = await asyncio.gather(*[worker("call_role", 0, "meet", "meet") for _ in range(2)])
    assert sorted(o.value for o in outcomes) == [0, 1]


#: Barriers of this process (a worker's, or in local mode the test's), made by ``execute``.
_barriers: dict[str, threading.Barrier] = {}


def _make_barrier(key: str) -> None:
    _barriers[key] = threading.Barrier(2)


async def test_errors_of_methods_come_back_as_outcomes(worker: Handle) -> None:
    await worker("make_roles", _payload(Role(Counter, 0)))
    failed = await worker("call_role", 0, "fail")
    assert failed.kind == "error"
    assert isinstance(failed.error, ValueError)
    assert "counter refused" in failed.traceback
    assert "in fail" in failed.traceback
    failed = await worker("call_role", 0, "fail_async")
    assert isinstance(failed.error, KeyError)
    missing = await worker("call_role", 0, "no_such_method")
    assert isinstance(missing.error, ExecutorStateError)
    assert "no method 'no_such_method'" in str(missing.error)
    missing = await worker("call_role", 3, "add")
    assert isinstance(missing.error, ExecutorStateError)


async def test_restore_is_called_after_init_when_a_checkpoint_is_given(
    worker: Handle, tmp_path: Path
) -> None:
    checkpoint = Checkpoint(tmp_path)
    await worker("make_roles", _payload(Role(Counter, 1), Role(Doubler)), checkpoint)
    assert (await worker("call_role", 0, "state")).value["restored"] == str(tmp_path)
    await worker("make_roles", _payload(Role(Counter, 1)), None)
    assert (await worker("call_role", 0, "state")).value["restored"] is None


@pytest.mark.parametrize(
    ("roles", "failure", "error"),
    [
        ((Role(Counter, 0), Role(Broken)), RoleFailure(1, "init"), RuntimeError),
        ((Role(BadRestore), Role(Counter, 0)), RoleFailure(0, "restore"), OSError),
    ],
)
async def test_a_role_that_fails_to_start_is_named_and_no_instance_is_kept(
    worker: Handle, tmp_path: Path, roles: tuple[Role[Any], ...], failure: RoleFailure, error: type
) -> None:
    outcome = await worker("make_roles", _payload(*roles), Checkpoint(tmp_path))
    assert outcome.kind == "error"
    assert outcome.value == failure
    assert isinstance(outcome.error, error)
    after = await worker("call_role", 0, "state")
    assert isinstance(after.error, ExecutorStateError)


async def test_a_role_that_does_not_unpickle_on_the_worker_is_named(worker: Handle) -> None:
    payload = cloudpickle.dumps((cloudpickle.dumps(Role(Doubler).spec()), b"not a pickle"))
    outcome = await worker("make_roles", payload)
    assert outcome.value == RoleFailure(1, "load")


async def test_the_backends_context_is_entered_around_the_roles_code(worker: Handle) -> None:
    await worker("make_roles", _payload(Role(Counter, 0)), None, _marked)
    assert await worker("call_role", 0, "in_context") == Outcome("ok", True)
    await worker("make_roles", _payload(Role(Counter, 0)))
    assert await worker("call_role", 0, "in_context") == Outcome("ok", False)


async def _run_to_end(worker: Handle) -> tuple[list[dict[str, Any]], Outcome]:
    reports: list[dict[str, Any]] = []
    while True:
        poll = await worker("poll", len(reports), 64)
        reports += poll.reports
        if poll.outcome is not None:
            return reports, poll.outcome


def _start(worker: Handle, tmp_path: Path) -> RunStart:
    context = replace(worker.context, run_id="run", attempt=1, storage_path=str(tmp_path))
    return RunStart(context, None, 16, 0, {})


async def test_a_runs_function_can_be_a_method_of_the_workers_instance(
    worker: Handle, tmp_path: Path
) -> None:
    await worker("make_roles", _payload(Role(Counter, 10)))
    payload = cloudpickle.dumps((RoleMethod(0, "train"), {"steps": 3}))
    await worker("start_run", payload, _start(worker, tmp_path))
    reports, outcome = await _run_to_end(worker)
    assert [r["value"] for r in reports] == [11, 12, 13]
    assert outcome == Outcome("ok", 13)
    # The run changed the instance that calls reach.
    assert await worker("call_role", 0, "add", 0) == Outcome("ok", 13)
    # An async def method without a config parameter.
    await worker(
        "start_run",
        cloudpickle.dumps((RoleMethod(0, "train_async"), None)),
        _start(worker, tmp_path),
    )
    reports, outcome = await _run_to_end(worker)
    assert (reports, outcome) == ([{"async": True}], Outcome("ok", "done"))


async def test_a_reset_drops_the_instances(worker: Handle, tmp_path: Path) -> None:
    await worker("make_roles", _payload(Role(Counter, 0)))
    assert (await worker("reset", 5.0, None)).kind == "ok"
    dropped = await worker("call_role", 0, "add")
    assert isinstance(dropped.error, ExecutorStateError)
    assert "no instances of roles" in str(dropped.error)
    await worker("setup", {}, worker.context, None)  # the next lease
    payload = cloudpickle.dumps((RoleMethod(0, "train"), {"steps": 1}))
    with pytest.raises(ExecutorStateError):
        await worker("start_run", payload, _start(worker, tmp_path))


@pytest.mark.ray_only
async def test_object_refs_among_the_arguments_arrive_resolved(worker: Handle) -> None:
    """How the driver sends a rank its parts: references, positional and keyword."""
    await worker("make_roles", _payload(Role(Counter, 0)))
    part, other = ray.put([1, 2]), ray.put({"x": 1})
    assert await worker("call_role", 0, "sizes", part, other=other) == Outcome(
        "ok", ("list", "dict")
    )


class LateHolder(RolloutServer):
    """A rollout server made as the docs show it: ``super().__init__()`` first, then what its
    ``load_weights`` loads into."""

    def __init__(self, channel: str) -> None:
        super().__init__(channel=channel)
        self.weights: Any = None
        self.load_thread: int | None = None

    async def chunks(self, prompt: Any) -> AsyncIterator[Any]:
        yield prompt

    def load_weights(self, state: Any, version: int) -> None:
        self.weights = state
        self.load_thread = threading.get_ident()

    async def held(self) -> tuple[Any, int | None, bool]:
        """The weights, their version, and whether they loaded off this (the worker's) loop."""
        return self.weights, self.weights_version(), self.load_thread != threading.get_ident()


@pytest.mark.timeout(60)
async def test_a_server_made_where_a_version_is_held_loads_it_once_made(
    worker: Handle, tmp_path: Path
) -> None:
    """Defect: a rollout server made in a worker that held a version of its channel (its roles
    made again after a spare took a rank, an elastic resize) had ``load_weights`` called inside
    ``super().__init__()``, before its own ``__init__`` had set up what it loads into: the
    weights were lost (or the start failed) while the server said it held that version. The
    held version loads once the instance is made, in a thread."""
    channel = f"held-{tmp_path.name}"
    await worker("channel_receive", channel, 3, {"w": 1})
    try:
        assert (await worker("make_roles", _payload(Role(LateHolder, channel)))).kind == "ok"
        assert await worker("call_role", 0, "held") == Outcome("ok", ({"w": 1}, 3, True))
    finally:
        await worker("reset", 5.0, None)  # (forgets the channel: local workers share it)


async def test_local_workers_in_one_process_hold_instances_of_their_own() -> None:
    """In local mode the instances live in each worker's place, not in the process."""
    targets = [LocalWorker("a"), LocalWorker("b")]
    try:
        first, second = [await _set_up(t) for t in targets]
        await first("make_roles", _payload(Role(Counter, 0)))
        await second("make_roles", _payload(Role(Counter, 100)))
        assert await first("call_role", 0, "add") == Outcome("ok", 1)
        assert await second("call_role", 0, "add") == Outcome("ok", 101)
        await first("reset", 5.0, None)
        assert await second("call_role", 0, "add") == Outcome("ok", 102)
    finally:
        for target in targets:
            target.kill()
    wait_no_local_threads()


# A rollout server's gate: installs of weights that arrive at once ------------------------------

_WAIT_S = 10.0  # (a bound for each wait of the gate's test)


class _Loads:
    """A ``load_weights`` that records each load and how many ran at once; the load of
    ``blocked`` waits for ``release``."""

    def __init__(self, blocked: int) -> None:
        self.blocked = blocked
        self.lock = threading.Lock()
        self.started = threading.Event()  # the blocked load began
        self.release = threading.Event()
        self.loaded: list[int] = []
        self.running = 0
        self.most = 0

    def __call__(self, state: Any, version: int) -> None:
        with self.lock:
            self.running += 1
            self.most = max(self.most, self.running)
        if version == self.blocked:
            self.started.set()
            assert self.release.wait(_WAIT_S)
        with self.lock:
            self.running -= 1
            self.loaded.append(version)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("first", "second", "loaded"),
    [(1, 2, [1, 2]), (2, 1, [2])],
    ids=["older_first", "newer_first"],
)
def test_concurrent_installs_load_one_at_a_time_and_leave_the_newest(
    first: int, second: int, loaded: list[int]
) -> None:
    """Two installs at once (each in its own thread, as ``install_weights`` calls run) both
    passed the version check and loaded at the same time; the one that finished last set the
    gate's version, so the older weights could stay while the newer version was said held."""
    gate = Gate()
    load = _Loads(blocked=first)
    threads = [
        threading.Thread(target=gate.install, args=(load, {"w": v}, v), daemon=True)
        for v in (first, second)
    ]
    threads[0].start()
    assert load.started.wait(_WAIT_S)
    threads[1].start()
    deadline = time.monotonic() + _WAIT_S
    # Until the second install waits at the gate (or, loading at once, has loaded).
    while not (gate.installing == 2 or second in load.loaded):
        assert time.monotonic() < deadline, "the second install never reached the gate"
        time.sleep(0.001)
    load.release.set()
    for thread in threads:
        thread.join(_WAIT_S)
    assert load.most == 1
    assert load.loaded == loaded
    assert gate.version == 2 and gate.installing == 0 and not gate.loading


# What a worker lets go of: instances made part-way, a dropped rollout server -----------------


class _Entered:
    """Events of this process (local workers share it): an ``__init__`` began, and lets it
    end; a ``close()`` ran."""

    init_began = threading.Event()
    init_release = threading.Event()
    closed = threading.Event()


class ClosesWhenDropped:
    """A role that holds something to let go of (an engine): its ``close()`` is recorded."""

    def close(self) -> None:
        _Entered.closed.set()


class SlowToStart:
    """A role whose ``__init__`` waits until the test lets it end (an engine loading)."""

    def __init__(self) -> None:
        _Entered.init_began.set()
        assert _Entered.init_release.wait(WAIT_S)


@pytest.mark.timeout(30)
async def test_roles_made_part_way_are_closed_when_the_make_is_cancelled() -> None:
    """Defect: a ``make_roles`` cancelled while it made a later role (a group's start cancelled,
    a local worker closed) left the instances it had made unclosed: no worker held them, and
    nothing called their ``close()`` (an engine kept its processes and memory)."""
    for event in (_Entered.init_began, _Entered.init_release, _Entered.closed):
        event.clear()
    target = LocalWorker("part-way")
    try:
        await _set_up(target)
        ref = target.call("make_roles", _payload(Role(ClosesWhenDropped), Role(SlowToStart)))
        assert await asyncio.to_thread(_Entered.init_began.wait, WAIT_S)
        target.cancel(ref)
        with pytest.raises(Exception, match="cancelled"):
            await asyncio.wait_for(_awaited_ref(ref), WAIT_S)
        assert _Entered.closed.is_set()
    finally:
        _Entered.init_release.set()
        target.kill()
    wait_no_local_threads()


async def _awaited_ref(ref: Any) -> Any:
    return await ref


class DroppedServer(RolloutServer):
    """A rollout server that records the versions it loads (in this process)."""

    loaded: ClassVar[list[int]] = []

    async def chunks(self, prompt: Any) -> AsyncIterator[Any]:
        yield prompt

    def load_weights(self, state: Any, version: int) -> None:
        DroppedServer.loaded.append(version)


@pytest.mark.timeout(30)
async def test_a_dropped_rollout_server_receives_no_more_weights(tmp_path: Path) -> None:
    """Defect: a rollout server that its worker let go of (its roles made again, after a spare
    took a rank or an elastic resize) stayed registered for its channel's installs: until the
    next roles registered theirs (or for good, when they had none), each version pushed was
    loaded into the closed server (an engine shut down), and the instance was never freed."""
    DroppedServer.loaded.clear()
    channel = f"dropped-{tmp_path.name}"
    async with _local_worker("dropped") as worker:
        server = _payload(Role(DroppedServer, channel=channel))
        assert (await worker("make_roles", server)).kind == "ok"
        await worker("channel_receive", channel, 1, {"w": 1})
        assert (await worker("make_roles", _payload(Role(Counter, 0)))).kind == "ok"
        await worker("channel_receive", channel, 2, {"w": 2})
        assert DroppedServer.loaded == [1]


class FailsAfterRegistering(DroppedServer):
    """A rollout server whose ``__init__`` fails after ``super().__init__()`` registered its
    installs; each instance made is recorded (weakly)."""

    made: ClassVar[list[weakref.ref[FailsAfterRegistering]]] = []

    def __init__(self, *, channel: str) -> None:
        super().__init__(channel=channel)
        FailsAfterRegistering.made.append(weakref.ref(self))
        raise RuntimeError("engine failed to start")


@pytest.mark.timeout(30)
async def test_a_rollout_server_whose_making_failed_is_let_go_of(tmp_path: Path) -> None:
    """Defect: a rollout server whose ``__init__`` failed after ``super().__init__()`` (its
    engine failed to start) stayed registered for its channel's installs until the next roles
    registered theirs (for good, when they had none): each version pushed meanwhile was handed
    to the failed instance (kept in it, never loaded), and the instance was never freed."""
    FailsAfterRegistering.made.clear()
    channel = f"failed-{tmp_path.name}"
    async with _local_worker("failed") as worker:
        roles = (Role(DroppedServer, channel=channel), Role(FailsAfterRegistering, channel=channel))
        outcome = await worker("make_roles", _payload(*roles))
        assert outcome.value == RoleFailure(1, "init")
        del outcome  # (its error's traceback holds the instance)
        await worker("channel_receive", channel, 1, {"w": 1})
        assert (await worker("make_roles", _payload(Role(Counter, 0)))).kind == "ok"
        gc.collect()
        assert [made() for made in FailsAfterRegistering.made] == [None]


class SlowServer(DroppedServer):
    """A rollout server whose engine loads after ``super().__init__()`` until the test lets it
    end; each instance made is recorded (weakly)."""

    made: ClassVar[list[weakref.ref[SlowServer]]] = []

    def __init__(self, *, channel: str) -> None:
        super().__init__(channel=channel)
        SlowServer.made.append(weakref.ref(self))
        SlowToStart()


def _wait_freed(refs: list[weakref.ref[Any]], timeout_s: float = 5.0) -> bool:
    """Whether each of ``refs``' objects is freed within ``timeout_s`` (the thread that made
    one lets go of it as it ends)."""
    deadline = time.monotonic() + timeout_s
    while True:
        gc.collect()
        if all(ref() is None for ref in refs):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


@pytest.mark.timeout(30)
async def test_a_rollout_server_whose_making_was_cancelled_is_let_go_of(tmp_path: Path) -> None:
    """Defect: a ``make_roles`` cancelled while a rollout server's ``__init__`` loaded its
    engine, after ``super().__init__()`` (a group's start cancelled), left that server
    registered for its channel's installs: each version pushed was handed to it (kept, never
    loaded), and it was never freed."""
    for event in (_Entered.init_began, _Entered.init_release):
        event.clear()
    SlowServer.made.clear()
    async with _local_worker("cancelled") as worker:
        try:
            server = _payload(Role(SlowServer, channel=tmp_path.name))
            ref = worker.target.call("make_roles", server)
            assert await asyncio.to_thread(_Entered.init_began.wait, WAIT_S)
            worker.target.cancel(ref)
            with pytest.raises(Exception, match="cancelled"):
                await asyncio.wait_for(_awaited_ref(ref), WAIT_S)
            _Entered.init_release.set()
            assert await asyncio.to_thread(_wait_freed, SlowServer.made)
        finally:
            _Entered.init_release.set()


class RefusesHeld:
    """A role that registers its own install in ``__init__``, which refuses the version the
    worker holds (a state of another shape)."""

    def __init__(self, channel: str) -> None:
        receive_weights(self.load, channel=channel)

    def load(self, state: Any, version: int) -> None:
        raise ValueError(f"cannot load version {version}")


@pytest.mark.timeout(30)
async def test_an_install_that_refuses_the_held_version_is_not_registered(tmp_path: Path) -> None:
    """Defect: a role whose ``__init__`` called ``receive_weights(install)``, where ``install``
    raised on the version the worker held, failed to start but stayed registered: each version
    pushed to the worker afterwards went to the failed instance's install, and the push failed
    with its error."""
    channel = f"refused-{tmp_path.name}"
    async with _local_worker("refused") as worker:
        await worker("channel_receive", channel, 1, {"w": 1})
        outcome = await worker("make_roles", _payload(Role(RefusesHeld, channel)))
        assert outcome.value == RoleFailure(0, "init")
        assert isinstance(outcome.error, ValueError)
        await worker("channel_receive", channel, 2, {"w": 2})
