"""TorchBackend: configuration, the held master port, process-group set-up on every rank against a
real Ray with real torch (gloo on CPU), all-reduce, shutdown, and two executors at once."""

from __future__ import annotations

import errno
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

import asyncexec
from asyncexec._worker import _place
from asyncexec.backends import GroupHandle, TorchBackend
from asyncexec.backends.torch import _worker as torch_backend
from asyncexec.backends.torch import cuda_device_index, resolve_backend, torch_env

TORCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK")
MASTER_ENV = ("MASTER_ADDR", "MASTER_PORT")
HALF_CPU = {"CPU": 0.5}


def _context(
    rank: int = 0, world_size: int = 1, gpus: tuple[str, ...] = ()
) -> asyncexec.WorkerContext:
    return asyncexec.WorkerContext(
        world_rank=rank,
        local_rank=rank,
        node_rank=0,
        world_size=world_size,
        local_world_size=world_size,
        node_id="node",
        node_ip="127.0.0.1",
        accelerator_ids={"GPU": gpus} if gpus else {},
    )


def _port_is_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("0.0.0.0", port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE:
                raise
            return False
    return True


def _read_records(directory: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in directory.iterdir()}


# Without Ray ------------------------------------------------------------------------------------


def test_importing_asyncexec_and_the_backend_class_does_not_import_torch() -> None:
    code = (
        "import sys, asyncexec, asyncexec.backends as b\n"
        "backend = b.TorchBackend(backend='gloo')\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "print(backend.name)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "torch"


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"backend": "glo"}, "backend"),
        ({"backend": "cpu:gloo,nccl"}, "backend"),
        ({"backend": 3}, "backend"),
        ({"init_method": "file"}, "init_method"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"timeout_s": True}, "timeout_s"),
        ({"shutdown_timeout_s": float("inf")}, "shutdown_timeout_s"),
    ],
)
def test_invalid_arguments_are_refused(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(asyncexec.ConfigurationError, match=needle):
        TorchBackend(**kwargs)


def test_valid_arguments_are_kept_and_the_instance_is_frozen() -> None:
    backend = TorchBackend(backend="cpu:gloo,cuda:nccl", init_method="tcp", timeout_s=5)
    assert (backend.backend, backend.init_method, backend.timeout_s) == (
        "cpu:gloo,cuda:nccl",
        "tcp",
        5,
    )
    with pytest.raises(AttributeError):
        backend.timeout_s = 1  # type: ignore[misc]


def test_torch_missing_on_the_driver_is_a_configuration_error_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "torch" else real(name, *a),
    )
    with pytest.raises(asyncexec.ConfigurationError, match=r"asyncexec\[torch\]"):
        TorchBackend()


def test_torch_missing_on_a_worker_is_an_import_error_naming_the_extra(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "torch.distributed", None)
    with pytest.raises(ImportError, match=r"asyncexec\[torch\]"):
        torch_backend._import_dist()


def test_backend_auto_is_nccl_with_gpus_and_gloo_without() -> None:
    cpu = [_context(0, 2), _context(1, 2)]
    gpu = [_context(0, 2, ("0",)), _context(1, 2, ("1",))]
    assert resolve_backend(None, cpu) == "gloo"
    assert resolve_backend(None, gpu) == "nccl"
    assert resolve_backend("gloo", gpu) == "gloo"


@pytest.mark.parametrize(
    ("gpu_ids", "visible", "local_rank", "expected"),
    [
        (("3",), "2,3", 1, 1),  # shared visible devices: the position of the worker's own GPU
        (("3",), "3", 0, 0),  # only its own GPU visible
        (("10",), "2,10,11", 0, 1),
        (("2",), None, 0, 2),  # everything visible: the id is the index
        ((), "0,1", 1, 1),  # no GPU of its own: the local rank
    ],
)
def test_cuda_device_is_the_index_of_the_workers_gpu_among_the_visible_ones(
    gpu_ids: tuple[str, ...], visible: str | None, local_rank: int, expected: int
) -> None:
    assert cuda_device_index(gpu_ids, visible, local_rank) == expected


def test_cuda_device_of_a_gpu_that_is_not_visible_is_an_error() -> None:
    with pytest.raises(RuntimeError, match="not in CUDA_VISIBLE_DEVICES"):
        cuda_device_index(("5",), "0,1", 0)


def test_torch_env_names_rank_sizes_and_master() -> None:
    ctx = asyncexec.WorkerContext(
        world_rank=3,
        local_rank=1,
        node_rank=1,
        world_size=4,
        local_world_size=2,
        node_id="n",
        node_ip="10.0.0.2",
    )
    assert torch_env(ctx, "10.0.0.1", 29500) == {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_WORLD_SIZE": "2",
        "NODE_RANK": "1",
        "MASTER_ADDR": "10.0.0.1",
        "MASTER_PORT": "29500",
    }


def test_master_port_stays_bound_from_reservation_until_the_group_is_destroyed(
    monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """No window for another process to take the port (the seed's race), and torch's own
    rendezvous joins the held server instead of failing with EADDRINUSE."""
    import torch.distributed as dist

    for name in (*TORCH_ENV, *MASTER_ENV):
        # Set, then deleted: undone as absent, so the variables init_process_group sets here
        # do not outlive the test (a Ray started later would hand them to every worker).
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)
    place = _place.Place()
    place.context = _context()
    token = _place.PLACE.set(place)
    request.addfinalizer(lambda: _place.PLACE.reset(token))
    assert not dist.is_initialized()
    addr, port = torch_backend.reserve_master(30)
    try:
        assert addr == "127.0.0.1"
        assert not _port_is_free(port), "the reserved port was released"
        torch_backend.init_process_group(addr, port, "gloo", "env://", 30)
        assert torch_backend._reserved is None
        assert dist.is_initialized()
        assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
        assert os.environ["MASTER_PORT"] == str(port)
        assert not _port_is_free(port), "the process group's store does not hold the port"
    finally:
        assert torch_backend.destroy_process_group(10) is True
    assert not dist.is_initialized()
    assert _port_is_free(port), "the port is still bound after the group was destroyed"


def test_destroy_that_hangs_is_given_up_after_the_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    release = threading.Event()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: release.wait(30))
    t0 = time.monotonic()
    try:
        assert torch_backend.destroy_process_group(0.2) is False
    finally:
        release.set()
    assert time.monotonic() - t0 < 5


# With Ray ---------------------------------------------------------------------------------------


def all_reduce_sum(value: float) -> float:
    """Each rank contributes ``value * (rank + 1)``; returns the all-reduced sum."""
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([value * (dist.get_rank() + 1)], dtype=torch.float64)
    dist.all_reduce(tensor)
    return float(tensor.item())


def torch_environment() -> dict[str, str | None]:
    return {name: os.environ.get(name) for name in (*TORCH_ENV, *MASTER_ENV)}


def is_initialized() -> bool:
    import torch.distributed as dist

    return bool(dist.is_initialized())


def record_initialized(directory: str) -> None:
    import torch.distributed as dist

    rank = asyncexec.get_context().world_rank
    Path(directory, f"rank{rank}").write_text(str(dist.is_initialized()))


@dataclass(frozen=True)
class RecordingTorchBackend(TorchBackend):
    """Records, after the real on_shutdown, whether each rank still has a process group."""

    record_dir: str = ""

    async def on_shutdown(self, group: GroupHandle) -> None:
        await super().on_shutdown(group)
        await group.execute(record_initialized, self.record_dir)


@pytest.mark.smoke
@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("init_method", ["env", "tcp"])
async def test_process_group_is_initialised_on_every_rank_and_all_reduce_sums(
    init_method: str,
) -> None:
    backend = TorchBackend(backend="gloo", init_method=init_method)  # type: ignore[arg-type]
    async with asyncexec.Executor(2, resources_per_worker=HALF_CPU, backend=backend) as ex:
        infos = await ex.execute(torch_backend.process_group_info)
        assert [(i["initialized"], i["rank"], i["world_size"], i["backend"]) for i in infos] == [
            (True, 0, 2, "gloo"),
            (True, 1, 2, "gloo"),
        ]
        envs = await ex.execute(torch_environment)
        workers = ex.workers
        for rank, env in enumerate(envs):
            assert env["RANK"] == str(rank)
            assert env["LOCAL_RANK"] == str(workers[rank].local_rank)
            assert env["WORLD_SIZE"] == "2"
            assert env["LOCAL_WORLD_SIZE"] == str(workers[rank].local_world_size)
            assert env["NODE_RANK"] == str(workers[rank].node_rank)
            assert env["MASTER_ADDR"] == workers[0].node_ip
        assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]
        assert await ex.execute(all_reduce_sum, 1.5) == [4.5, 4.5]


@pytest.mark.usefixtures("ray_local")
async def test_shutdown_destroys_the_process_group_on_every_rank(tmp_path: Path) -> None:
    backend = RecordingTorchBackend(backend="gloo", record_dir=str(tmp_path))
    async with asyncexec.Executor(2, resources_per_worker=HALF_CPU, backend=backend) as ex:
        assert await ex.execute(is_initialized) == [True, True]
    assert _read_records(tmp_path) == {"rank0": "False", "rank1": "False"}


@pytest.mark.usefixtures("ray_local")
async def test_two_executors_sharing_one_backend_at_once_do_not_interfere() -> None:
    backend = TorchBackend(backend="gloo")
    started = [anyio.Event(), anyio.Event()]
    results: dict[int, list[list[float]]] = {}
    ports: dict[int, set[str | None]] = {}

    async def use(k: int) -> None:
        async with asyncexec.Executor(2, resources_per_worker=HALF_CPU, backend=backend) as ex:
            started[k].set()
            await started[1 - k].wait()  # both groups are live before either all-reduces
            results[k] = [await ex.execute(all_reduce_sum, 10.0**k + i) for i in range(3)]
            ports[k] = {env["MASTER_PORT"] for env in await ex.execute(torch_environment)}

    async with anyio.create_task_group() as tg:
        tg.start_soon(use, 0)
        tg.start_soon(use, 1)
    for k in (0, 1):
        assert results[k] == [[3 * (10.0**k + i)] * 2 for i in range(3)]
    assert len(ports[0]) == len(ports[1]) == 1
    assert ports[0] != ports[1]
    assert backend == TorchBackend(backend="gloo"), "the shared instance was changed"


def destroy_group_and_report() -> None:
    import torch.distributed as dist

    dist.destroy_process_group()
    asyncexec.report({"destroyed": True})


def all_reduce_in_run() -> float:
    value = all_reduce_sum(2.0)
    asyncexec.report({"sum": value})
    return value


@pytest.mark.usefixtures("ray_local")
async def test_a_run_that_destroys_the_group_leaves_a_working_group_for_the_next_run() -> None:
    backend = TorchBackend(backend="gloo")
    async with asyncexec.Executor(2, resources_per_worker=HALF_CPU, backend=backend) as ex:
        async for _ in ex.run(destroy_group_and_report):
            pass
        assert await ex.execute(is_initialized) == [False, False]
        run = ex.run(all_reduce_in_run)
        steps = [s async for s in run]
        assert [s.metrics["sum"] for s in steps] == [6.0]
        assert run.result.return_values == [6.0, 6.0]


@pytest.mark.usefixtures("ray_local")
async def test_process_group_set_up_failure_is_a_backend_error_naming_the_rank() -> None:
    """A torch build without MPI cannot start an mpi group: start-up fails cleanly."""
    import torch.distributed as dist

    if dist.is_mpi_available():  # pragma: no cover - the CPU wheels have no MPI
        pytest.skip("this torch has MPI")
    backend = TorchBackend(backend="mpi", timeout_s=20)
    with pytest.raises(asyncexec.BackendError) as info:
        async with asyncexec.Executor(2, resources_per_worker=HALF_CPU, backend=backend):
            pytest.fail("start-up succeeded")
    assert (info.value.backend, info.value.hook) == ("torch", "on_start")
    assert info.value.rank in (0, 1)
    assert "MPI" in str(info.value)


@pytest.mark.usefixtures("ray_local")
async def test_a_pooled_worker_gets_a_fresh_process_group_each_lease_and_none_without() -> None:
    backend = TorchBackend(backend="gloo")
    async with asyncexec.WorkerPool(2, resources_per_worker=HALF_CPU) as pool:
        pids = []
        for size in (2, 1):
            async with asyncexec.Executor(size, pool=pool, backend=backend) as ex:
                infos = await ex.execute(torch_backend.process_group_info)
                assert [(i["initialized"], i["world_size"]) for i in infos] == [(True, size)] * size
                assert await ex.execute(all_reduce_sum, 1.0) == [size * (size + 1) / 2] * size
                pids += [w.pid for w in ex.workers]
        async with asyncexec.Executor(2, pool=pool) as ex:  # a lease without the backend
            assert await ex.execute(is_initialized) == [False, False]
            for env in await ex.execute(torch_environment):
                assert env["RANK"] is None and env["MASTER_PORT"] is None
            pids += [w.pid for w in ex.workers]
        assert len(set(pids)) == 2 and pool.statistics().replaced == 0  # reused, not killed


def all_reduce_steps_and_die_once() -> None:
    ctx = asyncexec.get_context()
    for n in range(4):
        asyncexec.report({"sum": all_reduce_sum(1.0), "pid": os.getpid()})
        # buffer_size=1: past the second report, step 0 has been taken.
        if n == 1 and ctx.attempt == 1 and ctx.world_rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.usefixtures("ray_local")
async def test_a_spare_joins_a_new_process_group_in_place_of_a_killed_rank() -> None:
    backend = TorchBackend(backend="gloo", timeout_s=20)
    policy = asyncexec.RestartPolicy(max_restarts=1)
    async with asyncexec.Executor(
        2, resources_per_worker=HALF_CPU, backend=backend, spares=1, restart=policy
    ) as ex:
        survivor = ex.workers[0].pid
        spare = ex._slot.group.spares[0].metadata.pid  # type: ignore[union-attr]
        steps = [s async for s in ex.run(all_reduce_steps_and_die_once, buffer_size=1)]
        assert [w.pid for w in ex.workers] == [survivor, spare]
        second = [s for s in steps if s.attempt == 2]
        assert len(second) == 4 and all(s.metrics["sum"] == 3.0 for s in second)
        assert ex.statistics().group_starts == 1


class _Ranks:
    """A group handle of two ranks: rank 0's run destroyed its process group, rank 1's destroy
    hangs (each function's answers given by name)."""

    def __init__(self, answers: dict[str, Any]) -> None:
        self.contexts: list[Any] = []
        self.answers = answers
        self.called: list[str] = []

    async def execute(self, fn: Any, /, *args: Any, **kwargs: Any) -> list[Any]:
        self.called.append(fn.__name__)
        answer = self.answers[fn.__name__]
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def execute_single(self, rank: int, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
        self.called.append(fn.__name__)
        return ("127.0.0.1", 1)


@pytest.mark.timeout(30)
async def test_a_group_set_up_anew_after_a_destroy_that_hung_names_the_destroy() -> None:
    """Defect: before a run, a rank whose run destroyed the group had all ranks destroy theirs
    and set up anew, with no look at whether each destroy ended: a rank whose destroy hung
    then failed the set-up with torch's "trying to initialize the default process group
    twice", naming nothing of what went wrong. Now the hook fails at once, naming the ranks
    whose destroy did not end and the bound."""
    twice = ValueError("trying to initialize the default process group twice!")
    group = _Ranks(
        {
            "reassert_env": [False, True],
            "destroy_process_group": [True, False],
            "init_process_group": twice,  # what rank 1 says, its group still there
        }
    )
    with pytest.raises(RuntimeError, match=r"rank\(s\) \[1\] was not destroyed within"):
        await TorchBackend(shutdown_timeout_s=2).on_training_start(group)
    assert group.called == ["reassert_env", "destroy_process_group"]
