"""A sample's chunks merged per weights version (``RolloutServer.merge``): runs of chunks made
under one version become one chunk, paired with that version, in finished and aborted samples
alike; a server that does not merge keeps every chunk; the vLLM server's merge keeps every
token, log-probability and end (no engine needed: its chunks are plain records)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

import asyncexec


class Stepped(asyncexec.RolloutServer):
    """Chunk ``i`` of a prompt ``n`` is ``[i]``, made when the test sets ``step``."""

    merging = True

    def __init__(self) -> None:
        super().__init__(channel="merge-tests")
        self.step = asyncio.Event()

    async def chunks(self, prompt: Any) -> AsyncIterator[Any]:
        for i in range(prompt):
            await self.step.wait()
            self.step.clear()
            yield [i]

    def merge(self, chunks: list[Any]) -> Any:
        return [x for c in chunks for x in c] if self.merging else None

    def load_weights(self, state: Any, version: int) -> None:
        pass


async def _steps(server: Stepped, n: int) -> None:
    for _ in range(n):
        server.step.set()
        while server.step.is_set():  # noqa: ASYNC110 (the chunk clears it as it takes it)
            await asyncio.sleep(0.001)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("merging", [True, False])
async def test_chunks_of_one_version_are_one_chunk_of_the_sample(merging: bool) -> None:
    server = Stepped()
    server.merging = merging
    await server.install_weights({}, 1)
    task = asyncio.ensure_future(server.generate(asyncexec.RolloutRequest(0, 5)))
    await _steps(server, 2)
    # The install waits for the chunk in flight (the third), then holds the next one.
    installing = asyncio.ensure_future(server.install_weights({}, 2))
    while not server._gate().installing:  # noqa: ASYNC110 (the install's thread, no event)
        await asyncio.sleep(0.001)
    await _steps(server, 1)
    await asyncio.wait_for(installing, 5)
    await _steps(server, 2)
    sample = await asyncio.wait_for(task, 5)
    if merging:
        assert sample.output == [[0, 1, 2], [3, 4]]
        assert sample.versions == (1, 2)
    else:
        assert sample.output == [[0], [1], [2], [3], [4]]
        assert sample.versions == (1, 1, 1, 2, 2)
    assert sample.version == 1


@pytest.mark.timeout(10)
async def test_an_aborted_samples_chunks_are_merged_too() -> None:
    server = Stepped()
    await server.install_weights({}, 3)
    task = asyncio.ensure_future(server.generate(asyncexec.RolloutRequest(0, 9)))
    await _steps(server, 3)
    aborting = asyncio.ensure_future(server.abort())
    server.step.set()  # the chunk in flight ends; the gate then ends the generation
    count, (sample,) = await asyncio.wait_for(aborting, 5)
    assert count == 1 and sample.aborted
    assert sample.output == [[0, 1, 2, 3]] and sample.versions == (3,)
    await server.resume()
    assert (await asyncio.wait_for(task, 5)) == sample


def test_the_vllm_servers_merge_keeps_every_token_and_end() -> None:
    pytest.importorskip("vllm")
    from asyncexec.engines import Delta, EngineChunk, VLLMServer, completions

    chunks = [
        EngineChunk((Delta(0, (5,), (-0.5,)), Delta(1, (6,), (-0.25,))), 4, (1, 2)),
        EngineChunk((Delta(0, (7,), (-1.0,), "length"), Delta(1, (8,), (-2.0,))), 4),
        EngineChunk((Delta(1, (9,), (-3.0,), "length", (("4", 0, 3),)),), 4),
    ]
    server = object.__new__(VLLMServer)  # merge() needs no engine
    merged = server.merge(chunks)
    assert merged.version == 4 and merged.prompt_token_ids == (1, 2)
    apart = asyncexec.Sample(0, None, chunks, (4, 4, 4), 0)
    joined = asyncexec.Sample(0, None, [merged], (4,), 0)
    assert completions(joined) == completions(apart)
    (first, second) = completions(joined)
    assert second.token_ids == (6, 8, 9) and second.logprobs == (-0.25, -2.0, -3.0)
    assert (first.finish_reason, second.engine_versions) == ("length", (("4", 0, 3),))


def test_an_aborted_vllm_sample_ends_every_unfinished_completion_as_aborted() -> None:
    """A pause to abort can end a generation at a chunk made before the engine's final output:
    the completions it left open end ``"abort"``, one that finished keeps its own end."""
    pytest.importorskip("vllm")
    from asyncexec.engines import Delta, EngineChunk, completions

    chunks = [EngineChunk((Delta(0, (5,), (), "length"), Delta(1, (6,), ())), 2, (1,))]
    ends = [c.finish_reason for c in completions(asyncexec.Sample(0, None, chunks, (2,), 0))]
    assert ends == ["length", None]  # not aborted: still going when its chunks were taken
    aborted = asyncexec.Sample(0, None, chunks, (2,), 0, aborted=True)
    assert [c.finish_reason for c in completions(aborted)] == ["length", "abort"]
