"""``benchmarks/pipeline.py --quick`` runs end to end, prints a row for every figure, and leaves
no Ray behind. It asserts what holds whatever the times (every request answered once through a
killed server, no sample beyond S in strict mode, sticky sessions kept), never a time: speed is
shown by the numbers the benchmark prints."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import ray

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def _stop_ray_of_this_process() -> None:
    """The benchmark starts a Ray of its own: the one this pytest process may hold must be down."""
    shutdown = getattr(sys.modules.get("conftest"), "_shutdown", None)
    if callable(shutdown):
        shutdown()  # also tells ray_local to start a fresh Ray for the next test
    if ray.is_initialized():
        ray.shutdown()


def _ray_processes_since(t0: float) -> list[str]:
    found = []
    for proc in psutil.process_iter(["create_time", "cmdline"]):
        try:
            cmd = " ".join(proc.info["cmdline"] or [])
            created = proc.info["create_time"] or 0.0
        except psutil.Error:
            continue
        if created >= t0 and ("raylet" in cmd or "gcs_server" in cmd):
            found.append(f"{proc.pid} {cmd[:80]}")
    return found


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_quick_pipeline_benchmark_prints_every_figure_and_cleans_up() -> None:
    _stop_ray_of_this_process()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    t0 = time.time() - 1.0  # process start times are rounded
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "pipeline.py"), "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=140,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    deadline = time.monotonic() + 15
    while (left := _ray_processes_since(t0)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, left
    rows = {}
    for line in proc.stdout.splitlines():
        cells = [c.strip() for c in line.split("|")[1:-1]]
        if len(cells) == 6 and cells[0] not in ("figure", "") and not cells[0].startswith("-"):
            rows[cells[0]] = cells
    labels = list(rows)
    for figure in (
        "samples trained/s",
        "samples beyond S",
        'pause to resume, "keep"',
        'pause to resume, "abort"',
        'update_weights() with 256 in flight, "keep"',
        'update_weights() with 256 in flight, "abort"',
        "1 of 4 servers SIGKILLed: requests answered",
        "1 of 4 servers SIGKILLed: replacement",
        "balance",
        "sticky sessions",
        "objects the collector tracks per request in flight",
        "anyio task-group tasks per request in flight",
        "exceptions kept alive per request in flight",
        "event-loop max lag",
    ):
        assert any(label.startswith(figure) for label in labels), (figure, proc.stdout)
    for label, cells in rows.items():
        assert cells[2] not in ("", "-"), (label, proc.stdout)  # the pipeline's figure
        if label.startswith(("samples beyond S", "1 of 4 servers SIGKILLed", "sticky")):
            assert cells[5] == "yes", (label, proc.stdout)
