"""Bad input, tried systematically: configuration values of every wrong kind (hypothesis over
resource mappings and timeouts, tables for the rest), amounts that pass asyncexec's checks but not
Ray's, report payloads that do not pickle, are huge or are not mappings, checkpoints that point at
missing directories, return values and exceptions that do not pickle, and init hooks that fail.

Each must end in a clear error that names the problem (an :class:`asyncexec.AsyncExecError` where
asyncexec raises it), and, where the run cannot go on, end it cleanly: the ``ray_local`` fixture
checks after every Ray test that no worker actor or placement group is left.
"""

from __future__ import annotations

import math
import numbers
import threading
import time
import types
from collections.abc import Iterator, Mapping
from typing import Any

import anyio
import pytest
import ray
from conftest import live_placement_groups, live_workers
from hypothesis import example, given, settings
from hypothesis import strategies as st

import asyncexec

CPU = {"CPU": 0.5}

# Configuration: hypothesis ------------------------------------------------------------------

_numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**62), max_value=2**62),
    st.fractions(),
)
_junk = st.one_of(
    st.booleans(), st.none(), st.text(max_size=3), st.lists(st.integers(), max_size=2)
)
_keys = st.one_of(
    st.sampled_from(["CPU", "GPU", "memory", "neuron_cores", "NPU", "custom"]),
    st.text(max_size=6),
    st.integers(),
    st.none(),
)
_resources = st.one_of(
    st.dictionaries(_keys, st.one_of(_numbers, _junk), max_size=4),
    st.lists(st.tuples(st.just("CPU"), _numbers), max_size=2),
    _junk,
    _numbers,
)


def _real(value: object) -> bool:
    return (
        isinstance(value, numbers.Real)
        and not isinstance(value, bool)
        and math.isfinite(float(value))
    )


def _resources_valid(resources: object) -> bool:
    """The documented rules: a mapping of non-empty names to finite, non-negative numbers, a GPU
    amount above 1 whole, and a positive amount of something."""
    if not isinstance(resources, Mapping):
        return False
    positive = False
    for key, value in resources.items():
        if not isinstance(key, str) or not key or not _real(value) or value < 0:
            return False
        if key == "GPU" and value > 1 and float(value) != int(value):
            return False
        positive = positive or value > 0
    return positive


@settings(max_examples=400, deadline=None)
@given(_resources)
@example({"CPU": float("nan")})
@example({"CPU": True})
@example({"": 1})
@example({"GPU": 2.5})
@example({"GPU": 0.5, "CPU": 0})
@example({"CPU": 0, "GPU": 0})
def test_resources_per_worker_is_accepted_exactly_when_valid(resources: object) -> None:
    if resources is None:  # the default, {"CPU": 1}
        assert asyncexec.Executor(2).config.resources_per_worker == {"CPU": 1.0}
    elif _resources_valid(resources):
        assert isinstance(resources, Mapping)
        checked = asyncexec.Executor(2, resources_per_worker=resources).config.resources_per_worker
        assert checked == {k: float(v) for k, v in resources.items()}
        assert all(type(v) is float for v in checked.values())
        asyncexec.Executor(2, resources_per_worker=resources)
    else:
        with pytest.raises(asyncexec.ConfigurationError, match="resources_per_worker"):
            asyncexec.Executor(2, resources_per_worker=resources)  # type: ignore[arg-type]


_TIMEOUTS = [
    "placement_timeout_s",
    "start_timeout_s",
    "shutdown_timeout_s",
    "health_check_timeout_s",
    "stop_timeout_s",
    "health_check_interval_s",
    "step_timeout_s",
]
_OPTIONAL = {"health_check_interval_s", "step_timeout_s"}


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(_TIMEOUTS), st.one_of(_numbers, _junk))
def test_every_timeout_is_accepted_exactly_when_a_positive_finite_number(
    name: str, value: object
) -> None:
    valid = (value is None and name in _OPTIONAL) or (_real(value) and value > 0)  # type: ignore[operator]
    if name == "health_check_interval_s" and _real(value) and value < 0.05:  # type: ignore[operator]
        valid = False  # a floor: faster pings would flood the workers
    if valid:
        asyncexec.Executor(1, **{name: value})  # type: ignore[arg-type]
    else:
        with pytest.raises(asyncexec.ConfigurationError, match=name):
            asyncexec.Executor(1, **{name: value})  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(st.one_of(st.integers(min_value=-(2**40), max_value=2**40), st.floats(), _junk))
def test_num_workers_is_accepted_exactly_when_a_positive_int(value: object) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        assert asyncexec.Executor(value).config.num_workers == value
    else:
        with pytest.raises(asyncexec.ConfigurationError, match="num_workers"):
            asyncexec.Executor(value)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(
    st.one_of(_numbers, _junk).filter(lambda v: not (isinstance(v, float) and not math.isfinite(v)))
)
def test_graceful_patience_is_accepted_exactly_when_a_non_negative_number(value: object) -> None:
    if _real(value) and value >= 0:  # type: ignore[operator]
        asyncexec.Timeouts(graceful_patience_s=value)  # type: ignore[arg-type]
    else:
        with pytest.raises(asyncexec.ConfigurationError, match="graceful_patience_s"):
            asyncexec.Timeouts(graceful_patience_s=value)  # type: ignore[arg-type]


# Configuration: what test_units does not cover -------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"num_workers": "2"}, "num_workers"),
        ({"placement_strategy": "pack"}, "placement_strategy"),
        ({"placement_strategy": None}, "placement_strategy"),
        ({"stop_timeout_s": float("inf")}, "stop_timeout_s"),
        ({"health_check_timeout_s": float("nan")}, "health_check_timeout_s"),
        ({"step_timeout_s": True}, "step_timeout_s"),
        ({"buffer_size": True}, "buffer_size"),
        ({"buffer_size": -1}, "buffer_size"),
        ({"share_devices": 1}, "share_devices"),
        ({"share_devices": ["GPU", "XPU"]}, "unknown device kinds"),
        ({"runtime_env": [("pip", ["x"])]}, "runtime_env"),
        ({"address": 6379}, "address"),
        ({"name": 3}, "name"),
        ({"checkpoint": {"num_to_keep": 2}}, "CheckpointConfig"),
        ({"storage_path": ["/tmp"]}, "storage_path"),
        ({"resources_per_worker": {"CPU": float("inf")}}, "number"),
        ({"resources_per_worker": {"CPU": 1, None: 1}}, "key"),
        ({"resources_per_worker": {}}, "positive amount"),
    ],
)
def test_more_bad_executor_arguments_are_refused_naming_the_argument(
    kwargs: dict[str, object], needle: str
) -> None:
    args = {"num_workers": 2, **kwargs}
    with pytest.raises(asyncexec.ConfigurationError, match=needle):
        asyncexec.Executor(**args)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"max_restarts": True}, "max_restarts"),
        ({"max_restarts": 1.5}, "max_restarts"),
        ({"max_restarts": "3"}, "max_restarts"),
        ({"sleep": 0}, "sleep"),
        ({"retry_if": "crash"}, "retry_if"),
        ({"stop": 3}, "stop"),
    ],
)
def test_bad_restart_policies_are_refused(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(asyncexec.ConfigurationError, match=needle):
        asyncexec.RestartPolicy(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"num_to_keep": True}, "num_to_keep"),
        ({"num_to_keep": 1.0}, "num_to_keep"),
        ({"score_attribute": 3}, "score_attribute"),
        ({"score_order": "MAX"}, "score_order"),
    ],
)
def test_bad_checkpoint_configs_are_refused(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(asyncexec.ConfigurationError, match=needle):
        asyncexec.CheckpointConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "kwargs",
    [{"resources_per_worker": {"CPU": 10**400}}, {"placement_timeout_s": 10**400}],
    ids=["resources", "timeout"],
)
def test_an_int_too_large_for_a_float_is_refused_as_configuration(
    kwargs: dict[str, object],
) -> None:
    with pytest.raises(asyncexec.ConfigurationError):
        asyncexec.Executor(1, **kwargs)  # type: ignore[arg-type]


def test_nan_graceful_patience_is_refused() -> None:
    with pytest.raises(asyncexec.ConfigurationError, match="graceful_patience_s"):
        asyncexec.Timeouts(graceful_patience_s=float("nan"))


@pytest.mark.parametrize(
    "value",
    [math.nan, math.inf, True, 10**400, "60", 0, -1.0],
    ids=["nan", "inf", "bool", "huge", "str", "zero", "negative"],
)
def test_a_reservations_placement_timeout_is_refused_unless_a_positive_finite_number(
    value: object,
) -> None:
    """As the executor's and the pool's timeouts are (a NaN or infinite wait never ends)."""
    with pytest.raises(asyncexec.ConfigurationError, match="placement_timeout_s"):
        asyncexec.Reservation(2, placement_timeout_s=value)  # type: ignore[arg-type]
    assert asyncexec.Reservation(2, placement_timeout_s=2).placement_timeout_s == 2.0


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "address", ["nonsense", "head:port", "10.0.0.1:6379:1", "::1:6379", "head:0", "head:70000"]
)
def test_an_address_ray_cannot_read_is_refused_when_given(address: str) -> None:
    """Defect: an address that ``ray.init`` cannot read (no port, a port that is not a
    number) was taken by the executor, the pool and the reservation, and entering them failed
    with Ray's bare ``ValueError`` ("Invalid address format: nonsense")."""
    made = (
        lambda: asyncexec.Executor(1, address=address),
        lambda: asyncexec.WorkerPool(1, address=address),
        lambda: asyncexec.Reservation(1, address=address),
    )
    for make in made:
        with pytest.raises(asyncexec.ConfigurationError, match="address must be 'auto'"):
            make()
    for good in ("auto", "local", "head:6379", "[::1]:6379", "ray://head:10001"):
        assert asyncexec.Executor(1, address=good).config.address == good
        assert asyncexec.Reservation(1, address=good).address == good


# Amounts that pass asyncexec's checks but not Ray's ------------------------------------------


def _remove_leftover_groups() -> None:
    """Clean up after a core defect, so that the fixture's leak check reports the defect's test
    and not the next one."""
    from ray._raylet import PlacementGroupID
    from ray.util.placement_group import PlacementGroup

    for group_id, info in ray.util.placement_group_table().items():
        if info["state"] != "REMOVED":
            group = PlacementGroup(PlacementGroupID(bytes.fromhex(group_id)))
            ray.util.remove_placement_group(group)


async def _left_behind(timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        actors = await anyio.to_thread.run_sync(live_workers)
        groups = await anyio.to_thread.run_sync(live_placement_groups)
        if not actors and not groups:
            return ""
        if time.monotonic() > deadline:
            return f"{len(actors)} actor(s), {len(groups)} placement group(s)"
        await anyio.sleep(0.1)


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"resources_per_worker": {"CPU": 0.00001}},
            asyncexec.ConfigurationError,
            r"Ray refused the worker options: .*precision .* num_cpus",
        ),
        (
            {"resources_per_worker": {"CPU": 0.5, "neuron_cores": 0.5}},
            asyncexec.PlacementInfeasibleError,
            r"no node has a resource named 'neuron_cores'",
        ),
        (
            {"resources_per_worker": CPU, "runtime_env": {"pip": 3}},
            asyncexec.ConfigurationError,
            r"Ray refused the worker options: .*runtime_env\['pip'\]",
        ),
    ],
    ids=["cpu-below-ray-precision", "fractional-neuron-cores", "runtime-env-ray-refuses"],
)
async def test_options_ray_refuses_end_in_a_clear_error_and_leave_nothing(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    """Each ends in the error that names what was refused (its kind and Ray's reason)."""
    try:
        with pytest.raises(error, match=message):
            async with asyncexec.Executor(1, **kwargs):
                pass
        assert await _left_behind() == ""
    finally:
        await anyio.to_thread.run_sync(_remove_leftover_groups)


# Report payloads -------------------------------------------------------------------------------


def reports_a_lock() -> int:
    asyncexec.report({"ok": 1})
    asyncexec.report({"lock": threading.Lock()})
    asyncexec.report({"ok": 3})
    return 1


@pytest.mark.usefixtures("ray_local")
async def test_a_report_that_does_not_pickle_ends_the_run_naming_pickling() -> None:
    async with asyncexec.Executor(2, resources_per_worker=CPU) as ex:
        with pytest.raises(asyncexec.WorkerRaisedError) as info:
            async for _ in ex.run(reports_a_lock):
                pass
    error = info.value
    assert "pickle" in str(error).splitlines()[0]
    assert "lock" in str(error).splitlines()[0]
    assert isinstance(error.__cause__, TypeError)


def reports_huge(config: dict[str, int]) -> int:
    for i in range(config["steps"]):
        asyncexec.report({"i": i, "blob": bytes([i]) * config["size"]})
    return asyncexec.get_context().world_rank


@pytest.mark.usefixtures("ray_local")
async def test_huge_reports_arrive_whole_without_wedging_the_run_or_the_loop() -> None:
    size = 50 * 1024 * 1024
    stalls: list[float] = []

    async def heartbeat() -> None:
        last = time.perf_counter()
        while True:
            await anyio.sleep(0.01)
            now = time.perf_counter()
            stalls.append(now - last - 0.01)
            last = now

    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat)
        async with asyncexec.Executor(2, resources_per_worker=CPU) as ex:
            run = ex.run(reports_huge, {"steps": 3, "size": size})
            seen = []
            async for step in run:
                for report in step.reports:
                    blob = report.metrics["blob"]
                    assert len(blob) == size and blob[:1] == blob[-1:] == bytes([step.index])
                seen.append(step.index)
            assert seen == [0, 1, 2]
            assert run.result.return_values == [0, 1]
        tg.cancel_scope.cancel()
    assert max(stalls) < 1.0, f"the event loop stalled {max(stalls):.2f} s"


def reports_value(config: dict[str, Any]) -> None:
    asyncexec.report(config["value"])


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize(
    "value",
    ["text", None, 42, [("a", 1)], b"bytes"],
    ids=["str", "None", "int", "pairs", "bytes"],
)
async def test_a_report_that_is_not_a_mapping_names_its_type(value: object) -> None:
    async with asyncexec.Executor(1, resources_per_worker=CPU) as ex:
        with pytest.raises(asyncexec.WorkerRaisedError) as info:
            async for _ in ex.run(reports_value, {"value": value}):
                pass
    first = str(info.value).splitlines()[0]
    assert "report() takes a mapping" in first and type(value).__name__ in first
    assert isinstance(info.value.__cause__, TypeError)


class _Metrics(Mapping[str, Any]):
    """A mapping that is not a dict."""

    def __init__(self, **items: Any) -> None:
        self._items = items

    def __getitem__(self, key: str) -> Any:
        return self._items[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)


def reports_other_mappings() -> None:
    asyncexec.report(types.MappingProxyType({"kind": "proxy"}))
    asyncexec.report(_Metrics(kind="custom"))


@pytest.mark.usefixtures("ray_local")
async def test_any_mapping_is_a_valid_report_and_arrives_as_a_dict() -> None:
    async with asyncexec.Executor(1, resources_per_worker=CPU) as ex:
        metrics = [s.metrics async for s in ex.run(reports_other_mappings)]
    assert metrics == [{"kind": "proxy"}, {"kind": "custom"}]
    assert all(type(m) is dict for m in metrics)


def reports_a_path_as_checkpoint() -> None:
    asyncexec.report({"i": 0}, checkpoint="/tmp")  # type: ignore[arg-type]


@pytest.mark.usefixtures("ray_local")
async def test_a_checkpoint_that_is_not_a_checkpoint_names_the_type() -> None:
    async with asyncexec.Executor(1, resources_per_worker=CPU) as ex:
        with pytest.raises(asyncexec.WorkerRaisedError, match=r"takes an asyncexec\.Checkpoint"):
            async for _ in ex.run(reports_a_path_as_checkpoint):
                pass


# Checkpoints that point at missing directories -------------------------------------------------


@pytest.mark.usefixtures("ray_local")
async def test_run_refuses_a_missing_or_wrong_checkpoint_before_anything_starts(
    tmp_path: Any,
) -> None:
    missing = tmp_path / "gone"
    async with asyncexec.Executor(1, resources_per_worker=CPU) as ex:
        with pytest.raises(asyncexec.ConfigurationError, match=r"does not exist.*gone"):
            ex.run(reports_value, {}, checkpoint=asyncexec.Checkpoint(missing))
        with pytest.raises(asyncexec.ConfigurationError, match=r"does not exist.*gone"):
            ex.run(reports_value, {}, checkpoint=str(missing))
        with pytest.raises(asyncexec.ConfigurationError, match="must be a Checkpoint"):
            ex.run(reports_value, {}, checkpoint=42)  # type: ignore[arg-type]
        assert ex.statistics().runs_started == 0


def opens_a_missing_checkpoint(config: dict[str, str]) -> None:
    asyncexec.report({"i": 0})
    asyncexec.Checkpoint.from_directory(config["path"])


def reports_a_missing_checkpoint(config: dict[str, str]) -> None:
    asyncexec.report({"i": 0}, checkpoint=asyncexec.Checkpoint(config["path"]))


@pytest.mark.usefixtures("ray_local")
@pytest.mark.parametrize("fn", [opens_a_missing_checkpoint, reports_a_missing_checkpoint])
async def test_a_missing_checkpoint_directory_in_the_worker_names_the_path(
    fn: Any, tmp_path: Any
) -> None:
    path = str(tmp_path / "never-made")
    async with asyncexec.Executor(2, resources_per_worker=CPU, storage_path=tmp_path) as ex:
        with pytest.raises(asyncexec.WorkerRaisedError) as info:
            async for _ in ex.run(fn, {"path": path}):
                pass
    assert isinstance(info.value.__cause__, FileNotFoundError)
    assert path in str(info.value).splitlines()[0]


# Return values and exceptions that do not pickle -----------------------------------------------


def returns_a_lock() -> threading.Lock:
    asyncexec.report({"i": 0})
    return threading.Lock()


@pytest.mark.usefixtures("ray_local")
async def test_a_return_value_that_does_not_pickle_is_named() -> None:
    async with asyncexec.Executor(2, resources_per_worker=CPU) as ex:
        steps = []
        with pytest.raises(asyncexec.WorkerRaisedError) as info:
            async for step in ex.run(returns_a_lock):
                steps.append(step)
    assert "return value cannot be pickled" in str(info.value).splitlines()[0]
    assert "lock" in str(info.value).splitlines()[0]
    assert info.value.rank in (0, 1)
    # Both ranks reported step 0 before returning; the failing rank's report arrives with its
    # error, and a report still in flight from the other rank when that error is handled is
    # dropped (see the report: survivors are not drained before the group is discarded).
    assert len(steps) <= 1


class _Unpicklable(Exception):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()


def raises_an_unpicklable_error() -> None:
    asyncexec.report({"i": 0})
    raise _Unpicklable("the batch was corrupt")


@pytest.mark.usefixtures("ray_local")
async def test_an_exception_that_does_not_pickle_keeps_its_type_and_text() -> None:
    async with asyncexec.Executor(1, resources_per_worker=CPU) as ex:
        with pytest.raises(asyncexec.WorkerRaisedError) as info:
            async for _ in ex.run(raises_an_unpicklable_error):
                pass
    first = str(info.value).splitlines()[0]
    assert "_Unpicklable" in first and "the batch was corrupt" in first
    assert "raises_an_unpicklable_error" in info.value.remote_traceback


# Init hooks that fail ------------------------------------------------------------------------


def hook_raises() -> None:
    raise ValueError("hook: no credentials")


@pytest.mark.usefixtures("ray_local")
async def test_an_init_hook_that_raises_fails_start_up_and_leaves_nothing() -> None:
    ex = asyncexec.Executor(2, resources_per_worker=CPU, init_hook=hook_raises)
    with pytest.raises(asyncexec.StartupError) as info:
        async with ex:
            pass
    assert "hook: no credentials" in str(info.value)
    assert "init hook" in str(info.value).splitlines()[0]
    assert ex.state is asyncexec.ExecutorState.CLOSED
    assert await _left_behind() == ""


@pytest.mark.usefixtures("ray_local")
async def test_an_init_hook_error_is_named_on_the_first_line() -> None:
    with pytest.raises(asyncexec.StartupError) as info:
        async with asyncexec.Executor(1, resources_per_worker=CPU, init_hook=hook_raises):
            pass
    first = str(info.value).splitlines()[0]
    assert "ValueError: hook: no credentials" in first
    assert "\x1b[" not in first  # no terminal color codes in an error message


@pytest.mark.usefixtures("ray_local")
async def test_an_init_hook_that_does_not_pickle_is_refused_before_anything_starts() -> None:
    lock = threading.Lock()

    def hook() -> None:
        with lock:
            pass

    with pytest.raises(asyncexec.ConfigurationError, match="init_hook") as info:
        asyncexec.Executor(1, resources_per_worker=CPU, init_hook=hook)
    assert "serialize" in str(info.value) or "pickle" in str(info.value)
    assert await _left_behind() == ""
