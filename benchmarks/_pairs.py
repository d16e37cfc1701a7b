"""Rows of two columns measured side by side (a reference and asyncexec, or before and after),
their medians over interleaved repeats, the ratio and a target: the table of ``dispatch.py`` and
``before_after.py``.

Nothing here starts Ray.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from _common import median

__all__ = ["Pair", "render_pairs"]


@dataclass
class Pair:
    """One row: samples of the reference column (``base``) and of the measured one (``ours``).

    The ratio is ours over base. ``limit`` is the target on it: at most ``limit`` where lower is
    better, at least ``1 / limit`` of the base where higher is better (a rate); None for a row
    shown as a contrast.
    """

    label: str
    unit: str
    higher_is_better: bool = False
    limit: float | None = None
    base: list[float] = field(default_factory=list)
    ours: list[float] = field(default_factory=list)

    def ratio(self) -> float:
        a, b = median(self.ours), median(self.base)
        if math.isnan(a) or math.isnan(b) or b == 0:
            return math.nan
        return a / b

    def paired(self) -> list[float]:
        """The ratio of each repeat (ours over base, measured one right after the other): on a
        machine whose load drifts, their median moves less than the ratio of the medians."""
        return [o / b for o, b in zip(self.ours, self.base, strict=False) if b]

    def target(self) -> str:
        if self.limit is None:
            return "(contrast)"
        if self.higher_is_better:
            return f">= {1 / self.limit:.2f}x"
        return f"<= {self.limit:.2f}x"

    def met(self) -> bool | None:
        """Whether the ratio meets the target (None without one or without figures)."""
        ratio = self.ratio()
        if self.limit is None or math.isnan(ratio):
            return None
        if self.higher_is_better:
            return ratio >= 1 / self.limit
        return ratio <= self.limit


def _fmt(value: float) -> str:
    if math.isnan(value):
        return "-"
    if abs(value) >= 100:
        return f"{value:,.0f}"
    if abs(value) >= 10:
        return f"{value:.1f}"
    return f"{value:.3f}"


def _each(ratios: list[float]) -> str:
    """The median of the repeats' ratios, with their range."""
    if not ratios:
        return "-"
    return f"{median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"


def render_pairs(rows: Sequence[Pair], base: str, ours: str) -> str:
    """The rows as one markdown table: each column's median, the ratio (of the medians: the
    target is on it), the repeats' own ratios (their median, lowest and highest: see
    :meth:`Pair.paired`), the target and whether it is met, and the spread (each column's
    lowest and highest repeat)."""
    head = [
        "figure",
        "unit",
        base,
        ours,
        f"{ours} / {base}",
        "each repeat's",
        "target",
        "met",
        "spread (min-max)",
    ]
    table = [head]
    for row in rows:
        ratio = row.ratio()
        spread = "; ".join(
            f"{_fmt(min(v))}-{_fmt(max(v))}" if v else "-" for v in (row.base, row.ours)
        )
        table.append(
            [
                row.label,
                row.unit,
                _fmt(median(row.base)),
                _fmt(median(row.ours)),
                "-" if math.isnan(ratio) else f"{ratio:.2f}x",
                _each(row.paired()),
                row.target(),
                {True: "yes", False: "NO", None: "-"}[row.met()],
                spread,
            ]
        )
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    numeric = {2, 3, 4, 5}

    def line(cells: list[str]) -> str:
        out = [
            cell.rjust(w) if i in numeric else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "| " + " | ".join(out) + " |"

    rule = (
        "|"
        + "|".join(
            ("-" * (w + 1) + ":") if i in numeric else ("-" * (w + 2)) for i, w in enumerate(widths)
        )
        + "|"
    )
    return "\n".join([line(table[0]), rule, *(line(r) for r in table[1:])])
