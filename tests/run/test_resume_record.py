"""A named run's record against what the consumer took, in local mode (no Ray): the checkpoint it
resumes from is one whose step the consumer has taken, a checkpoint it may resume from is not
deleted, the run is finished only once every step was taken; ``resume="never"`` starts over in
folders of its own; a run of independent ranks cannot be named."""

from __future__ import annotations

import json
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
from conftest import wait_no_local_threads

import asyncexec

pytestmark = pytest.mark.timeout(60)

RECORD_FILE = "asyncexec_run.json"  # as docs/semantics.md names it
STEPS = 40
_reported = threading.Event()  # the function has made all its reports


@pytest.fixture(autouse=True)
def _no_threads_left() -> Any:
    yield
    wait_no_local_threads()


def _train(config: dict[str, Any]) -> None:
    """Reports ``STEPS`` steps at once, a checkpoint (holding its step and the config's tag) at
    each step of ``config["at"]``."""
    for i in range(STEPS):
        checkpoint = None
        if i in config["at"]:
            folder = tempfile.mkdtemp()
            with open(os.path.join(folder, "state.txt"), "w") as f:
                f.write(f"{config['tag']}-{i}")
            checkpoint = asyncexec.Checkpoint.from_directory(folder)
        asyncexec.report({"i": i}, checkpoint=checkpoint)
    _reported.set()


def _record(storage: Path, name: str) -> dict[str, Any]:
    return json.loads((storage / name / RECORD_FILE).read_text())


async def _recorded(storage: Path, name: str, steps: int) -> dict[str, Any]:
    """The record once it counts ``steps`` steps delivered (it is written every 0.1 s)."""
    with anyio.fail_after(10):
        while (record := _record(storage, name))["steps"] != steps:  # noqa: ASYNC110 (a file)
            await anyio.sleep(0.02)
    return record


async def test_the_record_resumes_after_a_checkpoint_the_consumer_took(tmp_path: Path) -> None:
    """Defect: a checkpoint became the record's when the step that carried it was queued, up to
    the credit window ahead of the consumer, and the run was recorded finished once its work
    was done: a driver that died with the consumer at step 14 was resumed after step 30 (steps
    15 to 30 never delivered), or not at all. With one checkpoint kept, the one the record
    resumes from was also deleted once a newer one was made."""
    _reported.clear()
    checkpoint = asyncexec.CheckpointConfig(num_to_keep=1)
    async with asyncexec.Executor(
        1, local=True, storage_path=str(tmp_path), checkpoint=checkpoint
    ) as executor:
        async for step in executor.run(_train, {"at": [10, 30], "tag": "a"}, name="slow"):
            if step.index == 14:
                await anyio.to_thread.run_sync(_reported.wait, 30)  # step 30's is made
                record = await _recorded(tmp_path, "slow", 15)
                assert record["status"] == "running"
                assert record["checkpoint_index"] == 10, record
                assert (Path(record["checkpoint"]) / "state.txt").read_text() == "a-10"
    record = _record(tmp_path, "slow")
    assert (record["status"], record["steps"], record["checkpoint_index"]) == ("finished", 40, 30)
    assert sorted(p.name for p in (tmp_path / "slow").glob("checkpoint_*")) == [
        "checkpoint_000030_a1"
    ]


async def test_a_run_started_over_does_not_meet_the_earlier_runs_checkpoints(
    tmp_path: Path,
) -> None:
    """Defect: ``resume="never"`` wrote its checkpoints into the folders of the same names that
    the earlier run of the name had left (a step's index and attempt): a file of other content
    failed the run ("already written by another rank"), and the earlier run's files stayed in
    its checkpoints."""
    async with asyncexec.Executor(1, local=True, storage_path=str(tmp_path)) as executor:
        for tag in ("first", "second"):
            config = {"at": [0, 1], "tag": tag}
            steps = [s async for s in executor.run(_train, config, name="job", resume="never")]
            assert [s.index for s in steps] == list(range(STEPS))
        result = steps[-1]
    assert result.checkpoint is None  # (the checkpoints came with steps 0 and 1)
    folders = sorted((tmp_path / "job").glob("checkpoint_*"))
    assert [f.name for f in folders] == ["checkpoint_000000_a1", "checkpoint_000001_a1"]
    assert [(f / "state.txt").read_text() for f in folders] == ["second-0", "second-1"]
    assert [sorted(os.listdir(f)) for f in folders] == [["state.txt"], ["state.txt"]]


async def test_a_run_of_independent_ranks_cannot_be_named(tmp_path: Path) -> None:
    """Defect: its record held one rank's checkpoint, and every rank of a resumed run started
    from it."""
    async with asyncexec.Executor(2, local=True, storage_path=str(tmp_path)) as executor:
        with pytest.raises(asyncexec.ConfigurationError, match="independent ranks cannot be"):
            executor.run(_train, {"at": [], "tag": ""}, name="each", independent=True)
    assert not (tmp_path / "each").exists()


@pytest.mark.parametrize("again", [[10, 30], []], ids=["new-checkpoints", "none"])
async def test_a_resumed_run_deletes_the_checkpoint_it_resumed_from_once_past_it(
    tmp_path: Path, again: list[int]
) -> None:
    """Defect: a driver that stopped with its record's checkpoint held back (no longer kept,
    the consumer not yet past a newer one) left that folder for ever: the driver that resumed
    from it never deleted it, so a run with one checkpoint kept ended with two. It goes once
    the resumed run's record has moved past it, and stays while it is the run's latest."""
    _reported.clear()
    keep = asyncexec.CheckpointConfig(num_to_keep=1)
    async with asyncexec.Executor(
        1, local=True, storage_path=str(tmp_path), checkpoint=keep
    ) as executor:
        async for step in executor.run(_train, {"at": [10, 30], "tag": "a"}, name="job"):
            if step.index == 14:  # the driver stops here, as a dead one would
                await anyio.to_thread.run_sync(_reported.wait, 30)  # step 30's is made
                await _recorded(tmp_path, "job", 15)
                break
        run = executor.run(_train, {"at": again, "tag": "b"}, name="job", resume="force")
        indices = [s.index async for s in run]
        assert indices[0] == 11  # resumed after checkpoint 10
    start = tmp_path / "job" / "checkpoint_000010_a1"
    if again:  # the resumed run's checkpoints of steps 10 and 30 are at indices 21 and 41
        assert run.result.checkpoint is not None
        assert Path(run.result.checkpoint.path).name == "checkpoint_000041_a2"
        assert sorted(p.name for p in (tmp_path / "job").glob("checkpoint_*")) == [
            "checkpoint_000041_a2"
        ]
    else:  # it made none: the one it resumed from is its result's
        assert run.result.checkpoint is not None and run.result.checkpoint.path == str(start)
        assert (start / "state.txt").read_text() == "a-10"


async def test_a_run_started_over_from_the_earlier_runs_checkpoint_is_refused_keeping_it(
    tmp_path: Path,
) -> None:
    """Defect: ``resume="never"`` with ``checkpoint=`` one of the earlier run's (start over from
    where it got) deleted that checkpoint with the earlier run's folders before the run started
    from it: every rank failed with "checkpoint directory does not exist". The run is refused
    with a ConfigurationError that says to copy it, and the checkpoint is left."""
    async with asyncexec.Executor(1, local=True, storage_path=str(tmp_path)) as executor:
        steps = [s async for s in executor.run(_train, {"at": [5], "tag": "a"}, name="job")]
        start = steps[5].checkpoint
        assert start is not None
        config = {"at": [1], "tag": "b"}
        run = executor.run(_train, config, name="job", resume="never", checkpoint=start)
        with pytest.raises(asyncexec.ConfigurationError, match="copy it elsewhere"):
            [s async for s in run]
        assert (Path(start.path) / "state.txt").read_text() == "a-5"
        copy = start.to_directory(tmp_path / "copy")
        steps = [
            s
            async for s in executor.run(_train, config, name="job", resume="never", checkpoint=copy)
        ]
        assert len(steps) == STEPS


async def test_a_resumed_runs_latest_checkpoint_is_the_one_it_resumed_from(
    tmp_path: Path,
) -> None:
    """Defect: ``Run.latest_checkpoint`` of a resumed run was None until it made a checkpoint
    of its own, though its restarts resume from the record's (and the command line's view said
    "resuming from the start (no checkpoint)"); its ``latest_index`` was already the record's."""
    _reported.clear()
    async with asyncexec.Executor(1, local=True, storage_path=str(tmp_path)) as executor:
        async for step in executor.run(_train, {"at": [10], "tag": "a"}, name="job"):
            if step.index == 14:  # the driver stops here, as a dead one would
                await _recorded(tmp_path, "job", 15)
                break
        run = executor.run(_train, {"at": [], "tag": "a"}, name="job", resume="force")
        async for _step in run:
            assert run.latest_checkpoint is not None
            assert Path(run.latest_checkpoint.path).name == "checkpoint_000010_a1"
    assert run.result.checkpoint == run.latest_checkpoint
