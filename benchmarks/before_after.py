"""Rows of ``run.py`` for two trees of asyncexec (before and after a change), in one run.

    python benchmarks/before_after.py --before /tmp/before            # this tree is "after"
    python benchmarks/before_after.py --before /tmp/before --rounds 4 --what reports,restart
    python benchmarks/before_after.py --before /tmp/before --lock /tmp/asyncexec-ray.lock
    python benchmarks/before_after.py --before /tmp/a1ad2d1 --what observe   # "off costs nothing"

``--before`` is a tree of the earlier commit: a git worktree (``git worktree add /tmp/before
e9dad94``) or an export with a ``COMMIT`` file naming it (``git archive e9dad94 | tar -x -C
/tmp/before-e9dad94``).
Each measurement runs in a fresh process with that tree's asyncexec (driver and workers):
``_before_after_probe.py`` is copied into the tree's ``benchmarks/`` and run from there (for
``observe``, this tree's ``observe.py`` measures nothing observed, with the tree's asyncexec
first on the path: the cost of the timeline and the traces when both are off). The
rounds interleave the two trees, the order alternating each round, so that the machine's noise
falls on both alike; the table shows each figure's median over every sample of every round and
after / before. The batched floor, measured in the same processes (reports/s) and beside the
same rounds (start-up, lifecycle), shows how fast the machine was meanwhile.

With ``--lock``, each process runs under that lock (``flock``), released between processes, so
that other Ray jobs of the machine can run in between rather than at the same time.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import _harness
from _common import progress
from _harness import HERE, Pair, Result

PROBE = "_before_after_probe.py"
WHAT = ("reports", "startup", "restart", "lifecycle", "observe")
#: What runs without ``--what``: ``run.py``'s rows.
RUN_PY = WHAT[:4]

#: The rows: (measurement, figure key, column, label, unit, limit on the ratio). A limit of 1.1
#: reads "no worse than before beyond 10 %", the noise of this machine; higher is better for rates
#: and ratios (units "reports/s" and "x").
ROWS: tuple[tuple[str, str, str, str, str, float | None], ...] = (
    ("reports", "rate1", "asyncexec", "reports/s, 1 worker", "reports/s", 1.1),
    ("reports", "rate4", "asyncexec", "reports/s, 4 workers", "reports/s", 1.1),
    ("reports", "rate16", "asyncexec", "reports/s, 16 workers", "reports/s", 1.1),
    ("reports", "rate4", "floor", "(the batched floor beside it, 4 workers)", "reports/s", None),
    ("reports", "floor_ratio1", "asyncexec", "asyncexec / floor, 1 worker", "x", None),
    ("reports", "floor_ratio4", "asyncexec", "asyncexec / floor, 4 workers", "x", None),
    ("reports", "floor_ratio16", "asyncexec", "asyncexec / floor, 16 workers", "x", None),
    ("startup", "startup", "asyncexec", "start-up, 4 workers", "s", 1.1),
    ("startup", "startup", "floor", "(4 plain actors ready beside it)", "s", None),
    ("startup", "freeze_start", "asyncexec", "event-loop freeze during start-up", "ms", None),
    ("restart", "restart", "asyncexec", "SIGKILL of 1 of 4 to the next first step", "s", 1.1),
    ("restart", "restart_reuse", "asyncexec", "the same, reuse_survivors=True", "s", 1.1),
    ("restart", "restart_spare", "asyncexec", "the same, a standby spare", "s", 1.1),
    ("restart", "restart_default", "asyncexec", "the same, default RestartPolicy()", "s", 1.1),
    ("lifecycle", "life_p99", "asyncexec", "lifecycle lag p99, 4 executors x 2", "ms", 1.1),
    ("lifecycle", "life_max", "asyncexec", "lifecycle lag max", "ms", None),
    ("lifecycle", "life_alone_p99", "asyncexec", "lag p99 while streaming alone", "ms", 1.1),
    ("lifecycle", "life_alone_max", "asyncexec", "lag max while streaming alone", "ms", None),
    ("lifecycle", "life_p99", "floor", "(the floor's streaming p99 beside it)", "ms", None),
    ("observe", "observe_rate", "asyncexec", "observe.py: reports/s, all off", "reports/s", 1.1),
    ("observe", "observe_p50", "asyncexec", "observe.py: call p50, all off", "ms", 1.1),
    ("observe", "observe_p90", "asyncexec", "observe.py: call p90, all off", "ms", None),
)


@dataclass(frozen=True)
class Sizes:
    rounds: int  # of a fresh process per tree and measurement
    repeats: int | None  # within each process (None: the probe's own)
    quick: bool  # the probes' tiny sizes


FULL, QUICK = Sizes(3, None, False), Sizes(1, None, True)


def probe(tree: str, what: str, repeats: int | None, quick: bool, lock: str | None) -> Any:
    """Run one measurement with ``tree``'s asyncexec; its JSON result."""
    if what == "observe":
        script, args, within = os.path.join(HERE, "observe.py"), ["--child", "measure"], "--rounds"
    else:
        script, args, within = os.path.join(tree, "benchmarks", PROBE), [what], "--repeats"
        if os.path.abspath(tree) != os.path.dirname(HERE):
            shutil.copyfile(os.path.join(HERE, PROBE), script)
    args += [within, str(repeats)] if repeats is not None else []
    args += ["--quick"] if quick else []
    # The probe puts its own tree first on the path; observe.py is given the tree's.
    where = tree if what == "observe" else None
    result = _harness.child(script, *args, tree=where, lock=lock)
    if what == "observe":
        result = _observed(result)
    want = os.path.join(os.path.abspath(tree), "asyncexec")
    if result["asyncexec"] != want:
        raise RuntimeError(f"{tree}'s probe imported asyncexec from {result['asyncexec']}")
    return result


async def run(sizes: Sizes, args: argparse.Namespace) -> Result:
    chosen = [w for w in args.what.split(",") if w]
    if not set(chosen) <= set(WHAT):
        raise SystemExit(f"--what takes {', '.join(WHAT)}")
    trees = {"before": args.before, "after": args.after}
    samples: dict[str, dict[str, dict[str, list[float]]]] = {"before": {}, "after": {}}
    for r in range(sizes.rounds):
        for what in chosen:
            order = ["before", "after"] if (r + WHAT.index(what)) % 2 == 0 else ["after", "before"]
            for side in order:
                progress(f"round {r + 1}/{sizes.rounds}: {what}, {side}")
                result = probe(trees[side], what, sizes.repeats, sizes.quick, args.lock)
                for key, columns in result["figures"].items():
                    for column, values in columns.items():
                        samples[side].setdefault(key, {}).setdefault(column, []).extend(values)
                if args.save is not None:
                    _save(os.path.join(args.save, f"{what}-{side}-{r + 1}.json"), result)
    for side in samples.values():
        floor_ratios(side)
    rows = []
    for what, key, column, label, unit, limit in ROWS:
        if what in chosen:
            row = Pair(label, unit, higher_is_better=unit in ("reports/s", "x"), limit=limit)
            row.base.extend(samples["before"].get(key, {}).get(column, []))
            row.ours.extend(samples["after"].get(key, {}).get(column, []))
            rows.append(row)
    notes = [f"- each process's figures, notes and where the time went: {args.save}"]
    return Result(rows, _harness.pairs("before", "after"), notes if args.save else [])


def _observed(result: Any) -> Any:
    """``observe.py``'s samples as figures: reports/s a round, each process's call p50 and p90
    (ms)."""
    off = result["out"]["off"]
    calls = sorted(off["calls_s"])
    figures = {
        "observe_rate": off["reports_per_s"],
        "observe_p50": [calls[len(calls) // 2] * 1e3],
        "observe_p90": [calls[int(len(calls) * 0.9)] * 1e3],
    }
    return {**result, "figures": {key: {"asyncexec": v} for key, v in figures.items()}}


def _save(path: str, result: Any) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f)


def _options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--before", required=True, help="the earlier tree (a git worktree)")
    parser.add_argument("--after", default=os.path.dirname(HERE), help="default: this tree")
    parser.add_argument("--rounds", type=int, help="rounds (3; --quick: 1)")
    parser.add_argument("--what", default=",".join(RUN_PY), help=f"of {', '.join(WHAT)}")
    parser.add_argument("--lock", default=None, help="run each process under flock LOCK")
    parser.add_argument("--save", default=None, help="write each process's JSON result here")


def main(argv: list[str] | None = None) -> int:
    return _harness.main(
        argv,
        doc=__doc__,
        title="asyncexec before and after",
        full=FULL,
        quick=QUICK,
        run=run,
        options=_options,
        about=lambda sizes, args: (
            f"before {_commit(args.before)}, after {_commit(args.after)}; {sizes.rounds} "
            "interleaved round(s) of a fresh process per tree and measurement; medians of every "
            "sample"
        ),
    )


def floor_ratios(figures: dict[str, dict[str, list[float]]]) -> None:
    """Add ``floor_ratio{n}``: each asyncexec rate over the floor's measured just before it in
    the same process (the probe alternates them), so that a row reads how close to the floor
    each tree came on the same machine at the same moment."""
    for n in (1, 4, 16):
        rates = figures.get(f"rate{n}", {})
        pairs = zip(rates.get("asyncexec", []), rates.get("floor", []), strict=False)
        ratios = [ours / floor for ours, floor in pairs if floor > 0]
        if ratios:
            figures[f"floor_ratio{n}"] = {"asyncexec": ratios}


def _commit(tree: str) -> str:
    """The tree's commit (a git tree's HEAD, or a ``COMMIT`` file beside an exported one)."""
    marker = os.path.join(tree, "COMMIT")
    if os.path.exists(marker):
        with open(marker) as f:
            return f.read().strip()
    head = subprocess.run(
        ["git", "-C", tree, "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    dirty = subprocess.run(
        ["git", "-C", tree, "status", "--porcelain", "--", "asyncexec"],
        capture_output=True,
        text=True,
        check=False,
    )
    name = head.stdout.strip() or tree
    return name + (" + uncommitted changes to asyncexec/" if dirty.stdout.strip() else "")


if __name__ == "__main__":
    sys.exit(main())
