"""A timeline drawn as a PNG with matplotlib (the ``timeline`` extra): a section per executor
that recorded into it (titled by its name when there are several), all on one time axis; in each,
one row per rank and one for the driver (and the RL pipeline), spans coloured by kind, instants
as ticks, restarts shaded and marked. A rank's calls are drawn as its occupancy: the calls in
flight over time, up to the most it held (labelled on the row), so that a server's 4
concurrent ``generate`` calls read as 4, not as one bar; the long ones (well past the
median call of their rank) are marked above it.

The clock starts at the run's first work (:func:`work_began`: its first step, call or pipeline
event): what came before it (the groups' start-up, a first weight push), often most of a short
run's seconds, is folded into one band left of 0, labelled with its length in each section
(``startup=True`` draws it in full), so that the run itself fills the picture."""

from __future__ import annotations

import itertools
import os
import statistics
from typing import Any, NamedTuple

__all__ = ["COLOURS", "Plan", "long_calls", "occupancy", "render", "render_plan", "work_began"]

#: The colour of each kind of span.
COLOURS = {
    "step": "#4c72b0",
    "call": "#dd8452",
    "push": "#55a868",
    "restart": "#c44e52",
    "startup": "#8172b3",
    "attempt": "#937860",
    "failure": "#d62728",
    "preemption": "#e377c2",
    "pause": "#c9a227",
    "update": "#64b5cd",
    "batch": "#2ca02c",
    "wait": "#b0b0b0",
    "expired": "#e6550d",
    "aborted": "#000000",
    "long call": "#8b0000",
}
_OTHER = "#7f7f7f"
#: The tracks that are not ranks (the driver's, the RL pipeline's).
_NAMES = {-1: "driver", -2: "pipeline"}
#: A call is long when it took this many times its rank's median call, or more.
LONG = 3.0
#: About how many characters of a label (7 points) fit across the picture's time axis.
_CHARS = 190
#: The kinds of event that are a run's work (the clock starts at the first: see the module's
#: docstring); any event on the pipeline's track is too.
_WORK = frozenset({"step", "call", "batch", "wait", "pause", "update", "expired", "aborted"})
#: The narrowest a span is drawn, in seconds, and as a share of the picture's time axis (half
#: a pixel or so), whichever is less: an empty span shows, and a run of a few milliseconds of
#: 20 µs steps 50 µs apart is not drawn as one busy bar (each widened to 100 µs, it was).
_NARROWEST_S = 1e-4
_NARROWEST = 1 / 2000
#: The folded start-up's band, as a share of the run's width.
_FOLD = 0.06


def work_began(processes: list[tuple[str, list[Any]]]) -> float | None:
    """When the run's work began: the earliest start of a step, a call or a pipeline event of
    any process (None when there is none)."""
    return min(
        (e[4] for _, events in processes for e in events if e[3] in _WORK or e[1] == -2),
        default=None,
    )


def occupancy(spans: list[tuple[float, float]]) -> list[tuple[float, int]]:
    """The calls in flight over time: ``(time, count from then on)`` at each start and end of
    ``spans`` (``(start, width)`` each), in time order."""
    edges = sorted([(s, 1) for s, _ in spans] + [(s + w, -1) for s, w in spans])
    steps: list[tuple[float, int]] = []
    count = 0
    for at, change in edges:
        count += change
        if steps and steps[-1][0] == at:
            steps[-1] = (at, count)
        else:
            steps.append((at, count))
    return steps


def long_calls(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The calls of ``spans`` that took :data:`LONG` times their median or more (none when
    there are fewer than 5 to judge by)."""
    if len(spans) < 5:
        return []
    median = statistics.median(w for _, w in spans)
    return [(s, w) for s, w in spans if w >= LONG * median and w > 0]


class Plan(NamedTuple):
    """What a picture draws: ``processes`` (the start-up left out when folded), its clock's
    zero (``origin``), the folded band's left edge (``left``, below 0) and the run's end
    (``right``), in seconds from ``origin``, and each executor's start-up seconds
    (``startups``: empty when nothing is folded)."""

    processes: list[tuple[str, list[Any]]]
    origin: float
    left: float
    right: float
    startups: dict[str, float]


def render_plan(
    processes: list[tuple[str, list[Any]]], origin: float, startup: bool = False
) -> Plan:
    """The :class:`Plan` of a picture of ``processes`` (see :func:`render`)."""
    first = min((e[4] for _, events in processes for e in events), default=origin)
    end = max((e[5] for _, events in processes for e in events), default=origin)
    began = None if startup else work_began(processes)
    if began is None or began <= first:
        return Plan(processes, first, 0.0, end - first, {})
    startups = {
        name: began - min(e[4] for e in events)
        for name, events in processes
        if events and min(e[4] for e in events) < began
    }
    kept = [(name, _after(events, began)) for name, events in processes]
    return Plan(kept, began, -_FOLD * max(end - began, 1e-3), end - began, startups)


def render(
    processes: list[tuple[str, list[Any]]],
    origin: float,
    path: str | os.PathLike[str],
    title: str | None = None,
    startup: bool = False,
) -> None:
    """Draw ``processes`` (each a name and its timeline's events, on one clock) to ``path``, in
    seconds from the run's first work, the start-up before it folded (see the module's
    docstring); with ``startup``, or when nothing came before the work, in seconds from the
    first event (from ``origin`` when there is none), all of it drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise ImportError(
            "drawing a timeline needs matplotlib: pip install 'asyncexec[timeline]'"
        ) from exc
    plan = render_plan(processes, origin, startup)
    processes, origin = plan.processes, plan.origin
    sections = [(name, _tracks(events)) for name, events in processes]
    heights = [len(tracks) + 0.8 for _, tracks in sections]
    fig, axes = plt.subplots(
        len(sections),
        1,
        figsize=(12, 0.6 + 0.45 * sum(heights)),
        dpi=110,
        sharex=True,
        squeeze=False,
        gridspec_kw={"height_ratios": heights},
    )
    kinds: set[str] = set()
    narrowest = min(_NARROWEST_S, (plan.right - plan.left) * _NARROWEST) or _NARROWEST_S
    for ax, (name, _), (_, events) in zip(axes[:, 0], sections, processes, strict=True):
        kinds |= _section(ax, events, origin, narrowest)
        if len(sections) > 1:
            ax.set_title(name, loc="left", fontsize=10, fontweight="bold")
        if plan.startups:
            _fold(ax, plan.left, plan.startups.get(name))
    if plan.startups:
        axes[-1, 0].set_xlim(plan.left, plan.right * 1.01)
        ticks = [t for t in axes[-1, 0].get_xticks() if 0 <= t <= plan.right * 1.01]
        axes[-1, 0].set_xticks(ticks)
        axes[-1, 0].set_xlabel(
            "seconds from the first step or call (the start-up folded left of 0)"
        )
    else:
        axes[-1, 0].set_xlabel("seconds")
    handles = [Patch(color=COLOURS.get(kind, _OTHER), label=kind) for kind in sorted(kinds)]
    fig.legend(handles=handles, loc="upper right", fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 0.88, 1))
    fig.savefig(os.fspath(path))
    plt.close(fig)


def _after(events: list[Any], began: float) -> list[Any]:
    """``events`` from ``began`` on: one that ended before it is left out (a span that ends at
    it too; an instant at it is kept), a span across it starts at it."""
    kept = []
    for event in events:
        if event[5] < began or (event[5] == began and event[0] == "X"):
            continue
        if event[4] < began:
            event = (*event[:4], began, *event[5:])
        kept.append(event)
    return kept


def _fold(ax: Any, left: float, seconds: float | None) -> None:
    """The folded start-up's band, from ``left`` to 0, with its length (``seconds``)."""
    ax.axvspan(left, 0, facecolor="#eeeeee", edgecolor="#bbbbbb", hatch="///", lw=0)
    ax.axvline(0, color="#888888", lw=0.8)
    if seconds is not None and seconds > 0:
        ax.text(
            left / 2,
            0.5,
            f"start-up {_seconds(seconds)}",
            transform=ax.get_xaxis_transform(),
            rotation=90,
            ha="center",
            va="center",
            fontsize=7,
            color="#444444",
            clip_on=True,
        )


def _seconds(seconds: float) -> str:
    """``seconds`` written to two figures or so: ``12 s``, ``1.5 s``, ``4 ms`` (a local
    group's start-up of 4 ms read "0.0 s")."""
    if seconds >= 10:
        return f"{seconds:.0f} s"
    if seconds >= 0.1:
        return f"{seconds:.1f} s"
    return f"{seconds * 1000:.2g} ms"


def _tracks(events: list[Any]) -> list[int]:
    return sorted({e[1] for e in events} | {-1})


def _section(
    ax: Any, events: list[Any], origin: float, narrowest: float = _NARROWEST_S
) -> set[str]:
    """Draw one executor's ``events`` on ``ax``, each span at least ``narrowest`` wide (so
    that an empty one shows); return the kinds drawn (for the legend). A rank's calls in
    flight are counted from their own lengths, never from the widths drawn."""
    tracks = _tracks(events)
    rows = {track: i for i, track in enumerate(reversed(tracks))}  # the driver on top
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}
    labels: dict[tuple[int, str], list[str]] = {}
    marks: list[tuple[float, int, str]] = []
    restarts: list[tuple[float, float]] = []
    events = [e for e in events if e[0] != "C"]  # counters: Perfetto's, not drawn here
    for ph, track, name, kind, start, end, _ in events:
        if ph == "X":
            if track == -1 and kind == "restart" and name == "restart":
                restarts.append((start - origin, end - start))
                continue
            bars.setdefault((track, kind), []).append((start - origin, max(end - start, 0.0)))
            labels.setdefault((track, kind), []).append(name)
        else:
            marks.append((start - origin, track, kind))
    for begin, width in restarts:
        ax.axvspan(begin, begin + width, color=COLOURS["restart"], alpha=0.12, lw=0)
        ax.axvline(begin, color=COLOURS["failure"], lw=1.2, ls="--")
        ax.text(begin, len(tracks) - 0.35, " restart", color=COLOURS["failure"], fontsize=8)
    kinds = {kind for _, kind in bars} | {kind for _, _, kind in marks}
    if restarts:
        kinds.add("restart")
    # A pipeline's update first: its pause, push and resume are drawn over it.
    for (track, kind), spans in sorted(bars.items(), key=lambda item: item[0][1] != "update"):
        y = rows[track]
        if kind == "call" and track >= 0 and _concurrent(spans):
            if _occupancy(ax, spans, y):
                kinds.add("long call")
            continue
        # A driver's nested phases are drawn thinner, over the span that holds them.
        height = 0.7 if kind in ("step", "call", "push", "attempt", "update", "wait") else 0.5
        ax.broken_barh(
            [(begin, max(width, narrowest)) for begin, width in spans],
            (y - height / 2, height),
            facecolors=COLOURS.get(kind, _OTHER),
            edgecolors="white",
            linewidth=0.3,
        )
    _label_spans(ax, bars, labels, rows)
    for at, track, kind in marks:
        y = rows[track]
        if kind in ("expired", "aborted"):  # many: a dot each, under the row's spans
            ax.plot([at], [y - 0.42], marker="v", ms=4, color=COLOURS[kind], ls="none")
        else:
            ax.plot([at, at], [y - 0.45, y + 0.45], color=COLOURS.get(kind, _OTHER), lw=1.5)
    ax.set_yticks([rows[t] for t in tracks])
    ax.set_yticklabels([_NAMES.get(t, f"rank {t}") for t in tracks])
    ax.set_ylim(-0.6, len(tracks) - 0.2)
    ax.grid(axis="x", alpha=0.3)
    return kinds


def _concurrent(spans: list[tuple[float, float]]) -> bool:
    ordered = sorted(spans)
    return any(b[0] < a[0] + a[1] for a, b in itertools.pairwise(ordered))


def _occupancy(ax: Any, spans: list[tuple[float, float]], y: int) -> bool:
    """A rank's calls in flight over time, filled up to its row's height at the most it held
    (written at the row's end), the long calls marked above; return whether any was long."""
    steps = occupancy(spans)
    most = max(count for _, count in steps) or 1
    xs = [at for at, _ in steps]
    levels = [y - 0.35 + 0.7 * count / most for _, count in steps]
    ax.fill_between(
        xs, y - 0.35, levels, step="post", color=COLOURS["call"], alpha=0.85, linewidth=0
    )
    ax.text(xs[-1], y, f" ≤{most} in flight", va="center", fontsize=7, color="#555555")
    long = long_calls(spans)
    if long:
        ax.broken_barh(
            long, (y + 0.37, 0.08), facecolors=COLOURS["long call"], edgecolors="white", lw=0.5
        )
    return bool(long)


def _label_spans(
    ax: Any,
    bars: dict[tuple[int, str], list[tuple[float, float]]],
    labels: dict[tuple[int, str], list[str]],
    rows: dict[int, int],
) -> None:
    """Name the driver's and the pipeline's spans where their name fits inside them (a span
    too short for its name keeps its colour, which the legend names): readable at any run
    length. An update is not named: its pause, push and resume are, over it."""
    total = max((s + w for spans in bars.values() for s, w in spans), default=1.0) or 1.0
    per_char = total / _CHARS
    for (track, kind), spans in bars.items():
        if track not in (-1, -2) or kind == "update":
            continue
        for (begin, width), full in zip(spans, labels[(track, kind)], strict=True):
            # The whole name, else its head ("pause" of "pause (wait, 4 in flight)"), else none.
            fits = [n for n in (full, full.split(" (")[0]) if width >= (len(n) + 2) * per_char]
            if fits:
                label = fits[0]
                ax.text(
                    begin + width / 2,
                    rows[track],
                    label,
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if kind != "wait" else "black",
                    clip_on=True,
                )
