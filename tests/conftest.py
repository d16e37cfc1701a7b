"""Shared fixtures: one local Ray for the whole session, clusters for multi-node tests, and a
leak check after every test that touches Ray: no live asyncexec worker and no live placement
group may remain.

Every test is put in one tier by what it uses, not by hand (``pytest_collection_modifyitems``):
``fast`` (no Ray: pure, local-mode and simulated-cluster tests), ``subprocess`` (starts a Python
process of its own), ``bench`` (runs a benchmark or the chaos harness), ``ray`` (the shared local
Ray), ``engine`` (real vLLM engines on it) and ``multinode`` (a ``ray.cluster_utils.Cluster``);
the tiers run in that order (``TIERS``), so the shared Ray starts again once after the scripts
that run a Ray of their own, and the clusters come last. ``smoke`` marks a few Ray tests by
hand: the inner loop is ``pytest -m "fast or smoke"``."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import types
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import ray._private.state as ray_state
import structlog
from ray.cluster_utils import Cluster

# Keep Ray quiet and quick on small machines.
os.environ.setdefault("RAY_DEDUP_LOGS", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Functions defined in test modules are pickled by reference: the workers (children of the Ray
# started here) must be able to import the test modules.
# The tests live in folders by wing (``tests/<wing>/test_*.py``, no ``__init__.py``): pytest
# imports each by its base name, with its folder on ``sys.path``, and so must the workers.
_here = os.path.dirname(os.path.abspath(__file__))
_wings = sorted(
    os.path.join(_here, d)
    for d in os.listdir(_here)
    if os.path.isdir(os.path.join(_here, d)) and not d.startswith(("_", "."))
)
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (_here, *_wings, os.path.dirname(_here), os.environ.get("PYTHONPATH")) if p
)

# Ray's temp folder, this session's own (and its subprocesses'): ``ray.init()`` without an
# address joins the cluster that ``<temp>/ray_current_cluster`` names, which a cluster killed
# before its shutdown (a run cut short in the multinode tier, another job's ``ray start``) leaves
# behind. In the shared /tmp/ray every Ray of the suite would then try to join that dead cluster.
# A short path: Ray's Unix sockets live under it.
if "RAY_TMPDIR" not in os.environ:
    os.environ["RAY_TMPDIR"] = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    _OWN_RAY_TMPDIR: str | None = os.environ["RAY_TMPDIR"]
else:
    _OWN_RAY_TMPDIR = None

# A test runner started in the background by a shell without job control (``pytest ... &``)
# ignores SIGINT, and so would every program a test starts (an ignored signal stays ignored
# across exec), whatever a test's Ctrl-C does to it: the programs get the disposition a
# terminal gives them (Python then raises KeyboardInterrupt), as a user's program has it.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

LOCAL_CPUS = 4
_current: dict[str, Any] = {"mode": None, "cluster": None}


#: Every state of an actor but DEAD: the GCS filters by state, so a leak check reads the live
#: actors only, not the table of every actor the session made (it keeps the dead ones).
_LIVE_STATES = ("DEPENDENCIES_UNREADY", "PENDING_CREATION", "ALIVE", "RESTARTING")


def live_workers() -> list[dict[str, Any]]:
    """asyncexec worker actors that are not dead."""
    return [
        a
        for state in _LIVE_STATES
        for a in ray_state.actors(actor_state_name=state).values()
        if a["ActorClassName"] == "_Worker"
    ]


def live_placement_groups() -> list[dict[str, Any]]:
    """Placement groups that are not removed."""
    return [p for p in ray.util.placement_group_table().values() if p["state"] != "REMOVED"]


def wait_no_leaks(timeout_s: float = 15.0) -> None:
    """Fail unless every worker actor and placement group is gone within ``timeout_s`` (in a
    local-mode test: every local worker's thread); Ray is shut down before such a failure."""
    if os.environ.get("ASYNCEXEC_LOCAL") == "1":
        wait_no_local_threads(timeout_s)
        return
    deadline = time.monotonic() + timeout_s
    while True:
        actors, groups = live_workers(), live_placement_groups()
        if not actors and not groups:
            return
        if time.monotonic() > deadline:
            _shutdown()  # a leak fails its own test, not every one after it on this Ray
            pytest.fail(
                f"left behind in the cluster: {len(actors)} worker actor(s) "
                f"{[a['State'] for a in actors]}, {len(groups)} placement group(s) "
                f"{[g['state'] for g in groups]}"
            )
        time.sleep(0.1)


def wait_all_free(timeout_s: float = 15.0) -> None:
    """Wait until every CPU of the cluster is free; fail naming the live actors otherwise."""
    deadline = time.monotonic() + timeout_s
    while (free := ray.available_resources().get("CPU", 0.0)) < ray.cluster_resources()["CPU"]:
        if time.monotonic() > deadline:
            actors = [
                (a["ActorClassName"], a["State"])
                for state in _LIVE_STATES
                for a in ray_state.actors(actor_state_name=state).values()
            ]
            pytest.fail(f"only {free} CPUs of the cluster are free; live actors: {actors}")
        time.sleep(0.05)


@contextlib.contextmanager
def cluster_held(resources: dict[str, float]) -> Iterator[None]:
    """Hold ``resources`` in a placement group of their own, so that a placement that could fit
    the cluster has to wait (a request that can never fit fails at once instead). What an
    earlier test freed is waited for first (Ray returns a killed worker's CPUs a little later),
    so that what is left free is exactly the rest."""
    wait_all_free()
    group = ray.util.placement_group([resources])
    try:
        ray.get(group.ready(), timeout=30)
        yield
    finally:
        ray.util.remove_placement_group(group)  # also when it never became ready


def import_example(name: str) -> Any:
    """``examples.<name>``, imported by that name (the workers import it so: the repository root
    is on their PYTHONPATH)."""
    import importlib
    import sys

    root = os.path.dirname(_here)
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module(f"examples.{name}")


def reset_logging() -> None:
    """Undo the logging set-up an example's ``cli()`` made for the process."""
    import logging

    import structlog

    structlog.reset_defaults()
    stdlib = logging.getLogger("asyncexec")
    for handler in list(stdlib.handlers):
        stdlib.removeHandler(handler)
    stdlib.setLevel(logging.NOTSET)
    stdlib.propagate = True


def _shutdown() -> None:
    if ray.is_initialized():
        ray.shutdown()
    cluster = _current["cluster"]
    if cluster is not None:
        cluster.shutdown()
    _current.update(mode=None, cluster=None)


@pytest.fixture
def ray_local() -> Iterator[None]:
    """A local single-node Ray with LOCAL_CPUS CPUs, shared by every test that asks for it;
    after the test, nothing of asyncexec may be left in it."""
    if _current["mode"] != "local" or not ray.is_initialized():
        _shutdown()
        ray.init(num_cpus=LOCAL_CPUS, include_dashboard=False, log_to_driver=False)
        _current["mode"] = "local"
    yield
    wait_no_leaks()


@pytest.fixture(scope="module")
def ray_engines() -> Iterator[None]:
    """The shared local Ray for a module of real-engine tests, whose engines (started once by the
    module's own fixture, 20-60 s each) live across its tests; nothing of asyncexec may be left
    in it after the module."""
    if _current["mode"] != "local" or not ray.is_initialized():
        _shutdown()
        ray.init(num_cpus=LOCAL_CPUS, include_dashboard=False, log_to_driver=False)
        _current["mode"] = "local"
    yield
    wait_no_leaks(timeout_s=60.0)


@pytest.fixture
def make_cluster() -> Iterator[Any]:
    """Build a fresh ray.cluster_utils.Cluster for one test: ``make_cluster([node kwargs...])``.

    Node deaths are detected within about a second (health checks every 200 ms)."""

    def build(nodes: list[dict[str, Any]]) -> Cluster:
        _shutdown()
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                # No dashboard (no test reads it; its process costs each cluster's start
                # about a second of the 2 cores), as for the shared local Ray.
                "include_dashboard": False,
                **nodes[0],
                "_system_config": {
                    "health_check_initial_delay_ms": 0,
                    "health_check_period_ms": 200,
                    "health_check_failure_threshold": 3,
                },
            },
        )
        for node in nodes[1:]:
            cluster.add_node(**node)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        _current.update(mode="cluster", cluster=cluster)
        return cluster

    yield build
    if _current["mode"] == "cluster":
        try:
            wait_no_leaks()
        finally:
            _shutdown()


def live_local_threads() -> list[str]:
    """Threads of local workers (their loops, and their functions) still alive."""
    import threading

    return [
        t.name
        for t in threading.enumerate()
        if t.name.startswith(("asyncexec-local ", "asyncexec-fn "))
    ]


def wait_no_local_threads(timeout_s: float = 15.0) -> None:
    """Fail unless every local worker's thread has ended within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while live := live_local_threads():
        if time.monotonic() > deadline:
            pytest.fail(f"local worker threads left running: {live}")
        time.sleep(0.05)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test that uses ``mode`` runs on Ray actors and in local mode (threads of this process,
    no Ray), unless it is marked ``ray_only``: then on Ray actors only."""
    if "mode" in metafunc.fixturenames:
        ray_only = metafunc.definition.get_closest_marker("ray_only") is not None
        modes = ["ray"] if ray_only else ["ray", "local"]
        metafunc.parametrize("mode", modes, indirect=True)


@pytest.fixture
def mode(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Where the test's executors put their workers: ``"ray"`` (actors of the shared local Ray,
    checked for leaks after the test) or ``"local"`` (``ASYNCEXEC_LOCAL=1``: threads of this
    process; no Ray is started, and no worker thread may outlive the test)."""
    if request.param == "local":
        monkeypatch.setenv("ASYNCEXEC_LOCAL", "1")
        started = ray.is_initialized()
        yield "local"
        assert ray.is_initialized() == started, "a local-mode test started Ray"
        wait_no_local_threads()
    else:
        monkeypatch.delenv("ASYNCEXEC_LOCAL", raising=False)
        request.getfixturevalue("ray_local")
        yield "ray"


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    _shutdown()
    if _OWN_RAY_TMPDIR is not None:
        shutil.rmtree(_OWN_RAY_TMPDIR, ignore_errors=True)


#: The terminal's stderr, for the stacks a hung test's faulthandler dumps (pytest's plugin, which
#: arms it with ``faulthandler_timeout`` for every test, writes to its own copy of it).
_DUMP_TO: list[int] = []


def pytest_configure(config: pytest.Config) -> None:
    _DUMP_TO.append(os.dup(sys.stderr.fileno()))  # (capture is suspended while configuring)


def pytest_runtest_setup(item: pytest.Item) -> None:
    """A test given a timeout above ``faulthandler_timeout`` (its own pytest-timeout marker)
    has its threads' stacks dumped 10 s before that timeout, not at ``faulthandler_timeout``
    while it still runs as it should (the stacks of a test that passed were noise in the log)."""
    marker = item.get_closest_marker("timeout")
    dump_at = float(item.config.getini("faulthandler_timeout") or 0)
    if marker is None or not marker.args or not dump_at or not _DUMP_TO:
        return
    timeout = float(marker.args[0])
    if timeout - 10 > dump_at:
        faulthandler.dump_traceback_later(timeout - 10, file=_DUMP_TO[0])


# Tiers ----------------------------------------------------------------------------------------

#: The tiers in the order they run.
#: ``subprocess`` comes first after ``fast``: its tests wait on processes of their own and leave
#: about half of the 2 cores idle, where ``.ci/run`` runs mypy, the docs and the ``fast`` tier
#: beside it (they slowed it by 7 s of their 81; beside the ``ray`` tier, which leaves a quarter
#: idle, by about 60 s). ``bench`` follows it, for the tests that stop the shared Ray.
TIERS = ("fast", "subprocess", "bench", "ray", "engine", "multinode")
_SPAWNS = frozenset(
    {"subprocess", "executable", "create_subprocess_exec", "create_subprocess_shell", "Popen"}
)


def _names(code: types.CodeType, module: types.ModuleType, depth: int = 2) -> Iterator[str]:
    """The global and attribute names that ``code`` uses, with those of the functions nested in
    it and of the functions of its module that it calls (``depth`` calls deep): where a test's
    helper starts a process, the test does."""
    for name in code.co_names:
        yield name
        helper = getattr(module, name, None) if depth else None
        if isinstance(helper, types.FunctionType) and helper.__module__ == module.__name__:
            yield from _names(helper.__code__, module, depth - 1)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const, module, depth)


def _uses_benchmarks(module: types.ModuleType) -> bool:
    return any(
        isinstance(v, types.ModuleType) and v.__name__.startswith("benchmarks")
        for v in vars(module).values()
    ) or "BENCHMARKS" in vars(module)


def tier_of(item: pytest.Item) -> str:
    """The tier of a collected test, from the fixtures it uses and what its code starts; a test
    of a module that drives the benchmarks (or the chaos harness) on Ray is ``bench``."""
    names = set(getattr(item, "fixturenames", ()))
    if "make_cluster" in names:
        return "multinode"
    if "ray_engines" in names:
        return "engine"
    module = getattr(item, "module", None)
    callspec = getattr(item, "callspec", None)
    on_ray = "mode" in names and callspec is not None and callspec.params.get("mode") == "ray"
    code = getattr(getattr(item, "function", None), "__code__", None)
    if module is not None and code is not None and not _SPAWNS.isdisjoint(_names(code, module)):
        tier = "subprocess"
    elif "ray_local" in names or on_ray:
        tier = "ray"
    else:
        return "fast"
    return "bench" if module is not None and _uses_benchmarks(module) else tier


#: What a test calls to stop the shared Ray and run a script in a Ray of its own.
_STOPS_SHARED_RAY = frozenset({"_stop_ray_of_this_process"})


def stops_shared_ray(item: pytest.Item) -> bool:
    """Whether the test stops the shared Ray (a benchmark or example script with a Ray of its
    own): the next test on the shared Ray starts it again (4-5 s on 2 cores)."""
    module = getattr(item, "module", None)
    code = getattr(getattr(item, "function", None), "__code__", None)
    if module is None or code is None:
        return False
    return not _STOPS_SHARED_RAY.isdisjoint(_names(code, module))


def _run_order(tier: str, own_ray: bool) -> tuple[int, int]:
    """Where a test runs: its tier's place, then, within the tier, the tests that stop the
    shared Ray next to each other, so that it starts again once, not after each of them: last
    in the ``subprocess`` tier and first in the ``bench`` tier, which follows it."""
    within = 0
    if tier == "subprocess":
        within = 1 if own_ray else 0
    elif tier == "bench":
        within = 0 if own_ray else 1
    return TIERS.index(tier), within


def pytest_collection_modifyitems(session: pytest.Session, config: Any, items: list[Any]) -> None:
    """Mark each test with its tier and run the tiers in order (stable within a tier, but for
    the tests that stop the shared Ray: see ``_run_order``)."""
    order: dict[int, tuple[int, int]] = {}
    for item in items:
        tier = tier_of(item)
        order[id(item)] = _run_order(tier, stops_shared_ray(item))
        item.add_marker(getattr(pytest.mark, tier))
    items.sort(key=lambda item: order[id(item)])


@pytest.fixture(autouse=True)
def _fast_tests_start_no_ray(request: pytest.FixtureRequest) -> Iterator[None]:
    """A test of the ``fast`` tier that starts Ray is in the wrong tier: it fails, saying so."""
    if request.node.get_closest_marker("fast") is None or ray.is_initialized():
        yield
        return
    yield
    if ray.is_initialized():
        ray.shutdown()
        pytest.fail(
            "this test started Ray but its tier is 'fast': give it the ray_local (or mode) "
            "fixture, so that it runs in the 'ray' tier"
        )


@pytest.fixture(autouse=True)
def _logging_as_found() -> Iterator[None]:
    """Each test ends with logging as it found it: structlog's configuration and the
    ``asyncexec`` logger of the standard library. A test that runs ``asyncexec``'s command line
    in the test process calls ``configure_logging`` (structlog filtered at ``warning``, the
    ``asyncexec`` logger writing to its own handler only): the tests after it that read the
    library's events (``structlog.testing.capture_logs``, ``caplog``) then saw none of them."""
    configured = structlog.is_configured()
    config = structlog.get_config()
    stdlib = logging.getLogger("asyncexec")
    handlers, level, propagate = list(stdlib.handlers), stdlib.level, stdlib.propagate
    yield
    if configured:
        structlog.configure(**config)
    else:
        structlog.reset_defaults()
    for handler in [h for h in stdlib.handlers if h not in handlers]:
        stdlib.removeHandler(handler)
        handler.close()
    stdlib.setLevel(level)
    stdlib.propagate = propagate


class HeldStart:
    """Worker processes that do not come up while held: a ``runtime_env`` whose processes import
    a ``sitecustomize`` that waits, at interpreter start, while a marker file exists. Real
    processes that Ray starts and that never register, for as long as the test says."""

    def __init__(self, root: str) -> None:
        self.marker = os.path.join(root, "hold")
        with open(os.path.join(root, "sitecustomize.py"), "w") as f:
            f.write(
                "import os, time\n"
                "marker = os.environ.get('ASYNCEXEC_TEST_HOLD')\n"
                "while marker and os.path.exists(marker):\n"
                "    time.sleep(0.05)\n"
            )
        path = os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])
        self.runtime_env = {"env_vars": {"PYTHONPATH": path, "ASYNCEXEC_TEST_HOLD": self.marker}}

    def hold(self) -> None:
        """Processes that start from now on wait."""
        open(self.marker, "w").close()

    def release(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.marker)


@pytest.fixture
def held_start(tmp_path: Any) -> Iterator[HeldStart]:
    held = HeldStart(str(tmp_path))
    yield held
    held.release()
