"""Splitting a call's argument over ranks, and merging their results. Pure: numpy and torch
are never imported here (a value is one of theirs only when its module is already loaded).

What splits (:func:`split`): lists and tuples by items; numpy arrays and torch tensors along axis
0; mappings of these, value by value in lockstep (a value that cannot split, such as a batch's
metadata, goes whole to every part); any object with ``__asyncexec_split__(n)``
(:class:`Splittable`). Parts are contiguous, and uneven where they must be
(:func:`split_sizes`: 10 over 4 is 3, 3, 2, 2). :func:`concat` is the way back.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar, cast, runtime_checkable

from .._errors import ConfigurationError

__all__ = [
    "Scatter",
    "Splittable",
    "compact",
    "concat",
    "estimated_nbytes",
    "scatter",
    "short_repr",
    "split",
    "split_length",
    "split_sizes",
]

T = TypeVar("T")

#: What scatter() splits, for the messages that refuse anything else.
_SPLITS = (
    "lists, tuples, numpy arrays and torch tensors (along axis 0), mappings of them, and objects "
    "with __asyncexec_split__(n)"
)


@runtime_checkable
class Splittable(Protocol):
    """An object that splits itself for :func:`scatter`: ``__asyncexec_split__(n)`` returns
    exactly ``n`` parts, the one for each rank (or mesh coordinate) in order.

    Give a batch class of your own (verl's ``DataProto``, a dataclass of tensors) this method and
    ``scatter(batch)`` sends each rank its part; ``len()``, when the object has one, is checked
    against the other scattered arguments (they split in lockstep)::

        @dataclasses.dataclass
        class Batch:
            obs: torch.Tensor
            meta: dict[str, Any]  # the same for every part

            def __len__(self) -> int:
                return len(self.obs)

            def __asyncexec_split__(self, n: int) -> list[Batch]:
                return [Batch(o, self.meta) for o in self.obs.tensor_split(n)]

    The parts may be views of the batch's tensors: as they are sent, each is copied to storage
    of its own (off the driver's event loop when large), so a rank receives its part's bytes
    only, not the whole batch's. Returning another number of parts than ``n`` is refused
    before anything is sent.
    """

    def __asyncexec_split__(self, n: int) -> Sequence[Any]: ...


@dataclass(frozen=True, slots=True)
class Scatter:
    """An argument marked to be split over the ranks (see :func:`scatter`)."""

    value: Any
    axis: str | None = None

    def __repr__(self) -> str:
        axis = "" if self.axis is None else f", axis={self.axis!r}"
        return f"scatter({short_repr(self.value)}{axis})"


def scatter(value: T, *, axis: str | None = None) -> T:
    """Mark ``value`` to be split over the ranks of a call: each rank receives its part.

    Without ``axis`` the value splits into one part per rank (of the world, or of every mesh
    coordinate); with ``axis`` (a call ``on=`` a :class:`Mesh`) into one part per coordinate
    of that axis, each replicated along the other axes. Several scattered arguments of one call
    (on one axis) split in lockstep and must have the same length. Typed as the value it marks,
    so a type checker checks the call's arguments against the method's parameters (a part has
    the value's type).

    Parts differ in size by at most one item (10 over 4 ranks: 3, 3, 2, 2). Under DDP each
    rank's loss is the mean over its own part and the gradients are averaged over the ranks, so
    each rank's mean counts the same: an item on a rank of 2 items weighs 1.5 times one on a
    rank of 3. Scatter a multiple of the world size for equal weights, or weigh each rank's loss
    by its part's share. With fewer items than ranks the last ranks get an empty part and still
    run the method: a mean over no items is ``nan`` (a torch loss over an empty batch), with a
    zero gradient that the average over ranks still counts.

    A mapping's values that cannot split (numbers, strings, metadata dicts of them) are
    replicated: every part holds them whole.

    Args:
        value: what to split (see :func:`split`); checked when the call is planned.
        axis: the mesh axis to split along.

    Raises:
        ConfigurationError: ``axis`` is not a string.
    """
    if axis is not None and not isinstance(axis, str):
        raise ConfigurationError(f"scatter(axis=...) takes an axis name, got {axis!r}")
    return cast(T, Scatter(value, axis))


def split_sizes(total: int, n: int) -> list[int]:
    """The sizes of ``n`` contiguous parts of ``total`` items: as even as can be, the larger
    ones first (10 over 4: 3, 3, 2, 2; 2 over 4: 1, 1, 0, 0).

    Raises:
        ConfigurationError: ``n`` is not positive or ``total`` is negative.
    """
    if n < 1 or total < 0:
        raise ConfigurationError(f"cannot split {total} items into {n} parts")
    base, extra = divmod(total, n)
    return [base + (1 if i < extra else 0) for i in range(n)]


def split(value: Any, n: int, *, what: str = "the value") -> list[Any]:
    """Split ``value`` into ``n`` contiguous parts, each of the value's type.

    Lists and tuples split by items; numpy arrays and torch tensors along axis 0 (each part a
    view); a mapping value by value in lockstep (each part a dict of the same keys; a value that
    cannot split, such as a number, a string or a dict of them, is in every part whole); an
    object with ``__asyncexec_split__(n)`` splits itself. When there are fewer items than parts,
    the last parts are empty. Checked before anything is sent: a call that cannot split fails
    whole.

    Args:
        value: what to split.
        n: how many parts.
        what: how messages name the value (``"argument 'batch'"``).

    Raises:
        ConfigurationError: the value does not split (a str, a set, an int, a generator, a
            0-d array, a named tuple, unless inside a mapping, where all but a named tuple are
            replicated), a mapping's values differ in length,
            ``__asyncexec_split__`` returned another number of parts, or ``n`` is not positive.
    """
    if n < 1:
        raise ConfigurationError(f"cannot split {what} into {n} parts")
    splitter = getattr(type(value), "__asyncexec_split__", None)
    if splitter is not None:
        parts = splitter(value, n)
        if not isinstance(parts, Sequence) or len(parts) != n:
            got = f"{len(parts)} parts" if isinstance(parts, Sequence) else type(parts).__name__
            raise ConfigurationError(
                f"scatter(): {type(value).__qualname__}.__asyncexec_split__({n}) returned "
                f"{got} for {what}; it must return a sequence of exactly {n}"
            )
        return list(parts)
    if isinstance(value, Mapping):
        return _split_mapping(value, n, what)
    total = _length(value, what)
    bounds = _bounds(split_sizes(total, n))
    return [value[a:b] for a, b in bounds]


def _split_mapping(value: Mapping[Any, Any], n: int, what: str) -> list[Any]:
    _common_length(value, what)
    columns = {
        k: [v] * n if _replicated(v) else split(v, n, what=f"{what}[{k!r}]")
        for k, v in value.items()
    }
    return [{k: parts[i] for k, parts in columns.items()} for i in range(n)]


def _replicated(value: Any) -> bool:
    """Whether a mapping's value goes whole to every part: a leaf that cannot split (a number,
    a string, a 0-d array, a set, any other object), such as a batch's metadata. Lists, tuples,
    arrays, mappings and objects that split themselves are split (a named tuple is refused)."""
    if getattr(type(value), "__asyncexec_split__", None) is not None:
        return False
    if isinstance(value, Mapping | list | tuple):
        return False
    return value.ndim == 0 if _is_array(value) else True


def _common_length(value: Mapping[Any, Any], what: str) -> int | None:
    """The length every value of a mapping shares (None when none has one)."""
    common: tuple[Any, int] | None = None
    for key, item in value.items():
        if _replicated(item):
            continue
        length = split_length(item, f"{what}[{key!r}]")
        if length is None:
            continue
        if common is not None and length != common[1]:
            raise ConfigurationError(
                f"scatter() splits the values of {what} in lockstep, but {key!r} has {length} "
                f"items and {common[0]!r} has {common[1]}"
            )
        common = (key, length)
    return None if common is None else common[1]


def split_length(value: Any, what: str) -> int | None:
    """How many items ``value`` splits over (None for an object that splits itself and has no
    length, and for an empty mapping)."""
    if getattr(type(value), "__asyncexec_split__", None) is not None:
        try:
            return len(value)
        except TypeError:
            return None
    if isinstance(value, Mapping):
        return _common_length(value, what)
    return _length(value, what)


def _length(value: Any, what: str) -> int:
    """The length of a list, tuple, array or tensor that splits along axis 0."""
    if isinstance(value, list):
        return len(value)
    if isinstance(value, tuple):
        if hasattr(value, "_fields"):
            raise ConfigurationError(
                f"scatter() cannot split {what} ({type(value).__qualname__}, a named tuple): its "
                "parts could not be of its type; pass its fields as a dict, or give it "
                "__asyncexec_split__(n)"
            )
        return len(value)
    if _is_array(value):
        if value.ndim == 0:
            raise ConfigurationError(
                f"scatter() cannot split {what} (a 0-d {type(value).__qualname__}): it splits "
                "along axis 0"
            )
        return int(value.shape[0])
    raise ConfigurationError(
        f"scatter() cannot split {what} ({type(value).__qualname__}): it splits {_SPLITS}"
    )


def _bounds(sizes: Sequence[int]) -> list[tuple[int, int]]:
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    return bounds


def _is_array(value: object) -> bool:
    """A numpy array or a torch tensor (never imports either: a value of theirs means the
    module is loaded)."""
    return _is_numpy(value) or _is_torch(value)


def _is_numpy(value: object) -> bool:
    numpy = sys.modules.get("numpy")
    return numpy is not None and isinstance(value, numpy.ndarray)


def _is_torch(value: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


#: How deep :func:`compact` and :func:`estimated_nbytes` look into containers and objects.
_DEPTH = 4
#: How many items of a container they look at (the rest are taken to be alike).
_SAMPLE = 64
#: What a value counts when nothing more of its size is known.
_SMALL = 64
#: Values with nothing inside to look into.
_ATOMS = (int, float, complex, bool, str, bytes, bytearray, memoryview, type(None), type)
#: Libraries whose objects are not taken apart (their own pickling knows them).
_OPAQUE = frozenset({"builtins", "numpy", "pandas", "torch", "ray", "pyarrow"})


def compact(part: Any, depth: int = 0) -> Any:
    """``part`` as it should travel: a torch tensor that views a larger storage pickles that
    whole storage (every rank's data, for a part of a scattered tensor), so it is copied to a
    storage of its own. Views are looked for in dicts, lists, tuples, dataclasses and other
    objects' fields (as a :class:`Splittable`'s parts hold them), a bounded depth down; a
    container or object is copied (shallowly) only when something in it was. A numpy view
    pickles its own data only. Copies as much as the views hold: run it off the event loop for
    a large part."""
    if _is_torch(part):
        return _clone(part) if _is_view(part) else part
    if depth >= _DEPTH or isinstance(part, _ATOMS):
        return part
    kind = type(part)
    if kind is dict:
        values: dict[Any, Any] | None = None  # a copy, made at the first change only
        for key, value in part.items():
            new = compact(value, depth + 1)
            if new is not value:
                values = dict(part) if values is None else values
                values[key] = new
        return part if values is None else values
    if kind is list or kind is tuple:
        if not any(_may_hold_views(v) for v in part[:_SAMPLE]):
            return part  # a list of plain items: not walked item by item
        items: list[Any] | None = None
        for i, value in enumerate(part):
            new = compact(value, depth + 1)
            if new is not value:
                items = list(part) if items is None else items
                items[i] = new
        if items is None:
            return part
        return items if kind is list else tuple(items)
    return _compact_fields(part, depth)


def _may_hold_views(value: Any) -> bool:
    return not isinstance(value, _ATOMS) and not _is_numpy(value)


def _compact_fields(part: Any, depth: int) -> Any:
    """An object with its fields compacted: a shallow copy when one of them changed."""
    fields = _fields(part)
    if not fields:
        return part
    changed = {}
    for name, value in fields.items():
        new = compact(value, depth + 1)
        if new is not value:
            changed[name] = new
    if not changed:
        return part
    try:
        copied = copy.copy(part)
        for name, value in changed.items():
            object.__setattr__(copied, name, value)
    except Exception:  # an object that does not copy: it travels as it is
        return part
    return copied


def _fields(value: Any) -> dict[str, Any]:
    """The data fields of a dataclass or another object (``__dict__``, ``__slots__``); none for
    a class, a function, a module or an object of a library in :data:`_OPAQUE`."""
    kind = type(value)
    if kind.__module__.partition(".")[0] in _OPAQUE or callable(value):
        return {}
    if dataclasses.is_dataclass(value):
        return {f.name: getattr(value, f.name, None) for f in dataclasses.fields(value)}
    found: dict[str, Any] = dict(getattr(value, "__dict__", None) or {})
    for klass in kind.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(value, name):
                found[name] = getattr(value, name)
    return found


def _is_view(tensor: Any) -> bool:
    """Whether a torch tensor's storage holds more than the tensor (it pickles all of it)."""
    try:
        held = tensor.untyped_storage().nbytes()
    except Exception:  # a sparse, meta or other tensor without a plain storage
        return False
    return bool(held > tensor.numel() * tensor.element_size())


def _clone(tensor: Any) -> Any:
    """A copy of ``tensor`` with a storage of its own."""
    return tensor.clone()


def estimated_nbytes(value: Any, depth: int = 0) -> int:
    """About how many bytes ``value`` pickles to, without pickling it, to decide whether it
    travels inline with a call or is put where the workers read it once: arrays and tensors by
    their ``nbytes``, bytes and strings by length, pandas objects by their ``memory_usage()``,
    containers by a sample of their items, dataclasses and other objects by their fields
    (``__dict__``, ``__slots__``), a bounded depth down. Never raises."""
    try:
        return _estimate(value, depth)
    except Exception:  # an odd object (a property that raises): counted small
        return _SMALL


def _estimate(value: Any, depth: int) -> int:
    if isinstance(value, bytes | bytearray | memoryview | str):
        return len(value)
    if isinstance(value, _ATOMS):
        return _SMALL
    nbytes = getattr(value, "nbytes", None)
    if isinstance(nbytes, int):
        return nbytes
    pandas = sys.modules.get("pandas")
    if pandas is not None and isinstance(value, pandas.DataFrame | pandas.Series | pandas.Index):
        usage = value.memory_usage(index=True, deep=False)
        return int(usage.sum()) if hasattr(usage, "sum") else int(usage)
    if depth >= _DEPTH:
        return _SMALL
    if isinstance(value, Mapping):
        return _SMALL + _sampled(value.values(), len(value), depth)
    if isinstance(value, list | tuple | set | frozenset):
        return _SMALL + _sampled(value, len(value), depth)
    fields = _fields(value)
    return _SMALL + _sampled(fields.values(), len(fields), depth)


def _sampled(items: Iterable[Any], length: int, depth: int) -> int:
    """The size of ``length`` items from that of the first :data:`_SAMPLE`."""
    sample = list(itertools.islice(items, _SAMPLE))
    seen = sum(_estimate(item, depth + 1) for item in sample)
    return seen if length <= len(sample) else seen * length // max(len(sample), 1)


def concat(results: Sequence[T]) -> T:
    """Merge the results of several ranks into one: lists and tuples concatenated, numpy arrays
    and torch tensors along axis 0, mappings key by key (into a dict with the first's keys).

    Scalars (a dict of metrics) do not concatenate: ``call(..., merge=concat)`` of a method
    annotated to return them is refused before it is sent, and a merge that fails on the
    results raises :class:`~asyncexec.MergeError`, which holds each rank's result.

    Raises:
        TypeError: no results, results of different kinds or keys, or results that do not
            concatenate (named by type).
    """
    if not results:
        raise TypeError("concat() needs at least one result")
    return cast(T, _concat(list(results), "the results"))


def _concat(values: list[Any], what: str) -> Any:
    first = values[0]
    if isinstance(first, list | tuple) and not hasattr(first, "_fields"):
        kind = list if isinstance(first, list) else tuple
        _same_kind(values, kind, what)
        return kind(item for value in values for item in value)
    if _is_numpy(first):
        _same_kind(values, sys.modules["numpy"].ndarray, what)
        return sys.modules["numpy"].concatenate(values, axis=0)
    if _is_torch(first):
        _same_kind(values, sys.modules["torch"].Tensor, what)
        return sys.modules["torch"].cat(values, dim=0)
    if isinstance(first, Mapping):
        _same_kind(values, Mapping, what)
        keys = list(first)
        for value in values[1:]:
            if set(value) != set(keys):
                raise TypeError(
                    f"concat() merges mappings key by key, but {what} have different keys: "
                    f"{sorted(map(str, keys))} and {sorted(map(str, value))}"
                )
        return {k: _concat([v[k] for v in values], f"{what}[{k!r}]") for k in keys}
    raise TypeError(
        f"concat() cannot merge {what} ({type(first).__qualname__}): it merges lists, tuples, "
        "numpy arrays, torch tensors and mappings of them"
    )


def _same_kind(values: list[Any], kind: type | Any, what: str) -> None:
    for value in values:
        if not isinstance(value, kind):
            raise TypeError(
                f"concat() cannot merge {what}: {type(values[0]).__qualname__} and "
                f"{type(value).__qualname__}"
            )


def short_repr(value: object, limit: int = 60) -> str:
    """A repr for messages, cut short; never raises."""
    try:
        text = repr(value)
    except Exception:
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[: limit - 3] + "..."
