"""Checkpoint retention: the folders of an executor's unnamed runs are removed when it closes,
unless the run is named (it can be resumed by name) or the executor keeps its runs
(``CheckpointConfig(keep_runs=True)``). Local mode: the folders are the driver's."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from test_faults import counter

import asyncexec

pytestmark = pytest.mark.timeout(60)

STEPS = {"steps": 4, "every": 2}


def _runs(storage: Path) -> set[str]:
    return {p.name for p in storage.iterdir() if p.is_dir()}


async def test_unnamed_runs_are_removed_when_the_executor_closes_named_ones_kept(
    tmp_path: Path,
) -> None:
    """Unnamed runs left their folders under the storage path for ever (32 after an
    afternoon under ``~/asyncexec_results``)."""
    async with asyncexec.Executor(2, local=True, storage_path=tmp_path) as ex:
        [_ async for _ in ex.run(counter, STEPS)]
        first = ex.result.checkpoint
        [_ async for _ in ex.run(counter, STEPS, name="kept-by-name")]
        [_ async for _ in ex.run(counter, STEPS)]
        assert first is not None
        assert await anyio.Path(first.path).is_dir()  # usable while the executor is open
        assert len(_runs(tmp_path)) == 3
    assert _runs(tmp_path) == {"kept-by-name"}
    # Read after the close, the removed checkpoint says why it is gone and how to keep one.
    for use in (first.as_directory().__enter__, lambda: first.to_directory(tmp_path / "copy")):
        with pytest.raises(FileNotFoundError, match=r"unnamed run.*keep_runs=True"):
            use()


async def test_an_executor_that_keeps_its_runs_removes_nothing(tmp_path: Path) -> None:
    keep = asyncexec.CheckpointConfig(keep_runs=True)
    async with asyncexec.Executor(2, local=True, storage_path=tmp_path, checkpoint=keep) as ex:
        [_ async for _ in ex.run(counter, STEPS)]
        [_ async for _ in ex.run(counter, STEPS)]
    assert len(_runs(tmp_path)) == 2


async def test_runs_are_removed_also_when_the_executor_is_closed_by_aclose_or_an_error(
    tmp_path: Path,
) -> None:
    ex = asyncexec.Executor(1, local=True, storage_path=tmp_path)
    await ex.__aenter__()
    [_ async for _ in ex.run(counter, STEPS)]
    await ex.aclose()
    assert _runs(tmp_path) == set()
    await ex.__aexit__(None, None, None)
    with pytest.raises(RuntimeError, match="the loop body failed"):
        async with asyncexec.Executor(1, local=True, storage_path=tmp_path) as ex:
            async for _ in ex.run(counter, STEPS):
                raise RuntimeError("the loop body failed")
    assert _runs(tmp_path) == set()


def test_keep_runs_must_be_a_bool() -> None:
    with pytest.raises(asyncexec.ConfigurationError, match="keep_runs must be a bool"):
        asyncexec.CheckpointConfig(keep_runs="yes")  # type: ignore[arg-type]
