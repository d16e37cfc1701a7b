"""One weight push's cost: ``WeightChannel.push()`` (object store) against the same move by hand,
from one learner rank to two rollout servers, for a small state and a real model's.

    python benchmarks/push_cost.py            # about two minutes on 2 cores
    python benchmarks/push_cost.py --quick    # 10 pushes of each, the small state only
    python benchmarks/push_cost.py --repeats 100   # pushes of each way
    python benchmarks/push_cost.py --profile  # the driver's cProfile of the channel's pushes

- *by hand* (the floor): plain Ray actors, one of them holding the state and two receiving it:
  ``ref = source.read.remote()`` (the state stays in the object store, read by reference),
  then one ``install.remote(ref)`` call per receiver, awaited together (Ray resolves the
  reference before the call runs);
- *asyncexec*: ``await channel.push()`` on a ``WeightChannel(learner, servers)`` whose learner
  role serves the state (``asyncexec.serve_weights``) and whose servers install it
  (``asyncexec.receive_weights``), with ``max_staleness=1``: it returns once both hold it.

Each state: a dict of 3 KB (``{"w": 750 float32 as a list}``, a toy policy's) and two real
models' ``state_dict()`` (a 2-layer ``torch.nn.TransformerEncoder`` of float32 tensors:
d_model 256, about 6 MB, and d_model 512, about 25 MB). The two ways alternate push by push
after a warm-up; the table shows the medians and the ratio (target: at most 1.2x by hand).
Workers of 0.5 CPU each, in one local Ray of 4 CPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import pstats
import sys
import time
from dataclasses import dataclass
from typing import Any

import _harness
import ray
from _harness import Pair, Result

import asyncexec

CPU = {"CPU": 0.5}


#: The models' states, by kind: (d_model, dim_feedforward) of a 2-layer encoder.
MODELS = {"model, 6 MB": (256, 1024), "model, 25 MB": (512, 2048)}


def make_state(kind: str) -> Any:
    """The state of ``kind``: ``"3 KB"`` (a list of floats) or one of :data:`MODELS` (a torch
    state)."""
    if kind == "3 KB":
        return {"w": [float(i) for i in range(750)]}
    import torch

    torch.manual_seed(0)
    width, feedforward = MODELS[kind]
    layer = torch.nn.TransformerEncoderLayer(
        width, 4, dim_feedforward=feedforward, batch_first=True
    )
    model = torch.nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


class Source:
    """The learner's role: serves the state it was made with."""

    def __init__(self, kind: str) -> None:
        self.state = make_state(kind)
        asyncexec.serve_weights(lambda: self.state)


class Sink:
    """A rollout server's role: installs what arrives."""

    def __init__(self) -> None:
        self.held: Any = None
        asyncexec.receive_weights(self.install)

    def install(self, state: Any, version: int) -> None:
        self.held = state


@ray.remote(num_cpus=0.5)
class HandSource:
    def __init__(self, kind: str) -> None:
        self.state = make_state(kind)

    def read(self) -> Any:
        return self.state


@ray.remote(num_cpus=0.5)
class HandSink:
    def __init__(self) -> None:
        self.held: Any = None

    def install(self, state: Any) -> None:
        self.held = state


async def by_hand(source: Any, sinks: list[Any]) -> float:
    started = time.perf_counter()
    ref = source.read.remote()
    await asyncio.gather(*(sink.install.remote(ref) for sink in sinks))
    return time.perf_counter() - started


async def by_channel(channel: asyncexec.WeightChannel) -> float:
    started = time.perf_counter()
    await channel.push()
    return time.perf_counter() - started


@dataclass(frozen=True)
class Sizes:
    repeats: int  # pushes of each way, interleaved
    kinds: tuple[str, ...]


FULL = Sizes(200, ("3 KB", *MODELS))
QUICK = Sizes(10, ("3 KB",))


async def measure(kind: str, sizes: Sizes, profiler: cProfile.Profile | None) -> Pair:
    row = Pair(f"one push, {kind}: 1 learner rank -> 2 servers", "ms", limit=1.2)
    hand_source = HandSource.remote(kind)
    hand_sinks = [HandSink.remote() for _ in range(2)]
    async with (
        asyncexec.Executor(
            1, resources_per_worker=CPU, roles=asyncexec.Role(Source, kind), name="learner"
        ) as learner,
        asyncexec.Executor(2, resources_per_worker=CPU, roles=Sink, name="servers") as servers,
        asyncexec.WeightChannel(learner, servers) as channel,
    ):

        async def ours() -> float:
            if profiler is not None:
                profiler.enable()
            try:
                return await by_channel(channel) * 1e3
            finally:
                if profiler is not None:
                    profiler.disable()

        async def base() -> float:
            return await by_hand(hand_source, hand_sinks) * 1e3

        # The warm-up: the actors' methods, the first transfers.
        await _harness.repeat([row], {"base": base, "ours": ours}, sizes.repeats, warm=3)
    for actor in [hand_source, *hand_sinks]:
        ray.kill(actor)
    return row


async def bench(sizes: Sizes, args: argparse.Namespace) -> Result:
    profiler = cProfile.Profile() if args.profile else None
    rows = [await measure(kind, sizes, profiler) for kind in sizes.kinds]
    notes = []
    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(30)
        notes.append(out.getvalue())
    return Result(rows, _harness.pairs("by hand", "WeightChannel.push()"), notes)


def main(argv: list[str] | None = None) -> int:
    return _harness.main(
        argv,
        doc=__doc__,
        title="one weight push's cost",
        full=FULL,
        quick=QUICK,
        run=bench,
        ray={"num_cpus": 4, "fresh_workers": False},
        options=lambda parser: parser.add_argument(
            "--profile", action="store_true", help="cProfile the channel's pushes"
        ),
        about=lambda sizes, args: f"medians of {sizes.repeats} interleaved pushes; workers {CPU}",
    )


if __name__ == "__main__":
    sys.exit(main())
