"""Checkpoint retention: the folders of an executor's unnamed runs are removed when it closes,
unless the run is named (it can be resumed by name) or the executor keeps its runs
(``CheckpointConfig(keep_runs=True)``). Local mode: the folders are the driver's."""

from __future__ import annotations

import gc
import json
import math
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Any

import anyio
import numpy
import pytest
import structlog
import tenacity
from test_faults import counter

import asyncexec

pytestmark = pytest.mark.timeout(60)

STEPS = {"steps": 4, "every": 2}
#: The folder of the markers that name each unnamed run's driver (``<run_id>.json``).
MARKERS = ".asyncexec-runs"


def _runs(storage: Path) -> set[str]:
    return {p.name for p in storage.iterdir() if p.is_dir() and p.name != MARKERS}


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


#: A driver that SIGKILLs itself once its unnamed run has persisted a checkpoint: no close runs.
KILLED_DRIVER = """
import asyncio, os, signal, sys
sys.path.insert(0, sys.argv[2])
import asyncexec
from test_faults import counter

async def main():
    async with asyncexec.Executor(1, local=True, storage_path=sys.argv[1]) as ex:
        async for step in ex.run(counter, {"steps": 100, "every": 1, "sleep": 0.05}):
            if step.checkpoint is not None:
                os.kill(os.getpid(), signal.SIGKILL)

asyncio.run(main())
"""


async def test_the_unnamed_runs_of_a_killed_driver_are_removed_by_the_next_close(
    tmp_path: Path,
) -> None:
    """A driver that is killed runs no close: its unnamed runs' folders piled up. The next
    executor on this host to close removes them; a live driver's and an unmarked folder stay."""
    killed = await anyio.run_process(
        [sys.executable, "-c", KILLED_DRIVER, str(tmp_path), str(Path(__file__).parent)],
        check=False,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()[-2000:]
    (orphan,) = _runs(tmp_path)
    assert (tmp_path / MARKERS / f"{orphan}.json").is_file()
    (tmp_path / "unmarked").mkdir()  # a folder of another tool, or a run made before markers
    (tmp_path / "live").mkdir()  # a run of a driver that is alive (this process)
    marker = {"host": socket.gethostname(), "pid": os.getpid()}
    (tmp_path / MARKERS / "live.json").write_text(json.dumps(marker))
    async with asyncexec.Executor(1, local=True, storage_path=tmp_path) as ex:
        [_ async for _ in ex.run(counter, STEPS, name="named")]
    assert _runs(tmp_path) == {"unmarked", "live", "named"}
    assert {p.stem for p in (tmp_path / MARKERS).iterdir()} == {"live"}  # the orphan's went


def test_to_directory_overwrites_the_destinations_files_as_a_remote_checkpoint_does(
    tmp_path: Path,
) -> None:
    """Copying a local checkpoint over an older copy failed with an error about "another
    rank" writing "this step" (a remote checkpoint's copy overwrote); it copies, as Ray's."""
    source, destination = tmp_path / "source", tmp_path / "copy"
    (source / "sub").mkdir(parents=True)
    (source / "model.txt").write_text("new")
    (source / "sub" / "state.txt").write_text("new state")
    (destination / "sub").mkdir(parents=True)
    (destination / "model.txt").write_text("old")
    (destination / "other.txt").write_text("kept")
    checkpoint = asyncexec.Checkpoint.from_directory(source)
    assert checkpoint.to_directory(destination) == os.fspath(destination)
    assert (destination / "model.txt").read_text() == "new"
    assert (destination / "sub" / "state.txt").read_text() == "new state"
    assert (destination / "other.txt").read_text() == "kept"
    assert checkpoint.to_directory(source) == os.fspath(source)  # onto itself: nothing to do
    assert (source / "model.txt").read_text() == "new"


def _files(directory: str) -> set[str]:
    """The files under ``directory`` (not links), relative to it."""
    found = Path(directory).rglob("*")
    return {
        p.relative_to(directory).as_posix() for p in found if p.is_file() and not p.is_symlink()
    }


def report_a_linked_folder(directory: str) -> None:
    """Rank 0 reports a checkpoint whose ``model`` folder is a symbolic link."""
    if asyncexec.get_context().world_rank == 0:
        asyncexec.report({}, checkpoint=asyncexec.Checkpoint.from_directory(directory))
    else:
        asyncexec.report({})


@pytest.mark.parametrize("remote", [False, True], ids=["local", "remote"])
async def test_a_checkpoint_keeps_the_files_of_a_linked_folder(
    tmp_path: Path, remote: bool
) -> None:
    """A folder of the checkpoint that was a symbolic link was persisted empty (locally) or
    not at all (remotely): its files were dropped without a word."""
    real, reported = tmp_path / "real", tmp_path / "reported"
    (real / "sub").mkdir(parents=True)
    (real / "weights.bin").write_text("w")
    (real / "sub" / "config.json").write_text("{}")
    reported.mkdir()
    (reported / "step.txt").write_text("1")
    (reported / "model").symlink_to(real, target_is_directory=True)
    (reported / "loop").symlink_to(reported, target_is_directory=True)  # a cycle: not followed
    storage = f"memory://linked-{os.getpid()}" if remote else tmp_path / "runs"
    async with asyncexec.Executor(2, local=True, storage_path=storage) as ex:
        (step,) = [s async for s in ex.run(report_a_linked_folder, str(reported))]
        assert step.checkpoint is not None
        with step.checkpoint.as_directory() as directory:
            files = _files(directory)
    assert files == {"step.txt", "model/weights.bin", "model/sub/config.json"}


def report_losses(losses: list[Any]) -> None:
    """One checkpoint a step, each reported with its loss."""
    for loss in losses:
        directory = tempfile.mkdtemp()
        Path(directory, "loss.txt").write_text(str(loss))
        asyncexec.report({"loss": loss}, checkpoint=asyncexec.Checkpoint.from_directory(directory))


@pytest.mark.parametrize(
    "losses",
    [[0.5, math.nan, 0.1, 0.2, 0.3], [numpy.float32(x) for x in (0.5, 0.4, 0.1, 0.2, 0.3)]],
    ids=["nan", "numpy"],
)
async def test_checkpoints_are_ranked_by_the_scores_value(
    tmp_path: Path, losses: list[Any]
) -> None:
    """A loss that went NaN (a diverged step) made the ranking arbitrary, and a numpy scalar
    counted as no score at all (so the first were kept): either way the best checkpoint was
    deleted. A NaN ranks last, as a missing score; a numpy number by its value."""
    keep = asyncexec.CheckpointConfig(num_to_keep=2, score_attribute="loss", score_order="min")
    async with asyncexec.Executor(1, local=True, storage_path=tmp_path, checkpoint=keep) as ex:
        paths = [s.checkpoint.path async for s in ex.run(report_losses, losses) if s.checkpoint]
        kept = {p.name for p in (tmp_path / ex.result.run_id).iterdir()}
    # The two best (0.1, 0.2) and the latest (0.3), which a restart would need.
    assert kept == {Path(paths[i]).name for i in (2, 3, 4)}


def report_one_checkpoint() -> None:
    directory = tempfile.mkdtemp()
    Path(directory, "state.txt").write_text("1")
    asyncexec.report({}, checkpoint=asyncexec.Checkpoint.from_directory(directory))


async def test_a_storage_that_fails_to_remove_a_run_never_hides_the_users_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only an OSError of the storage was caught: any other (gcsfs raises its HttpError) came
    out of the close in place of the error that left the block."""
    from fsspec.implementations.memory import MemoryFileSystem

    def rm(*args: object, **kwargs: object) -> None:
        raise RuntimeError("503 backend error")

    monkeypatch.setattr(MemoryFileSystem, "rm", rm)
    storage = f"memory://failing-rm-{os.getpid()}"
    with structlog.testing.capture_logs() as logs, pytest.raises(ValueError, match="the user's"):
        async with asyncexec.Executor(1, local=True, storage_path=storage) as ex:
            [_ async for _ in ex.run(report_one_checkpoint)]
            raise ValueError("the user's error")
    (event,) = [e for e in logs if e["event"] == "runs_not_removed"]
    assert "503 backend error" in event["error"]


_ahead = threading.Event()  # rank 0 has saved checkpoints beyond the step rank 1 fails at


def saves_ahead_of_a_failing_rank(config: dict[str, Any]) -> None:
    """Each rank saves a checkpoint (its own file) at every even step, resuming after the latest;
    in the first attempt rank 1 fails at step 3 once rank 0 has saved up to step 8."""
    ctx = asyncexec.get_context()
    start = 0
    if (checkpoint := asyncexec.get_checkpoint()) is not None:
        start = int(Path(checkpoint.path, f"rank{ctx.world_rank}.txt").read_text()) + 1
    for step in range(start, 10):
        if ctx.attempt == 1 and ctx.world_rank == 1 and step == 3:
            assert _ahead.wait(30)
            raise ValueError("bad batch")
        saved = None
        if step % 2 == 0:
            folder = tempfile.mkdtemp()
            Path(folder, f"rank{ctx.world_rank}.txt").write_text(str(step))
            saved = asyncexec.Checkpoint.from_directory(folder)
        asyncexec.report({"step": step}, checkpoint=saved)
        if ctx.world_rank == 0 and step == 8:
            _ahead.set()


async def test_a_failed_attempt_leaves_no_checkpoint_of_a_step_it_never_completed(
    tmp_path: Path,
) -> None:
    """Defect: the checkpoints that a rank ahead of the others saved in an attempt that failed
    (here rank 0's of steps 4, 6 and 8, after rank 1 failed at step 3) were carried by no step,
    counted by no ``num_to_keep`` and deleted by nothing: with one checkpoint kept, the run's
    folder held four when it ended, a set of them more after each restart."""
    _ahead.clear()
    policy = asyncexec.RestartPolicy(
        max_restarts=1, restart_on_user_error=True, wait=tenacity.wait_none()
    )
    keep = asyncexec.CheckpointConfig(num_to_keep=1)
    async with asyncexec.Executor(
        2, local=True, storage_path=tmp_path, checkpoint=keep, restart=policy
    ) as ex:
        steps = [s async for s in ex.run(saves_ahead_of_a_failing_rank)]
        assert [s.metrics["step"] for s in steps] == list(range(10))
        assert ex.result.attempts == 2 and ex.result.checkpoint is not None
        folders = [p.name for p in (tmp_path / ex.result.run_id).iterdir()]
        assert folders == [Path(ex.result.checkpoint.path).name] == ["checkpoint_000008_a2"]


_gone = threading.Event()  # the consumer has deleted the run's checkpoint


def restarts_from_a_deleted_checkpoint() -> None:
    """Saves a checkpoint, then fails once it is deleted; the restart reads it."""
    if (checkpoint := asyncexec.get_checkpoint()) is not None:
        with checkpoint.as_directory():
            return
    folder = tempfile.mkdtemp()
    Path(folder, "state.txt").write_text("0")
    asyncexec.report({}, checkpoint=asyncexec.Checkpoint.from_directory(folder))
    assert _gone.wait(30)
    raise ValueError("bad batch")


async def test_a_checkpoint_gone_while_the_run_goes_on_is_not_blamed_on_a_closed_executor(
    tmp_path: Path,
) -> None:
    """Defect: a restart's checkpoint that was not there (deleted, or on another node's disk:
    a local storage path the nodes do not share) failed the run with an error that said an
    unnamed run's checkpoints go when its executor closes, while the executor was open. It
    names the other causes too: a storage path that every node must share."""
    _gone.clear()
    policy = asyncexec.RestartPolicy(
        max_restarts=1, restart_on_user_error=True, wait=tenacity.wait_none()
    )
    async with asyncexec.Executor(1, local=True, storage_path=tmp_path, restart=policy) as ex:
        with pytest.raises(asyncexec.RestartsExhaustedError) as caught:
            async for step in ex.run(restarts_from_a_deleted_checkpoint):
                assert step.checkpoint is not None
                shutil.rmtree(step.checkpoint.path)
                _gone.set()
    message = str(caught.value.failures[-1])
    assert "does not exist" in message and "every node of the workers shares" in message


def saves_an_undeletable_file(config: dict[str, Any]) -> None:
    """Three steps, each with a checkpoint holding a file that cannot be deleted."""
    for step in range(3):
        folder = tempfile.mkdtemp()
        Path(folder, "undeletable.txt").write_text(str(step))
        asyncexec.report({"step": step}, checkpoint=asyncexec.Checkpoint.from_directory(folder))


async def test_a_local_checkpoint_that_cannot_be_deleted_is_logged_and_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect: on a local storage path a deletion that failed (a file the driver may not
    delete) was ignored without a word, though a failure is logged
    (``checkpoint_prune_failed``): the folders that ``num_to_keep`` dropped piled up unseen.
    Each is logged now, and the run goes on."""
    unlink = os.unlink

    def refusing_unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        if os.path.basename(os.fspath(path)) == "undeletable.txt":
            raise PermissionError(13, "Permission denied", os.fspath(path))
        unlink(path, *args, **kwargs)

    keep = asyncexec.CheckpointConfig(num_to_keep=1)
    async with asyncexec.Executor(1, local=True, storage_path=tmp_path, checkpoint=keep) as ex:
        with structlog.testing.capture_logs() as logs:
            monkeypatch.setattr(os, "unlink", refusing_unlink)
            steps = [s async for s in ex.run(saves_an_undeletable_file)]
            monkeypatch.undo()
        assert len(steps) == 3
    failed = [e for e in logs if e["event"] == "checkpoint_prune_failed"]
    assert len(failed) == 2 and all("Permission denied" in e["error"] for e in failed)


async def test_a_run_folder_that_cannot_be_removed_leaves_the_others_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A local run folder that cannot be removed at the close is logged (``runs_not_removed``)
    and keeps its marker (a later close tries again); the executor's other runs still go."""
    unlink = os.unlink

    def refusing_unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        if os.path.basename(os.fspath(path)) == "undeletable.txt":
            raise PermissionError(13, "Permission denied", os.fspath(path))
        unlink(path, *args, **kwargs)

    with structlog.testing.capture_logs() as logs:
        async with asyncexec.Executor(1, local=True, storage_path=tmp_path) as ex:
            [_ async for _ in ex.run(saves_an_undeletable_file)]
            stuck = ex.result.run_id
            [_ async for _ in ex.run(counter, STEPS)]
            monkeypatch.setattr(os, "unlink", refusing_unlink)
        monkeypatch.undo()
    assert _runs(tmp_path) == {stuck}
    assert {p.stem for p in (tmp_path / MARKERS).iterdir()} == {stuck}
    (warning,) = [e for e in logs if e["event"] == "runs_not_removed"]
    assert "Permission denied" in warning["error"]


class Payload:
    """A metric's value that the test can watch being freed (local mode passes it as it is)."""


_payloads: list[weakref.ref[Payload]] = []


def reports_payloads(config: dict[str, Any]) -> None:
    """``config["steps"]`` steps, each with a checkpoint and a ``Payload`` in its metrics."""
    for step in range(config["steps"]):
        payload = Payload()
        if asyncexec.get_context().world_rank == 0:
            _payloads.append(weakref.ref(payload))
        folder = tempfile.mkdtemp()
        Path(folder, "state.txt").write_text(str(step))
        saved = asyncexec.Checkpoint.from_directory(folder)
        asyncexec.report({"payload": payload, "loss": float(step)}, checkpoint=saved)


@pytest.mark.parametrize("independent", [False, True], ids=["aligned", "independent"])
async def test_the_checkpoints_kept_do_not_hold_their_steps_metrics(
    tmp_path: Path, independent: bool
) -> None:
    """Defect: the driver held the whole metrics of every checkpoint it kept, for the run's
    life (of every checkpoint, without ``num_to_keep``; in a run of independent ranks, of every
    checkpoint whatever ``num_to_keep`` said): memory grew with the run's length. It keeps the
    score only."""
    _payloads.clear()
    steps = 60
    keep = asyncexec.CheckpointConfig(num_to_keep=1 if independent else None)
    async with asyncexec.Executor(1, local=True, storage_path=tmp_path, checkpoint=keep) as ex:
        run = ex.run(reports_payloads, {"steps": steps}, buffer_size=2, independent=independent)
        async for step in run:
            if step.index == steps - 1:
                del step
                gc.collect()
                alive = [ref for ref in _payloads[: steps // 2] if ref() is not None]
                assert alive == []
