"""Worker classes (roles) and the plan of a dispatched call. Pure: no Ray here (its cloudpickle
is imported where a role is checked and sent).

A :class:`Role` is a worker class and its constructor's arguments; each rank of a group holds
one instance of each of its roles. A call is planned before anything is sent (:func:`plan_call`):
the function is found among the roles' methods (:func:`method_of`), the arguments are bound to
its signature, the target (``_targets``) is resolved against the world size, and every argument
becomes a *part*: an argument marked with :func:`scatter` gives one part per piece it splits into
(``_split``), any other argument one part that every rank shares. The driver puts each distinct
part in the object store once (replicas along a mesh axis share theirs) and sends each rank
references to its own parts only.

This module is where the driver finds every name of dispatch: it re-exports those of ``_split``
and ``_targets``.
"""

from __future__ import annotations

import functools
import inspect
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import FrozenInstanceError, dataclass, field
from typing import Any, Generic, NoReturn, ParamSpec, TypeVar, cast

from ._errors import ConfigurationError, describe
from ._protocol import RoleMethod, RoleSpec
from ._split import (
    Scatter,
    Splittable,
    compact,
    concat,
    scatter,
    short_repr,
    split,
    split_length,
    split_sizes,
)
from ._targets import (
    ALL,
    AllRanks,
    LeastLoaded,
    Load,
    Mesh,
    OneRank,
    Target,
    least_loaded,
    rank,
)

__all__ = [
    "ALL",
    "AllRanks",
    "CallPlan",
    "LeastLoaded",
    "Load",
    "Mesh",
    "OneRank",
    "Role",
    "RoleMethod",
    "Scatter",
    "Splittable",
    "Target",
    "concat",
    "least_loaded",
    "method_of",
    "plan_call",
    "rank",
    "roles_of",
    "roles_payload",
    "scatter",
    "split",
    "split_sizes",
]

P = ParamSpec("P")
T = TypeVar("T")

#: The longest list, tuple or dict argument looked into for a misplaced scatter() marker.
_NESTED_SCAN = 64


# Roles -------------------------------------------------------------------------------------


class Role(Generic[T]):
    """A worker class and its constructor's arguments: each rank holds one instance.

    A frozen value. The constructor's arguments are checked against ``cls`` by a type checker
    (``Role(Learner, cfg)`` is typed as ``Learner(cfg)`` is) and, when it is made, against the
    signature of ``cls``; the class and every argument must pickle (with Ray's cloudpickle),
    since they are sent to every worker.

    Args:
        cls: the worker class.
        *args: positional arguments of its constructor.
        **kwargs: keyword arguments of its constructor.

    Raises:
        ConfigurationError: ``cls`` is not a class, the arguments do not bind to its
            constructor, or the class or an argument cannot be pickled (named).
    """

    __slots__ = ("args", "cls", "kwargs")
    cls: type[T]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]

    def __init__(self, cls: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> None:
        if not isinstance(cls, type):
            raise ConfigurationError(
                f"Role() takes a class, got {type(cls).__name__}: {short_repr(cls)}"
            )
        _check_constructor(cls, args, kwargs)
        _check_pickles(cls, args, kwargs)
        object.__setattr__(self, "cls", cls)
        object.__setattr__(self, "args", tuple(args))
        object.__setattr__(self, "kwargs", dict(kwargs))

    @property
    def name(self) -> str:
        """The class's qualified name, as messages name the role."""
        return self.cls.__qualname__

    def spec(self) -> RoleSpec:
        """The record a worker receives."""
        return RoleSpec(self.cls, self.args, dict(self.kwargs))

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> NoReturn:
        raise FrozenInstanceError(f"cannot delete field {name!r}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Role):
            return NotImplemented
        return (self.cls, self.args, self.kwargs) == (other.cls, other.args, other.kwargs)

    def __hash__(self) -> int:
        return hash(self.cls)  # the arguments may not hash (a config dict)

    def __repr__(self) -> str:
        shown = [self.cls.__qualname__, *map(short_repr, self.args)]
        shown += [f"{k}={short_repr(v)}" for k, v in self.kwargs.items()]
        return f"Role({', '.join(shown)})"

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_role, (self.cls, self.args, dict(self.kwargs))


def _rebuild_role(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Role[Any]:
    role: Role[Any] = object.__new__(Role)
    object.__setattr__(role, "cls", cls)
    object.__setattr__(role, "args", args)
    object.__setattr__(role, "kwargs", kwargs)
    return role


def _check_constructor(cls: type, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # a builtin or an odd metaclass: the worker will tell
        return
    try:
        signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise ConfigurationError(
            f"Role({cls.__qualname__}): the arguments do not bind to "
            f"{cls.__qualname__}{signature}: {exc}"
        ) from None


def _check_pickles(cls: type, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
    from ray import cloudpickle

    values: list[tuple[str, Any]] = [("the class", cls)]
    values += [(f"argument {i}", v) for i, v in enumerate(args)]
    values += [(f"keyword argument {k!r}", v) for k, v in kwargs.items()]
    for what, value in values:
        try:
            cloudpickle.dumps(value)
        except Exception as exc:
            raise ConfigurationError(
                f"Role({cls.__qualname__}): {what} ({type(value).__name__}) cannot be pickled "
                f"to be sent to the workers: {describe(exc)}"
            ) from exc


def roles_of(value: Role[Any] | type | Sequence[Role[Any] | type] | None) -> tuple[Role[Any], ...]:
    """Normalise ``Executor(roles=...)``: one role, a bare class (``Role(cls)``), or a list of
    them (colocated in one process per rank, made in this order); None for no roles.

    Raises:
        ConfigurationError: an empty list, an item that is neither a Role nor a class, or two
            roles of one class.
    """
    if value is None:
        return ()
    if isinstance(value, Role | type):
        items: Sequence[Any] = [value]
    elif isinstance(value, Sequence) and not isinstance(value, str | bytes):
        items = value
    else:
        raise ConfigurationError(
            f"roles= takes a Role, a class, or a list of them, got {type(value).__name__}"
        )
    if not items:
        raise ConfigurationError("roles= is an empty list: leave it out for a group without roles")
    roles: list[Role[Any]] = []
    for item in items:
        if isinstance(item, Role):
            roles.append(item)
        elif isinstance(item, type):
            roles.append(Role(item))
        else:
            raise ConfigurationError(
                f"roles= takes Roles or classes, got {type(item).__name__}: {short_repr(item)}"
            )
    seen: set[type] = set()
    for role in roles:
        if role.cls in seen:
            raise ConfigurationError(
                f"roles= holds two roles of {role.name}: a rank holds one instance per class "
                "(a subclass makes a second role)"
            )
        seen.add(role.cls)
    return tuple(roles)


def roles_payload(roles: Sequence[Role[Any]]) -> bytes:
    """What a group sends every worker to make its roles (``make_roles``): pickled once for all
    ranks, each role apart, so that a worker names the role it could not unpickle."""
    from ray import cloudpickle

    return bytes(cloudpickle.dumps(tuple(cloudpickle.dumps(r.spec()) for r in roles)))


def method_of(fn: Callable[..., Any], roles: Sequence[Role[Any]]) -> RoleMethod | None:
    """Which role's method ``fn`` is, as ``RoleMethod(role_index, name)``; None for a function
    that is no class's method (it runs as ``execute()`` runs it).

    ``fn`` is a role's method when ``getattr(cls, fn.__name__) is fn`` for the role's class
    (inherited methods too). Static and class methods of a role's class count as its methods:
    they are called through the rank's instance, which changes nothing for them. A static method
    of another class is a plain function; a bound method of an object (``obj.method``) is a plain
    callable. A function defined in another class's body is refused, since it needs an instance
    that no rank holds.

    Raises:
        ConfigurationError: ``fn`` is a method of a class that is not a role, or of several
            roles (a base class's method that two roles inherit).
    """
    name = getattr(fn, "__name__", None)
    if not isinstance(name, str):
        return None
    found = [i for i, role in enumerate(roles) if _defines(role.cls, name, fn)]
    if len(found) > 1:
        which = ", ".join(roles[i].name for i in found)
        raise ConfigurationError(
            f"{_qualname(fn)} is a method of several roles ({which}): the call cannot tell "
            "whose instance it is for (override it in the role it belongs to)"
        )
    if found:
        return RoleMethod(found[0], name)
    owner = _owner(fn)
    if owner is None:
        return None
    owner_name, owner_cls = owner
    names = ", ".join(r.name for r in roles) or "none"
    hint = ""
    for role in roles:
        if owner_cls is not None and issubclass(role.cls, owner_cls):
            hint = f" ({role.name} overrides it: name {role.name}.{name})"
    raise ConfigurationError(
        f"{_qualname(fn)} is a method of {owner_name}, which is not a role of this executor "
        f"(roles: {names}){hint}"
    )


def _defines(cls: type, name: str, fn: Callable[..., Any]) -> bool:
    attr = getattr(cls, name, None)
    if attr is fn:
        return True
    # A classmethod is bound anew at each attribute access: compare its function and class.
    return inspect.ismethod(fn) and inspect.ismethod(attr) and attr == fn


def _owner(fn: Callable[..., Any]) -> tuple[str, type | None] | None:
    """The class whose body defines ``fn`` (its name, and the class when it can be found), when
    ``fn`` needs an instance of it; None for a plain function or callable."""
    if inspect.ismethod(fn):
        owner = fn.__self__
        return (owner.__qualname__, owner) if isinstance(owner, type) else None
    if not inspect.isfunction(fn):
        return None
    parts = fn.__qualname__.split(".")
    if len(parts) < 2 or parts[-2] == "<locals>":
        return None
    found: Any = sys.modules.get(fn.__module__)
    for part in parts[:-1]:
        found = getattr(found, part, None)
    cls = found if isinstance(found, type) else None
    if cls is not None and isinstance(inspect.getattr_static(cls, parts[-1], None), staticmethod):
        return None
    return ".".join(parts[:-1]), cls


def _takes_self(cls: type, name: str) -> bool:
    """Whether ``cls.name`` is called with the instance as its first argument (not a static or
    class method)."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return not isinstance(vars(klass)[name], staticmethod | classmethod)
    return True


# The plan of a call --------------------------------------------------------------------------


@dataclass(frozen=True)
class CallPlan:
    """A call checked and laid out before anything is sent (see :func:`plan_call`).

    Every argument is a part: a scattered argument gives one part per piece, any other one part
    shared by every rank; a part appears once in ``parts`` however many ranks receive it. The
    driver puts each part in the object store once (or keeps it inline when small), then builds
    each called rank's arguments from those references with :meth:`arguments`, and hands the
    called ranks' results to :meth:`result` (or asks :meth:`returns` while streaming).
    """

    #: The function to call (partials unwrapped): a role's method, or a plain function.
    fn: Callable[..., Any]
    #: The role and method name when ``fn`` is a role's method, else None (``execute()``).
    method: RoleMethod | None
    #: The distinct parts of the arguments, in order of first use.
    parts: tuple[Any, ...] = field(repr=False)
    #: The ranks to call, in rank order; empty when the driver chooses one by load (``choose``).
    ranks: tuple[int, ...]
    #: The ranks whose results are returned, in order (empty when chosen by load).
    returned: tuple[int, ...]
    #: Whether the call returns one rank's result rather than a list.
    single: bool
    #: The load rule when the driver chooses the rank, else None.
    choose: LeastLoaded | None
    #: The merge of the returned results, or None for the list of them.
    merge: Callable[[list[Any]], Any] | None
    #: How many of the arguments are positional; the others are passed by these keywords.
    positional: int
    keywords: tuple[str, ...]
    #: Each rank's part index for each argument (one row for every rank when nothing scatters).
    rows: tuple[tuple[int, ...], ...] = field(repr=False)
    _returned_set: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_returned_set", frozenset(self.returned))

    def parts_of(self, r: int) -> tuple[int, ...]:
        """Which parts rank ``r`` receives, as indices into ``parts`` (one per argument)."""
        return self.rows[r] if len(self.rows) > 1 else self.rows[0]

    def arguments(
        self, r: int, parts: Sequence[Any] | None = None
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Rank ``r``'s ``(args, kwargs)``, taken from ``parts`` (the driver's references to
        the parts, in the order of ``self.parts``; the parts themselves when None)."""
        values = self.parts if parts is None else parts
        row = self.parts_of(r)
        args = tuple(values[i] for i in row[: self.positional])
        kwargs = {k: values[i] for k, i in zip(self.keywords, row[self.positional :], strict=True)}
        return args, kwargs

    def returns(self, r: int) -> bool:
        """Whether rank ``r``'s result is returned (always, for a rank chosen by load)."""
        return self.choose is not None or r in self._returned_set

    def result(self, values: Sequence[Any]) -> Any:
        """What the call returns, from the results of the ranks called (in the order of
        ``ranks``, or the one chosen rank's): the one result, the returned ranks' results in
        order, or their merge."""
        if self.single:
            return values[0]
        if len(self.returned) == len(self.ranks):
            picked = list(values)
        else:
            where = {r: i for i, r in enumerate(self.ranks)}
            picked = [values[where[r]] for r in self.returned]
        return picked if self.merge is None else self.merge(picked)


def plan_call(
    fn: Callable[..., Any],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    world_size: int,
    on: Target = ALL,
    *,
    roles: Sequence[Role[Any]] = (),
    merge: Callable[[list[Any]], Any] | None = None,
) -> CallPlan:
    """Check a call and lay it out, before anything is sent.

    ``fn`` may be a ``functools.partial`` (how a method whose own keyword is named ``on`` or
    ``merge`` gets it): its keywords, and for a plain function its positional arguments, join
    the call's. The arguments are bound to ``fn``'s signature (``self`` standing for the
    instance, a scatter marker for its part); each scattered argument is split now.

    Args:
        fn: a role's method or a plain function.
        args: the call's positional arguments, scatter markers among them.
        kwargs: the call's keyword arguments, scatter markers among them.
        world_size: the group's size now.
        on: the target: :data:`ALL`, a :class:`Mesh`, :func:`least_loaded` or :func:`rank`.
        roles: the group's roles, in order.
        merge: a callable over the list of returned results (``concat``), or None.

    Raises:
        ConfigurationError: ``fn`` is a method of another class, the arguments do not bind, a
            value cannot be split, scattered values differ in length, a scatter goes to one
            rank or names an axis the target has not, a mesh does not multiply to the world
            size, a rank is past it, or ``merge`` is given for a call that returns one result.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigurationError(f"a call needs a group of at least one rank, got {world_size!r}")
    fn, args, kwargs, method = _unwrapped(fn, tuple(args), dict(kwargs), roles)
    names = _bind(fn, method, roles, args, kwargs)
    values: list[Any] = [*args, *kwargs.values()]
    ranks, returned, single, choose = _targets(on, world_size)
    if merge is not None and (single or not callable(merge)):
        raise ConfigurationError(
            f"merge= takes a callable over several ranks' results; on={on!r} returns one"
            if single
            else f"merge= takes a callable, got {type(merge).__name__}"
        )
    parts: list[Any] = []
    shared: dict[int, int] = {}  # id of a value passed as several arguments: its part
    columns: list[list[int] | int] = []  # per argument: the part of each rank, or a shared part
    scattered = [(i, v) for i, v in enumerate(values) if isinstance(v, Scatter)]
    _check_lockstep(scattered, names)
    for i, value in enumerate(values):
        if isinstance(value, Scatter):
            if single:
                raise ConfigurationError(
                    f"scatter() splits {names[i]} over several ranks, but on={on!r} calls one"
                )
            columns.append(_scatter_column(value, names[i], on, world_size, parts))
            continue
        _refuse_nested(value, names[i])
        if id(value) not in shared:
            shared[id(value)] = len(parts)
            parts.append(value)
        columns.append(shared[id(value)])
    if scattered:
        rows = tuple(
            tuple(c if isinstance(c, int) else c[r] for c in columns) for r in range(world_size)
        )
    else:
        rows = (tuple(cast(list[int], columns)),)
    return CallPlan(
        fn=fn,
        method=method,
        parts=tuple(parts),
        ranks=ranks,
        returned=returned,
        single=single,
        choose=choose,
        merge=merge,
        positional=len(args),
        keywords=tuple(kwargs),
        rows=rows,
    )


def _unwrapped(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    roles: Sequence[Role[Any]],
) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], RoleMethod | None]:
    """``fn`` without its partials, their arguments joined to the call's, and its method."""
    bound = 0
    while isinstance(fn, functools.partial):
        args = (*fn.args, *args)
        kwargs = {**fn.keywords, **kwargs}
        bound += len(fn.args)
        fn = fn.func
    if not callable(fn):
        raise ConfigurationError(f"a call takes a callable, got {type(fn).__name__}")
    method = method_of(fn, roles)
    if method is not None and bound and _takes_self(roles[method.role_index].cls, method.name):
        raise ConfigurationError(
            f"functools.partial({_qualname(fn)}, ...) binds positional arguments, which would "
            "stand for the instance: bind keywords only"
        )
    return fn, args, kwargs, method


def _bind(
    fn: Callable[..., Any],
    method: RoleMethod | None,
    roles: Sequence[Role[Any]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> list[str]:
    """Check that the arguments bind to ``fn``; return how messages name each argument
    (positional ones by their parameter's name where there is one)."""
    named = [f"argument {i}" for i in range(len(args))]
    named += [f"argument {k!r}" for k in kwargs]
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin: the worker will tell
        return named
    takes_self = method is not None and _takes_self(roles[method.role_index].cls, method.name)
    instance = (None,) if takes_self else ()
    try:
        signature.bind(*instance, *args, **kwargs)
    except TypeError as exc:
        raise ConfigurationError(
            f"the arguments do not bind to {_qualname(fn)}{signature}: {exc}"
        ) from None
    params = list(signature.parameters.values())[len(instance) :]
    for i, param in enumerate(params[: len(args)]):
        if param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
            named[i] = f"argument {param.name!r}"
    return named


def _targets(
    on: Target, world_size: int
) -> tuple[tuple[int, ...], tuple[int, ...], bool, LeastLoaded | None]:
    """The ranks to call, the ranks returned, whether one result, and the load rule."""
    everyone = tuple(range(world_size))
    if isinstance(on, AllRanks):
        return everyone, everyone, False, None
    if isinstance(on, Mesh):
        if on.size != world_size:
            raise ConfigurationError(
                f"{on!r} has {on.size} ranks but the group has {world_size}: the sizes of its "
                "axes must multiply to the world size"
            )
        return everyone, tuple(on.collected()), False, None
    if isinstance(on, OneRank):
        if on.rank >= world_size:
            raise ConfigurationError(
                f"on=rank({on.rank}): the group has {world_size} ranks (0 to {world_size - 1})"
            )
        return (on.rank,), (on.rank,), True, None
    if isinstance(on, LeastLoaded):
        return (), (), True, on
    raise ConfigurationError(
        f"on= takes ALL, a Mesh, least_loaded() or rank(i), got {type(on).__name__}"
    )


def _check_lockstep(scattered: list[tuple[int, Scatter]], names: list[str]) -> None:
    """Scattered arguments on one axis must have the same length."""
    seen: dict[str | None, tuple[int, int]] = {}
    for i, marker in scattered:
        length = split_length(marker.value, names[i])
        if length is None:
            continue
        first = seen.setdefault(marker.axis, (i, length))
        if first[1] != length:
            raise ConfigurationError(
                f"scattered arguments split in lockstep, but {names[i]} has {length} items "
                f"and {names[first[0]]} has {first[1]}"
            )


def _scatter_column(
    marker: Scatter, what: str, on: Target, world_size: int, parts: list[Any]
) -> list[int]:
    """Split a scattered argument into ``parts``; return each rank's part index."""
    base = len(parts)
    if marker.axis is None:
        parts.extend(map(compact, split(marker.value, world_size, what=what)))
        return list(range(base, base + world_size))
    if not isinstance(on, Mesh):
        raise ConfigurationError(
            f"scatter({what}, axis={marker.axis!r}) splits along a mesh axis: "
            "call with on=Mesh(...)"
        )
    axes = on.axes
    if marker.axis not in axes:
        raise ConfigurationError(f"scatter({what}, axis={marker.axis!r}): {on!r} has no such axis")
    parts.extend(map(compact, split(marker.value, axes[marker.axis], what=what)))
    return [base + on.coord(r, marker.axis) for r in range(world_size)]


def _refuse_nested(value: Any, what: str) -> None:
    """A scatter marker inside an argument would reach the worker as a marker. Short lists,
    tuples and dicts are looked into (where the mistake is made: ``call(fn, [scatter(x)])``);
    a long one, a batch of data, is not scanned on every call."""
    items: Iterable[Any]
    if isinstance(value, list | tuple) and len(value) <= _NESTED_SCAN:
        items = value
    elif isinstance(value, dict) and len(value) <= _NESTED_SCAN:
        items = value.values()
    else:
        return
    if any(isinstance(item, Scatter) for item in items):
        raise ConfigurationError(
            f"{what} holds a scatter() inside it: scatter() marks a whole argument"
        )


def _qualname(fn: Callable[..., Any]) -> str:
    return str(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn))
