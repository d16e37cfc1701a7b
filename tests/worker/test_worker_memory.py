"""A worker process keeps the memory it frees for the next push (``_worker._memory``): a state
unpickled again and again in a thread other than the main one takes no fresh pages from the
kernel each time, as it did with glibc's defaults (a threaded worker unpickles a pushed state in
Ray's threads)."""

from __future__ import annotations

import subprocess
import sys

import pytest

_CHILD = """
import pickle, resource, sys, threading
from asyncexec._worker import _memory

if sys.argv[1] == "tuned":
    assert _memory.keep_freed_memory()
blob = pickle.dumps({str(i): bytes(1 << 20) for i in range(6)})  # a 6 MB state
faults = []

def pushes():
    held = None
    for _ in range(12):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        held = pickle.loads(blob)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return held

thread = threading.Thread(target=pushes)
thread.start()
thread.join()
print(sorted(faults[4:])[len(faults[4:]) // 2])
"""


def _median_faults(mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, mode], capture_output=True, text=True, timeout=60, check=True
    )
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_state_unpickled_again_in_a_thread_takes_no_fresh_pages() -> None:
    """6 MB is 1,536 pages: with glibc's defaults each push faults about that many again; with
    the worker's thresholds, after the first pushes, almost none."""
    assert _median_faults("default") > 1000
    assert _median_faults("tuned") < 100
