"""The layout's promises, read from the source (no Ray): classes under about 250 lines,
functions under about 80, modules under about 600; no import circle (imports for type checkers
and imports inside functions included); the driver's wings layered (cluster below group below run
below the executor and the channel) with ``ray`` imported only by the cluster seam; no module
importing another wing's private names, nor the worker side's private modules from outside it;
local mode with no ``is_local`` checks outside the seam.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "asyncexec"
CLASS_LINES, FUNCTION_LINES, MODULE_LINES = 250, 80, 600

#: The driver's layers, lowest first: a module may import its own layer's and lower ones'.
LAYERS = [
    (
        "base",
        [
            "_driver._config",
            "_driver._devices",
            "_driver._taskgroups",
            "_driver._logging",
            "_driver._interrupt",
            "_driver._metrics",
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
        if lines > MODULE_LINES:
            yield f"module {name}: {lines} lines"
        for node in ast.walk(ast.parse(path.read_text())):
            size = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef) and size > CLASS_LINES:
                yield f"class {name}.{node.name}: {size} lines"
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and size > FUNCTION_LINES:
                yield f"function {name}.{node.name} (line {node.lineno}): {size} lines"


def test_no_class_function_or_module_over_the_guide() -> None:
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


def test_only_the_cluster_seam_imports_ray_in_the_driver() -> None:
    importers = sorted(
        f"{name}:{line}"
        for name in MODULES
        if name.startswith("_driver") and not name.startswith("_driver.cluster")
        for target, _, line in _imports(name)
        if target == "ray" or target.startswith("ray.")
    )
    assert importers == []


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
