"""The pickler of what is sent to the workers: Ray's cloudpickle, which Ray itself pickles a
call's arguments and an actor's class with, so that a value checked here (a role, an init hook, a
call's argument that Ray refused) pickles here exactly as it will when Ray sends it.

Outside the cluster seam and the worker side, the one module that names Ray
(``tests/project/test_structure.py`` allows it by name): asyncexec depends on no cloudpickle of its
own, and Ray's is the one that must agree. Ray is imported when a value is pickled, never when this
module is.
"""

from __future__ import annotations

from typing import Any

__all__ = ["dumps"]


def dumps(value: Any) -> bytes:
    """``value`` pickled as Ray pickles what it sends (by value where Ray would: a function or
    class of ``__main__``, a lambda)."""
    from ray import cloudpickle

    return bytes(cloudpickle.dumps(value))
