"""Worker classes: state on each rank's instance, methods called from the driver with dispatch.

    python examples/worker_classes.py

A ``Shard`` holds rows on each rank. The driver scatters 10 rows over 4 ranks (3, 3, 2, 2:
each rank receives its own part only), asks every rank for a sum and merges the results,
streams each rank's answer as it is ready, sends single requests to the least-loaded rank, and
runs a method as a run's function while the instances keep what they hold.
"""

from __future__ import annotations

import argparse
import asyncio

import asyncexec


# --8<-- [start:main]
class Shard:
    """One instance per rank, made on the worker; its state stays between calls."""

    def __init__(self, scale: float) -> None:
        self.rank = asyncexec.get_context().world_rank
        self.scale = scale
        self.rows: list[float] = []

    def load(self, rows: list[float]) -> int:
        self.rows.extend(rows)
        return len(rows)

    def total(self) -> list[float]:
        return [sum(self.rows) * self.scale]

    async def lookup(self, i: int) -> tuple[int, float]:
        await asyncio.sleep(0.01 * (self.rank + 1))  # an async method runs on the worker's loop
        return self.rank, self.rows[i % len(self.rows)]

    def sweep(self, config: dict[str, int]) -> float:
        """A run's function that is a method: it reports steps, on the same instance."""
        for step in range(config["steps"]):
            asyncexec.report({"step": step, "sum": sum(self.rows)})
        return sum(self.rows)


async def main() -> dict[str, object]:
    role = asyncexec.Role(Shard, scale=2.0)  # the constructor's arguments are sent once
    async with asyncexec.Executor(4, resources_per_worker={"CPU": 0.25}, roles=role) as ex:
        sizes = await ex.call(Shard.load, asyncexec.scatter([float(i) for i in range(10)]))
        print("rows per rank:", sizes)  # [3, 3, 2, 2]
        totals = await ex.call(Shard.total, merge=asyncexec.concat)
        print("totals, merged:", totals)
        order = [rank async for rank, _ in ex.stream(Shard.lookup, 0)]
        print("answers in the order they were ready:", order)
        one = asyncexec.least_loaded(max_in_flight=2)
        answers = await asyncio.gather(*(ex.call(Shard.lookup, i, on=one) for i in range(8)))
        print("least-loaded ranks:", sorted(rank for rank, _ in answers))
        steps = [step.metrics["step"] async for step in ex.run(Shard.sweep, {"steps": 3})]
        print("steps of the run:", steps, "returned:", ex.result.return_values)
        return {"sizes": sizes, "totals": totals, "order": order, "answers": answers}


# --8<-- [end:main]


if __name__ == "__main__":
    raw = argparse.RawDescriptionHelpFormatter  # --help prints the docstring above as it is
    argparse.ArgumentParser(description=__doc__, formatter_class=raw).parse_args()
    asyncio.run(main())
