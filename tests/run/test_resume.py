"""Runs that resume after their driver dies: a driver process is SIGKILLed mid-run, and a new one
started with the same run name and storage finishes the run from the latest checkpoint, with the
step index going on; the dead driver's workers are gone; a different config or a finished run is
refused clearly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import ray
from conftest import wait_no_leaks
from resume_driver import train

import asyncexec

#: The run record's name under ``<storage_path>/<name>/``, as docs/semantics.md gives it.
RECORD_FILE = "asyncexec_run.json"

pytestmark = [pytest.mark.usefixtures("ray_local"), pytest.mark.timeout(240)]

DRIVER = str(Path(__file__).with_name("resume_driver.py"))
STEPS = 24


def _start(
    storage: Path, name: str, delay: float, log: Path, hash_seed: int
) -> subprocess.Popen[str]:
    address = ray.get_runtime_context().gcs_address
    args = [sys.executable, DRIVER, address, str(storage), name, str(STEPS), str(delay)]
    env = dict(os.environ, PYTHONHASHSEED=str(hash_seed))
    with open(log, "w") as stderr:  # the child keeps its own descriptor
        return subprocess.Popen(args, stdout=subprocess.PIPE, stderr=stderr, text=True, env=env)


async def _lines(proc: subprocess.Popen[str]) -> Any:
    assert proc.stdout is not None
    while True:
        line = await anyio.to_thread.run_sync(proc.stdout.readline)
        if not line:
            return
        yield json.loads(line)


def _record(storage: Path, name: str) -> dict[str, Any]:
    return json.loads((storage / name / RECORD_FILE).read_text())


async def test_a_new_driver_resumes_a_named_run_after_the_first_was_sigkilled(
    tmp_path: Path,
) -> None:
    """Also: the config holds a set of strings and each driver has its own hash seed (it was
    refused as another config); the resumed stream's index matches the work (it was one off:
    it went on from the recorded step count, not from the step after the checkpoint); the
    checkpoints the dead driver kept are pruned by the new one (they were left for ever)."""
    # The undisturbed run, for the final state.
    async with asyncexec.Executor(
        2, storage_path=str(tmp_path / "ref"), resources_per_worker={"CPU": 0.5}
    ) as executor:
        async for _ in executor.run(train, {"steps": STEPS, "delay": 0.05, "tag": ""}):
            pass
        expected = executor.result.return_values

    storage = tmp_path / "runs"
    first = _start(storage, "job", 0.05, tmp_path / "first.err", hash_seed=1)
    seen: list[dict[str, Any]] = []
    async for line in _lines(first):
        if "index" in line:
            seen.append(line)
            # Past a checkpoint that the record holds: kill the driver, mid-run.
            if line["i"] >= 8 and _record(storage, "job")["checkpoint"]:
                first.send_signal(signal.SIGKILL)
                break
    first.wait(30)
    # Ray owned the dead driver's workers by its job: they are gone, nothing is left behind.
    await anyio.to_thread.run_sync(wait_no_leaks, 30.0)
    record = _record(storage, "job")
    assert record["status"] == "running" and record["attempt"] == 1
    # The record lags the stream by at most its interval (0.1 s, 2 steps here) and a poll.
    assert len(seen) - 6 <= record["steps"] <= len(seen)

    second = _start(storage, "job", 0.05, tmp_path / "second.err", hash_seed=2)
    resumed = [line async for line in _lines(second)]
    if second.wait(60) != 0:
        pytest.fail(await anyio.Path(tmp_path / "second.err").read_text())
    steps = [line for line in resumed if "index" in line]
    # The stream goes on from the step after the checkpoint, in a new attempt: each index is
    # the same work as in the first driver's stream (here, with no restart there, step i).
    checkpoint_index = int(Path(record["checkpoint"]).name.split("_")[1])
    assert steps[0]["index"] == checkpoint_index + 1
    assert record.get("checkpoint_index") == checkpoint_index
    assert all(s["index"] == s["i"] for s in steps), steps
    assert [s["index"] for s in steps] == list(range(checkpoint_index + 1, STEPS))
    assert {s["attempt"] for s in steps} == {2}
    assert steps[-1]["i"] == STEPS - 1
    # CheckpointConfig(num_to_keep=2) over both drivers: the first's are pruned too.
    kept = sorted(p.name for p in (storage / "job").iterdir() if p.name.startswith("checkpoint_"))
    assert len(kept) == 2, (kept, json.dumps(record))
    final = resumed[-1]
    assert final["result"] == expected and final["attempts"] == 2
    assert _record(storage, "job")["status"] == "finished"
    await anyio.to_thread.run_sync(wait_no_leaks, 30.0)


async def test_a_named_run_refuses_another_config_or_a_finished_run(tmp_path: Path) -> None:
    config = {"steps": 3, "delay": 0.0, "tag": ""}
    async with asyncexec.Executor(
        1, storage_path=str(tmp_path), resources_per_worker={"CPU": 0.5}
    ) as executor:
        async for _ in executor.run(train, config, name="done"):
            pass
        assert _record(tmp_path, "done")["status"] == "finished"
        with pytest.raises(asyncexec.ConfigurationError, match="already finished"):
            async for _ in executor.run(train, config, name="done"):
                pass
        # An unfinished record of another config.
        record = _record(tmp_path, "done")
        record["status"] = "running"
        (tmp_path / "other").mkdir()
        (tmp_path / "other" / RECORD_FILE).write_text(json.dumps(record))
        with pytest.raises(asyncexec.ConfigurationError, match="another config"):
            async for _ in executor.run(train, {**config, "tag": "x"}, name="other"):
                pass
        # "never" starts over; the stream starts at 0.
        indices = [s.index async for s in executor.run(train, config, name="done", resume="never")]
        assert indices == [0, 1, 2]
        with pytest.raises(asyncexec.ConfigurationError, match="run name"):
            executor.run(train, name="../escape")
        with pytest.raises(asyncexec.ConfigurationError, match="resume"):
            executor.run(train, name="x", resume="maybe")  # type: ignore[arg-type]
