"""The RL pipeline: staleness-bounded rollouts from rollout servers (``RolloutServer`` roles)
to a learner, weight updates while generating, a router for the servers.

Above the executor, its dispatch and the weight channel (``tests/project/test_structure.py``). This
file is a plain list of re-exports.
"""

from __future__ import annotations

from ._pipeline import Pipeline
from ._router import Router, RouterStatistics
from ._stats import PauseFigures, PipelineBatch, PipelineStatistics

__all__ = [
    "PauseFigures",
    "Pipeline",
    "PipelineBatch",
    "PipelineStatistics",
    "Router",
    "RouterStatistics",
]
