"""What can be checked of ``merge=concat`` before a call is sent (``asyncexec._dispatch._plan``): a
function annotated to return a scalar (``None`` too), a union of them (``float | None``) or a
mapping of scalars (metrics) returns what ``concat()`` cannot merge. Pure."""

from __future__ import annotations

import functools
import inspect
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

from .._errors import ConfigurationError
from ._role import qualname

__all__ = ["check_concat"]

#: Results that concat() never merges, by the type a function's return is annotated with.
_SCALARS = (int, float, complex, bool, str, bytes, type(None))


def check_concat(fn: Callable[..., Any]) -> None:
    """What can be checked of ``merge=concat`` before the call is sent: a function annotated to
    return a scalar (``None`` too), a union of them or a mapping of scalars (metrics) returns
    what concat() cannot merge."""
    try:
        refused = _concat_refuses(fn)
    except TypeError:  # an unhashable callable: nothing to remember it by
        refused = _concat_refuses.__wrapped__(fn)
    if refused is not None:
        raise ConfigurationError(
            f"merge=concat cannot merge the results of {qualname(fn)} (annotated {refused}): it "
            "merges lists, tuples, numpy arrays, torch tensors and mappings of them; leave "
            "merge= out for each rank's result, or pass a merge of your own"
        )


@functools.lru_cache(maxsize=1024)
def _concat_refuses(fn: Callable[..., Any]) -> str | None:
    """``fn``'s return annotation, written out, when concat() cannot merge what it names."""
    try:
        hint = inspect.signature(fn, eval_str=True).return_annotation
    except Exception:  # no signature, or an annotation that does not resolve: not checked
        return None
    return inspect.formatannotation(hint) if _scalar_results(hint) else None


def _scalar_results(hint: Any) -> bool:
    if hint is None or hint in _SCALARS:  # ``-> None`` is annotated with None, not NoneType
        return True
    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if origin in (dict, Mapping) and len(args) == 2:
        return _scalar_results(args[1])
    if origin in (typing.Union, types.UnionType):  # ``float | None``: each member a scalar
        return all(_scalar_results(arg) for arg in args)
    return False
