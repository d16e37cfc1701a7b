"""Strict mode's expiry (``on_expire="requeue"``): a batch that would wait for samples about to
go beyond S cancels them instead and requeues their prompts at the next version, except a
prompt expired ``max_requeues`` times already (then it waits). The bound is checked from each
sample's ``versions``, not from the pipeline's own count.

The policy against stand-in servers in this process (no Ray: a request sleeps its prompt's
length), then through real rollout servers on Ray actors and in local mode."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace
from typing import Any, Literal

import anyio
import pytest

import asyncexec
from asyncexec._driver.pipeline import _pipeline
from asyncexec._driver.pipeline._budget import Budget

CPU = {"CPU": 0.25}


def _oldest(sample: asyncexec.Sample) -> int:
    """The learner's version of a sample's oldest chunk (None: before the first, version 0)."""
    return min(0 if v is None else v for v in sample.versions)


def _check_bound(batches: list[asyncexec.PipelineBatch], staleness: int) -> None:
    for batch in batches:
        for sample, told in zip(batch.samples, batch.staleness, strict=True):
            assert batch.version - _oldest(sample) <= staleness, (batch.version, sample)
            assert told == batch.version - _oldest(sample)


# The budget's part ----------------------------------------------------------------------------


def test_expiring_names_the_deadline_a_strict_batch_waits_for_once_b_are_finished() -> None:
    budget: Budget[str] = Budget(2, 1, strict=True)
    old = [budget.admit() for _ in range(4)]  # version 0, deadline 1
    budget.finish(old[0], 0, "a")
    assert budget.expiring() is None  # fewer than B finished: the batch waits anyway
    budget.finish(old[1], 0, "b")
    assert budget.ready() and budget.expiring() is None  # nothing would expire after it
    budget.take()
    budget.advance()
    budget.finish(budget.admit(), 1, "c")
    budget.finish(budget.admit(), 1, "d")
    assert not budget.ready()
    assert budget.expiring() == 1  # the two of version 0 in flight would go beyond S = 1
    budget.drop(old[2])
    budget.drop(old[3])  # expired: the batch goes
    assert budget.ready() and budget.expiring() is None
    assert budget.take() == [(1, "c"), (1, "d")]


def test_nothing_expires_at_s0_in_aggregate_mode_or_with_room_to_wait() -> None:
    for staleness, strict in ((0, True), (1, False)):
        budget: Budget[str] = Budget(1, staleness, strict=strict)
        first = budget.admit()
        budget.take() if budget.ready() else None
        budget.finish(budget.admit(), 0, "x") if budget.admissible() else None
        assert budget.expiring() is None, (staleness, strict)
        budget.drop(first)
    budget = Budget(2, 3, strict=True)  # S = 3: samples of version 0 may wait until 3
    held = [budget.admit() for _ in range(3)]
    budget.finish(held[0], 0, "a")
    budget.finish(held[1], 0, "b")
    assert budget.ready() and budget.expiring() is None


# The policy against stand-in servers ---------------------------------------------------------


class _Servers:
    """Stands in for the pipeline's servers: a request sleeps ``prompt * unit_s``; its sample's
    versions are the ones held when it started and when it ended. Counts starts and cancels."""

    def __init__(self, unit_s: float) -> None:
        self.executor = SimpleNamespace(config=SimpleNamespace(name="standin"), timeline=None)
        self.name = "standin"  # its router's name
        self.unit_s = unit_s
        self.keep_without_pause = False  # its pause() and resume() are called
        self.version = 0
        self.started: Counter[Any] = Counter()
        self.started_at: dict[Any, list[int]] = {}
        self.cancelled: Counter[Any] = Counter()
        self.completed: Counter[Any] = Counter()

    def held(self) -> contextlib.AbstractAsyncContextManager[None]:
        return contextlib.nullcontext()

    async def turn(self) -> None:
        await anyio.lowlevel.checkpoint()

    async def generate(self, request: asyncexec.RolloutRequest) -> asyncexec.Sample:
        self.started[request.id] += 1
        self.started_at.setdefault(request.id, []).append(self.version)
        first = self.version
        try:
            await anyio.sleep(request.prompt * self.unit_s)
        except anyio.get_cancelled_exc_class():
            self.cancelled[request.id] += 1
            raise
        versions = (first, self.version)
        self.completed[request.id] += 1
        return asyncexec.Sample(request.id, request.prompt, request.prompt, versions, 0)

    async def pause(self, mode: str) -> int:
        return 0

    async def resume(self) -> None:
        pass

    async def install(self, state: Any, version: int) -> None:
        self.version = version


async def _run(
    monkeypatch: pytest.MonkeyPatch,
    lengths: list[int],
    *,
    staleness: int = 1,
    batch_size: int = 2,
    on_expire: Literal["requeue", "wait"] = "requeue",
    max_requeues: int = 1,
    train_s: float = 0.005,
    unit_s: float = 0.002,
) -> tuple[list[asyncexec.PipelineBatch], asyncexec.PipelineStatistics, _Servers]:
    servers = _Servers(unit_s)
    monkeypatch.setattr(_pipeline, "servers_of", lambda target, channel: servers)
    batches = []
    async with asyncexec.Pipeline(
        object(),
        lengths,
        batch_size=batch_size,
        staleness=staleness,
        on_expire=on_expire,
        max_requeues=max_requeues,
    ) as pipe:
        async for batch in pipe:
            batches.append(batch)
            await anyio.sleep(train_s)
            await pipe.update_weights({"w": pipe.version + 1})
    return batches, pipe.statistics(), servers


@pytest.mark.timeout(10)
@pytest.mark.parametrize("on_expire", ["requeue", "wait"])
async def test_a_straggler_is_requeued_once_at_the_next_version_then_waited_for(
    monkeypatch: pytest.MonkeyPatch, on_expire: Literal["requeue", "wait"]
) -> None:
    """Prompt 0 is long: the batch of version 1 would wait for it (it expires after it). With
    "requeue" it is cancelled there, admitted again once the version is 2 (not at once: at the
    end of version 1 it would have one training step to its deadline) and, requeued once
    already, waited for by the batch of version 3; with "wait" the batch of version 1 waits."""
    batches, stats, servers = await _run(monkeypatch, [150] + [1] * 9, on_expire=on_expire)
    ids = [i for b in batches for i in b.ids]
    assert sorted(ids) == list(range(10))  # each once, none skipped
    _check_bound(batches, 1)
    [slow_batch] = [b for b in batches if 0 in b.ids]
    if on_expire == "wait":
        assert stats.expired == 0 and servers.started[0] == 1 and slow_batch.version == 1
        assert slow_batch.waited_s > 0.15
        return
    assert stats.expired == 1 and servers.started[0] == 2 and servers.cancelled[0] == 1
    assert servers.started_at[0] == [0, 2]  # held until the version after its expiry
    assert slow_batch.version == 3
    assert stats.aborted == stats.requeued == 1 and stats.admitted == 11
    assert 0 < stats.expired_s < stats.generation_s
    assert batches[1].version == 1 and batches[1].waited_s < 0.15


def _delay_bound(staleness: int, max_requeues: int) -> int:
    """What docs/pipeline.md promises: a prompt is trained at most this many versions after it
    was first admitted (each expiry holds it S + 1 versions: S to its deadline, one held)."""
    return (max_requeues + 1) * (staleness + 1) - 1


@pytest.mark.timeout(20)
@pytest.mark.parametrize(("staleness", "max_requeues"), [(1, 1), (1, 2), (2, 1)])
async def test_a_straggler_requeued_every_time_is_trained_at_the_documented_bound(
    monkeypatch: pytest.MonkeyPatch, staleness: int, max_requeues: int
) -> None:
    """The docs promised "at most ``max_requeues`` versions later than it was first
    admitted"; each requeue costs S + 1 versions, so a prompt that expires every time it may
    is trained (max_requeues + 1)(S + 1) - 1 versions after its first admission (3 for S = 1
    and one requeue, as the issue measured), which is what the docs now say."""
    batches, stats, servers = await _run(
        monkeypatch, [150] + [1] * 40, staleness=staleness, max_requeues=max_requeues
    )
    [slow_batch] = [b for b in batches if 0 in b.ids]
    assert stats.expired >= max_requeues and servers.started[0] == 1 + max_requeues
    delay = slow_batch.version - servers.started_at[0][0]
    assert delay == _delay_bound(staleness, max_requeues)
    _check_bound(batches, staleness)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("staleness", "max_requeues"), [(1, 1), (1, 3), (2, 1)])
async def test_random_long_tailed_workload_expiry_keeps_the_bound_and_every_prompt(
    monkeypatch: pytest.MonkeyPatch, staleness: int, max_requeues: int
) -> None:
    """Long-tailed lengths: no sample beyond S by its versions, every prompt consumed once, no
    prompt expired more than ``max_requeues`` times, each expiry cancelled on the server."""
    rng = random.Random(staleness * 10 + max_requeues)
    lengths = [min(100, int(rng.lognormvariate(1.5, 1.1)) + 1) for _ in range(48)]
    batches, stats, servers = await _run(
        monkeypatch,
        lengths,
        staleness=staleness,
        batch_size=4,
        max_requeues=max_requeues,
        train_s=0.01,
    )
    assert sorted(i for b in batches for i in b.ids) == list(range(48))
    _check_bound(batches, staleness)
    assert stats.beyond_bound == 0 and stats.consumed == 48
    assert stats.expired >= 1  # the workload has stragglers: the policy is exercised
    assert max(servers.started.values()) <= 1 + max_requeues
    # Each expiry is cancelled on its server, unless that generation had just finished (its
    # end and the expiry in one turn of the loop: its sample is dropped, its prompt requeued).
    cancelled, completed = sum(servers.cancelled.values()), sum(servers.completed.values())
    assert cancelled + completed == sum(servers.started.values()) == stats.admitted
    assert cancelled <= stats.expired == stats.requeued
    assert completed == 48 + stats.expired - cancelled
    assert stats.admitted == 48 + stats.expired
    trained = {id: b.version for b in batches for id in b.ids}
    delays = [trained[id] - servers.started_at[id][0] for id in trained]
    assert max(delays) <= _delay_bound(staleness, max_requeues)


def test_on_expire_and_max_requeues_are_checked() -> None:
    for kwargs in ({"on_expire": "drop"}, {"max_requeues": 0}, {"max_requeues": True}):
        with pytest.raises(asyncexec.ConfigurationError):
            asyncexec.Pipeline(object(), [], **kwargs)  # type: ignore[arg-type]


# Through real rollout servers -----------------------------------------------------------------


class Chunky(asyncexec.RolloutServer):
    """``prompt`` chunks of 5 ms; records each generation as [id, chunks made so far]."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[list[int]] = []

    async def chunks(self, prompt: dict[str, int]) -> AsyncIterator[int]:
        record = [prompt["id"], 0]
        self.made.append(record)
        for i in range(prompt["length"]):
            await asyncio.sleep(0.005)
            record[1] += 1
            yield i

    def load_weights(self, state: Any, version: int) -> None:
        pass

    def records(self) -> list[list[int]]:
        return [list(r) for r in self.made]


@pytest.mark.timeout(60)
async def test_an_expired_request_stops_on_its_server_and_is_regenerated_once(mode: str) -> None:
    """The straggler's first generation is cancelled on its server (it does not run to its
    end holding a slot), its second is waited for; every prompt once, none beyond S."""
    prompts = [{"id": i, "length": 150 if i == 0 else 1} for i in range(10)]
    batches = []
    async with (
        asyncexec.Executor(2, resources_per_worker=CPU, roles=asyncexec.Role(Chunky)) as servers,
        asyncexec.Pipeline(servers, prompts, batch_size=2, staleness=1, max_requeues=1) as pipe,
    ):
        async for batch in pipe:
            batches.append(batch)
            await pipe.update_weights({"w": pipe.version + 1})
        records = await servers.call(asyncexec.method(Chunky, Chunky.records))
    assert sorted(i for b in batches for i in b.ids) == list(range(10))
    _check_bound(batches, 1)
    stats = pipe.statistics()
    assert stats.expired == 1 and stats.beyond_bound == 0
    slow = [made for rank in records for i, made in rank if i == 0]
    assert len(slow) == 2 and max(slow) == 150
    assert min(slow) < 150  # the expired one stopped on its server
    [sample] = [s for b in batches for s in b.samples if s.id == 0]
    assert len(sample.versions) == 150 and _oldest(sample) >= 2


@pytest.mark.timeout(20)
async def test_a_stoppable_request_whose_caller_is_cancelled_stops_on_its_server() -> None:
    """Local mode: ``generate_stoppable``'s cancelled caller frees the server's slot within a
    chunk and the generation ends there (``generate`` keeps both until the server answers:
    ``tests/pipeline/test_router_units.py``)."""
    async with (
        asyncexec.Executor(2, roles=Chunky, local=True) as servers,
        asyncexec.Router(servers, max_in_flight=1) as router,
    ):
        with anyio.move_on_after(0.1):
            await router.generate_stoppable(asyncexec.RolloutRequest(0, {"id": 0, "length": 200}))
        with anyio.fail_after(2):
            while sum(router.in_flight.values()):  # noqa: ASYNC110 (no event for it)
                await anyio.sleep(0.005)
        records = await servers.call(asyncexec.method(Chunky, Chunky.records))
        [made] = [made for rank in records for _, made in rank]
        assert made < 100  # of 200: stopped about 0.1 s in (5 ms a chunk)
        sample = await router.generate_stoppable(
            asyncexec.RolloutRequest(1, {"id": 1, "length": 2})
        )
        assert sample.output == [0, 1]
        assert router.statistics().late_dropped == 0


@pytest.mark.timeout(20)
@pytest.mark.parametrize("retry", [False, True], ids=["once", "retried"])
async def test_a_stoppable_request_that_gives_up_on_its_deadline_stops_its_attempts(
    retry: bool,
) -> None:
    """Defect: ``generate_stoppable`` that gave up on its deadline (``TimeoutError``) left its
    attempts running on the servers, each holding its slot to the end of its generation
    (4 s here), as ``generate``'s do; they now stop there when it gives up."""
    async with (
        asyncexec.Executor(2, roles=Chunky, local=True) as servers,
        asyncexec.Router(servers, max_in_flight=2) as router,
    ):
        request = asyncexec.RolloutRequest(0, {"id": 0, "length": 800})
        with pytest.raises(TimeoutError, match=r"no answer within 0\.1 s"):
            await router.generate_stoppable(request, deadline_s=0.1, retry=retry)
        with anyio.fail_after(2):
            while sum(router.in_flight.values()):  # noqa: ASYNC110 (no event for it)
                await anyio.sleep(0.005)
        records = await servers.call(asyncexec.method(Chunky, Chunky.records))
        made = [made for rank in records for _, made in rank]
        assert len(made) == (3 if retry else 1)  # sent to ranks 0, 1 and 0 again when retried
        assert max(made) < 400  # of 800 (5 ms each): stopped well before their end
        assert router.statistics().late_dropped == 0


# The versions' scale after a failed push ------------------------------------------------------


class _Channel(asyncexec.WeightChannel):
    """Stands in for a weight channel into ``servers``: a push counts the next version, then
    delivers it (``servers.install``), or, once ``fail`` is set, fails its delivery as a
    channel's does after the read (the version counted, the servers keep theirs)."""

    def __init__(self, servers: _Servers) -> None:  # (no channel of its own to open)
        self.servers = servers
        self.max_staleness = 1
        self.pushed = 0
        self.fail = False

    @property
    def version(self) -> int:
        return self.pushed

    async def push(self) -> int:
        self.pushed += 1
        if self.fail:
            self.fail = False
            raise asyncexec.ChannelError(f"delivering version {self.pushed}: a rank failed")
        await self.servers.install(None, self.pushed)
        return self.pushed

    async def _push_read(self) -> tuple[int, Callable[[], Awaitable[None]]]:
        self.pushed += 1
        version, fail, self.fail = self.pushed, self.fail, False

        async def delivered() -> None:
            await anyio.lowlevel.checkpoint()
            if fail:
                raise asyncexec.ChannelError(f"delivering version {version}: a rank failed")
            await self.servers.install(None, version)

        return version, delivered


class _Held(_Servers):
    """A request for prompt 0 runs until the test's ``release``; the others take one unit."""

    def __init__(self) -> None:
        super().__init__(0.001)
        self.release = anyio.Event()

    async def generate(self, request: asyncexec.RolloutRequest) -> asyncexec.Sample:
        if request.prompt != 0:
            return await super().generate(request)
        first = self.version
        await self.release.wait()
        return asyncexec.Sample(request.id, request.prompt, [0], (first, self.version), 0)


@pytest.mark.timeout(10)
async def test_a_failed_push_does_not_shift_the_versions_of_the_samples_in_flight(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Defect: a push whose delivery failed still counts a version on the channel, so the
    next push's version mapped every version on the channel one lower for the learner; a
    sample in flight across both, made on the learner's version 0 and 1, came back counted
    as made on version -1 and 1, and a strict batch at version 1 handed it with staleness 2
    (S = 1; ``beyond_bound`` 1). The versions on the channel now map to the learner's
    version of the push that made each one: the sample is (0, 1), staleness 1."""
    servers = _Held()
    monkeypatch.setattr(_pipeline, "servers_of", lambda target, channel: servers)
    channel = _Channel(servers)
    prompts = [0, 1, 1, 1]
    async with asyncexec.Pipeline(
        object(), prompts, batch_size=1, staleness=1, on_expire="wait", channel=channel
    ) as pipe:
        with anyio.fail_after(5):
            first = await pipe.__anext__()  # a short one at version 0; prompt 0 is in flight
            channel.fail = True
            with pytest.raises(asyncexec.ChannelError):
                await pipe.update_weights()
            assert pipe.version == 0
            await pipe.update_weights()
            servers.release.set()
            batches = [first]
            async for batch in pipe:
                batches.append(batch)
                await pipe.update_weights()
    [straggler] = [s for b in batches for s in b.samples if s.id == 0]
    assert straggler.versions == (0, 1)
    assert sorted(i for b in batches for i in b.ids) == [0, 1, 2, 3]
    _check_bound(batches, 1)
    assert pipe.statistics().beyond_bound == 0


class _Delivering(_Channel):
    """A push whose delivery, once the servers hold the new version, lets the held request end
    and come back before the push returns (generation goes on through a "keep" update over
    servers that hold it for their own loads): the second push, the pipeline's first update
    (the first is the pipeline's own, as it starts)."""

    async def push(self) -> int:
        self.pushed += 1
        await self.servers.install(None, self.pushed)
        if self.pushed == 2:
            assert isinstance(self.servers, _Held)
            self.servers.release.set()
            await anyio.wait_all_tasks_blocked()  # the held sample is back in the pipeline
        return self.pushed


@pytest.mark.timeout(10)
async def test_a_sample_that_ends_while_its_push_is_delivered_counts_that_push(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Defect: a "keep" update over servers that are not paused (``keep_without_pause``)
    marks its push on the learner's scale once the push returns; a sample that came back
    before, with a chunk made on the new weights, had that chunk counted as the learner's
    version before (made on 1, tagged 0: in a Ray run, each chunk's weights against its tag
    failed about one run in two). It waits for the update's end now, and is tagged (0, 1)."""
    servers = _Held()
    servers.keep_without_pause = True
    monkeypatch.setattr(_pipeline, "servers_of", lambda target, channel: servers)
    channel = _Delivering(servers)
    prompts = [0, 1, 1, 1]  # the first is held until the push delivers version 1
    async with asyncexec.Pipeline(
        object(), prompts, batch_size=1, staleness=1, on_expire="wait", channel=channel
    ) as pipe:
        with anyio.fail_after(5):
            batches = [await pipe.__anext__()]  # a short one at version 0; prompt 0 in flight
            await pipe.update_weights()
            async for batch in pipe:
                batches.append(batch)
                await pipe.update_weights()
    [straggler] = [s for b in batches for s in b.samples if s.id == 0]
    assert straggler.versions == (0, 1)
    assert sorted(i for b in batches for i in b.ids) == [0, 1, 2, 3]
    _check_bound(batches, 1)


@pytest.mark.timeout(10)
async def test_after_a_delivery_that_failed_in_the_background_no_sample_goes_beyond_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Defect: ``update_weights(wait=False)`` counts the version at the read; when the
    delivery then failed, the servers went on with the weights of the version before, but
    the prompts admitted meanwhile were counted as made by the new one (a deadline one
    version later than theirs). One of them, in flight across the next update, was made by
    version 0 and handed by the strict batch at version 2 (S = 1): staleness 2. Admission
    now counts from the version the servers hold: that prompt waits for the next update."""
    servers = _Held()
    monkeypatch.setattr(_pipeline, "servers_of", lambda target, channel: servers)
    channel = _Channel(servers)
    prompts = [1, 1, 0, 1, 1]  # the third is held until the test releases it
    async with asyncexec.Pipeline(
        object(), prompts, batch_size=1, staleness=1, on_expire="wait", channel=channel
    ) as pipe:
        with anyio.fail_after(5):
            batches = [await pipe.__anext__()]
            channel.fail = True
            await pipe.update_weights(wait=False)  # the read: version 1
            with pytest.raises(asyncexec.ChannelError):
                await pipe.update_weights()  # the delivery failed: the servers hold version 0
            await anyio.wait_all_tasks_blocked()  # (what admission admits meanwhile)
            batches.append(await pipe.__anext__())
            await pipe.update_weights()
            servers.release.set()
            async for batch in pipe:
                batches.append(batch)
                await pipe.update_weights()
    assert sorted(i for b in batches for i in b.ids) == [0, 1, 2, 3, 4]
    _check_bound(batches, 1)
    assert pipe.statistics().beyond_bound == 0


@pytest.mark.timeout(10)
async def test_at_s0_an_update_after_a_delivery_that_failed_delivers_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Defect: at S = 0 in strict mode, after ``update_weights(wait=False)`` whose delivery
    failed, the update that delivers again was refused (no batch taken at the version counted
    at the read), and the only way on was a batch made by the version before: staleness 1.
    No prompt is admitted while the servers hold the version before, and the update that
    delivers the learner's weights again goes; every sample is within S = 0."""
    servers = _Held()
    servers.release.set()
    monkeypatch.setattr(_pipeline, "servers_of", lambda target, channel: servers)
    channel = _Channel(servers)
    async with asyncexec.Pipeline(
        object(), [1, 1, 1], batch_size=1, staleness=0, channel=channel
    ) as pipe:
        with anyio.fail_after(5):
            batches = [await pipe.__anext__()]
            channel.fail = True
            await pipe.update_weights(wait=False)  # the read: version 1
            with pytest.raises(asyncexec.ChannelError):
                await pipe.update_weights()  # the delivery failed: the servers hold version 0
            assert await pipe.update_weights() == 2
            async for batch in pipe:
                batches.append(batch)
                await pipe.update_weights()
    assert sorted(i for b in batches for i in b.ids) == [0, 1, 2]
    _check_bound(batches, 0)
    assert pipe.statistics().beyond_bound == 0
