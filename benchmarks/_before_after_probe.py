"""One measurement of ``before_after.py`` in a fresh process, with the asyncexec of the tree this
file sits in (``run.py`` beside it puts that tree first on the path, for the driver and for the
workers). It prints one JSON line last: every figure's samples by column, and the notes.

    python benchmarks/_before_after_probe.py reports|startup|restart|lifecycle [--quick]

Copied into a baseline worktree by ``before_after.py``; it uses only the parts of ``run.py``
that the baseline has too (``Bench``, ``start_ray``, the groups of ``_systems``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from dataclasses import replace
from typing import Any

# This tree's benchmarks and asyncexec first (before the installed one), whatever imports first;
# run.py sets the same for the workers.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

import run  # noqa: E402
import structlog  # noqa: E402
from _common import progress  # noqa: E402
from _systems import AsyncexecGroup, LoopGroup  # noqa: E402

WHAT = ("reports", "startup", "restart", "lifecycle")


async def reports(bench: Any) -> None:
    """reports/s of 1, 4 and 16 workers, asyncexec and the batched floor in the same process
    (the floor shows how fast the machine was meanwhile)."""
    sizes = bench.sizes
    # The sizes' worker counts (the quick ones leave 16 out).
    for n in [n for n in (1, 4, 16) if f"rate{n}" in bench.figures]:
        loops = LoopGroup(n, run.RESOURCES, run.BUFFER)
        ae = AsyncexecGroup(n, run.RESOURCES, bench.storage)
        try:
            await loops.start()
            await ae.start()
            await ae.stream(min(2000, sizes.steps[n]))  # unrecorded: the function's export
            for _ in range(sizes.repeats):
                progress(f"reports/s, {n} worker(s)")
                bench.add(f"rate{n}", "floor", (await loops.floor(sizes.steps[n]))["rate"])
                bench.add(f"rate{n}", "asyncexec", (await ae.stream(sizes.steps[n]))["rate"])
        finally:
            await ae.close()
            await loops.close()


async def restart(bench: Any) -> None:
    ae = AsyncexecGroup(4, run.RESOURCES, bench.storage)
    await ae.start()
    try:
        await bench.restart(None, ae)
    finally:
        await ae.close()


async def measure(bench: Any, what: str) -> None:
    if what == "reports":
        await reports(bench)
    elif what == "startup":
        await bench.startup()
    elif what == "restart":
        await restart(bench)
    else:
        await bench.lifecycle()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=WHAT)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--repeats", type=int, default=None, help="repeats within the process")
    args = parser.parse_args()
    sizes = run.QUICK if args.quick else run.FULL
    if args.repeats is not None:
        sizes = replace(
            sizes,
            repeats=args.repeats,
            startup_repeats=args.repeats,
            restart_repeats=args.repeats,
            lifecycle_repeats=args.repeats,
        )
    events = run.Events()
    structlog.configure(processors=[events])
    # The lifecycle measured alone warms up first: ``parts``, or ``lifecycle_only`` in a
    # baseline whose run.py predates ``--only``.
    alone = args.what == "lifecycle"
    if hasattr(run, "PARTS"):
        bench = run.Bench(sizes, events, parts={"lifecycle"} if alone else run.PARTS)
    else:
        bench = run.Bench(sizes, events, lifecycle_only=alone)
    run.start_ray()
    try:
        asyncio.run(measure(bench, args.what))
    finally:
        run.ray.shutdown()
    figures = {key: dict(f.values) for key, f in bench.figures.items() if f.values}
    print(
        json.dumps(
            {
                "asyncexec": run.asyncexec_path(),
                "figures": figures,
                "where": bench.where,
                "notes": bench.lifecycle_notes,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
