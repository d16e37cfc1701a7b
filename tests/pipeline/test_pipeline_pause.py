"""A pause to abort that hands the aborted samples back in the servers' pause replies
(``RolloutServer.abort``): the server's gate without Ray; the router answering each aborted
request from those replies (on Ray and in local mode), each once; a pipeline's abort update
requeueing every aborted prompt once, at the head, in order."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import anyio
import pytest

import asyncexec

CPU = {"CPU": 0.25}


class Slow(asyncexec.RolloutServer):
    """``prompt`` is ``(chunks, seconds per chunk)``; each chunk waits for ``step`` when one
    is set (in the test's process)."""

    def __init__(self) -> None:
        super().__init__(channel="pause-tests")
        self.step: asyncio.Event | None = None

    async def chunks(self, prompt: Any) -> AsyncIterator[Any]:
        n, delay = prompt
        for i in range(n):
            if self.step is not None:
                await self.step.wait()
                self.step.clear()
            else:
                await asyncio.sleep(delay)
            yield i

    def load_weights(self, state: Any, version: int) -> None:
        pass


async def _wait_for(condition: Any, timeout_s: float) -> None:
    with anyio.fail_after(timeout_s):
        while not condition():  # noqa: ASYNC110 (the router's state, no event to wait on)
            await anyio.sleep(0.01)


@pytest.mark.timeout(10)
async def test_abort_hands_back_the_samples_and_their_own_replies_wait_for_resume() -> None:
    """``abort()`` returns once no generation is left, with each aborted sample; each
    ``generate`` it collected returns the same sample only after ``resume()``; a request that
    comes after it (still paused) ends at once, as under ``pause("abort")``."""
    server = Slow()
    server.step = asyncio.Event()
    tasks = [
        asyncio.ensure_future(server.generate(asyncexec.RolloutRequest(i, (5, 0))))
        for i in range(3)
    ]
    await asyncio.sleep(0.01)
    server.step.set()  # one chunk ends; the other generations are mid-chunk
    await asyncio.sleep(0.01)
    aborting = asyncio.ensure_future(server.abort())
    for _ in range(3):
        server.step.set()
        await asyncio.sleep(0.01)
    count, samples = await asyncio.wait_for(aborting, 5)
    assert count == 3
    assert sorted(s.id for s in samples) == [0, 1, 2]
    assert all(s.aborted for s in samples)
    assert all(s.output == list(range(len(s.output))) for s in samples)  # made before it
    assert all(1 <= len(s.output) < 5 for s in samples)
    await asyncio.sleep(0.05)
    assert not any(t.done() for t in tasks)  # their replies wait for the resume
    late = await asyncio.wait_for(server.generate(asyncexec.RolloutRequest(9, (2, 0))), 5)
    assert late.aborted and late.output == []
    await server.resume()
    got = await asyncio.wait_for(asyncio.gather(*tasks), 5)
    assert {s.id: s for s in got} == {s.id: s for s in samples}
    server.step = None
    sample = await server.generate(asyncexec.RolloutRequest(10, (2, 0)))
    assert not sample.aborted and sample.output == [0, 1]


@pytest.mark.timeout(30)
async def test_router_abort_answers_each_request_from_the_pause_reply_once(mode: str) -> None:
    """12 requests in flight over 2 servers, ``router.pause("abort")``: every caller has its
    aborted sample before the resume (the servers hold the requests' own replies until then);
    their slots come free at once; after the resume those replies are dropped uncounted: each
    request answered once, nothing counted as a duplicate or late; the router serves again."""
    async with (
        asyncexec.Executor(2, resources_per_worker=CPU, roles=Slow) as servers,
        asyncexec.Router(servers, max_in_flight=8) as router,
    ):
        samples: list[asyncexec.Sample] = []

        async def ask(i: int) -> None:
            samples.append(await router.generate(asyncexec.RolloutRequest(i, (1000, 0.01))))

        async with anyio.create_task_group() as tg:
            for i in range(12):
                tg.start_soon(ask, i)
            await _wait_for(lambda: sum(router.in_flight.values()) == 12, 20)
            await anyio.sleep(0.1)  # under way on the servers
            assert await router.pause("abort") == 12
        # Every caller answered (the task group waited for them), the servers still paused.
        assert sorted(s.id for s in samples) == list(range(12))
        assert all(s.aborted and s.output for s in samples)
        assert sum(router.in_flight.values()) == 0  # their slots free (replies after resume)
        await router.resume()
        await _wait_for(lambda: not router.requests.live, 20)  # the replies came, dropped
        stats = router.statistics()
        assert (stats.requests, stats.answered) == (12, 12)
        assert (stats.duplicates_dropped, stats.late_dropped, stats.retries) == (0, 0, 0)
        sample = await router.generate(asyncexec.RolloutRequest(99, (2, 0.0)))
        assert not sample.aborted and sample.output == [0, 1]
        # Closed right after a resume: the held replies come first (none is cancelled).
        async with anyio.create_task_group() as tg:
            for i in range(100, 104):
                tg.start_soon(ask, i)
            await _wait_for(lambda: sum(router.in_flight.values()) == 4, 20)
            await router.pause("abort")
        await router.resume()
    assert router.requests.held == 0 and not router.requests.live


@pytest.mark.ray_only
@pytest.mark.timeout(30)
async def test_pipeline_abort_requeues_each_prompt_once_at_the_head_in_order(
    ray_local: None,
) -> None:
    """A pipeline (aggregate, S = 1, B = 4) over 2 servers with 8 long prompts in flight:
    ``update_weights(on_update="abort")`` requeues the 8 at the head of the queue in the order
    they were admitted, and they are sent again before any new prompt; every prompt is
    consumed once, none counted twice."""
    sent: list[int] = []
    long_, short = (1000, 0.01), (2, 0.0)
    prompts = [asyncexec.RolloutRequest(i, long_ if i < 8 else short) for i in range(16)]
    async with (
        asyncexec.Executor(2, resources_per_worker=CPU, roles=Slow) as servers,
        asyncexec.Router(servers, max_in_flight=4) as router,
    ):
        generate = router.generate_stoppable  # what a pipeline's requests go through

        async def watched(request: asyncexec.RolloutRequest, **kwargs: Any) -> Any:
            sent.append(request.id)
            if len(sent) > 8:  # sent again: short from now on
                request = asyncexec.RolloutRequest(request.id, short)
            return await generate(request, **kwargs)

        router.generate_stoppable = watched  # type: ignore[method-assign]
        async with asyncexec.Pipeline(
            router, prompts, batch_size=4, staleness=1, mode="aggregate"
        ) as pipe:
            await _wait_for(lambda: sum(router.in_flight.values()) == 8, 20)
            await anyio.sleep(0.1)
            await pipe.update_weights("w1", on_update="abort")
            consumed: list[Any] = []
            async for batch in pipe:
                consumed += [s.id for s in batch.samples]
                await pipe.update_weights(f"w{pipe.version + 1}", on_update="keep")
            stats = pipe.statistics()
        assert sent[:8] == list(range(8))
        assert sent[8:16] == list(range(8))  # requeued at the head, in order, before 8..15
        assert sorted(consumed) == list(range(16))
        assert (stats.aborted, stats.requeued, stats.duplicates) == (8, 8, 0)
        assert router.statistics().duplicates_dropped == 0
