"""The benchmarks' one harness: a figure is a workload and the systems it compares; this owns the
rest.

- **Start-up**: importing this module sets the environment Ray's workers inherit (no token
  authentication, every worker's log line, this folder and its tree first on ``PYTHONPATH`` and
  ``sys.path``, so that workers import the benchmark's functions by module name and the driver
  imports the asyncexec its workers import); :func:`ray_session` starts a fresh local Ray with the
  figure's options (every worker process fresh by default) and shuts it down; :func:`child` runs a
  measurement in a fresh driver process (of another tree's asyncexec, if given) and returns the
  JSON it printed.
- **Systems side by side**: :func:`interleave` runs one repeat of each system, the order
  alternating each repeat so that the machine's noise falls on all of them alike;
  :func:`repeat` runs the warm-up and the repeats and files each result in its rows;
  :func:`latency` times a block of sequential calls (a common system's result).
- **Rows**: :class:`Row` holds each column's samples (the table shows medians), the measured
  column's ratio to a reference column (the floor), each repeat's paired ratio, the target and
  whether it is met.
- **Output**: :func:`machine` is the line that says when, on what and with what; :class:`Table`
  renders the rows as one markdown table (:class:`Grid`: cases as rows, cells formatted by the
  figure); :func:`main` is a figure script's whole ``main``: arguments (``--quick``, ``--only``,
  ``--repeats``, a size by name), Ray, the run, the machine line, the table and the notes.

A new figure is a file with its sizes, its workload (a coroutine per system) and a ``main`` that
calls :func:`main`; ``execute.py`` is one.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import dataclasses
import io
import json
import math
import os
import platform
import pstats
import signal
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

__all__ = [
    "HERE",
    "ROOT",
    "Figure",
    "Grid",
    "Pair",
    "Profiler",
    "Result",
    "Row",
    "Table",
    "alternate",
    "child",
    "drop_library_logs",
    "fmt",
    "interleave",
    "latency",
    "machine",
    "main",
    "median",
    "progress",
    "ray_session",
    "repeat",
    "start_ray",
]

#: This folder (the benchmarks' modules) and the tree it is in (its asyncexec).
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _setup() -> None:
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (HERE, ROOT, os.environ.get("PYTHONPATH")) if p
    )
    for index, path in enumerate((HERE, ROOT)):
        if path not in sys.path:
            sys.path.insert(index, path)


_setup()

from _common import median, progress  # noqa: E402 (this folder is on sys.path now)

T = TypeVar("T")


# -- Ray ------------------------------------------------------------------------------------------


def start_ray(
    num_cpus: int = 16,
    *,
    fresh_workers: bool = True,
    object_store_bytes: int | None = None,
    preallocate_store: bool = False,
    address: str = "local",
    **init: Any,
) -> None:
    """A fresh local Ray for this run only (never one already running): ``num_cpus`` logical
    CPUs (the machine may have fewer cores; every worker asks for a share). ``fresh_workers``
    switches Ray's pre-started worker processes off, so that every worker of every system is a
    fresh process and none gets a warm one for being first. ``preallocate_store`` allocates the
    object store up front (a put into pages never touched pays a page fault per 4 KiB, which
    would fall on whichever system's turn it was). ``init``: more of ``ray.init``'s options."""
    import ray

    config: dict[str, Any] = {}
    if fresh_workers:
        config |= {"prestart_worker_first_driver": False, "enable_worker_prestart": False}
    if preallocate_store:
        config["preallocate_plasma_memory"] = True
    options: dict[str, Any] = {"_system_config": config} if config else {}
    if object_store_bytes is not None:
        options["object_store_memory"] = object_store_bytes
    ray.init(
        address=address,
        num_cpus=num_cpus,
        include_dashboard=False,
        log_to_driver=False,
        **options,
        **init,
    )


@contextmanager
def ray_session(*, cluster: Mapping[str, Any] | None = None, **options: Any) -> Iterator[Any]:
    """:func:`start_ray` with ``options`` for the block, or, with ``cluster`` (its head node's
    options), a ``ray.cluster_utils.Cluster`` that the figure adds nodes to and removes them
    from, this driver joined to it; yields the cluster (None without). Ray, and the cluster, are
    shut down on leaving the block."""
    import ray

    if cluster is None:
        start_ray(**options)
        try:
            yield None
        finally:
            ray.shutdown()
        return
    from ray.cluster_utils import Cluster

    nodes = Cluster(initialize_head=True, head_node_args=dict(cluster))
    try:
        ray.init(address=nodes.address, log_to_driver=False, **options)
        try:
            yield nodes
        finally:
            ray.shutdown()
    finally:
        nodes.shutdown()


def child(
    script: str,
    *args: str,
    tree: str | None = None,
    lock: str | None = None,
    timeout_s: float = 900.0,
) -> Any:
    """Run ``script`` with ``args`` in a fresh Python process (under ``flock lock``, if given),
    joined to no running Ray, and return the JSON object its last line printed (``RESULT `` may
    come first). With ``tree``, it runs in that tree with its asyncexec first on ``PYTHONPATH``
    (for the driver and its workers), this folder's tools after it. A process that fails raises
    RuntimeError with the end of what it wrote to stderr; one still running after ``timeout_s``
    is killed with everything it started in its process group (under ``flock``, the script
    itself, which would otherwise go on holding the lock) and raises TimeoutExpired."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH")}
    if tree is not None:
        env["PYTHONPATH"] = os.pathsep.join([tree, HERE])
    command = [sys.executable, script, *args]
    if lock is not None:
        command = ["flock", lock, *command]
    with subprocess.Popen(
        command,
        cwd=tree,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise
    lines = [x for x in stdout.splitlines() if x.startswith(("{", "RESULT "))]
    if proc.returncode != 0 or not lines:
        name = " ".join([os.path.basename(script), *args])
        raise RuntimeError(f"{name} (in {tree or HERE}) failed:\n{stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def drop_library_logs() -> None:
    """The library logs through structlog and never configures it; a benchmark's output is its
    table, so its log lines are dropped (no terminal I/O in the figures either)."""
    import structlog

    def dropped(logger: Any, name: str, event: Any) -> Any:
        raise structlog.DropEvent

    structlog.configure(processors=[dropped])


def machine() -> str:
    """When, on what and with what: the date, the cores, Python's and (if imported) Ray's
    version."""
    import psutil

    line = (
        f"{time.strftime('%Y-%m-%d %H:%M')}, {psutil.cpu_count(logical=True)} cores "
        f"({platform.machine()}), Python {platform.python_version()}"
    )
    ray = sys.modules.get("ray")
    if ray is not None:
        line += f", Ray {ray.__version__}"
    return line


# -- systems side by side -------------------------------------------------------------------------


async def interleave(index: int, systems: Mapping[str, Callable[[], Awaitable[T]]]) -> dict[str, T]:
    """Repeat ``index`` of every system, one after the other, in their order on even repeats and
    the reverse on odd ones: whatever the machine does meanwhile falls on all of them alike, and
    none always runs first (warmer caches) or last."""
    names = list(systems)
    if index % 2:
        names.reverse()
    return {name: await systems[name]() for name in names}


async def alternate(
    index: int,
    base: Callable[[], Awaitable[Any]],
    ours: Callable[[], Awaitable[Any]],
    profiler: Profiler | None = None,
) -> tuple[Any, Any]:
    """Repeat ``index`` of ``base`` and ``ours`` (:func:`interleave`): their results, in that
    order; only ``ours`` is profiled."""
    timed = ours if profiler is None else lambda: profiler.timed(ours)
    got = await interleave(index, {"base": base, "ours": timed})
    return got["base"], got["ours"]


class Profiler:
    """cProfile over one side of the measurements (asyncexec's, on the driver), when asked for:
    disabled, it only runs what it is given."""

    def __init__(self, enabled: bool = True) -> None:
        self.profile = cProfile.Profile() if enabled else None

    @contextmanager
    def on(self) -> Iterator[None]:
        """Profile the block."""
        if self.profile is None:
            yield
            return
        self.profile.enable()
        try:
            yield
        finally:
            self.profile.disable()

    async def timed(self, call: Callable[[], Awaitable[T]]) -> T:
        """``await call()``, profiled."""
        with self.on():
            return await call()

    def report(self, top: int = 30) -> str:
        """The top functions by their own time and by cumulative time ("" when disabled)."""
        if self.profile is None:
            return ""
        out = io.StringIO()
        stats = pstats.Stats(self.profile, stream=out)
        stats.sort_stats("tottime").print_stats(top)
        stats.sort_stats("cumulative").print_stats(top)
        return out.getvalue()


async def repeat(
    rows: Sequence[Row],
    systems: Mapping[str, Callable[[], Awaitable[float | Sequence[float]]]],
    repeats: int,
    *,
    warm: int = 1,
    name: str = "",
) -> None:
    """``warm`` unrecorded rounds (imports, exporting the classes and functions), then
    ``repeats`` interleaved ones; each system's result goes to its column of ``rows``: a number
    to ``rows[0]``, a sequence to the rows in order."""
    for i in range(warm):
        await interleave(i, systems)
    for i in range(repeats):
        if name:
            progress(f"{name}, repeat {i + 1}/{repeats}")
        for system, result in (await interleave(i, systems)).items():
            values = [result] if isinstance(result, int | float) else list(result)
            for row, value in zip(rows, values, strict=False):
                row.add(system, float(value))


async def latency(calls: int, one: Callable[[int], Awaitable[Any]]) -> tuple[float, float, float]:
    """``calls`` sequential calls ``one(i)``: their median latency, and the CPU per call of the
    event loop's thread and of the whole driver (Ray's own threads serialise and send); in us."""
    seen = []
    loop0, cpu0 = time.thread_time(), time.process_time()
    for i in range(calls):
        t0 = time.perf_counter()
        await one(i)
        seen.append(time.perf_counter() - t0)
    loop, cpu = time.thread_time() - loop0, time.process_time() - cpu0
    return median(seen) * 1e6, loop / calls * 1e6, cpu / calls * 1e6


# -- rows and the table ---------------------------------------------------------------------------


@dataclass
class Row:
    """One row: each column's samples (the table shows their median), the measured column's
    ratio to the reference column, and the target.

    ``limit`` is a target on that ratio (at most ``limit`` where lower is better, at least
    ``1 / limit`` where higher is better, a rate); ``most`` a bound on the measured column's
    median, in the row's unit (the target's text says it); ``check`` is any other target,
    decided from the medians (None when it cannot be: a column is missing). None of them: a row
    shown as a contrast.
    """

    label: str
    unit: str = ""
    target: str = ""
    limit: float | None = None
    most: float | None = None
    check: Callable[[dict[str, float]], bool | None] | None = None
    higher_is_better: bool = False
    key: str = ""
    measured: str = "asyncexec"
    reference: str = "floor"
    values: dict[str, list[float]] = field(default_factory=dict)

    def add(self, column: str, value: float) -> None:
        self.values.setdefault(column, []).append(value)

    def of(self, column: str) -> list[float]:
        """The samples of ``column`` (a list to append to)."""
        return self.values.setdefault(column, [])

    def medians(self) -> dict[str, float]:
        return {k: median(v) for k, v in self.values.items() if v}

    def ratio(self, other: str | None = None) -> float:
        """The measured column's median over ``other``'s (the reference's by default)."""
        m = self.medians()
        a, b = m.get(self.measured), m.get(other or self.reference)
        if a is None or b is None or b == 0 or math.isnan(a) or math.isnan(b):
            return math.nan
        return a / b

    def paired(self, other: str | None = None) -> list[float]:
        """The ratio of each repeat (measured over reference, one right after the other): on a
        machine whose load drifts, their median moves less than the ratio of the medians."""
        pairs = zip(self.of(self.measured), self.of(other or self.reference), strict=False)
        return [a / b for a, b in pairs if b]

    def target_text(self) -> str:
        if self.target:
            return self.target
        if self.most is not None:
            return f"<= {self.most:g} {self.unit}"
        if self.limit is None:
            return "(contrast)" if self.check is None else "-"
        if self.higher_is_better:
            return f">= {1 / self.limit:.2f}x"
        return f"<= {self.limit:.2f}x"

    def met(self) -> bool | None:
        """Whether the target is met (None without a target or without figures)."""
        if self.check is not None:
            try:
                return self.check(self.medians())
            except (KeyError, ZeroDivisionError):
                return None
        if self.most is not None:
            measured = self.medians().get(self.measured)
            return None if measured is None else measured <= self.most
        ratio = self.ratio()
        if self.limit is None or math.isnan(ratio):
            return None
        return ratio >= 1 / self.limit if self.higher_is_better else ratio <= self.limit


class Figure(Row):
    """A row of ``run.py``'s table (columns ``raytrain``, ``lockstep``, ``floor``,
    ``asyncexec``), with whether Ray Train has a figure in it (the test expects one when its
    column was not skipped)."""

    def __init__(
        self, key: str, label: str, unit: str, *, raytrain: bool = True, **options: Any
    ) -> None:
        super().__init__(label, unit, key=key, **options)
        self.raytrain = raytrain


class Pair(Row):
    """A row of two columns: the reference (``base``: plain Ray, the floor, before) and the
    measured one (``ours``); the ratio is ours over base."""

    def __init__(self, label: str, unit: str = "", **options: Any) -> None:
        super().__init__(label, unit, measured="ours", reference="base", **options)

    @property
    def base(self) -> list[float]:
        return self.of("base")

    @property
    def ours(self) -> list[float]:
        return self.of("ours")


def fmt(value: float, unit: str = "", small: int = 2) -> str:
    """A figure for the table: whole numbers from 100 (and every rate), one decimal from 10."""
    if math.isnan(value):
        return "-"
    if unit == "reports/s" or abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.{small}f}"


def _fmt_ratio(value: float) -> str:
    if math.isnan(value):
        return "-"
    return f"{value:,.0f}x" if value >= 10 else f"{value:.2f}x"


def _each(ratios: list[float]) -> str:
    """The median of the repeats' ratios, with their range."""
    if not ratios:
        return "-"
    return f"{median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


@dataclass
class Table:
    """How rows are shown: ``columns`` (each column's key and header, in order), ``ratios``
    (the columns the measured one is divided by, None for each row's reference, and each
    ratio's header), whether to show each
    repeat's paired ratio (to the first of ``ratios``) and each column's spread, the unit column,
    and the decimals of small values."""

    columns: Sequence[tuple[str, str]]
    ratios: Sequence[tuple[str | None, str]]
    paired: bool = False
    spread: bool = False
    unit: bool = True
    small: int = 2

    def render(self, rows: Sequence[Row]) -> str:
        """The rows as one markdown table; the numbers right-aligned."""
        head = ["figure", *(["unit"] if self.unit else []), *(h for _, h in self.columns)]
        head += [h for _, h in self.ratios]
        head += [*(["each repeat's"] if self.paired else []), "target", "met"]
        head += ["spread (min-max)"] if self.spread else []
        first = 1 + self.unit
        numeric = set(range(first, first + len(self.columns) + len(self.ratios) + self.paired))
        table = [head]
        for row in rows:
            m = row.medians()
            cells = [row.label, *([row.unit] if self.unit else [])]
            cells += [fmt(m.get(c, math.nan), row.unit, self.small) for c, _ in self.columns]
            cells += [_fmt_ratio(row.ratio(c)) for c, _ in self.ratios]
            if self.paired:
                cells.append(_each(row.paired(self.ratios[0][0])))
            cells += [row.target_text(), {True: "yes", False: "NO", None: "-"}[row.met()]]
            if self.spread:
                cells.append(
                    "; ".join(
                        f"{fmt(min(v), small=self.small)}-{fmt(max(v), small=self.small)}"
                        if (v := row.values.get(c))
                        else "-"
                        for c, _ in self.columns
                    )
                )
            table.append(cells)
        widths = [max(len(r[i]) for r in table) for i in range(len(head))]

        def line(cells: list[str]) -> str:
            out = [
                cell.rjust(w) if i in numeric else cell.ljust(w)
                for i, (cell, w) in enumerate(zip(cells, widths, strict=True))
            ]
            return "| " + " | ".join(out) + " |"

        rule = "".join(
            f"|{'-' * (w + 1)}:" if i in numeric else f"|{'-' * (w + 2)}"
            for i, w in enumerate(widths)
        )
        return "\n".join([line(table[0]), rule + "|", *(line(r) for r in table[1:])])


#: Two columns side by side: a reference and asyncexec (or before and after).
def pairs(base: str, ours: str) -> Table:
    """The table of :class:`Pair` rows: both medians, the ratio, each repeat's, the spread."""
    return Table(
        [("base", base), ("ours", ours)],
        [("base", f"{ours} / {base}")],
        paired=True,
        spread=True,
        small=3,
    )


# -- a figure's script ----------------------------------------------------------------------------


@dataclass
class Grid:
    """A table of cases, a row each, and their figures, a column each (``head``): the cells come
    formatted (a figure of several parts, such as "median (min..max)"); all but the first column
    right-aligned."""

    head: Sequence[str]

    def render(self, rows: Sequence[Sequence[str]]) -> str:
        rule = "|---|" + "--:|" * (len(self.head) - 1)
        return "\n".join([_line(self.head), rule, *map(_line, rows)])


def _line(cells: Sequence[str]) -> str:
    return "| " + " | ".join(cells) + " |"


class Shows(Protocol):
    """How a figure's rows are shown: a :class:`Table`, a :class:`Grid`, or tables of its own."""

    def render(self, rows: Any) -> str: ...


@dataclass
class Result:
    """What a figure's run gives back: its rows, how they are shown (a :class:`Table` of
    :class:`Row`, a :class:`Grid` of formatted cells, or tables of the figure's own), and notes
    under them."""

    rows: Sequence[Any]
    table: Shows
    notes: Sequence[str] = ()


def main(
    argv: list[str] | None,
    *,
    doc: str,
    title: str,
    full: Any,
    quick: Any,
    run: Callable[[Any, argparse.Namespace], Coroutine[Any, Any, Result]],
    ray: Mapping[str, Any] | None = None,
    figures: Sequence[str] | Mapping[str, str] = (),
    options: Callable[[argparse.ArgumentParser], object] | None = None,
    about: Callable[[Any, argparse.Namespace], str] | None = None,
) -> int:
    """A figure script's ``main``. Arguments: ``--quick`` (the ``quick`` sizes, else ``full``),
    ``--repeats`` (when the sizes have ``repeats``), ``--only`` (when there are ``figures``, by
    name or as a mapping of each name to its help; the chosen ones are ``args.only``, a name
    that is none of them an error before anything starts) and whatever ``options`` adds; one
    named as a field of the sizes (a dataclass) sets that field. Then the library's log lines
    dropped, a fresh Ray started with ``ray`` (:func:`ray_session`'s options, its cluster
    ``args.cluster``; None: no Ray),
    ``run(sizes, args)`` on an event loop, Ray shut down, and printed: the title with the
    machine line (and ``about(sizes, args)``: repeats, resources), the table, the notes and the
    total time."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (smoke run)")
    repeats = hasattr(full, "repeats")
    if repeats:
        default = f"{full.repeats}; --quick: {quick.repeats}"
        if full.repeats is None:
            default = "each measurement's own"
        parser.add_argument("--repeats", type=int, help=f"repeats ({default})")
    if figures:
        names = ", ".join(figures)
        if isinstance(figures, Mapping):
            names = "; ".join(f"{name}: {text}" for name, text in figures.items())
        parser.add_argument(
            "--only",
            default=",".join(figures),
            help=f"comma-separated figures to measure (default: all), of {names}",
        )
    if options is not None:
        options(parser)
    args = parser.parse_args(argv)
    if figures:
        args.only = set(args.only.split(","))
        if not args.only <= set(figures):
            parser.error(f"--only takes {', '.join(figures)}")
    sizes = quick if args.quick else full
    if dataclasses.is_dataclass(sizes) and not isinstance(sizes, type):  # a size given
        given = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(sizes)}
        sizes = dataclasses.replace(sizes, **{k: v for k, v in given.items() if v is not None})
    drop_library_logs()
    t0 = time.perf_counter()
    result: Result
    if ray is None:
        result = asyncio.run(run(sizes, args))
    else:
        with ray_session(**ray) as args.cluster:
            result = asyncio.run(run(sizes, args))
    head = f"{title} ({'quick' if args.quick else 'full'}), {machine()}"
    if about is not None:
        head += f"; {about(sizes, args)}"
    elif repeats:
        head += f"; medians of {sizes.repeats} interleaved repeat(s)"
    print(f"\n{head}\n")
    print(result.table.render(result.rows))
    print()
    for line in result.notes:
        print(line)
    print(f"- total {time.perf_counter() - t0:.0f} s")
    return 0
