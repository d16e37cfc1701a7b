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
