"""The pickler of what is sent to the workers: Ray's cloudpickle, which Ray itself pickles a
call's arguments and an actor's class with, so that a value checked here (a role, an init hook, a
call's argument that Ray refused) pickles here exactly as it will when Ray sends it.

Outside the cluster seam and the worker side, the one module that names Ray
(``tests/project/test_structure.py`` allows it by name): asyncexec depends on no cloudpickle of its
own, and Ray's is the one that must agree. Ray is imported when a value is pickled, never when this
module is.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

__all__ = ["dumps", "loads_here"]


def dumps(value: Any) -> bytes:
    """``value`` pickled as Ray pickles what it sends (by value where Ray would: a function or
    class of ``__main__``, a lambda)."""
    from ray import cloudpickle

    return bytes(cloudpickle.dumps(value))


def loads_here(data: bytes) -> Any:
    """``data``, pickled by :func:`dumps` in this very process, unpickled here as a worker
    unpickles it, but for the classes it holds by value (of ``__main__``, or defined in a
    function): those are this process's own classes, left as they are.

    cloudpickle hands such a class back (it knows it by its id) and then sets the class's
    attributes again from the pickle: its functions become copies, so that a method taken from
    the class before (``fn = Server.step``) is no longer the class's. A worker process unpickles
    a copy of its own and leaves the driver's class alone; so does this."""
    from ray.cloudpickle import cloudpickle

    return _Here(io.BytesIO(data), cloudpickle).load()


class _Here(pickle.Unpickler):
    """An unpickler that finds the dynamic classes this process knows and leaves them be."""

    def __init__(self, file: io.BytesIO, cloudpickle: Any) -> None:
        super().__init__(file)
        self._cloudpickle = cloudpickle
        # The makers of a class sent by value (both take ..., class_tracker_id, extra), and
        # what sets its attributes once it is made.
        makers = ("_make_skeleton_class", "_make_skeleton_enum")
        self._makers = [m for m in (getattr(cloudpickle, n, None) for n in makers) if m]
        self._setstate: Any = getattr(cloudpickle, "_class_setstate", None)
        #: The classes found, not made: their attributes are theirs already.
        self._known: list[type] = []

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name)
        if any(found is m for m in self._makers):
            return lambda *args: self._made(found, args)
        if self._setstate is not None and found is self._setstate:
            return self._set
        return found

    def _set(self, cls: Any, state: Any) -> Any:
        if any(cls is k for k in self._known):
            return cls
        return self._setstate(cls, state)

    def _made(self, make: Any, args: tuple[Any, ...]) -> Any:
        known = self._cloudpickle._DYNAMIC_CLASS_TRACKER_BY_ID.get(args[-2])
        cls = make(*args)
        if known is not None and cls is known:
            self._known.append(cls)
        return cls
