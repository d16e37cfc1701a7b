"""A timeline drawn as a PNG with matplotlib (the ``timeline`` extra): one row per rank and one
for the driver, spans coloured by kind, instants as ticks, restarts shaded and marked."""

from __future__ import annotations

import os
from typing import Any

__all__ = ["COLOURS", "render"]

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
}
_OTHER = "#7f7f7f"
#: The tracks that are not ranks (the driver's, the RL pipeline's).
_NAMES = {-1: "driver", -2: "pipeline"}


def render(
    events: list[Any], origin: float, path: str | os.PathLike[str], title: str | None = None
) -> None:
    """Draw ``events`` (a timeline's, times on its clock) to ``path``, in seconds from the
    first event (from ``origin`` when there is none)."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise ImportError(
            "drawing a timeline needs matplotlib: pip install 'asyncexec[timeline]'"
        ) from exc
    origin = min((e[4] for e in events), default=origin)
    tracks = sorted({e[1] for e in events} | {-1})
    rows = {track: i for i, track in enumerate(reversed(tracks))}  # the driver on top
    fig, ax = plt.subplots(figsize=(12, 1.0 + 0.45 * len(tracks)), dpi=110)
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
            bars.setdefault((track, kind), []).append((start - origin, max(end - start, 1e-4)))
            labels.setdefault((track, kind), []).append(name)
        else:
            marks.append((start - origin, track, kind))
    for begin, width in restarts:
        ax.axvspan(begin, begin + width, color=COLOURS["restart"], alpha=0.12, lw=0)
        ax.axvline(begin, color=COLOURS["failure"], lw=1.2, ls="--")
        ax.text(begin, len(tracks) - 0.35, " restart", color=COLOURS["failure"], fontsize=8)
    # A pipeline's update first: its pause, push and resume are drawn over it.
    for (track, kind), spans in sorted(bars.items(), key=lambda item: item[0][1] != "update"):
        y = rows[track]
        # A driver's nested phases are drawn thinner, over the span that holds them.
        height = 0.7 if kind in ("step", "call", "push", "attempt", "update") else 0.5
        ax.broken_barh(
            spans,
            (y - height / 2, height),
            facecolors=COLOURS.get(kind, _OTHER),
            edgecolors="white",
            linewidth=0.3,
        )
    _label_driver(ax, bars, labels, rows)
    for at, track, kind in marks:
        y = rows[track]
        ax.plot([at, at], [y - 0.45, y + 0.45], color=COLOURS.get(kind, _OTHER), lw=1.5)
    ax.set_yticks([rows[t] for t in tracks])
    ax.set_yticklabels([_NAMES.get(t, f"rank {t}") for t in tracks])
    ax.set_ylim(-0.6, len(tracks) - 0.2)
    ax.set_xlabel("seconds")
    ax.grid(axis="x", alpha=0.3)
    kinds = sorted({kind for _, kind in bars} | {kind for _, _, kind in marks})
    if restarts:
        kinds = sorted({*kinds, "restart"})
    handles = [Patch(color=COLOURS.get(kind, _OTHER), label=kind) for kind in kinds]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(os.fspath(path))
    plt.close(fig)


def _label_driver(
    ax: Any,
    bars: dict[tuple[int, str], list[tuple[float, float]]],
    labels: dict[tuple[int, str], list[str]],
    rows: dict[int, int],
) -> None:
    """Name the driver's spans where they have room (6 % of the picture or more)."""
    total = max((s + w for spans in bars.values() for s, w in spans), default=1.0) or 1.0
    for (track, kind), spans in bars.items():
        if track != -1:  # (the pipeline's names are longer than its spans: its legend tells)
            continue
        for (begin, width), label in zip(spans, labels[(track, kind)], strict=True):
            if width > 0.06 * total:  # the driver's phases named where they have room
                ax.text(
                    begin + width / 2,
                    rows[track],
                    label,
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white",
                    clip_on=True,
                )
