"""The command line's views of a run: a live rich table, plain lines, or JSON lines.

rich is imported only when the live view is shown (the ``cli`` extra); without it the plain view
is used.
"""

from __future__ import annotations

import importlib
import json
import sys
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TextIO

from .._driver.run import Step
from ._logconfig import _json_default

__all__ = ["JsonView", "PlainView", "RichView", "Tracker", "View", "make_view"]

#: Ranks shown in the live table; more are summarised in one line.
_MAX_ROWS = 16
#: Metric columns shown in the live table.
_MAX_COLUMNS = 8


@dataclass
class Tracker:
    """The state of a run as the views show it, updated as steps arrive."""

    title: str
    num_workers: int
    total: int | None = None
    started: float = field(default_factory=time.monotonic)
    run_id: str | None = None
    state: str = "starting"
    attempt: int = 1
    steps: int = 0
    index: int = -1
    latest: Sequence[Mapping[str, Any]] = ()
    checkpoint: str | None = None
    _window: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=64))

    def add(self, step: Step) -> None:
        self.steps += 1
        self.index = step.index
        self.attempt = step.attempt
        self.latest = [r.metrics for r in step.reports]
        if step.checkpoint is not None:
            self.checkpoint = step.checkpoint.path

    def sample(self) -> None:
        """Record the step count now, for the rate."""
        self._window.append((time.monotonic(), self.steps))

    @property
    def rate(self) -> float:
        """Steps per second over the last few seconds; over the whole run until the view has
        sampled twice (a run shorter than a redraw has a rate too)."""
        if len(self._window) < 2 or self._window[-1][0] <= self._window[0][0]:
            return self.steps / self.elapsed if self.steps else 0.0
        (t0, s0), (t1, s1) = self._window[0], self._window[-1]
        return (s1 - s0) / (t1 - t0)

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    @property
    def completed(self) -> int:
        """Progress: rank 0's ``step`` metric plus one when it reports one (so the bar goes back
        when a restart resumes from an earlier checkpoint), else the steps delivered."""
        step = self.latest[0].get("step") if self.latest else None
        done = step + 1 if isinstance(step, int) and not isinstance(step, bool) else self.steps
        return done if self.total is None else min(done, self.total)


class View(Protocol):
    """How a run is shown: a live view, plain lines, or JSON lines."""

    def __enter__(self) -> View: ...

    def __exit__(self, *exc_info: object) -> None: ...

    def on_step(self, step: Step) -> None: ...

    def refresh(self) -> None: ...

    def note(self, text: str) -> None: ...


class JsonView:
    """One JSON object per step on ``out``, named as :class:`Step` names its parts: ``index``,
    ``attempt``, ``metrics`` (rank 0's metrics, as ``Step.metrics``), ``reports`` (each rank's
    metrics, in rank order, as ``Step.reports``) and ``checkpoint`` (a path or null)."""

    def __init__(self, out: TextIO) -> None:
        self._out = out

    def __enter__(self) -> JsonView:
        return self

    def __exit__(self, *exc_info: object) -> None:
        return None

    def on_step(self, step: Step) -> None:
        line = {
            "index": step.index,
            "attempt": step.attempt,
            "metrics": dict(step.metrics),
            "reports": [dict(r.metrics) for r in step.reports],
            "checkpoint": step.checkpoint.path if step.checkpoint is not None else None,
        }
        self._out.write(json.dumps(line, default=_json_default) + "\n")
        self._out.flush()

    def refresh(self) -> None:
        return None

    def note(self, text: str) -> None:
        return None  # stdout carries steps only; the log lines on stderr tell the story


class PlainView:
    """Plain lines, a few per second at most: used when rich is not installed."""

    def __init__(self, tracker: Tracker, out: TextIO, hint: str | None = None) -> None:
        self._tracker = tracker
        self._out = out
        self._hint = hint
        self._last = 0.0

    def __enter__(self) -> PlainView:
        if self._hint:
            self._print(self._hint)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._line()

    def _print(self, text: str) -> None:
        self._out.write(text + "\n")
        self._out.flush()

    def _line(self) -> None:
        t = self._tracker
        if t.steps == 0:
            return
        total = f"/{t.total}" if t.total is not None else ""
        metrics = _format_metrics(t.latest[0]) if t.latest else ""
        self._print(
            f"step {t.index} ({t.completed}{total}) attempt {t.attempt} "
            f"{t.rate:.1f} steps/s  rank 0: {metrics}"
        )
        self._last = time.monotonic()

    def on_step(self, step: Step) -> None:
        if time.monotonic() - self._last >= 0.5:
            self._line()

    def refresh(self) -> None:
        return None

    def note(self, text: str) -> None:
        self._print(text)


class RichView:
    """The live terminal view (rich): header, progress bar, and each rank's latest metrics."""

    def __init__(self, tracker: Tracker, rich: Any) -> None:
        self._tracker = tracker
        self._rich = rich
        self._console = rich["console"].Console()
        self._live = rich["live"].Live(
            console=self._console, auto_refresh=False, transient=False, redirect_stderr=True
        )

    def __enter__(self) -> RichView:
        self._live.start()
        self.refresh()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._live.update(self._render())
        self._live.stop()
        if not self._console.is_terminal:
            self._console.line()  # a file gets the final frame only, without its line end

    def on_step(self, step: Step) -> None:
        return None  # drawn at the refresh rate, however fast steps arrive

    def refresh(self) -> None:
        self._live.update(self._render(), refresh=True)

    def note(self, text: str) -> None:
        self._console.print(text)

    def _render(self) -> Any:
        r, t = self._rich, self._tracker
        restarts = t.attempt - 1
        header = r["text"].Text.assemble(
            (t.title, "bold"),
            f"  ·  {t.num_workers} workers  ·  run {t.run_id or '-'}\n",
            ("attempt ", "dim"),
            (str(t.attempt), "bold yellow" if restarts else "bold"),
            (f" ({restarts} restart{'s' if restarts != 1 else ''})  ·  ", "dim"),
            (t.state, _STATE_STYLE.get(t.state, "")),
            ("  ·  ", "dim"),
            f"{t.steps} steps  ·  {t.rate:.1f} steps/s  ·  {_clock(t.elapsed)}",
        )
        parts: list[Any] = [header]
        if t.total is not None:
            bar = r["table"].Table.grid(padding=(0, 1))
            bar.add_row(
                r["progress_bar"].ProgressBar(total=t.total, completed=t.completed, width=40),
                f"{t.completed}/{t.total}",
            )
            parts.append(bar)
        if t.latest:
            keys: list[str] = []
            for metrics in t.latest:
                keys.extend(k for k in metrics if k not in keys)
            keys = keys[:_MAX_COLUMNS]
            table = r["table"].Table(box=r["box"].SIMPLE_HEAD, pad_edge=False)
            table.add_column("rank", justify="right", style="cyan")
            for key in keys:
                table.add_column(str(key), justify="right", overflow="ellipsis", max_width=24)
            for rank, metrics in enumerate(t.latest[:_MAX_ROWS]):
                table.add_row(str(rank), *(_format_value(metrics.get(k, "")) for k in keys))
            if len(t.latest) > _MAX_ROWS:
                table.add_row("…", f"{len(t.latest) - _MAX_ROWS} more ranks")
            parts.append(table)
        if t.checkpoint:
            parts.append(r["text"].Text(f"latest checkpoint: {t.checkpoint}", style="dim"))
        return r["console"].Group(*parts)


_STATE_STYLE = {
    "running": "green",
    "restarting": "bold yellow",
    "finished": "bold green",
    "failed": "bold red",
    "cancelled": "yellow",
}


def _clock(seconds: float) -> str:
    minutes, secs = divmod(int(seconds), 60)
    return f"{minutes:02d}:{secs:02d}"


def _format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.5g}"
    text = str(value)
    return text if len(text) <= 24 else text[:23] + "…"


def _format_metrics(metrics: Mapping[str, Any]) -> str:
    return " ".join(f"{k}={_format_value(v)}" for k, v in list(metrics.items())[:_MAX_COLUMNS])


def _import_rich() -> dict[str, Any] | None:
    """rich's modules, or None when the ``cli`` extra is not installed (imported lazily: only
    the command line needs rich)."""
    try:
        return {
            name: importlib.import_module(f"rich.{name}")
            for name in ("box", "console", "live", "progress_bar", "table", "text")
        }
    except ImportError:
        return None


def make_view(tracker: Tracker, *, as_json: bool) -> View:
    """JSON lines, the rich live view, or plain lines when rich is missing."""
    if as_json:
        return JsonView(sys.stdout)
    rich = _import_rich()
    if rich is None:
        hint = "(plain output: pip install 'asyncexec[cli]' for the live view)"
        return PlainView(tracker, sys.stdout, hint)
    return RichView(tracker, rich)


# Running ---------------------------------------------------------------------------------------
