"""Pure logic, no Ray: ranks, device sharing, configuration checks, the error tree, the restart
policy, the public exports."""

from __future__ import annotations

import pickle

import pytest
import tenacity

import asyncexec
from asyncexec import _errors
from asyncexec._driver._config import ExecutorConfig, validate_resources
from asyncexec._driver._devices import shared_device_env
from asyncexec._driver.group._ranks import assign_ranks, order_workers


def test_ranks_follow_the_seed_example() -> None:
    """Ray Train's docstring example: workers on nodes 0,0,1,0,1."""
    ranks = assign_ranks(["n0", "n0", "n1", "n0", "n1"])
    assert [r.local_rank for r in ranks] == [0, 1, 0, 2, 1]
    assert [r.local_world_size for r in ranks] == [3, 3, 2, 3, 2]
    assert [r.node_rank for r in ranks] == [0, 0, 1, 0, 1]
    assert {r.world_size for r in ranks} == {5}


def test_order_puts_driver_node_first_then_lowest_gpu() -> None:
    nodes = ["b", "a", "b", "a"]
    gpus = [{"GPU": ("1",)}, {"GPU": ("10",)}, {"GPU": ("0",)}, {"GPU": ("2",)}]
    assert order_workers(nodes, gpus, first_node="a") == [3, 1, 2, 0]
    assert order_workers(nodes, gpus, first_node=None) == [2, 0, 3, 1]
    # A driver node that holds no worker changes nothing.
    assert order_workers(nodes, gpus, first_node="z") == [2, 0, 3, 1]


def test_device_env_is_the_union_per_node_sorted_numerically() -> None:
    env = shared_device_env(
        ["a", "a", "b"],
        [{"GPU": ("10",), "neuron_cores": ("0", "1")}, {"GPU": ("2",)}, {"GPU": ("0",)}],
        ["GPU", "neuron_cores", "NPU"],
    )
    assert env[0]["CUDA_VISIBLE_DEVICES"] == "2,10"
    assert env[1]["CUDA_VISIBLE_DEVICES"] == "2,10"
    assert env[0]["HIP_VISIBLE_DEVICES"] == "2,10"
    assert env[2]["CUDA_VISIBLE_DEVICES"] == "0"
    assert env[1]["NEURON_RT_VISIBLE_CORES"] == "0,1"
    assert "NEURON_RT_VISIBLE_CORES" not in env[2]
    assert all("ASCEND_RT_VISIBLE_DEVICES" not in e for e in env)


def test_device_sharing_off_sets_nothing() -> None:
    assert shared_device_env(["a", "a"], [{"GPU": ("0",)}, {"GPU": ("1",)}], []) == [{}, {}]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"num_workers": 0}, "num_workers"),
        ({"num_workers": -2}, "num_workers"),
        ({"num_workers": 1.5}, "num_workers"),
        ({"num_workers": True}, "num_workers"),
        ({"resources_per_worker": {"CPU": -1}}, "negative"),
        ({"resources_per_worker": {"CPU": "one"}}, "number"),
        ({"resources_per_worker": {"CPU": 0}}, "positive amount"),
        ({"resources_per_worker": [("CPU", 1)]}, "mapping"),
        ({"resources_per_worker": {1: 1}}, "key"),
        ({"resources_per_worker": {"GPU": 1.5}}, "whole number"),
        ({"resources_per_worker": {"CPU": float("nan")}}, "number"),
        ({"placement_strategy": "SPRAY"}, "placement_strategy"),
        ({"placement_timeout_s": 0}, "placement_timeout_s"),
        ({"start_timeout_s": -1}, "start_timeout_s"),
        ({"health_check_interval_s": "5"}, "health_check_interval_s"),
        ({"step_timeout_s": 0}, "step_timeout_s"),
        ({"buffer_size": 0}, "buffer_size"),
        ({"buffer_size": 2.0}, "buffer_size"),
        ({"share_devices": {"TPU"}}, "unknown device kinds"),
        ({"share_devices": "GPU"}, "share_devices"),
        ({"init_hook": 3}, "init_hook"),
        ({"storage_path": 3}, "storage_path"),
        ({"restart": 3}, "restart"),
        ({"backend": object()}, "backend"),
        ({"graceful_patience_s": -1}, "graceful_patience_s"),
        ({"name": ""}, "name"),
    ],
)
def test_bad_executor_arguments_are_refused_before_anything_starts(
    kwargs: dict[str, object], needle: str
) -> None:
    args = {"num_workers": 2, **kwargs}
    with pytest.raises(asyncexec.ConfigurationError, match=needle):
        asyncexec.Executor(**args)  # type: ignore[arg-type]


def test_valid_resources_are_normalised() -> None:
    assert validate_resources({"CPU": 1, "GPU": 0.5, "neuron_cores": 2}) == {
        "CPU": 1.0,
        "GPU": 0.5,
        "neuron_cores": 2.0,
    }
    config = ExecutorConfig.build(3, resources_per_worker={"CPU": 1, "GPU": 0})
    assert config.bundles == [{"CPU": 1.0}] * 3


def test_checkpoint_config_is_checked() -> None:
    with pytest.raises(asyncexec.ConfigurationError, match="num_to_keep"):
        asyncexec.CheckpointConfig(num_to_keep=0)
    with pytest.raises(asyncexec.ConfigurationError, match="score_order"):
        asyncexec.CheckpointConfig(score_order="up")  # type: ignore[arg-type]


def _all_errors() -> list[BaseException]:
    cause = ValueError("boom")
    return [
        asyncexec.ConfigurationError("bad"),
        asyncexec.ExecutorStateError("closed"),
        asyncexec.StartupError("no"),
        asyncexec.PlacementTimeoutError([{"CPU": 1.0}], {"CPU": 0.5}, 3.0),
        asyncexec.StartupTimeoutError("starting", 5.0),
        asyncexec.BackendError("torch", "on_start", 1, "port in use"),
        asyncexec.WorkerCrashedError(2, node_id="abc", pid=7, attempt=3, detail="SIGKILL"),
        asyncexec.NodeLostError(1, node_id="n", attempt=2),
        asyncexec.WorkerHungError(0, detail="no answer"),
        asyncexec.WorkerUnreachableError(3, node_id="n", detail="ObjectLostError"),
        asyncexec.WorkerRaisedError(1, node_id="n", error=cause, remote_traceback="tb"),
        asyncexec.ReportMismatchError({0: 3, 1: 2}, [1]),
        asyncexec.RestartsExhaustedError(
            3, [asyncexec.WorkerCrashedError(0), asyncexec.WorkerHungError(1)]
        ),
    ]


@pytest.mark.parametrize("error", _all_errors(), ids=lambda e: type(e).__name__)
def test_every_error_pickles_with_its_attributes(error: BaseException) -> None:
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert str(copy) == str(error)
    assert isinstance(copy, asyncexec.AsyncExecError)
    for attr in (
        "rank",
        "node_id",
        "pid",
        "attempt",
        "counts",
        "attempts",
        "requested",
        "available",
    ):
        if hasattr(error, attr):
            assert getattr(copy, attr) == getattr(error, attr)
    if isinstance(error, asyncexec.WorkerRaisedError):
        assert isinstance(copy.__cause__, ValueError)
        assert copy.remote_traceback == "tb"
    if isinstance(error, asyncexec.RestartsExhaustedError):
        assert [type(f) for f in copy.failures] == [type(f) for f in error.failures]
        assert type(copy.__cause__) is asyncexec.WorkerHungError


def test_errors_name_what_failed() -> None:
    crash = asyncexec.WorkerCrashedError(2, node_id="abcdef0123456789", pid=7, attempt=3)
    assert "rank 2" in str(crash) and "abcdef012345" in str(crash) and "attempt 3" in str(crash)
    mismatch = asyncexec.ReportMismatchError({0: 3, 1: 2})
    assert "rank 0: 3" in str(mismatch) and "rank 1: 2" in str(mismatch)
    placement = asyncexec.PlacementTimeoutError([{"CPU": 64.0}], {"CPU": 4.0}, 2.0)
    assert "64" in str(placement) and "'CPU': 4.0" in str(placement)
    exhausted = asyncexec.RestartsExhaustedError(2, [crash, crash])
    assert "2 attempt" in str(exhausted) and str(exhausted).count("WorkerCrashedError") == 2
    assert isinstance(asyncexec.WorkerHungError(0), TimeoutError)
    assert isinstance(asyncexec.ConfigurationError("x"), ValueError)


def test_restart_policy_max_restarts_means_exactly_that() -> None:
    policy = asyncexec.RestartPolicy(max_restarts=2, wait=tenacity.wait_none())
    retrying = policy.retrying(before_sleep=lambda state: None)
    state = tenacity.RetryCallState(retrying, fn=None, args=(), kwargs={})
    stops = []
    for attempt in range(1, 5):
        state.attempt_number = attempt
        stops.append(retrying.stop(state))
    assert stops == [False, False, True, True]  # attempts 1..3 may run: 2 restarts


def test_restart_after_progress_starts_at_once_and_backoff_is_for_repeated_failures() -> None:
    """The default backoff waits 0.5 s and more before a restart; a restart after an attempt
    that completed a step does not wait (Ray Train's first executor never waits; asyncexec
    waits only when failures repeat without progress), unless backoff_after_progress."""
    progress = [True]
    waits = {}
    for backoff in (False, True):
        policy = asyncexec.RestartPolicy(backoff_after_progress=backoff)
        retrying = policy.retrying(before_sleep=lambda state: None, progressed=lambda: progress[0])
        state = tenacity.RetryCallState(retrying, fn=None, args=(), kwargs={})
        seen = []
        for attempt, made_progress in ((1, True), (2, False), (3, True)):
            state.attempt_number = attempt
            progress[0] = made_progress
            seen.append(retrying.wait(state))
        waits[backoff] = seen
    assert waits[False][0] == 0.0 and waits[False][2] == 0.0
    assert waits[False][1] >= 1.0  # the second attempt failed without progress: backoff
    assert all(w >= 0.5 for w in waits[True])


def test_restart_policy_default_predicate() -> None:
    policy = asyncexec.RestartPolicy()
    assert policy.should_restart(asyncexec.WorkerCrashedError(0))
    assert policy.should_restart(asyncexec.NodeLostError(0))
    assert policy.should_restart(asyncexec.WorkerHungError(0))
    assert policy.should_restart(asyncexec.StartupTimeoutError("x", 1))
    assert policy.should_restart(asyncexec.PlacementTimeoutError([], {}, 1))
    assert not policy.should_restart(asyncexec.WorkerRaisedError(0))
    assert not policy.should_restart(asyncexec.ReportMismatchError({0: 1}))
    assert asyncexec.RestartPolicy(restart_on_user_error=True).should_restart(
        asyncexec.WorkerRaisedError(0)
    )
    only_hangs = asyncexec.RestartPolicy(retry_if=lambda e: isinstance(e, TimeoutError))
    assert only_hangs.should_restart(asyncexec.WorkerHungError(0))
    assert not only_hangs.should_restart(asyncexec.WorkerCrashedError(0))


def test_restart_policy_refuses_bad_values() -> None:
    with pytest.raises(asyncexec.ConfigurationError, match="max_restarts"):
        asyncexec.RestartPolicy(max_restarts=-1)
    with pytest.raises(asyncexec.ConfigurationError, match="wait"):
        asyncexec.RestartPolicy(wait=5)  # type: ignore[arg-type]


def test_public_exports_are_sorted_complete_and_public() -> None:
    names = asyncexec.__all__
    assert names == sorted(names, key=lambda n: (n[0].islower(), n))
    public = {n for n in dir(asyncexec) if not n.startswith("_")}
    assert public == set(names)
    for name in names:
        obj = getattr(asyncexec, name)
        assert getattr(obj, "__module__", "asyncexec") == "asyncexec", name
    assert set(_errors.__all__) <= set(names)


def test_the_default_restart_policy_warns_nothing() -> None:
    """A suite run with warnings as errors must not fail on asyncexec's defaults (tenacity 9.1
    deprecated ``wait_exponential_jitter(initial=...)``)."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        policy = asyncexec.RestartPolicy()
        waits = [policy.wait(_retry_state(n)) for n in (1, 2, 3, 10)]
    assert 0.5 <= waits[0] <= 1.0 and 1.0 <= waits[1] <= 1.5 and 2.0 <= waits[2] <= 2.5
    assert 30.0 <= waits[3] <= 30.5  # capped at 30 s, plus the jitter


def _retry_state(attempt: int) -> tenacity.RetryCallState:
    state = tenacity.RetryCallState(tenacity.Retrying(), None, (), {})
    state.attempt_number = attempt
    return state


def _fingerprints_in(hash_seed: int) -> list[str]:
    import json
    import os
    import subprocess
    import sys

    code = (
        "import json\n"
        "from asyncexec._driver.run import fingerprint, legacy_fingerprint\n"
        "config = {'tags': {'alpha', 'beta', 'gamma', 'delta', 'epsilon'}, 'lr': 0.1,\n"
        "          'nested': [frozenset({'x', 'y', 'z'}), {'b': 1, 'a': 2}]}\n"
        "print(json.dumps([fingerprint(config), legacy_fingerprint(config)]))\n"
    )
    env = dict(os.environ, PYTHONHASHSEED=str(hash_seed))
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True
    )
    printed: list[str] = json.loads(done.stdout.strip().splitlines()[-1])
    return printed


def test_a_config_with_sets_has_one_fingerprint_in_every_process() -> None:
    """A set of strings pickles in hash-seed order: resume="auto" refused a genuine resume in a
    new process as another config."""
    seeds = [_fingerprints_in(seed) for seed in (1, 2, 3)]
    assert len({canonical for canonical, _ in seeds}) == 1
    assert len({legacy for _, legacy in seeds}) > 1  # what the pickled config gave
    from asyncexec._driver.run import fingerprint

    assert fingerprint({"a": 1, "b": {1, 2}}) == fingerprint({"b": {2, 1}, "a": 1})
    assert fingerprint({"a": 1}) != fingerprint({"a": 2})
    assert fingerprint([1, 2]) != fingerprint((1, 2))


def test_grouped_options_and_their_old_spelling() -> None:
    """Timeouts and HealthChecks are the spelling of 0.2; the old keyword arguments still work
    for a release, with a DeprecationWarning that points at the caller's line."""
    new = asyncexec.Executor(
        1,
        timeouts=asyncexec.Timeouts(start_s=7, stop_s=3),
        health=asyncexec.HealthChecks(step_timeout_s=9),
    )
    with pytest.warns(DeprecationWarning, match=r"timeouts=asyncexec.Timeouts\(start_s=") as seen:
        old = asyncexec.Executor(1, start_timeout_s=7, stop_timeout_s=3, step_timeout_s=9)
    assert {w.filename for w in seen} == {__file__}
    for field in ("start_timeout_s", "stop_timeout_s", "step_timeout_s", "placement_timeout_s"):
        assert getattr(old.config, field) == getattr(new.config, field)
    assert new.config.start_timeout_s == 7 and new.config.step_timeout_s == 9
    with pytest.raises(asyncexec.ConfigurationError, match="both given"):
        asyncexec.Executor(1, timeouts=asyncexec.Timeouts(), start_timeout_s=1)
    with pytest.raises(TypeError, match="start_timeout"):
        asyncexec.Executor(1, start_timeout=1)
    with (
        pytest.warns(DeprecationWarning, match="deprecated"),
        pytest.raises(asyncexec.ConfigurationError, match=r"^start_timeout_s"),
    ):
        asyncexec.Executor(1, start_timeout_s=-1)  # named as it was given

    pool = asyncexec.WorkerPool(1, timeouts=asyncexec.Timeouts(start_s=4, placement_s=5))
    assert (pool.config.start_timeout_s, pool.config.placement_timeout_s) == (4, 5)
    with pytest.warns(DeprecationWarning, match=r"WorkerPool\(start_timeout_s") as seen:
        asyncexec.WorkerPool(1, start_timeout_s=4)
    assert {w.filename for w in seen} == {__file__}
    with pytest.raises(TypeError, match=r"WorkerPool.*stop_timeout_s"):
        asyncexec.WorkerPool(1, stop_timeout_s=1)  # a pool has no runs to stop


def test_the_stdlib_route_renders_events_with_their_fields(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import structlog

    from asyncexec._logging import get_logger

    previous = structlog.get_config()
    structlog.reset_defaults()  # as in a program that configured nothing
    try:
        with caplog.at_level("INFO", logger="asyncexec"):
            get_logger(executor="x-1").bind(run_id="r").info("run_started", attempt=1)
            get_logger().debug("hidden")
    finally:
        structlog.configure(**previous)
    assert [r.getMessage() for r in caplog.records] == [
        "run_started executor=x-1 run_id=r attempt=1"
    ]
