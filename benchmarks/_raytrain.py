"""Ray Train's first executor (``ray.train._internal.backend_executor.BackendExecutor``),
measured in a driver process of its own.

Why a second driver: importing ``ray.train`` imports ``ray.data`` (pandas, pyarrow) into the
driver, and that would change what the asyncexec figures measure (a bigger driver; and asyncexec
hands the driver's Ray Data context to its workers when ``ray.data`` is loaded, so every worker
would import it too). So the benchmark's own process never imports ``ray.train``; it starts
``python _raytrain.py ADDRESS``, which joins the same Ray instance and serves one command at a
time (JSON lines on stdin; answers on stdout prefixed with ``@@bench``).

The executor is driven the way Ray Train v1's trainers drove it: ``start()``,
``start_training()``, ``get_next_results()`` until None, ``finish_training()``, ``shutdown()``;
after a worker failure ``get_next_results()`` restarts the group itself (``_restart``) and raises
``TrainingWorkerError``, and the trainer calls ``start_training()`` again. Every one of these
calls blocks; the server calls them on its event loop's thread only where it measures what they
do to an event loop (``start`` and ``lag``).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import signal
import sys
import tempfile
import time
import uuid
from typing import Any

from _common import cpu_seconds, heartbeat, lag_ms, rate
from _workload import rt_last_time, rt_steps, rt_until_killed

__all__ = ["RayTrainClient", "RayTrainGroup", "unavailable_reason"]

_MARK = "@@bench "
_SCRIPT = os.path.abspath(__file__)
#: The longest any one command may take before the client gives up on the server.
COMMAND_TIMEOUT_S = 300.0


def unavailable_reason() -> str | None:
    """Why Ray Train's first executor cannot be measured here, or None when it can."""
    if os.environ.get("RAY_TRAIN_V2_ENABLED") != "0":
        return "RAY_TRAIN_V2_ENABLED=0 was not set before Ray started"
    try:
        import ray.train  # noqa: F401
        from ray.train._internal.backend_executor import BackendExecutor  # noqa: F401
    except Exception as exc:  # ImportError, or a broken optional dependency below it
        return f"`import ray.train` failed ({type(exc).__name__}: {exc}); install asyncexec[bench]"
    return None


class RayTrainGroup:
    """One BackendExecutor with ``num_workers`` workers, and the figures measured on it."""

    def __init__(self, num_workers: int, resources_per_worker: dict[str, float]) -> None:
        from ray.train._internal.backend_executor import BackendExecutor
        from ray.train.backend import BackendConfig

        self.num_workers = num_workers
        # max_retries large: the restart figure kills a worker once per repeat.
        self.executor: Any = BackendExecutor(
            BackendConfig(),
            num_workers=num_workers,
            resources_per_worker=dict(resources_per_worker),
            max_retries=100,
        )
        self._root = tempfile.mkdtemp(prefix="asyncexec-bench-raytrain-")

    def start(self) -> float:
        """Start the worker group; return the seconds ``start()`` took."""
        t0 = time.perf_counter()
        self.executor.start()
        return time.perf_counter() - t0

    def pids(self) -> list[int]:
        return [int(w.metadata.pid) for w in self.executor.worker_group.workers]

    def _storage(self) -> Any:
        from ray.train._internal.storage import StorageContext

        return StorageContext(
            storage_path=self._root,
            experiment_dir_name=f"bench-{uuid.uuid4().hex[:8]}",
            trial_dir_name="trial",
        )

    def start_training(self, fn: Any) -> None:
        from ray.train import DataConfig

        self.executor.start_training(
            fn, datasets={}, metadata={}, data_config=DataConfig(), storage=self._storage()
        )

    def stream(self, steps: int) -> dict[str, float]:
        """Run ``steps`` tiny reports per worker; the rate is measured from the run's start
        (``start_training``) to its last step, with the CPU time of the driver and the workers."""
        pids = self.pids()
        cpu0 = cpu_seconds([os.getpid()]), cpu_seconds(pids)
        start = last = time.perf_counter()
        self.start_training(functools.partial(rt_steps, steps))
        count = 0
        while self.executor.get_next_results() is not None:
            last = time.perf_counter()
            count += 1
        cpu1 = cpu_seconds([os.getpid()]), cpu_seconds(pids)
        self.executor.finish_training()
        assert count == steps, (count, steps)
        total = count * self.num_workers
        return {
            "rate": rate(count, self.num_workers, start, last),
            "driver_cpu_us": (cpu1[0] - cpu0[0]) / total * 1e6,
            "worker_cpu_us": (cpu1[1] - cpu0[1]) / total * 1e6,
        }

    def run_end(self, steps: int) -> float:
        """Seconds from the last report (its wall time, taken in the worker) to the run's end
        (``get_next_results()`` returned None and ``finish_training()`` returned)."""
        self.start_training(functools.partial(rt_last_time, steps))
        last_t = 0.0
        while (results := self.executor.get_next_results()) is not None:
            last_t = max(r.metrics["t"] for r in results)
        self.executor.finish_training()
        return time.time() - last_t

    def restart(self, kill_after: int, period_s: float, resume_steps: int) -> dict[str, float]:
        """SIGKILL one worker mid-run; return the seconds from the kill to the first result of
        the restarted run (and to the moment the group was restarted)."""
        from ray.train._internal.backend_executor import TrainingWorkerError

        self.start_training(functools.partial(rt_until_killed, 100_000, period_s))
        for _ in range(kill_after):
            self.executor.get_next_results()
        victim = self.pids()[min(1, self.num_workers - 1)]
        t0 = time.perf_counter()
        os.kill(victim, signal.SIGKILL)
        try:
            while self.executor.get_next_results() is not None:
                pass
        except TrainingWorkerError:
            pass
        else:
            raise RuntimeError("Ray Train's run ended without noticing the killed worker")
        restarted = time.perf_counter()
        # What Ray Train v1's trainer does next: start the function again (from its latest
        # checkpoint) on the fresh group.
        self.start_training(functools.partial(rt_steps, resume_steps))
        first = self.executor.get_next_results()
        t1 = time.perf_counter()
        assert first is not None
        while self.executor.get_next_results() is not None:
            pass
        self.executor.finish_training()
        return {"first_step": t1 - t0, "group_restarted": restarted - t0}

    async def stream_on_loop(self, steps: int) -> int:
        """The stream driven from a coroutine, as an asyncio program would call it: every call
        blocks the event loop; ``await asyncio.sleep(0)`` between steps lets other tasks run."""
        self.start_training(functools.partial(rt_steps, steps))
        count = 0
        while self.executor.get_next_results() is not None:
            count += 1
            await asyncio.sleep(0)
        self.executor.finish_training()
        return count

    def shutdown(self) -> None:
        self.executor.shutdown()


# The server: the second driver process. -----------------------------------------------------


def _answer(message: dict[str, Any]) -> None:
    sys.stdout.write(_MARK + json.dumps(message) + "\n")
    sys.stdout.flush()


async def _serve_commands(resources: dict[str, float]) -> None:
    group: RayTrainGroup | None = None
    while True:
        line = await asyncio.to_thread(sys.stdin.readline)
        if not line:
            break
        command = json.loads(line)
        op = command["op"]
        try:
            result: Any = None
            if op == "exit":
                _answer({"ok": True, "result": None})
                break
            if op == "start":
                if group is not None:
                    group.shutdown()
                group = RayTrainGroup(command["n"], resources)
                # On the loop's thread on purpose: what start() does to an event loop.
                async with heartbeat() as lags:
                    seconds = group.start()
                result = {
                    "seconds": seconds,
                    "freeze_ms": lag_ms(lags)[1],
                    "pids": group.pids(),
                }
            elif group is None:
                raise RuntimeError(f"{op!r} before 'start'")
            elif op == "stream":
                result = group.stream(command["steps"])
            elif op == "run_end":
                result = group.run_end(command["steps"])
            elif op == "restart":
                result = group.restart(
                    command["kill_after"], command["period_s"], command["resume_steps"]
                )
            elif op == "lag":
                async with heartbeat() as lags:
                    await group.stream_on_loop(command["steps"])
                p99, worst = lag_ms(lags)
                result = {"p99_ms": p99, "max_ms": worst, "samples": len(lags)}
            elif op == "shutdown":
                group.shutdown()
                group = None
            else:
                raise ValueError(f"unknown command {op!r}")
            _answer({"ok": True, "result": result})
        except Exception as exc:
            _answer({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
    if group is not None:
        group.shutdown()


def serve(address: str, resources: dict[str, float]) -> None:
    """Join the Ray at ``address`` and serve commands until ``exit`` or the end of stdin."""
    import logging

    reason = unavailable_reason()
    if reason is not None:
        _answer({"ok": False, "unavailable": reason})
        return
    import ray

    logging.getLogger("ray.train").setLevel(logging.ERROR)
    ray.init(address=address, log_to_driver=False)
    try:
        _answer({"ok": True, "result": "ready"})
        asyncio.run(_serve_commands(resources))
    finally:
        ray.shutdown()


class RayTrainClient:
    """The benchmark's side of the Ray Train driver: sends a command, awaits the answer, never
    blocking the event loop."""

    def __init__(self) -> None:
        self._proc: asyncio.subprocess.Process | None = None
        self.unavailable: str | None = None

    async def open(self, address: str, resources: dict[str, float]) -> bool:
        """Start the server process; return whether Ray Train can be measured (else
        ``unavailable`` says why)."""
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable,
            _SCRIPT,
            address,
            json.dumps(resources),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        first = await self._receive()
        if not first.get("ok"):
            self.unavailable = str(first.get("unavailable") or first.get("error"))
            await self.close()
            return False
        return True

    async def _receive(self) -> dict[str, Any]:
        assert self._proc is not None
        assert self._proc.stdout is not None
        while True:
            raw = await asyncio.wait_for(self._proc.stdout.readline(), COMMAND_TIMEOUT_S)
            if not raw:
                code = await self._proc.wait()
                return {"ok": False, "error": f"the Ray Train driver exited ({code})"}
            line = raw.decode(errors="replace")
            if line.startswith(_MARK):
                message: dict[str, Any] = json.loads(line[len(_MARK) :])
                return message

    async def call(self, op: str, **args: Any) -> Any:
        """Run one command in the Ray Train driver and return its result.

        Raises:
            RuntimeError: the command failed there (its error is in the message).
        """
        assert self._proc is not None
        assert self._proc.stdin is not None
        self._proc.stdin.write((json.dumps({"op": op, **args}) + "\n").encode())
        await self._proc.stdin.drain()
        answer = await self._receive()
        if not answer.get("ok"):
            raise RuntimeError(f"Ray Train driver, {op}: {answer.get('error')}")
        return answer["result"]

    async def close(self) -> None:
        """Ask the server to exit (it shuts its group down) and wait for it, bounded."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.returncode is None and proc.stdin is not None:
                proc.stdin.write(b'{"op": "exit"}\n')
                await proc.stdin.drain()
                proc.stdin.close()
            await asyncio.wait_for(proc.wait(), 60)
        except (TimeoutError, OSError):
            proc.kill()
            await proc.wait()


if __name__ == "__main__":
    serve(sys.argv[1], json.loads(sys.argv[2]))
