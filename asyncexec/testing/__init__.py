"""Test your loops without Ray: simulated workers, a stand-in rollout server, and metrics for one
test.

As ``httpx.MockTransport`` stands in for the network and ``trio.testing`` for the clock, this
module stands in for the cluster. An ``Executor`` (or pool) handed a :class:`SimCluster`
(``Executor(4, cluster=SimCluster())``), or made inside :func:`simulated` (which makes one the
default of its block), puts its ranks on it: small objects on your own event loop, no process,
thread or Ray. What they run:

- ``execute()``, ``call()`` and your roles' methods run your code, on the driver's loop (an
  ``async def`` method as a task, so calls to one rank overlap as on an async actor); their
  answers cross a pickle round trip, as an actor's do; an argument that Ray could not send
  is refused, as on Ray (the others are handed over as they are, not copied).
- A run does not run its function: each rank reports as the cluster's :class:`SimLoad` says
  (how many reports, how fast, which ranks are slow), so the driver's side of a run (your loop
  over the steps, the restart policy, the straggler watch) is what the test exercises.
  :meth:`SimCluster.crash` kills a rank, as a SIGKILL would its actor.
- Weight channels are refused: a pipeline without a channel hands its states to the servers
  (``Pipeline.update_weights(state)``).

:class:`ScriptedServer` is a rollout server without a model, for a ``Router`` or a ``Pipeline``
under test; its prompts may be :class:`Script`\\ s that say how long a generation is, how slow,
and where it fails. It runs on simulated workers, in local mode and on Ray alike.

:func:`metrics_enabled` turns asyncexec's Prometheus metrics on for a block, in a registry of
its own, and off again after it.

To run a run's own function without Ray, use local mode instead (``Executor(local=True)``:
the ranks are threads of your process).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._servers import Script, ScriptedServer

# Public name -> the module that defines it. The simulated cluster is the driver's: loaded on
# first use, so that a Ray worker that unpickles a ScriptedServer stays light.
_LAZY: dict[str, str] = {
    "SimCluster": "asyncexec._driver.cluster._sim",
    "SimLoad": "asyncexec._driver.cluster._sim",
    "SimStatistics": "asyncexec._driver.cluster._sim",
    "metrics_enabled": "asyncexec.testing._metrics",
    "simulated": "asyncexec.testing._simulated",
}

__all__ = [
    "Script",
    "ScriptedServer",
    "SimCluster",
    "SimLoad",
    "SimStatistics",
    "metrics_enabled",
    "simulated",
]

Script.__module__ = ScriptedServer.__module__ = __name__  # tracebacks, pickles, the docs


def __getattr__(name: str) -> Any:
    home = _LAZY.get(name)
    if home is None:
        raise AttributeError(f"module 'asyncexec.testing' has no attribute {name!r}")
    obj = getattr(importlib.import_module(home), name)
    obj.__module__ = __name__  # tracebacks, pickles and the docs say asyncexec.testing
    globals()[name] = obj
    return obj


def __dir__() -> list[str]:
    return sorted(__all__)


if TYPE_CHECKING:
    from .._driver.cluster._sim import SimCluster as SimCluster
    from .._driver.cluster._sim import SimLoad as SimLoad
    from .._driver.cluster._sim import SimStatistics as SimStatistics
    from ._metrics import metrics_enabled as metrics_enabled
    from ._simulated import simulated as simulated
