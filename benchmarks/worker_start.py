"""One worker's start-up time and memory: the async worker actor against the threaded one (the
workers of a group whose roles have only plain methods) at several sizes of its default group.

    python benchmarks/worker_start.py            # about a minute on 2 cores
    python benchmarks/worker_start.py --quick    # 2 workers of each kind

Each worker is created alone (the kinds interleaved, every process fresh: no pre-started
workers), timed from ``.remote()`` until its ``ping`` is answered; then its process's resident
memory and threads are read. Medians over the workers of each kind.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import psutil  # noqa: E402
import ray  # noqa: E402
from _common import median  # noqa: E402

from asyncexec._worker import CONTROL_THREADS, ThreadedWorkerActor, WorkerActor  # noqa: E402

KINDS = {
    "async worker actor": (WorkerActor, None),
    "threaded, 8 control threads": (ThreadedWorkerActor, 8),
    f"threaded, {CONTROL_THREADS} control threads (asyncexec's)": (ThreadedWorkerActor, None),
    "threaded, 256 control threads": (ThreadedWorkerActor, 256),
}


def start_one(cls: object, threads: int | None) -> tuple[float, float, int]:
    """Seconds to a first answer, resident MiB and threads of one fresh worker."""
    options: dict[str, object] = {"num_cpus": 0.25}
    if threads is not None:
        options["max_concurrency"] = threads
    t0 = time.perf_counter()
    actor = cls.options(**options).remote()  # type: ignore[attr-defined]
    pid = ray.get(actor.ping.remote())
    seconds = time.perf_counter() - t0
    process = psutil.Process(pid)
    rss, threads_seen = process.memory_info().rss / 2**20, process.num_threads()
    ray.kill(actor, no_restart=True)
    return seconds, rss, threads_seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 workers of each kind")
    each = 2 if parser.parse_args().quick else 8
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        _system_config={"prestart_worker_first_driver": False, "enable_worker_prestart": False},
    )
    seen: dict[str, list[tuple[float, float, int]]] = {kind: [] for kind in KINDS}
    try:
        for cls, threads in KINDS.values():  # the first of each class exports it
            start_one(cls, threads)
        for _ in range(each):
            for kind, (cls, threads) in KINDS.items():
                seen[kind].append(start_one(cls, threads))
    finally:
        ray.shutdown()
    print(f"one worker's start-up, Ray {ray.__version__}, medians of {each} fresh workers each")
    print("| worker | start-up to first answer, ms | resident memory, MiB | threads |")
    print("|---|--:|--:|--:|")
    for kind, rows in seen.items():
        ms = median([r[0] for r in rows]) * 1e3
        rss = median([r[1] for r in rows])
        threads_seen = median([float(r[2]) for r in rows])
        print(f"| {kind} | {ms:,.0f} | {rss:,.1f} | {threads_seen:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
