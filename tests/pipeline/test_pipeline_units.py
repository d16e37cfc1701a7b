"""The pipeline's parts without Ray: the rollout server's gate (pause points, installs, aborts)
on an instance made in the test's process, and the pipeline's admission and bookkeeping."""

from __future__ import annotations

import asyncio
import pickle
import threading
from collections.abc import AsyncIterator
from typing import Any

import pytest

import asyncexec


class Toy(asyncexec.RolloutServer):
    """Yields ``prompt`` chunks; each chunk waits for ``step`` when one is given."""

    def __init__(self) -> None:
        super().__init__(channel="units")
        self.weights: Any = None
        self.loads: list[int] = []
        self.step: asyncio.Event | None = None
        self.chunk_running = False

    async def chunks(self, prompt: Any) -> AsyncIterator[Any]:
        for i in range(prompt):
            self.chunk_running = True
            if self.step is not None:
                await self.step.wait()
                self.step.clear()
            else:
                await asyncio.sleep(0)
            self.chunk_running = False
            yield (i, self.weights)

    def load_weights(self, state: Any, version: int) -> None:
        assert not self.chunk_running  # never half a chunk on old weights
        self.weights = state
        self.loads.append(version)


def _request(i: int, n: int) -> asyncexec.RolloutRequest:
    return asyncexec.RolloutRequest(i, n)


@pytest.mark.timeout(10)
async def test_generate_tags_each_chunk_with_the_version_it_ran_under() -> None:
    server = Toy()
    sample = await server.generate(_request(0, 3))
    assert sample.output == [(0, None), (1, None), (2, None)]
    assert sample.versions == (None, None, None) and sample.version is None
    await server.install_weights("w1", 1)
    sample = await server.generate(_request(1, 2))
    assert sample.versions == (1, 1) and sample.version == 1 and not sample.aborted
    assert server.weights_version() == 1


@pytest.mark.timeout(10)
async def test_keep_parks_at_the_pause_point_and_goes_on_with_the_new_weights() -> None:
    server = Toy()
    await server.install_weights("w1", 1)
    server.step = asyncio.Event()
    task = asyncio.ensure_future(server.generate(_request(0, 3)))
    await asyncio.sleep(0.01)
    server.step.set()  # chunk 0 ends; chunk 1 starts and waits
    await asyncio.sleep(0.01)
    pausing = asyncio.ensure_future(server.pause("keep"))
    await asyncio.sleep(0.01)
    assert not pausing.done()  # chunk 1 still runs
    server.step.set()
    assert await asyncio.wait_for(pausing, 5) == 1
    await server.install_weights("w2", 2)  # parked: no chunk runs
    await server.resume()
    server.step.set()
    sample = await asyncio.wait_for(task, 5)
    assert sample.versions == (1, 1, 2)
    assert sample.version == 1
    assert [w for _, w in sample.output] == ["w1", "w1", "w2"]


@pytest.mark.timeout(10)
async def test_abort_ends_generations_at_their_next_pause_point() -> None:
    server = Toy()
    server.step = asyncio.Event()
    tasks = [asyncio.ensure_future(server.generate(_request(i, 5))) for i in range(3)]
    await asyncio.sleep(0.01)
    pausing = asyncio.ensure_future(server.pause("abort"))
    server.step.set()  # one chunk ends (of one generation); the others are mid-chunk
    await asyncio.sleep(0.01)
    for _ in range(3):
        server.step.set()
        await asyncio.sleep(0.01)
    assert await asyncio.wait_for(pausing, 5) == 3
    samples = await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert all(s.aborted for s in samples)
    assert all(len(s.output) == 1 for s in samples)
    # While paused so, a new request ends at once; after resume(), generation works again.
    assert (await server.generate(_request(9, 2))).aborted
    await server.resume()
    server.step = None
    assert not (await server.generate(_request(10, 2))).aborted


@pytest.mark.timeout(10)
async def test_a_channel_install_from_a_thread_waits_for_the_running_chunk() -> None:
    server = Toy()
    server.step = asyncio.Event()
    task = asyncio.ensure_future(server.generate(_request(0, 2)))
    await asyncio.sleep(0.01)
    installed = threading.Event()

    def install() -> None:  # as the channel's delivery does, in a thread of the worker
        server._install_from_channel("w7", 7)
        installed.set()

    thread = threading.Thread(target=install)
    thread.start()
    await asyncio.sleep(0.05)
    assert not installed.is_set()  # chunk 0 still runs
    server.step.set()
    await asyncio.to_thread(installed.wait, 5)
    server.step.set()
    sample = await asyncio.wait_for(task, 5)
    thread.join()
    assert sample.versions == (None, 7)


def test_receive_weights_in_a_role_init_installs_a_version_held_before_it() -> None:
    """A version delivered before the instance existed (a replaced server) is installed by
    ``super().__init__()``, outside any run."""
    from asyncexec._worker import _channel

    _channel.install_state("units-held", 3, "held")
    try:

        class Held(Toy):
            def __init__(self) -> None:
                self.weights, self.loads, self.chunk_running = None, [], False
                asyncexec.RolloutServer.__init__(self, channel="units-held")

        server = Held()
        assert server.loads == [3] and server.weights == "held"
        assert server.weights_version() == 3
    finally:
        _channel.reset()


@pytest.mark.timeout(10)
async def test_a_server_that_skips_super_init_is_told_so() -> None:
    class Bad(asyncexec.RolloutServer):
        def __init__(self) -> None:
            pass

    with pytest.raises(TypeError, match="super"):
        await Bad().generate(_request(0, 1))


def test_requests_and_samples_pickle_and_report_their_oldest_version() -> None:
    sample = asyncexec.Sample("a", "p", [1], (3, 2, None), 0)
    assert sample.version is None
    assert asyncexec.Sample("a", "p", [1], (3, 2, 4), 0).version == 2
    assert pickle.loads(pickle.dumps(sample)) == sample
    request = asyncexec.RolloutRequest(1, "p", key="s")
    assert pickle.loads(pickle.dumps(request)) == request


# The budget: admission and batches, simulated ------------------------------------------------


def _simulate(
    staleness: int, batch_size: int, *, strict: bool, seed: int, batches: int = 40
) -> list[int]:
    """A learner and servers of unbounded concurrency in simulated time: long-tailed generation
    lengths, random queueing before a sample's first chunk (its version is the learner's at
    that start), random training times. Returns the staleness of every consumed sample."""
    import heapq
    import random

    from asyncexec._driver.pipeline._budget import Budget

    rng = random.Random(seed)
    budget: Budget[int] = Budget(batch_size, staleness, strict=strict)
    now, seq = 0.0, 0
    updates: list[float] = []  # when each update happened
    running: list[tuple[float, int, int, float]] = []  # (end, seq, admitted version, start)
    training_until: float | None = None
    seen: list[int] = []
    while len(seen) < batches * batch_size:
        for _ in range(budget.admissible()):
            start = now + rng.choice([0.0, 0.0, rng.uniform(0, 3)])
            length = rng.paretovariate(1.2) * 0.2  # long-tailed
            heapq.heappush(running, (start + length, seq, budget.admit(), start))
            seq += 1
        if training_until is None and budget.ready():
            taken = budget.take()
            seen += [budget.version - version for version, _ in taken]
            training_until = now + rng.uniform(0.05, 2.0)
        ends = [t for t in (training_until, running[0][0] if running else None) if t is not None]
        assert ends, f"stuck: {budget!r}"
        now = min(ends)
        if training_until is not None and now == training_until:
            budget.check_update()
            budget.advance()
            updates.append(now)
            training_until = None
            continue
        _end, _, admitted, start = heapq.heappop(running)
        made = max(admitted, sum(u <= start for u in updates))
        budget.finish(admitted, made, seq)
    return seen


@pytest.mark.parametrize("staleness", [0, 1, 2, 4])
@pytest.mark.parametrize("seed", range(6))
def test_strict_budget_never_hands_a_sample_beyond_the_bound(staleness: int, seed: int) -> None:
    """Random lengths, queueing and update times: no consumed sample staler than S."""
    seen = _simulate(staleness, 4, strict=True, seed=seed)
    assert max(seen) <= staleness
    if staleness == 0:
        assert set(seen) == {0}


def test_strict_budget_checks_every_future_batch_not_only_the_next() -> None:
    """S = 2, B = 2, seed 52: the rule "the batch at v contains every sample of version
    v - S" alone handed a sample of staleness 3 here (a batch took fresh samples while older
    ones were in flight, leaving more than B to expire at once); 0 of 1200 such runs (S 0-4,
    B 1-8) go beyond S with every future batch's need checked."""
    assert max(_simulate(2, 2, strict=True, seed=52, batches=30)) <= 2


def test_aggregate_budget_measures_staleness_beyond_the_bound() -> None:
    """SkyRL's aggregate bound lets long-tailed samples through staler than S."""
    worst = max(max(_simulate(1, 4, strict=False, seed=seed)) for seed in range(6))
    assert worst > 1


def test_only_the_b_oldest_fit_a_strict_batch_and_updates_need_a_batch() -> None:
    from asyncexec._driver.pipeline._budget import Budget

    budget: Budget[str] = Budget(2, 1, strict=True)
    assert budget.admissible() == 4  # (S + 1) * B
    admitted = [budget.admit() for _ in range(4)]
    with pytest.raises(asyncexec.ExecutorStateError):
        budget.check_update()  # no batch at version 0 yet
    budget.finish(admitted[0], 0, "a")
    budget.finish(admitted[1], 0, "b")
    assert budget.ready()
    assert budget.take() == [(0, "a"), (0, "b")]
    assert budget.admissible() == 0  # the batch of version 0 is taken: no room until the update
    budget.advance()
    assert budget.admissible() == 2
    v1 = budget.admit()
    budget.finish(v1, 1, "c")
    budget.finish(budget.admit(), 1, "d")
    assert not budget.ready()  # the two of version 0 still in flight would expire after it
    budget.finish(admitted[2], 0, "e")
    assert not budget.ready()
    budget.finish(admitted[3], 0, "f")
    assert budget.ready() and budget.take() == [(0, "e"), (0, "f")]


def test_consumed_ids_are_kept_as_a_watermark_and_the_ids_above_it() -> None:
    from asyncexec._driver.pipeline._consumed import Consumed

    consumed = Consumed()
    for i in [0, 1, 3, 2, 7, "x"]:
        assert consumed.add(i)
    assert not consumed.add(3)
    state = consumed.state()
    assert state["watermark"] == 4 and state["above"] == [7, "x"]
    again = Consumed.from_state(pickle.loads(pickle.dumps(state)))
    assert all(i in again for i in [0, 1, 2, 3, 7, "x"])
    assert 4 not in again and 5 not in again and len(again) == 6
    with pytest.raises(asyncexec.ConfigurationError):
        Consumed.from_state({"watermark": 3})


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"watermark": 2.7}, "watermark"),
        ({"watermark": -1}, "watermark"),
        ({"version": -2}, "version"),
        ({"version": True}, "version"),
        ({"version": "3"}, "version"),
        ({"above": "123"}, "above"),
    ],
)
def test_a_consumed_record_that_no_pipeline_wrote_is_refused_naming_its_field(
    change: dict[str, Any], named: str
) -> None:
    """A float watermark was truncated, a negative version or a bool taken as they were: the
    pipeline resumed at a version (or a watermark) that no pipeline had written."""
    from asyncexec._driver.pipeline._consumed import Consumed

    state = {**Consumed(3, {5}, version=2).state(), **change}
    with pytest.raises(asyncexec.ConfigurationError, match=rf"consumed=.*{named}"):
        Consumed.from_state(state)


# A server whose engine runs its own loop and pauses itself -------------------------------------


_END = object()


class _Engine:
    """An engine with its own loop: one token per step for each request, into its queue, unless
    paused; ``abort`` ends every request."""

    def __init__(self) -> None:
        self.queues: dict[int, asyncio.Queue[Any]] = {}
        self.running = asyncio.Event()
        self.running.set()
        self.weights: Any = None

    async def stream(self, rid: int, n: int) -> AsyncIterator[Any]:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self.queues[rid] = queue
        steps = asyncio.ensure_future(self._steps(queue, n))
        try:
            while (token := await queue.get()) is not _END:
                yield token
        finally:
            steps.cancel()
            del self.queues[rid]

    async def _steps(self, queue: asyncio.Queue[Any], n: int) -> None:
        for _ in range(n):
            await self.running.wait()
            await asyncio.sleep(0.002)
            queue.put_nowait(self.weights)
        queue.put_nowait(_END)

    def abort_all(self) -> None:
        for queue in self.queues.values():
            queue.put_nowait(_END)


class EngineServer(asyncexec.RolloutServer):
    pause_point = "engine"

    def __init__(self) -> None:
        super().__init__(channel="units-engine")
        self.engine = _Engine()

    async def chunks(self, prompt: Any) -> AsyncIterator[Any]:
        async for token in self.engine.stream(prompt["id"], prompt["n"]):
            yield token

    def load_weights(self, state: Any, version: int) -> None:
        assert not self.engine.running.is_set()  # installed while the engine is paused
        self.engine.weights = state

    async def pause_engine(self, mode: Any) -> None:
        self.engine.running.clear()
        if mode == "abort":
            self.engine.abort_all()

    async def resume_engine(self) -> None:
        self.engine.running.set()


@pytest.mark.timeout(10)
async def test_an_engine_that_pauses_itself_installs_while_a_chunk_waits_for_it() -> None:
    """With ``pause_point = "engine"`` a chunk waiting for the paused engine's output holds
    neither the pause nor the install up (with the chunk pause point, a chunk waiting for a
    paused engine whose output queue is empty would hold both up until the engine resumed)."""
    server = EngineServer()
    task = asyncio.ensure_future(server.generate(asyncexec.RolloutRequest(0, {"id": 0, "n": 30})))
    await asyncio.sleep(0.02)
    assert await asyncio.wait_for(server.pause("keep"), 2) == 1
    await asyncio.wait_for(server.install_weights("w1", 1), 2)
    await server.resume()
    sample = await asyncio.wait_for(task, 5)
    assert not sample.aborted and len(sample.output) == 30
    assert sample.output[0] is None and sample.output[-1] == "w1"
    assert sample.versions[0] is None and sample.versions[-1] == 1


@pytest.mark.timeout(10)
async def test_an_engine_that_ends_its_requests_on_abort_gives_aborted_samples() -> None:
    server = EngineServer()
    task = asyncio.ensure_future(server.generate(asyncexec.RolloutRequest(0, {"id": 0, "n": 30})))
    await asyncio.sleep(0.02)
    await asyncio.wait_for(server.pause("abort"), 2)
    sample = await asyncio.wait_for(task, 5)
    assert sample.aborted and 0 < len(sample.output) < 30
    await server.resume()


@pytest.mark.timeout(10)
async def test_an_engine_server_resumes_its_engine_only_once_the_load_in_progress_ended() -> None:
    """Defect: ``resume()`` resumed the engine while an install was loading into it (paused,
    the engine let the install start), so the engine's steps ran on half-loaded weights,
    tagged with the old version: the pipeline resumes its servers when a push fails or is
    cancelled, while the workers' installs go on."""
    loading, release = threading.Event(), threading.Event()
    ran_during_load: list[bool] = []

    class SlowLoad(EngineServer):
        def load_weights(self, state: Any, version: int) -> None:
            loading.set()
            release.wait(5)
            ran_during_load.append(self.engine.running.is_set())
            self.engine.weights = state

    server = SlowLoad()
    await server.pause("keep")
    install = asyncio.ensure_future(server.install_weights("w1", 1))
    assert await asyncio.to_thread(loading.wait, 5)
    resuming = asyncio.ensure_future(server.resume())
    await asyncio.sleep(0)  # the resume's first step (it resumed the engine at once)
    release.set()
    await asyncio.wait_for(install, 5)
    await asyncio.wait_for(resuming, 5)
    assert ran_during_load == [False]
    assert server.engine.running.is_set()  # resumed once the load ended
    # Paused again, an install goes on while chunks wait for the paused engine.
    task = asyncio.ensure_future(server.generate(asyncexec.RolloutRequest(0, {"id": 0, "n": 30})))
    await asyncio.wait_for(server.pause("keep"), 2)
    release.clear()
    loading.clear()
    installing = asyncio.ensure_future(server.install_weights("w2", 2))
    assert await asyncio.to_thread(loading.wait, 5)
    release.set()
    await asyncio.wait_for(installing, 5)
    await server.resume()
    sample = await asyncio.wait_for(task, 5)
    assert ran_during_load == [False, False] and sample.output[-1] == "w2"
