"""The layout's promises, read from the source (no Ray).

- The root holds wings: the package's ``__init__`` (public names only), ``__main__``, and the two
  modules every wing uses (the error tree, the library's logger); each other concept is a wing
  of its own (:data:`ROOT_MODULES`).
- The wings are layered (:data:`WINGS`): a wing imports only lower ones, so no two wings import
  each other; inside the driver, its own layers (:data:`LAYERS`: cluster below group below run
  below the executor and the channel, the pipeline on top); no import circle between modules.
- Ray is known where it must be and nowhere else (:data:`RAY_KNOWN`): the cluster seam, the
  worker side (it runs inside Ray's actors), and the pickler of what is sent.
- No module takes another wing's private names, nor the worker side's private modules from
  outside it; local mode has no ``is_local`` checks outside the seam; nothing above the seam maps
  the cluster's errors.
- The cluster an object runs on is handed in (``cluster=``) or chosen in the seam's ``_choice``
  alone (:data:`CLUSTER_CHOSEN`), never by a flag and a global stack elsewhere.
- Every shielded cancel scope has a deadline of its own (a ``move_on_after`` or ``fail_after`` in
  the same ``with``, or ``teardown()``), or says where it is bounded (``# bounded: ...``): a hang
  in teardown is the worst defect the library can have.

Sizes. The guide (STYLE.md) is a class under about 250 lines, a function under about 80 (a
screen), a module under about 600: past those, look whether it holds several concepts, and split
it by concept if it does; one concept may be longer, and says why. The guide is not a quota, so
it is not what this test counts: the test is an alarm for the god class or module that nobody
looked at, set well above the guide (:data:`CLASS_ALARM`, :data:`FUNCTION_ALARM`,
:data:`MODULE_ALARM`: 400, 120, 800, about one and a half times it), where a class or module holds
several concepts whatever its reasons. Hard limits at the guide made the guide a target: classes
squeezed to 249 lines, a docstring shortened and a module left unformatted to stay under a number.
Never trim a docstring, fold lines or skip the formatter to pass it: split by concept.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "asyncexec"
#: The alarms (see the module's docstring): well above the guide of 250, 80 and 600 lines.
CLASS_ALARM, FUNCTION_ALARM, MODULE_ALARM = 400, 120, 800

#: The modules at the package's root that are not wings: the public names, ``python -m``, and the
#: two that every wing uses (the error tree, both sides; the logger, driver side).
ROOT_MODULES = {"__main__", "_errors", "_logging"}

#: The wings, lowest first: a module imports only its own wing and lower ones. ``""`` is the
#: package's root (``asyncexec/__init__.py``, which makes the public names of every wing);
#: the engines take those public names; ``testing`` (the simulated cluster and a stand-in
#: rollout server, public for users' tests) sits on top of them all.
WINGS = [
    "_errors",
    "_logging",
    "_wire",
    "_dispatch",
    "_timeline",
    "_worker",
    "backends",
    "_driver",
    "_cli",
    "",
    "__main__",
    "engines",
    "testing",
]

#: Where Ray may be known (imported, or named as a module path): the one seam to where the
#: workers live, the worker side, which runs inside Ray's actors, and the pickler of what is sent
#: to them (Ray's cloudpickle, which must agree with what Ray sends). Nowhere else: the command
#: line, the configuration and the package's root ask the seam or the worker side.
RAY_KNOWN = ("_driver.cluster", "_worker", "_wire._pickle")

#: The driver's layers, lowest first: a module may import its own layer's and lower ones'.
LAYERS = [
    (
        "base",
        [
            "_driver._config",
            "_driver._devices",
            "_driver._taskgroups",
            "_driver._interrupt",
            "_driver._metrics",
            "_driver._observe",
            "_driver._events",
            "_driver._sinks",
            "_driver._restart",
            "_driver._retention",
        ],
    ),
    ("cluster", ["_driver.cluster"]),
    ("group", ["_driver.group"]),
    ("run", ["_driver.run"]),
    (
        "top",
        [
            "_driver._lifecycle",
            "_driver._executor",
            "_driver._runs",
            "_driver._dispatcher",
            "_driver._loads",
            "_driver._recovery",
            "_driver.channel",
        ],
    ),
    # The RL pipeline: above the executor, its dispatch and the weight channel.
    ("pipeline", ["_driver.pipeline"]),
]


def _modules() -> dict[str, Path]:
    """Dotted name (without ``asyncexec.``) -> path, for every module of the package."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str) -> Iterator[tuple[str, list[str], int]]:
    """Every import of module ``name`` (top level, for type checkers, inside functions): the
    imported module (dotted, ``asyncexec.`` dropped for the package's own, else absolute), the
    names taken from it, and the line."""
    tree = ast.parse(MODULES[name].read_text())
    package = name if _is_package(name) else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = alias.name.removeprefix("asyncexec.").removeprefix("asyncexec")
                yield target, [], node.lineno
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = (node.module or "").removeprefix("asyncexec.").removeprefix("asyncexec")
            yield target, [a.name for a in node.names], node.lineno


def _edges(name: str) -> set[str]:
    """The package's own modules that ``name`` imports (a name taken from a package that is a
    submodule of it counts as that submodule)."""
    out = set()
    for target, names, _ in _imports(name):
        if target not in MODULES:
            continue
        subs = [f"{target}.{n}" if target else n for n in names]
        taken = [s for s in subs if s in MODULES]
        out.update(taken)
        if len(taken) < len(names) or not names:
            out.add(target)
    out.discard(name)
    return out


def _sizes() -> Iterator[str]:
    for name, path in MODULES.items():
        lines = path.read_text().count("\n")
        if lines > MODULE_ALARM:
            yield f"module {name}: {lines} lines"
        for node in ast.walk(ast.parse(path.read_text())):
            size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef) and size > CLASS_ALARM:
                yield f"class {name}.{node.name}: {size} lines"
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and size > FUNCTION_ALARM:
                yield f"function {name}.{node.name} (line {node.lineno}): {size} lines"


def test_no_god_class_function_or_module() -> None:
    """Past an alarm, a class, function or module holds several concepts: split it by concept
    (the guide below the alarm is for reading, not for counting: see the module's docstring)."""
    assert list(_sizes()) == []


def _cycle() -> list[str] | None:
    graph = {name: _edges(name) for name in MODULES}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_no_import_circle() -> None:
    """Imports for type checkers and inside functions count: a circle hidden in them is still
    two modules that cannot be read apart."""
    assert _cycle() is None, " -> ".join(_cycle() or [])


def _layer(name: str) -> int | None:
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(name == p or name.startswith(p + ".") for p in prefixes):
            return index
    return None


def test_every_module_of_the_driver_has_a_layer() -> None:
    """A module left out of :data:`LAYERS` is checked by nothing (``_driver._runs`` was)."""
    unlayered = [n for n in MODULES if n.startswith("_driver.") and _layer(n) is None]
    assert unlayered == []


def test_the_driver_wings_import_only_their_own_layer_and_lower_ones() -> None:
    wrong = []
    for name in MODULES:
        mine = _layer(name)
        if mine is None:
            continue
        for target in _edges(name):
            theirs = _layer(target)
            if theirs is not None and theirs > mine:
                wrong.append(f"{name} ({LAYERS[mine][0]}) imports {target} ({LAYERS[theirs][0]})")
    assert wrong == []


#: The executor's wings whose events go through its observer (``_driver._events``,
#: ``_driver._sinks``): its groups, runs and calls, and the executor that owns them.
OBSERVED = (
    "_driver.group",
    "_driver.run",
    "_driver._dispatcher",
    "_driver._loads",
    "_driver._recovery",
    "_driver._runs",
    "_driver._lifecycle",
    "_driver._executor",
)
#: What those may still take from the timeline and the metrics: the timeline's type (the
#: executor makes it, its slot hands it to a weight channel) and a run's backlog meter (read by
#: a scrape, not an event).
OBSERVED_MAY_TAKE = {
    "_timeline._timeline": {"Timeline", "new_timeline"},
    "_driver._metrics": {"RunMeter"},
}


def test_the_executors_wings_emit_events_rather_than_call_the_timeline_or_the_metrics() -> None:
    """An instrumented event of a group, a run or a call is emitted once to the executor's
    observer, whose sinks draw it on the timeline and count it in the metrics and statistics:
    none of those wings calls the timeline's recording functions or the metrics itself."""
    wrong = []
    for name in MODULES:
        if not any(name == p or name.startswith(p + ".") for p in OBSERVED):
            continue
        for target, names, line in _imports(name):
            allowed = OBSERVED_MAY_TAKE.get(target)
            if allowed is None and (target == "_timeline" or target.startswith("_timeline.")):
                allowed = set()
            if allowed is not None and not set(names) <= allowed:
                wrong.append(f"{name}:{line} takes {sorted(set(names) - allowed)} from {target}")
    assert wrong == []


def _knows_ray(name: str) -> Iterator[str]:
    """Where module ``name`` knows Ray: an import of it, or a module path of Ray named in a
    string (``sys.modules.get("ray._private.worker")``, a patch by name)."""
    for target, _, line in _imports(name):
        if target == "ray" or target.startswith("ray."):
            yield f"{name}:{line} imports {target}"
    for node in ast.walk(ast.parse(MODULES[name].read_text())):
        is_text = isinstance(node, ast.Constant) and isinstance(node.value, str)
        if is_text and node.value.startswith("ray."):
            yield f"{name}:{node.lineno} names {node.value}"


def test_ray_is_known_only_where_it_must_be() -> None:
    """The whole package, not the driver alone: the command line, the configuration and the
    package's root knew Ray until they asked the seam (or the worker side) instead."""
    known = sorted(
        found
        for name in MODULES
        if not any(name == k or name.startswith(k + ".") for k in RAY_KNOWN)
        for found in _knows_ray(name)
    )
    assert known == []


def test_the_places_that_may_know_ray_do() -> None:
    """Each entry of :data:`RAY_KNOWN` is needed: a module there that no longer knows Ray
    leaves the list."""
    for entry in RAY_KNOWN:
        inside = [n for n in MODULES if n == entry or n.startswith(entry + ".")]
        assert any(list(_knows_ray(n)) for n in inside), entry


#: Where the cluster an object runs on is chosen: the seam's ``_choice`` (the one handed in, its
#: parts', the context's default, else Ray's or local mode's threads). ``simulated()`` alone sets
#: that default, for a block; the seam's package re-exports it for it.
CLUSTER_CHOSEN = "_driver.cluster._choice"
CLUSTER_DEFAULT_SET = ("_driver.cluster", "testing._simulated")
#: The classes that hold workers or bundles, each handed the cluster they run on (``cluster=``).
CLUSTER_TAKERS = {
    "_driver._executor": "Executor",
    "_driver.group._pool": "WorkerPool",
    "_driver.group._reservation": "Reservation",
}


def test_the_cluster_is_handed_in_or_chosen_in_one_place() -> None:
    """No boolean and global stack picks the cluster: Ray's and local mode's clusters are made,
    and the context's default read, in ``_choice`` alone; ``simulated()`` alone sets that
    default; and the classes that hold workers take the cluster they run on."""
    made = [
        name
        for name, path in MODULES.items()
        if name != CLUSTER_CHOSEN
        and re.search(r"\b(RayCluster|LocalCluster|InProcessCluster)\(\)", path.read_text())
    ]
    assert made == []
    defaults = [
        name
        for name, path in MODULES.items()
        if name not in (CLUSTER_CHOSEN, *CLUSTER_DEFAULT_SET)
        and re.search(r"\bDEFAULT_CLUSTER\b|\bdefault_cluster\(", path.read_text())
    ]
    assert defaults == []
    for module, cls in CLUSTER_TAKERS.items():
        tree = ast.parse(MODULES[module].read_text())
        [init] = [
            f
            for c in ast.walk(tree)
            if isinstance(c, ast.ClassDef) and c.name == cls
            for f in c.body
            if isinstance(f, ast.FunctionDef) and f.name == "__init__"
        ]
        assert "cluster" in [a.arg for a in init.args.kwonlyargs], cls


def _root_wing(name: str) -> str:
    """The wing at the root a module belongs to (``_driver.group._slot`` -> ``_driver``); the
    root's own modules are their own."""
    return name.split(".")[0]


def test_the_root_holds_wings_and_the_few_shared_modules_only() -> None:
    """A concept is a wing at the root (``_timeline/``, ``_dispatch/``, ...), never flat modules
    beside them: a newcomer finds "how a call is split" by its folder."""
    flat = sorted(n for n in MODULES if "." not in n and not _is_package(n))
    assert set(flat) <= ROOT_MODULES, sorted(set(flat) - ROOT_MODULES)
    wings = sorted({_root_wing(n) for n in MODULES})
    assert sorted(set(wings) - set(WINGS)) == [], "a new wing needs its place in WINGS"


def test_the_wings_import_only_their_own_and_lower_ones() -> None:
    """No arrow up (the torch backend's driver part took the driver's logger), and so no two
    wings import each other."""
    wrong = []
    for name in MODULES:
        mine = WINGS.index(_root_wing(name))
        for target in _edges(name):
            theirs = WINGS.index(_root_wing(target))
            if theirs > mine:
                wrong.append(f"{name} ({WINGS[mine] or 'root'}) imports {target}")
    assert wrong == []


def _wing(name: str) -> str:
    """The sub-package a module belongs to (``_driver.group``, ``_worker``, ...), or the module
    itself for a top-level one."""
    return name if _is_package(name) else name.rpartition(".")[0] or name


def test_no_module_takes_another_wings_private_names() -> None:
    taken = []
    for name in MODULES:
        for target, names, line in _imports(name):
            if target not in MODULES or _wing(target) == _wing(name):
                continue
            private = [
                n
                for n in names
                if n.startswith("_")
                and not n.startswith("__")
                and f"{target}.{n}".lstrip(".") not in MODULES  # a module, not a name
            ]
            taken += [f"{name}:{line} takes {target}.{n}" for n in private]
    assert taken == []


def _private_modules_taken(name: str) -> Iterator[tuple[str, int]]:
    """The private modules of sub-packages that module ``name`` imports (``from pkg import
    _mod``, ``from pkg._mod import x``, ``import pkg._mod``), with the line."""
    for target, names, line in _imports(name):
        if target not in MODULES:
            continue
        modules = [f"{target}.{n}" if target else n for n in names]
        modules = [m for m in modules if m in MODULES] or [target]
        for module in modules:
            inner = module.rpartition(".")[2]
            if _wing(module) != module and inner.startswith("_") and not inner.startswith("__"):
                yield module, line


def test_no_module_outside_the_worker_side_takes_its_private_modules() -> None:
    """Code outside ``_worker/`` (the seam's local and simulated workers, the Ray actor's
    spawner, worker-side helpers elsewhere) takes the names ``asyncexec._worker`` gives, never
    its private modules: a driver wing reaching into them crosses the process boundary by a side
    door. The package root, where the public names are made, may."""
    taken = [
        f"{name}:{line} takes {module}"
        for name in MODULES
        if name and not name.startswith("_worker")
        for module, line in _private_modules_taken(name)
        if module.startswith("_worker.")
    ]
    assert taken == []


@pytest.mark.parametrize("word", ["is_local(", "LocalWorker(", "config.local"])
def test_local_mode_is_decided_in_the_seam_alone(word: str) -> None:
    """Outside the seam, nothing asks whether workers are threads or actors (the configuration
    checks what local mode refuses, before anything starts)."""
    allowed = ("_driver.cluster", "_driver._config", "_driver._lifecycle", "_driver.run._spec")
    users = [
        name
        for name, path in MODULES.items()
        if not name.startswith(allowed) and word in path.read_text()
    ]
    if word == "config.local":  # a channel refuses local executors, as a configuration check
        users = [u for u in users if u != "_driver.channel._channel"]
    assert users == []


#: The seam's own mapping of the cluster's errors (and Ray's classes, through it): only the seam
#: uses it, inside the calls it makes.
SEAM_MAPPING = {"call_error", "ray_error_kind", "RAY_ERROR_KINDS"}


def test_only_the_seam_maps_the_clusters_errors() -> None:
    """A call on a worker made through the seam (``cluster.submit``) raises asyncexec's errors,
    mapped inside the seam, as httpx's transports map httpcore's; no upper layer catches the
    cluster's raw errors to map them itself (``call_error`` was called at ten sites)."""
    users = sorted(
        f"{name}:{line} uses {word}"
        for name, path in MODULES.items()
        if not name.startswith("_driver.cluster")
        for word, line in _names_used(path)
        if word in SEAM_MAPPING
    )
    assert users == []


def _names_used(path: Path) -> Iterator[tuple[str, int]]:
    """Every name a module reads, imports or takes as an attribute, with its line."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            yield node.id, node.lineno
        elif isinstance(node, ast.Attribute):
            yield node.attr, node.lineno
        elif isinstance(node, ast.Import | ast.ImportFrom):
            for alias in node.names:
                yield alias.name.rpartition(".")[2], node.lineno


#: A worker's handle's raw methods (the cluster's own failures, a method named by a string): the
#: seam calls them; above it, workers are called through the typed proxy (``cluster.proxy``).
HANDLE_METHODS = {"call", "call_n", "cancel"}
#: The worker interface's method names (``_wire._interface.WorkerMethod``), read from its source.
_INTERFACE = PACKAGE / "_wire" / "_interface.py"


def _worker_method_names() -> set[str]:
    tree = ast.parse(_INTERFACE.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "WorkerMethod" for t in node.targets
        ):
            assert isinstance(node.value, ast.Subscript)
            elements = node.value.slice
            assert isinstance(elements, ast.Tuple)
            return {e.value for e in elements.elts if isinstance(e, ast.Constant)}
    raise AssertionError("WorkerMethod is not in _wire/_interface.py")


def _receiver(node: ast.expr) -> str:
    """The last name of what a method is called on: ``handle`` for ``w.handle.call``."""
    if isinstance(node, ast.Attribute):
        return node.attr
    return node.id if isinstance(node, ast.Name) else ""


def _raw_calls(path: Path, methods: set[str]) -> Iterator[str]:
    """The raw handle calls in a module: a handle's method called on something named a handle
    (``handle``, ``h``, ``.handle``), any ``call``/``call_n`` whose first argument names a
    worker method, and Ray's graceful exit named anywhere."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Constant) and node.value == "__ray_terminate__":
            yield f"{node.lineno}: names __ray_terminate__"
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        attr, on = node.func.attr, _receiver(node.func.value)
        if attr in HANDLE_METHODS and on in ("handle", "h", "handles"):
            yield f"{node.lineno}: {on}.{attr}(...)"
        elif (
            attr in ("call", "call_n")
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and node.args[0].value in methods
        ):
            yield f"{node.lineno}: .{attr}({node.args[0].value!r}, ...)"


def test_no_raw_worker_call_above_the_seam() -> None:
    """Issue 43: above ``_driver/cluster``, a worker's method is called through the typed proxy
    (its call's errors mapped, the method and its arguments checked against the interface by
    mypy), never by a raw ``handle.call("name", ...)`` under ``suppress(Exception)``; Ray's
    graceful exit is the cluster's kill's (it was called by name in the group's close)."""
    methods = _worker_method_names()
    assert {"ping", "poll", "wait_closed"} <= methods  # the names are read
    found = [
        f"{name}:{where}"
        for name, path in MODULES.items()
        if not name.startswith("_driver.cluster")
        for where in _raw_calls(path, methods)
    ]
    assert found == []
    # The check sees what it looks for: the seam itself calls handles.
    assert any(_raw_calls(MODULES["_driver.cluster._calls"], methods))


#: Context managers that give a shielded scope a deadline of its own.
_DEADLINES = {"move_on_after", "fail_after", "move_on_at", "fail_at", "teardown"}
#: The comment that says where a shield without a deadline of its own is bounded.
_BOUNDED = re.compile(r"#.*\bbounded(:|\s+by\b)", re.IGNORECASE)


def _callee(call: ast.Call) -> str:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def _shields(call: ast.Call) -> bool:
    """Whether ``call`` makes a shielded scope with no deadline: ``CancelScope(shield=...)``."""
    return (
        _callee(call) == "CancelScope"
        and any(k.arg == "shield" for k in call.keywords)
        and not any(k.arg == "deadline" for k in call.keywords)
    )


def _unbounded_shields(path: Path) -> Iterator[str]:
    """The shielded scopes of ``path`` with neither a deadline nor a ``# bounded`` comment (on
    the ``with``'s lines or the line above)."""
    lines = path.read_text().splitlines()

    def says_bounded(first: int, last: int) -> bool:
        """Whether lines ``first`` to ``last`` (1-based), or the comment block just above
        them, say where the shield is bounded."""
        first -= 1
        while first > 0 and lines[first - 1].lstrip().startswith("#"):
            first -= 1
        return any(_BOUNDED.search(line) for line in lines[first:last])

    seen: set[int] = set()
    tree = ast.parse("\n".join(lines))
    for node in ast.walk(tree):
        if isinstance(node, ast.With | ast.AsyncWith):
            calls = [i.context_expr for i in node.items if isinstance(i.context_expr, ast.Call)]
            shielded = [c for c in calls if _shields(c)]
            seen.update(id(c) for c in shielded)
            if (
                shielded
                and not any(_callee(c) in _DEADLINES for c in calls)
                and not says_bounded(node.lineno, node.body[0].lineno - 1)
            ):
                yield f"{node.lineno}: with CancelScope(shield=True)"
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            shield = any(isinstance(t, ast.Attribute) and t.attr == "shield" for t in targets)
            if shield and not says_bounded(node.lineno, node.lineno):
                yield f"{node.lineno}: .shield = ..."
    for node in ast.walk(tree):  # a shielded scope made outside a ``with``
        if (
            isinstance(node, ast.Call)
            and _shields(node)
            and id(node) not in seen
            and not says_bounded(node.lineno, node.lineno)
        ):
            yield f"{node.lineno}: CancelScope(shield=True) outside a with"


def test_every_shield_is_bounded() -> None:
    """Issue 43: a shielded scope keeps out the cancellation that closes its object, so one
    without a deadline of its own waits as long as what it waits for (a death's node check that
    never answered hung the mapping of the call, and every close that waited for it). Each has a
    deadline in the same ``with`` (``move_on_after``, ``fail_after``, or ``teardown()``), or a
    ``# bounded: ...`` / ``# bounded by ...`` comment that says where it is bounded (what it
    awaits has its own deadline; a thread that a deadline would not cut)."""
    found = [f"{name}:{w}" for name, path in MODULES.items() for w in _unbounded_shields(path)]
    assert found == []


def test_the_shield_check_sees_what_it_looks_for(tmp_path: Path) -> None:
    source = tmp_path / "example.py"
    source.write_text(
        "async def f(scope, event):\n"
        "    with anyio.CancelScope(shield=True):\n"  # 2: unbounded
        "        await event.wait()\n"
        "    with anyio.CancelScope(shield=True), anyio.move_on_after(1):\n"
        "        await event.wait()\n"
        "    with anyio.move_on_after(1, shield=True):\n"
        "        await event.wait()\n"
        "    with teardown('x'):\n"
        "        await event.wait()\n"
        "    # bounded: event is set within a second\n"
        "    with anyio.CancelScope(shield=True):\n"
        "        await event.wait()\n"
        "    with anyio.CancelScope(shield=True):  # bounded by the event's setter\n"
        "        await event.wait()\n"
        "    # Shielded so that it ends; bounded by\n"
        "    # the event's setter.\n"
        "    with anyio.CancelScope(shield=True):\n"
        "        await event.wait()\n"
        "    scope.shield = True\n"  # 19: unbounded
        "    held = anyio.CancelScope(shield=True)\n"  # 20: unbounded
    )
    assert [w.split(":")[0] for w in _unbounded_shields(source)] == ["2", "19", "20"]


# The tests -------------------------------------------------------------------------------------

TESTS = PACKAGE.parent / "tests"
#: The test modules that import the library's private modules: unit tests of an internal (the
#: budget, the report window, the dispatch plan, the seam, the sinks...) that pin what the public
#: names cannot reach precisely or without Ray. Every other test goes through the public names
#: (``asyncexec``, ``asyncexec.testing``, ``engines``, ``backends``); this list only shrinks.
INTERNAL_UNIT_TESTS = {
    *("backends/test_engines_vllm.py", "backends/test_torch_backend.py"),
    *("channel/test_channel_units.py", "cli/test_cli.py", "group/test_spares_sim.py"),
    "group/test_pool_leases.py",
    *("cluster/test_preemption.py", "cluster/test_seam_calls.py", "cluster/test_seam_errors.py"),
    *("cluster/test_seams.py", "cluster/test_stacks.py", "cluster/test_teardown_bounds.py"),
    *("dispatch/test_dispatch.py", "dispatch/test_dispatch_packed.py"),
    "dispatch/test_dispatch_speed_paths.py",
    "dispatch/test_payloads.py",
    *("observe/test_dashboard.py", "observe/test_metrics.py", "observe/test_observe.py"),
    *("observe/test_observe_executor.py", "observe/test_timeline.py"),
    *("observe/test_timeline_pipeline.py", "observe/test_timeline_shared.py"),
    *("observe/test_tracing.py", "pipeline/test_pipeline_expiry.py"),
    *("pipeline/test_pipeline_lag.py", "pipeline/test_pipeline_units.py"),
    *("pipeline/test_router_units.py", "project/test_units.py"),
    *("run/test_credit.py", "run/test_datasets.py", "run/test_elastic.py", "run/test_faults.py"),
    *("run/test_handover.py", "run/test_held_groups.py"),
    *("run/test_interrupt_handler.py", "run/test_report_path.py", "run/test_stragglers.py"),
    *("worker/test_roles_worker.py", "worker/test_threaded_worker.py"),
    *("worker/test_worker_interface.py", "worker/test_worker_loop.py"),
}


def _takes_private_modules(path: Path) -> bool:
    """Whether a test module imports a private module of the library (a dotted part ``_x``)."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[0] == "asyncexec" and any(
                p.startswith("_") and not p.startswith("__") for p in parts[1:]
            ):
                return True
    return False


def test_the_tests_take_the_public_names_but_the_listed_unit_tests_of_internals() -> None:
    found = {
        path.relative_to(TESTS).as_posix()
        for path in TESTS.rglob("test_*.py")
        if _takes_private_modules(path)
    }
    assert found - INTERNAL_UNIT_TESTS == set(), "a test takes private modules: use public names"
    assert INTERNAL_UNIT_TESTS - found == set(), "no longer takes private modules: unlist it"
