"""Servers that fail in ways a real engine does, on Ray: every rollout server dead and none able
to come back (the pipeline ends within a bound, naming what died, instead of waiting for
servers for ever); a server whose pause hangs (an engine that is stopped: the pause takes it out
instead of failing the weight update)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import asyncexec


class Mortal(asyncexec.RolloutServer):
    """Dies (its process exits) at a prompt that says so; refuses to start again once the
    marker file exists (an engine that cannot come back: out of memory, a bad driver)."""

    def __init__(self, marker: str) -> None:
        if os.path.exists(marker):
            raise RuntimeError("this server cannot start again")
        super().__init__()

    async def chunks(self, prompt: dict[str, Any]) -> AsyncIterator[int]:
        for i in range(3):
            await asyncio.sleep(0.005)
            if prompt.get("die"):
                os._exit(1)
            yield i

    def load_weights(self, state: Any, version: int) -> None:
        pass


def _prompts(marker: str) -> Iterator[dict[str, Any]]:
    for i in range(8):
        yield {"i": i}
    with open(marker, "w"):
        pass
    while True:
        yield {"die": True}


@pytest.mark.timeout(120)
async def test_every_server_dead_ends_the_pipeline_within_a_bound_naming_it(
    ray_local: None, tmp_path: Any
) -> None:
    marker = str(tmp_path / "no-more")
    servers = asyncexec.Executor(
        2,
        resources_per_worker={"CPU": 0.25},
        roles=asyncexec.Role(Mortal, marker),
        restart=asyncexec.RestartPolicy(max_restarts=1),
        timeouts=asyncexec.Timeouts(start_s=10),  # a rejoin's bound: 10 s + the health check's
    )
    async with servers:
        router = asyncexec.Router(servers, max_in_flight=2, health_timeout_s=2.0)
        started = time.perf_counter()
        pipeline = asyncexec.Pipeline(router, _prompts(marker), batch_size=4)
        with pytest.raises(asyncexec.RestartsExhaustedError) as raised, anyio.fail_after(90):
            async with router, pipeline:
                async for _ in pipeline:
                    pass
        elapsed = time.perf_counter() - started
    # Within the bound (a rejoin's: 10 + 2 s, from the first failed rejoin) and a few attempts.
    assert elapsed < 12 + 15
    text = str(raised.value) + " ".join(getattr(raised.value, "__notes__", []))
    assert "Mortal.__init__ raised" in text and "rank" in text, text


class HangsInPause(asyncexec.RolloutServer):
    """Rank 0's engine pause hangs while the marker file exists (a stopped engine)."""

    pause_point = "engine"

    def __init__(self, marker: str) -> None:
        super().__init__()
        self.marker = marker

    async def chunks(self, prompt: Any) -> AsyncIterator[int]:
        for i in range(3):
            await asyncio.sleep(0.005)
            yield i

    def load_weights(self, state: Any, version: int) -> None:
        pass

    async def pause_engine(self, mode: Any) -> None:
        if os.path.exists(self.marker) and asyncexec.get_context().world_rank == 0:  # noqa: ASYNC240
            await asyncio.Event().wait()


@pytest.mark.timeout(120)
async def test_a_server_whose_pause_hangs_is_taken_out_and_the_pause_returns(
    ray_local: None, tmp_path: Any
) -> None:
    """Defect: the router's pause raised TimeoutError when one server did not answer within
    ``health_timeout_s`` (a weight update failed, and the pipeline with it, because one engine
    hung); the server is now taken out and the others are paused."""
    marker = str(tmp_path / "hang")
    servers = asyncexec.Executor(
        2, resources_per_worker={"CPU": 0.25}, roles=asyncexec.Role(HangsInPause, marker)
    )
    async with servers, asyncexec.Router(servers, max_in_flight=2, health_timeout_s=2.0) as router:
        await router.generate(asyncexec.RolloutRequest(0, "before"))
        Path(marker).touch()  # noqa: ASYNC240
        started = time.perf_counter()
        with anyio.fail_after(30):
            await router.pause("keep")
        assert time.perf_counter() - started < 2.0 + 10
        assert router.statistics().taken_out == 1
        os.remove(marker)
        await router.resume()
        with anyio.fail_after(60):
            while not all(router.statistics().serving):  # noqa: ASYNC110 (the router's state)
                await anyio.sleep(0.05)
        assert router.statistics().replaced == 1
        samples = [await router.generate(asyncexec.RolloutRequest(i, "after")) for i in (1, 2, 3)]
        assert [s.output for s in samples] == [[0, 1, 2]] * 3


class SlowToReplace(asyncexec.RolloutServer):
    """A server whose process starts again as slowly as an engine does: its constructor takes
    ``seconds`` once the marker file exists. A prompt is a number of chunks, 50 ms each."""

    def __init__(self, marker: str, seconds: float) -> None:
        if os.path.exists(marker):
            time.sleep(seconds)
        super().__init__()

    async def chunks(self, prompt: int) -> AsyncIterator[int]:
        for i in range(prompt):
            await asyncio.sleep(0.05)
            yield i

    def load_weights(self, state: Any, version: int) -> None:
        pass

    def pid(self) -> int:
        return os.getpid()


@pytest.mark.timeout(120)
async def test_a_server_that_dies_holds_nothing_up_while_its_replacement_starts(
    ray_local: None, tmp_path: Any
) -> None:
    """Defect: a call whose worker died raised only once the fresh process put in its place had
    started (a vLLM engine's start: 35 s in examples/grpo_vllm.py), so the dead server's
    requests waited for it, and a pause waited until it timed out and took the server out.
    SIGKILL of a server with 4 requests inside, whose fresh process takes 20 s to start: the
    other server answers every request, and a pause and a resume return, long before."""
    marker = tmp_path / "started"
    servers = asyncexec.Executor(
        2,
        resources_per_worker={"CPU": 0.25},
        roles=asyncexec.Role(SlowToReplace, str(marker), 20.0),
    )
    async with servers, asyncexec.Router(servers, max_in_flight=4) as router:
        pids = await servers.call(SlowToReplace.pid)
        marker.touch()
        answers: list[asyncexec.Sample] = []

        async def ask(i: int) -> None:
            answers.append(await router.generate(asyncexec.RolloutRequest(i, 20)))  # 1 s

        with anyio.fail_after(10):  # half the replacement's start
            async with anyio.create_task_group() as tg:
                for i in range(8):
                    tg.start_soon(ask, i)
                while router.statistics().in_flight != (4, 4):  # noqa: ASYNC110 (the router's state)
                    await anyio.sleep(0.01)
                os.kill(pids[1], signal.SIGKILL)
                await router.pause("keep")
                await router.resume()
        assert sorted(s.id for s in answers) == list(range(8))
        stats = router.statistics()
        assert stats.serving == (True, False) and stats.taken_out == 0  # seen dead, not hung
