"""The worker end of a weight channel, in this process (no Ray): how a source rank's read waits
for the ``serve_weights`` of a function that is running, and which torch store servers a source
rank keeps; and the driver's bookkeeping of the versions on their way, over a stand-in
transport."""

from __future__ import annotations

import gc
import logging
import socket
import threading
import weakref
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from asyncexec import ChannelError
from asyncexec._driver.channel._versions import Versions
from asyncexec._worker import _channel, _place
from asyncexec._worker._actor import _Worker


class _Running:
    """The session of a run whose function is running (it may register a reader yet)."""

    finished = False


class _Named(logging.Handler):
    """Sets ``event`` on the first warning that names ``serve_weights``."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.event = threading.Event()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "serve_weights" in message:
            self.messages.append(message)
            self.event.set()


@pytest.mark.timeout(30)
def test_a_read_that_waits_for_a_running_functions_serve_weights_names_it_soon(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A learner whose function runs and never calls ``serve_weights``: the push waited in
    silence until its bound (96 s of the default 120) before anything named the missing call.
    Now the rank says so in a warning once it has waited a little, and a function that calls
    it after all (one still loading its model) is read as before: no false failure."""
    monkeypatch.setattr(_channel, "_NAMED_AFTER_S", 0.05)
    place = _place.Place()
    place.session = _Running()  # type: ignore[assignment]
    token = _place.PLACE.set(place)
    named = _Named()
    logger = logging.getLogger("asyncexec.worker")
    logger.addHandler(named)
    result: list[Any] = []
    try:
        reader = threading.Thread(
            target=_place_run, args=(place, result), daemon=True, name="channel-read"
        )
        reader.start()
        assert named.event.wait(10), "no warning named serve_weights"
        assert reader.is_alive() and not result  # still waiting: not a failure
        _channel.serve_weights(lambda: {"w": 1}, channel="door")
        reader.join(10)
    finally:
        logger.removeHandler(named)
        _place.PLACE.reset(token)
        _channel.reset()
    assert result == [{"w": 1}]
    (message,) = named.messages
    assert "serve_weights(read, channel='door')" in message and "rank=" in message, message


def _place_run(place: _place.Place, result: list[Any]) -> None:
    _place.PLACE.set(place)
    result.append(_channel.read_state("door", 20.0, mapping=False))


def test_every_install_registered_later_gets_the_latest_state_the_rank_holds() -> None:
    """The next run's function registers an install of its own: it got nothing (the rank held
    the version its previous run's install took), while ``weights_version()`` said it had it.
    An install that takes keys out of its state leaves the kept state whole."""
    place = _place.Place()
    token = _place.PLACE.set(place)
    first: list[tuple[dict[str, int], int]] = []
    second: list[tuple[dict[str, int], int]] = []

    def takes_out(into: list[tuple[dict[str, int], int]]) -> Any:
        def install(state: dict[str, int], version: int) -> None:
            into.append((dict(state), version))
            state.pop("w")

        return install

    try:
        _channel.install_state("door", 1, {"w": 1})  # before any install: held
        assert _channel.receive_weights(takes_out(first), channel="door") == 1
        _channel.install_state("door", 2, {"w": 2})  # into the first run's install
        assert _channel.receive_weights(takes_out(second), channel="door") == 2
        assert _channel.weights_version("door") == 2 and place.version == 2
    finally:
        _place.PLACE.reset(token)
        _channel.reset()
    assert first == [({"w": 1}, 1), ({"w": 2}, 2)]
    assert second == [({"w": 2}, 2)]


class _Stuck:
    """A transport whose reads end at once and whose deliveries never do."""

    targets_before_read = False

    async def read(self, pending: Any) -> None:
        pass

    async def deliver(self, pending: Any, targets: Any) -> None:
        await anyio.sleep_forever()

    def broken(self) -> None:
        pass


@pytest.mark.timeout(10)
async def test_a_push_whose_delivery_the_channels_close_cuts_short_raises() -> None:
    """Defect: a push waiting for a delivery (``max_staleness=2``: the version before its own)
    that the channel's close cut short returned its version as if that one were installed;
    it now raises ``ChannelError`` naming the close."""
    worker = SimpleNamespace(handle=SimpleNamespace(key="w0"), rank=0)
    group = SimpleNamespace(closed=False, workers=[worker])
    slot = SimpleNamespace(group=group, timeline=None, config=SimpleNamespace(name="side"))
    versions = Versions("units", lambda: slot, lambda: slot, False, 2, 30.0, SimpleNamespace())
    versions.moves = _Stuck()
    outcome: list[Any] = []

    async def push() -> None:
        try:
            outcome.append(await versions.push())
        except ChannelError as exc:
            outcome.append(exc)

    async with anyio.create_task_group() as outer, anyio.create_task_group() as tg:
        versions.tg = tg
        assert await versions.push() == 1  # on its way, never delivered
        outer.start_soon(push)  # version 2 waits for version 1's delivery
        await anyio.wait_all_tasks_blocked()
        versions.tg = None  # the channel closes, as WeightChannel.__aexit__ does
        tg.cancel_scope.cancel()
    assert versions.version == 2
    assert len(outcome) == 1 and isinstance(outcome[0], ChannelError), outcome
    assert "closed before version 1 was delivered" in str(outcome[0])


class _JoinFails:
    """A transport whose joins fail (a joining rank's install raised)."""

    async def join(self, workers: Any) -> None:
        raise ChannelError("the install raised")

    def broken(self) -> None:
        pass


@pytest.mark.timeout(10)
async def test_a_join_that_failed_is_not_counted_as_a_join() -> None:
    """Defect: ``statistics().joins`` ("target ranks that joined after a restart and got the
    latest version") counted the joining ranks before their transfer, so a join that failed
    counted them too."""
    worker = SimpleNamespace(handle=SimpleNamespace(key="w0"), rank=0)
    group = SimpleNamespace(closed=False, workers=[worker])
    slot = SimpleNamespace(group=group, timeline=None, config=SimpleNamespace(name="side"))
    versions = Versions("units", lambda: slot, lambda: slot, False, 1, 30.0, SimpleNamespace())
    versions.moves = _JoinFails()
    versions.version = 3  # pushed before the restart: rank 0 of the fresh group holds none
    async with anyio.create_task_group() as tg:
        versions.tg = tg
        with pytest.raises(ChannelError, match="the install raised"):
            await versions.join(group)  # type: ignore[arg-type]
        versions.tg = None
    assert versions.counts["joins"] == 0


class _State:
    """A stand-in for a state's reference in the object store (held while referenced)."""


class _Delivers:
    """A transport whose reads give each version a state of its own and whose deliveries end
    at once."""

    targets_before_read = False

    def __init__(self) -> None:
        self.states: list[weakref.ref[_State]] = []

    async def read(self, pending: Any) -> None:
        state = _State()
        self.states.append(weakref.ref(state))
        pending.refs = [state]

    async def deliver(self, pending: Any, targets: Any) -> None:
        pass

    def broken(self) -> None:
        pass


@pytest.mark.timeout(10)
@pytest.mark.parametrize("max_staleness", [1, 3])
async def test_the_channel_holds_the_state_of_its_latest_version_only(max_staleness: int) -> None:
    """Defect: the driver kept the object-store references of the last ``max_staleness + 1``
    versions after they were delivered (two copies of the weights in the object store with
    the default, four with ``max_staleness=3``), where the docs promise the latest's only
    (for the ranks that join). Now a delivered version's state goes once a newer one is
    read."""
    worker = SimpleNamespace(handle=SimpleNamespace(key="w0"), rank=0)
    group = SimpleNamespace(closed=False, workers=[worker])
    slot = SimpleNamespace(group=group, timeline=None, config=SimpleNamespace(name="side"))
    versions = Versions(
        "units", lambda: slot, lambda: slot, False, max_staleness, 30.0, SimpleNamespace()
    )
    transport = versions.moves = _Delivers()
    async with anyio.create_task_group() as tg:
        versions.tg = tg
        for _ in range(5):
            await versions.push()
        await anyio.wait_all_tasks_blocked()  # every delivery ended
        versions.tg = None
    gc.collect()
    held = [ref() is not None for ref in transport.states]
    assert held == [False, False, False, False, True]
    assert versions.delivered == 5


@pytest.mark.timeout(10)
async def test_the_version_lag_of_ranks_that_left_the_target_goes_at_the_next_push() -> None:
    """Defect: ``asyncexec_channel_version_lag`` kept the series of every target rank it ever
    had until the channel closed: after the target's group shrank (or closed), the ranks that
    left were shown at their last lag for ever. A push now drops the series of the ranks it
    does not reach."""
    pytest.importorskip("prometheus_client")
    from asyncexec._driver.channel._sinks import channel_observer
    from asyncexec.testing import metrics_enabled

    def group_of(size: int) -> SimpleNamespace:
        workers = [
            SimpleNamespace(handle=SimpleNamespace(key=f"w{r}"), rank=r) for r in range(size)
        ]
        return SimpleNamespace(closed=False, workers=workers)

    slot = SimpleNamespace(group=group_of(4), timeline=None, config=SimpleNamespace(name="t"))
    log = SimpleNamespace(info=lambda *a, **k: None, warning=lambda *a, **k: None)
    with metrics_enabled() as registry:
        observer = channel_observer("shrinks", log, lambda: None)
        source = SimpleNamespace(group=group_of(1), timeline=None, config=slot.config)
        versions = Versions("units", lambda: source, lambda: slot, False, 1, 30.0, log, observer)
        versions.moves = _Delivers()

        def ranks() -> set[str]:
            found = registry.get_sample_value
            return {
                str(r)
                for r in range(4)
                if found("asyncexec_channel_version_lag", {"executor": "shrinks", "rank": str(r)})
                is not None
            }

        async with anyio.create_task_group() as tg:
            versions.tg = tg
            await versions.push()
            assert ranks() == {"0", "1", "2", "3"}
            slot.group = group_of(2)  # the target shrank to 2 ranks
            await versions.push()
            assert ranks() == {"0", "1"}
            slot.group = SimpleNamespace(closed=True, workers=[])  # and closed
            await versions.push()
            assert ranks() == set()
            versions.tg = None


@pytest.mark.timeout(20)
async def test_closing_a_channel_leaves_the_workers_event_loop_free_while_an_install_runs() -> None:
    """Defect: closing a channel told each worker to forget it on the actor's event loop,
    which waited there for an install still running (a delivery the close cut short): the
    worker answered nothing (report polls, calls) until the install ended. The worker now
    forgets it in a thread."""
    installing, release, ended = threading.Event(), threading.Event(), threading.Event()

    def install(state: Any, version: int) -> None:
        installing.set()
        release.wait(3)
        ended.set()

    _channel.receive_weights(install, channel="slow")
    installer = threading.Thread(
        target=_channel.install_state, args=("slow", 1, {"w": 1}), daemon=True
    )
    installer.start()
    seen: list[bool] = []

    async def meanwhile() -> None:  # the loop's next turn: before the install ended?
        seen.append(ended.is_set())
        release.set()

    try:
        assert installing.wait(10)
        async with anyio.create_task_group() as tg:
            tg.start_soon(meanwhile)
            await _Worker().channel_close("slow")
    finally:
        release.set()
        installer.join(10)
        _channel.reset()
    assert seen == [False]


class _Group:
    """A process group whose broadcasts end at once."""

    def broadcast(self, tensors: Any, options: Any) -> Any:
        return SimpleNamespace(wait=lambda: None)


@pytest.mark.timeout(30)
def test_a_target_rank_receives_cuda_tensors_on_its_own_gpu(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Defect: a target rank of the torch transport over nccl received into tensors on
    ``"cuda"``, the current device of the thread that receives, which never set one: GPU 0,
    for every rank of a node that sees its node's GPUs (asyncexec's default), so two ranks of
    one node met on one GPU (nccl refuses that) and a rank's buffers took another's memory.
    Now it receives on its own GPU, as ``get_device()`` finds it."""
    import torch

    made: list[str] = []
    empty = torch.empty

    def recorded(*args: Any, device: Any = None, **kwargs: Any) -> Any:
        made.append(str(device))
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", recorded)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    place = _place.Place()
    place.context = SimpleNamespace(  # type: ignore[assignment]
        world_rank=2, local_rank=1, accelerator_ids={"GPU": ("1",)}
    )
    token = _place.PLACE.set(place)
    try:
        _channel._end("gpus").groups["c.1/0"] = _Group()
        meta = [("w", (2, 3), "float32")]
        assert _channel.receive("gpus", 1, [("c.1/0", meta)], "cuda") == 24
    finally:
        _place.PLACE.reset(token)
        _channel.reset()
    assert made == ["cuda:1"]


@pytest.mark.timeout(30)
def test_a_sources_store_of_a_set_up_that_failed_is_closed_at_the_next_set_up() -> None:
    """Defect: the torch transport reserves each source rank's store server (listening, with
    its thread) before any rank joins; when a later source's port call failed, the servers of
    the sources before it were kept until the channel closed, one more at each failed set-up.
    The next set-up's port call closes them now (and only those of earlier set-ups)."""
    pytest.importorskip("torch")
    name = "store-leak-test"
    try:
        address, first = _channel.reserve_store(name, "ch.1/0", 5.0)  # source 1's failed
        _channel.reserve_store(name, "ch.2/0", 5.0)  # the next push's set-up
        _channel.reserve_store(name, "ch.1/1", 5.0)  # a late port call of the failed one
        assert sorted(_channel._ends[name].stores) == ["ch.1/1", "ch.2/0"]
        with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
            probe.settimeout(5)
            probe.connect((address, first))
    finally:
        _channel.close(name)
