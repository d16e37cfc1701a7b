"""A run: the iterator its caller holds, the task that drives it (aligned attempts or independent
ranks under the restart policy, over one credit window and the group's health watch), its steps,
its spec, and the record a named run resumes from."""

from __future__ import annotations

from ._engine import RunDriver
from ._iterator import Run, RunCore, RunEnd, RunState, new_run_id
from ._resume import RECORD_FILE, Resume, fingerprint, legacy_fingerprint
from ._spec import RunSpec, named_spec, prepare, run_spec
from ._steps import Report, RunResult, Step, StepBatch
from ._window import HandOver

__all__ = [
    "RECORD_FILE",
    "HandOver",
    "Report",
    "Resume",
    "Run",
    "RunCore",
    "RunDriver",
    "RunEnd",
    "RunResult",
    "RunSpec",
    "RunState",
    "Step",
    "StepBatch",
    "fingerprint",
    "legacy_fingerprint",
    "named_spec",
    "prepare",
    "new_run_id",
    "run_spec",
]
