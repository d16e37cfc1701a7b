"""The plan of a dispatched call, made before anything is sent (:func:`plan_call`). Pure: no
Ray here.

The function is found among the roles' methods (``_role.method_of``; a role is a worker class and
its constructor's arguments, each rank holding one instance of each), the arguments are bound to
its signature, the target (``_targets``) is resolved against the world size, and every argument
becomes a *part*: an argument marked with ``scatter()`` gives one part per piece it splits into
(``_split``), any other argument one part that every rank shares. The driver puts each distinct
part in the object store once (replicas along a mesh axis share theirs) and sends each rank
references to its own parts only.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import FunctionType
from typing import Any, ParamSpec, TypeVar, cast

from .._errors import ConfigurationError, MergeError, describe
from .._wire._interface import method_key
from .._wire._pickle import dumps as pickled
from .._wire._protocol import RoleMethod
from ._concat_check import check_concat
from ._role import NamedMethod, Role, method_of, qualname, takes_self
from ._split import Scatter, compact, concat, estimated_nbytes, split, split_length
from ._targets import ALL, AllRanks, LeastLoaded, Mesh, OneRank, Target

__all__ = ["CallPlan", "call_label", "plan_call"]

P = ParamSpec("P")
T = TypeVar("T")

#: The longest list, tuple or dict argument looked into for a misplaced scatter() marker.
_NESTED_SCAN = 64


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
    #: How messages name each argument (``"argument 'batch'"``), in the order of a row.
    names: tuple[str, ...] = field(default=(), repr=False)
    #: A role's plain (``def``) method whose role runs one call at a time (the default): the
    #: worker runs it where its calls queue, without a hop to a thread (``call_method_sync``).
    plain: bool = False
    #: An ``async def`` (method or function): cancelled on the worker when its caller stops
    #: waiting. A plain one runs to its end.
    cancellable: bool = False
    #: What ran, as the timeline, the spans and the logs name it: ``PolicyServer.generate`` for a
    #: role's method (by the role's class, which an inherited method's ``__qualname__`` is not),
    #: the function's qualified name for a plain function.
    label: str = ""
    _returned_set: frozenset[int] = field(init=False, repr=False, compare=False)

    #: How the worker's ``call_method`` names ``method`` (``_interface.method_key``); "" for a
    #: plain function.
    key: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_returned_set", frozenset(self.returned))
        key = "" if self.method is None else method_key(*self.method)
        object.__setattr__(self, "key", key)

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
        if not self.keywords:
            return tuple([values[i] for i in row]), {}
        args = tuple([values[i] for i in row[: self.positional]])
        kwargs = {k: values[i] for k, i in zip(self.keywords, row[self.positional :], strict=True)}
        return args, kwargs

    def returns(self, r: int) -> bool:
        """Whether rank ``r``'s result is returned (always, for a rank chosen by load)."""
        return self.choose is not None or r in self._returned_set

    def inline(self, inline_bytes: int) -> list[Any] | None:
        """Each part as it travels when every part travels inline (none over ``inline_bytes``:
        see :meth:`travelling`), without a coroutine; None when a part is to be put."""
        travelling = []
        for part in self.parts:
            if estimated_nbytes(part) > inline_bytes:
                return None
            travelling.append(compact(part))
        return travelling

    async def travelling(
        self, put: Callable[[Any], Awaitable[Any]], inline_bytes: int
    ) -> list[Any]:
        """Each part as it travels, in the order of ``parts``: one over ``inline_bytes`` (by
        :func:`estimated_nbytes`) compacted in a thread (torch views copied to storage of their
        own, see :func:`compact`: a large copy stays off the event loop) and handed to ``put``
        (the object store's, once for every rank that receives it); a smaller one compacted
        here, to travel inline with the call.

        Raises:
            ConfigurationError: a large part does not pickle (named by its argument).
        """
        import anyio  # here, not at the top: planning a call loads no event-loop library

        travelling: list[Any] = []
        for part in self.parts:
            if estimated_nbytes(part) <= inline_bytes:
                travelling.append(compact(part))
                continue
            whole = await anyio.to_thread.run_sync(compact, part)
            try:
                travelling.append(await put(whole))
            except TypeError as exc:  # Ray's own text for what does not pickle: name it
                raise self.pickling_error(exc) from exc
        return travelling

    def pickling_error(self, exc: Exception) -> Exception:
        """What to raise when sending the call failed with ``exc`` (Ray's ``TypeError`` for an
        argument that does not pickle, a long text with colours): a
        :class:`ConfigurationError` that names the first argument that does not pickle, or
        ``exc`` itself when each does. Pickles the parts again: only on such a failure."""
        for index, part in enumerate(self.parts):
            try:
                pickled(part)
            except Exception as failure:
                return ConfigurationError(
                    f"{self._argument_of(index)} ({type(part).__name__}) cannot be pickled to "
                    f"be sent to the workers: {describe(failure)}"
                )
        return exc

    def argument_name(self, rank: int, key: int | str) -> str:
        """How messages name the argument that rank ``rank`` receives at position ``key`` or by
        keyword ``key`` (the seam asks, naming an argument that does not pickle)."""
        if isinstance(key, int):
            column = key
        elif key in self.keywords:
            column = self.positional + self.keywords.index(key)
        else:
            return f"argument {key!r}"
        row = self.parts_of(rank)
        if 0 <= column < len(row):
            return self._argument_of(row[column])
        return f"argument {key!r}"

    def _argument_of(self, part: int) -> str:
        """How messages name the argument that part ``part`` is (a piece) of."""
        for row in self.rows:
            for column, index in enumerate(row):
                if index == part and column < len(self.names):
                    whole = all(r[column] == index for r in self.rows)
                    return self.names[column] if whole else f"a part of {self.names[column]}"
        return f"part {part} of the arguments"

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
        if self.merge is None:
            return picked
        try:
            return self.merge(picked)
        except Exception as exc:  # every rank ran the call: their results go with the error
            raise MergeError(
                _name_of(self.merge), qualname(self.fn), self.returned, picked, describe(exc)
            ) from exc


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
    if type(fn) is FunctionType and not kwargs and merge is None and roles:
        quick = _quick_plan(fn, tuple(args), world_size, on, roles)
        if quick is not None:
            return quick
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
    if merge is concat:
        check_concat(fn)
    parts, rows = _laid_out(values, names, on, world_size, single)
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
        names=tuple(names),
        plain=method is not None and _one_at_a_time(fn, method, roles),
        cancellable=inspect.iscoroutinefunction(_code(fn)),
        label=call_label(fn, method, roles),
    )


#: What planning finds of a role's method that its arguments do not change (its role and name,
#: whether it takes ``self``, ``plain``, ``cancellable``, and the arguments' names by how many
#: there are: they bind to the method), per group's roles (held, by identity: an executor's are
#: fixed) and function; looked up again when the class's attribute changed.
_Found = tuple[RoleMethod, bool, bool, bool, str, dict[int, tuple[str, ...]]]
_FOUND: dict[int, tuple[Sequence[Role[Any]], dict[Any, _Found]]] = {}


def _quick_plan(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    world_size: int,
    on: Target,
    roles: Sequence[Role[Any]],
) -> CallPlan | None:
    """The plan of the commonest call, a role's method with positional arguments that are not
    scattered, to every rank, one rank or by load: what :func:`plan_call` makes of it, with
    what does not depend on the arguments found once; None for any other call."""
    if isinstance(on, Mesh) or any(isinstance(v, Scatter) for v in args):
        return None
    held = _FOUND.get(id(roles))
    if held is None or held[0] is not roles:
        if len(_FOUND) >= 64:
            _FOUND.clear()
        held = _FOUND[id(roles)] = (roles, {})
    found = held[1].get(fn)
    if found is None or getattr(roles[found[0].role_index].cls, found[0].name, None) is not fn:
        method = method_of(fn, roles)
        if method is None:
            return None
        with_self = takes_self(roles[method.role_index].cls, method.name)
        cancellable = inspect.iscoroutinefunction(fn)
        plain = not cancellable and roles[method.role_index].max_concurrency == 1
        label = call_label(fn, method, roles)
        found = held[1][fn] = (method, with_self, plain, cancellable, label, {})
    method, with_self, plain, cancellable, label, named = found
    names = named.get(len(args))
    if names is None:  # binds, or raises: only a call that binds is kept
        names = _role_method_names(fn, with_self, len(args), ())
        if len(named) < 16:
            named[len(args)] = names
    ranks, returned, single, choose = _targets(on, world_size)
    parts: list[Any] = []
    shared: dict[int, int] = {}  # id of a value passed as several arguments: its part
    for i, value in enumerate(args):
        _refuse_nested(value, names[i])
        if id(value) not in shared:
            shared[id(value)] = len(parts)
            parts.append(value)
    row = tuple(shared[id(value)] for value in args)
    return CallPlan(
        fn,
        method,
        tuple(parts),
        ranks,
        returned,
        single,
        choose,
        None,
        len(args),
        (),
        (row,),
        names,
        plain,
        cancellable,
        label,
    )


def call_label(
    fn: Callable[..., Any], method: RoleMethod | None, roles: Sequence[Role[Any]]
) -> str:
    """What a call of ``fn`` runs, named for people (see ``CallPlan.label``)."""
    if method is None:
        return qualname(fn)
    return f"{roles[method.role_index].name}.{method.name}"


def _one_at_a_time(fn: Callable[..., Any], method: RoleMethod, roles: Sequence[Role[Any]]) -> bool:
    """Whether ``fn`` is a plain method of a role that runs one such call at a time."""
    return roles[method.role_index].max_concurrency == 1 and not inspect.iscoroutinefunction(
        _code(fn)
    )


def _code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The function itself of a method named with :func:`asyncexec.method` (whose wrapper is
    neither ``def`` nor ``async def``)."""
    return fn.fn if isinstance(fn, NamedMethod) else fn


def _laid_out(
    values: list[Any], names: list[str], on: Target, world_size: int, single: bool
) -> tuple[list[Any], tuple[tuple[int, ...], ...]]:
    """The call's parts (a scattered argument's pieces, every other argument once: a value
    passed as several arguments is one part) and each rank's row of part indices (one row that
    every rank shares when nothing is scattered)."""
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
    if not scattered:
        return parts, (tuple(cast(list[int], columns)),)
    rows = tuple(
        tuple(c if isinstance(c, int) else c[r] for c in columns) for r in range(world_size)
    )
    return parts, rows


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
    if isinstance(fn, type):
        _refuse_class(fn, roles)
    method = method_of(fn, roles)
    if method is not None and bound and takes_self(roles[method.role_index].cls, method.name):
        raise ConfigurationError(
            f"functools.partial({qualname(fn)}, ...) binds positional arguments, which would "
            "stand for the instance: bind keywords only"
        )
    return fn, args, kwargs, method


def _refuse_class(cls: type, roles: Sequence[Role[Any]]) -> None:
    """A class passed where a method is expected (``call(Learner, ...)``): say what is."""
    name = cls.__qualname__
    methods = [n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")][:3]
    example = ", ".join(f"{name}.{m}" for m in methods) or f"{name}.<method>"
    made = (
        "the executor makes its instances (roles=); "
        if any(role.cls is cls for role in roles)
        else ""
    )
    raise ConfigurationError(
        f"a call takes a method of a role or a function, got the class {name}: {made}call one "
        f"of its methods ({example})"
    )


def _bind(
    fn: Callable[..., Any],
    method: RoleMethod | None,
    roles: Sequence[Role[Any]],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> list[str]:
    """Check that the arguments bind to ``fn``; return how messages name each argument
    (positional ones by their parameter's name where there is one).

    Whether arguments bind depends only on how many are positional and the keywords' names,
    never on their values: a role's method is checked once per shape of call and remembered
    (a method lives as long as its class); a plain function is checked every call."""
    shape = (len(args), tuple(kwargs))
    if method is None:
        return _names(fn, False, *shape)
    with_self = takes_self(roles[method.role_index].cls, method.name)
    try:
        return list(_role_method_names(fn, with_self, *shape))
    except TypeError:  # a callable object as a class attribute: nothing to remember it by
        return _names(fn, with_self, *shape)


@functools.lru_cache(maxsize=1024)
def _role_method_names(
    fn: Callable[..., Any], with_self: bool, positional: int, keywords: tuple[str, ...]
) -> tuple[str, ...]:
    return tuple(_names(fn, with_self, positional, keywords))


def _names(
    fn: Callable[..., Any], with_self: bool, positional: int, keywords: tuple[str, ...]
) -> list[str]:
    """The arguments' names in messages, once a call of this shape is known to bind to ``fn``
    (placeholders stand for the values: binding looks at names and counts only)."""
    named = [f"argument {i}" for i in range(positional)]
    named += [f"argument {k!r}" for k in keywords]
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin: the worker will tell
        return named
    instance = (None,) if with_self else ()
    try:
        signature.bind(*instance, *([None] * positional), **dict.fromkeys(keywords))
    except TypeError as exc:
        raise ConfigurationError(
            f"the arguments do not bind to {qualname(fn)}{signature}: {exc}"
        ) from None
    params = list(signature.parameters.values())[len(instance) :]
    for i, param in enumerate(params[:positional]):
        if param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD):
            named[i] = f"argument {param.name!r}"
    return named


def _name_of(merge: Callable[..., Any]) -> str:
    name = getattr(merge, "__qualname__", None)
    return name if isinstance(name, str) else type(merge).__qualname__


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
        parts.extend(split(marker.value, world_size, what=what))
        return list(range(base, base + world_size))
    if not isinstance(on, Mesh):
        raise ConfigurationError(
            f"scatter({what}, axis={marker.axis!r}) splits along a mesh axis: "
            "call with on=Mesh(...)"
        )
    axes = on.axes
    if marker.axis not in axes:
        raise ConfigurationError(f"scatter({what}, axis={marker.axis!r}): {on!r} has no such axis")
    parts.extend(split(marker.value, axes[marker.axis], what=what))
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
