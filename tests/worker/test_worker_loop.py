"""A worker's event loop stays free while the worker does slow work of its own for the driver
(a local worker: threads of this process): a health check (``ping``) answers while a reset
destroys a torch process group, and while a run's function and config are unpickled."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import types
from dataclasses import replace
from typing import Any

import pytest
from conftest import wait_no_local_threads
from ray import cloudpickle
from test_roles_worker import _set_up  # describe, then set up one worker as rank 0 of 1

from asyncexec import report
from asyncexec._driver.cluster._local import LocalWorker
from asyncexec._wire._protocol import RunStart

pytestmark = pytest.mark.timeout(30)

#: Bounds every wait on a worker.
WAIT_S = 10.0
#: How long a ping of a free loop may take (it answers at once).
PING_S = 3.0


async def _call(target: LocalWorker, method: Any, /, *args: Any, timeout_s: float = WAIT_S) -> Any:
    async def wait() -> Any:
        return await target.call(method, *args)

    return await asyncio.wait_for(wait(), timeout_s)


class _HungDistributed(types.ModuleType):
    """A stand-in for ``torch.distributed`` whose process group's destroy hangs until the test
    lets it end (a collective still waiting on a peer)."""

    def __init__(self) -> None:
        super().__init__("torch.distributed")
        self.destroying = threading.Event()
        self.release = threading.Event()

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return not self.release.is_set()

    def destroy_process_group(self) -> None:
        self.destroying.set()
        self.release.wait(WAIT_S)


async def test_a_reset_whose_process_group_destroy_hangs_leaves_the_loop_free(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Defect: a pooled worker's reset destroyed a torch process group (one the user's function
    set up) on the worker's event loop, without a bound: a destroy that hung froze the loop
    (health checks, every call) for good. It runs in a thread now, bounded by the stop
    timeout: past it the reset fails (the worker is not reused) and the loop answers on."""
    dist = _HungDistributed()
    monkeypatch.setitem(sys.modules, "torch.distributed", dist)
    target = LocalWorker("hung-destroy")
    try:
        await _set_up(target)
        reset = asyncio.ensure_future(_call(target, "reset", 0.5, None))
        assert await asyncio.to_thread(dist.destroying.wait, WAIT_S)
        assert await _call(target, "ping", timeout_s=PING_S) == os.getpid()
        outcome = await reset
        assert outcome.kind == "error"
        assert "process group" in str(outcome.error)
    finally:
        dist.release.set()
        target.kill()
    wait_no_local_threads()


class _Unpickling:
    """Events of this process: a config's unpickling began, and lets it end."""

    began = threading.Event()
    release = threading.Event()


def _slow_config() -> dict[str, int]:
    _Unpickling.began.set()
    assert _Unpickling.release.wait(WAIT_S)
    return {"steps": 2}


class SlowToUnpickle:
    """A config whose unpickling takes a while (a large one, or one whose classes' modules
    import slowly)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return _slow_config, ()


def _train(config: dict[str, int]) -> int:
    for i in range(config["steps"]):
        report({"i": i})
    return config["steps"]


async def test_a_run_whose_config_unpickles_slowly_leaves_the_loop_free(tmp_path: Any) -> None:
    """Defect: ``start_run`` unpickled the run's function and config on the worker's event
    loop: a large config (or a function whose module imports slowly) froze the loop meanwhile
    (health checks, calls, the polls of the run). It is unpickled in a thread now."""
    _Unpickling.began.clear()
    _Unpickling.release.clear()
    target = LocalWorker("slow-config")
    try:
        context = (await _set_up(target)).context
        context = replace(context, run_id="run", attempt=1, storage_path=str(tmp_path))
        start = RunStart(context, None, 16, 0, {})
        payload = cloudpickle.dumps((_train, SlowToUnpickle()))
        started = asyncio.ensure_future(_call(target, "start_run", payload, start))
        assert await asyncio.to_thread(_Unpickling.began.wait, WAIT_S)
        assert await _call(target, "ping", timeout_s=PING_S) == os.getpid()
        _Unpickling.release.set()
        await started
        reports: list[Any] = []
        while True:
            poll = await _call(target, "poll", len(reports), 64)
            reports += poll.reports
            if poll.outcome is not None:
                break
        assert [r["i"] for r in reports] == [0, 1] and poll.outcome.value == 2
    finally:
        _Unpickling.release.set()
        target.kill()
    wait_no_local_threads()
