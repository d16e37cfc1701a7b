"""One weight push's cost: ``WeightChannel.push()`` (object store) against the same move by hand,
from one learner rank to two rollout servers, for a small state and a real model's.

    python benchmarks/push_cost.py            # about a minute on 2 cores
    python benchmarks/push_cost.py --quick    # 10 pushes of each, the small state only
    python benchmarks/push_cost.py --profile  # the driver's cProfile of the channel's pushes

- *by hand* (the floor): plain Ray actors, one of them holding the state and two receiving it:
  ``ref = source.read.remote()`` (the state stays in the object store, read by reference),
  then one ``install.remote(ref)`` call per receiver, awaited together (Ray resolves the
  reference before the call runs);
- *asyncexec*: ``await channel.push()`` on a ``WeightChannel(learner, servers)`` whose learner
  role serves the state (``asyncexec.serve_weights``) and whose servers install it
  (``asyncexec.receive_weights``), with ``max_staleness=1``: it returns once both hold it.

Each state: a dict of 3 KB (``{"w": 750 float32 as a list}``, a toy policy's) and a real
model's ``state_dict()`` (a 2-layer ``torch.nn.TransformerEncoder``, d_model 256, about 6 MB
of float32 tensors). The two ways alternate push by push after a warm-up; the table shows the
medians and the ratio. Workers of 0.5 CPU each, in one local Ray of 4 CPUs.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import os
import pstats
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (ROOT, HERE, os.environ.get("PYTHONPATH")) if p
)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import ray  # noqa: E402
from _common import median  # noqa: E402

import asyncexec  # noqa: E402

CPU = {"CPU": 0.5}


def make_state(kind: str) -> Any:
    """The state of ``kind``: ``"3 KB"`` (a list of floats) or ``"model"`` (a torch state)."""
    if kind == "3 KB":
        return {"w": [float(i) for i in range(750)]}
    import torch

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(256, 4, dim_feedforward=1024, batch_first=True)
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


async def measure(kind: str, pushes: int, profile: bool) -> tuple[list[float], list[float]]:
    hand_source = HandSource.remote(kind)
    hand_sinks = [HandSink.remote() for _ in range(2)]
    hand, channel_s = [], []
    async with (
        asyncexec.Executor(
            1, resources_per_worker=CPU, roles=asyncexec.Role(Source, kind), name="learner"
        ) as learner,
        asyncexec.Executor(2, resources_per_worker=CPU, roles=Sink, name="servers") as servers,
        asyncexec.WeightChannel(learner, servers) as channel,
    ):
        for _ in range(3):  # warm-up: the actors' methods, the first transfers
            await by_hand(hand_source, hand_sinks)
            await by_channel(channel)
        profiler = cProfile.Profile() if profile else None
        for _ in range(pushes):
            hand.append(await by_hand(hand_source, hand_sinks))
            if profiler is not None:
                profiler.enable()
            channel_s.append(await by_channel(channel))
            if profiler is not None:
                profiler.disable()
    for actor in [hand_source, *hand_sinks]:
        ray.kill(actor)
    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(30)
        print(out.getvalue())
    return hand, channel_s


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 pushes, the small state only")
    parser.add_argument("--profile", action="store_true", help="cProfile the channel's pushes")
    parser.add_argument("--pushes", type=int, default=40)
    args = parser.parse_args()
    pushes = 10 if args.quick else args.pushes
    kinds = ["3 KB"] if args.quick else ["3 KB", "model"]
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    rows = []
    try:
        for kind in kinds:
            hand, channel_s = await measure(kind, pushes, args.profile)
            rows.append((kind, median(hand) * 1e3, median(channel_s) * 1e3))
    finally:
        ray.shutdown()
    print(f"one push, 1 learner rank -> 2 servers, medians of {pushes} (Ray {ray.__version__})")
    print("| state | by hand (ms) | WeightChannel.push() (ms) | asyncexec / by hand |")
    print("|---|---:|---:|---:|")
    for kind, hand_ms, channel_ms in rows:
        print(f"| {kind} | {hand_ms:.2f} | {channel_ms:.2f} | {channel_ms / hand_ms:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
