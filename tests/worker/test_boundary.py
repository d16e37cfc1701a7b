"""The process boundary: what a worker process imports, checked in a fresh interpreter and in
real workers (with and without the torch backend)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from typing import Any

import pytest
import ray

import asyncexec

#: What a worker must never import: the driver's libraries and asyncexec's driver side.
FORBIDDEN = ("anyio", "structlog", "tenacity", "rich", "asyncexec._driver", "asyncexec._cli._main")


def _forbidden(modules: list[str]) -> list[str]:
    return sorted(m for m in modules if m in FORBIDDEN or m.startswith(FORBIDDEN[4] + "."))


#: Puts a fresh interpreter in Ray's worker mode, as Ray does in a worker before it runs any code
#: of the application: ``import asyncexec`` anywhere else imports the driver side too.
_AS_A_WORKER = "import ray._private.worker as w\nw.global_worker.mode = w.WORKER_MODE\n"


def _fresh_import(code: str) -> list[str]:
    """Run ``code`` in a fresh interpreter in Ray's worker mode and return the modules it has
    imported."""
    script = (
        _AS_A_WORKER
        + textwrap.dedent(code)
        + "\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    modules: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return modules


def test_the_worker_side_imports_no_driver_module() -> None:
    modules = _fresh_import(
        """
        import asyncexec
        from asyncexec._worker import _actor, _session
        asyncexec.report, asyncexec.get_context, asyncexec.Checkpoint, asyncexec.WorkerContext
        asyncexec.WorkerRaisedError
        """
    )
    assert "asyncexec._worker._actor" in modules
    assert _forbidden(modules) == []


def test_the_torch_backends_worker_part_imports_no_driver_module() -> None:
    modules = _fresh_import(
        """
        from asyncexec.backends.torch import _worker, get_device
        """
    )
    assert "asyncexec.backends.torch._worker" in modules
    assert _forbidden(modules) == []
    assert "asyncexec.backends.torch._driver" not in modules
    assert "torch" not in modules  # imported only when a helper needs it


def test_the_stand_in_rollout_server_imports_no_driver_module() -> None:
    """A ``ScriptedServer`` unpickled in a worker stays light: ``asyncexec.testing`` loads the
    simulated cluster (the driver's) on first use only."""
    modules = _fresh_import("from asyncexec.testing import Script, ScriptedServer")
    assert "asyncexec.testing._servers" in modules
    assert _forbidden(modules) == []


def test_the_demo_function_imports_no_driver_module() -> None:
    modules = _fresh_import("from asyncexec._cli._demo import demo_train")
    assert _forbidden(modules) == []


def _loaded() -> list[str]:
    return sorted(sys.modules)


@ray.remote(num_cpus=0)
class _PlainActor:
    """The baseline: a plain async Ray actor handed a function (Ray's async actors import anyio
    themselves, after their first call)."""

    async def call(self, fn: Any) -> Any:
        return fn()


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("with_torch", [False, True])
async def test_a_real_worker_imports_no_driver_module(with_torch: bool) -> None:
    """Measured in the workers themselves, after start-up, a run and execute(): beyond what a
    plain async actor imports, nothing of the driver's."""
    plain = _PlainActor.remote()
    await plain.call.remote(_loaded)
    baseline = set(await plain.call.remote(_loaded))
    ray.kill(plain)
    backend: Any = None
    if with_torch:
        pytest.importorskip("torch")
        from asyncexec.backends import TorchBackend

        backend = TorchBackend()
    async with asyncexec.Executor(
        2, resources_per_worker={"CPU": 0.5}, backend=backend
    ) as executor:
        steps = [s async for s in executor.run(_two_steps)]
        assert len(steps) == 2
        for modules in await executor.execute(_loaded):
            assert _forbidden([m for m in modules if m not in baseline]) == []
            assert not [m for m in modules if m.startswith("asyncexec._driver")]
            assert "asyncexec._worker._actor" in modules


def _two_steps() -> None:
    asyncexec.report({"a": 1})
    asyncexec.report({"a": 2})
