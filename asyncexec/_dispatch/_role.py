"""Worker classes (roles): a :class:`Role` is a worker class and its constructor's arguments; each
rank of a group holds one instance of each of its roles. Pure: no Ray here (a role is pickled with
Ray's cloudpickle through ``asyncexec._wire._pickle``). A method of a role is found by reference
(:func:`method_of`), so that a call names it as ``Learner.update``.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import FrozenInstanceError, dataclass
from typing import Any, Generic, NoReturn, ParamSpec, TypeVar

from .._errors import ConfigurationError, describe
from .._wire._pickle import dumps as pickled
from .._wire._protocol import RoleMethod, RoleSpec
from ._split import short_repr

__all__ = [
    "NamedMethod",
    "Role",
    "RoleMethod",
    "method",
    "method_of",
    "plain_only",
    "qualname",
    "roles_of",
    "roles_payload",
    "takes_self",
]

P = ParamSpec("P")
T = TypeVar("T")


class Role(Generic[T]):
    """A worker class and its constructor's arguments: each rank holds one instance.

    A frozen value. The constructor's arguments are checked against ``cls`` by a type checker
    (``Role(Learner, cfg)`` is typed as ``Learner(cfg)`` is) and, when it is made, against the
    signature of ``cls``; the class and every argument must pickle (with Ray's cloudpickle),
    since they are sent to every worker.

    A rank runs the plain (``def``) methods of its instance one call at a time, as Ray runs a
    plain actor's methods, and ``async def`` methods concurrently on its event loop, as on an
    async Ray actor; :meth:`options` lets more plain calls run at once.

    Args:
        cls: the worker class.
        *args: positional arguments of its constructor.
        **kwargs: keyword arguments of its constructor.

    Raises:
        ConfigurationError: ``cls`` is not a class, the arguments do not bind to its
            constructor, the class or an argument cannot be pickled (named), or the class's
            own check refuses it (a :class:`~asyncexec.RolloutServer` whose ``chunks`` is not
            an async generator function).
    """

    __slots__ = ("args", "cls", "kwargs", "max_concurrency")
    cls: type[T]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    #: How many calls of the plain methods of one instance may run at once (1 by default).
    max_concurrency: int

    def __init__(self, cls: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> None:
        if not isinstance(cls, type):
            raise ConfigurationError(
                f"Role() takes a class, got {type(cls).__name__}: {short_repr(cls)}"
            )
        _check_constructor(cls, args, kwargs)
        _check_class(cls)
        _check_pickles(cls, args, kwargs)
        object.__setattr__(self, "cls", cls)
        object.__setattr__(self, "args", tuple(args))
        object.__setattr__(self, "kwargs", dict(kwargs))
        object.__setattr__(self, "max_concurrency", 1)

    def options(self, *, max_concurrency: int) -> Role[T]:
        """This role with other options (as Ray's ``.options()``).

        Args:
            max_concurrency: how many calls of the plain (``def``) methods of one instance may
                run at once, each in a thread of its own (1 by default: one at a time, as on a
                plain Ray actor). ``async def`` methods run concurrently on the worker's event
                loop whatever this is, and are not counted.

        Raises:
            ConfigurationError: ``max_concurrency`` is not a positive int.
        """
        if (
            not isinstance(max_concurrency, int)
            or isinstance(max_concurrency, bool)
            or max_concurrency < 1
        ):
            raise ConfigurationError(
                f"max_concurrency must be a positive int, got {max_concurrency!r}"
            )
        return _rebuild_role(self.cls, self.args, dict(self.kwargs), max_concurrency)

    @property
    def name(self) -> str:
        """The class's qualified name, as messages name the role."""
        return self.cls.__qualname__

    def spec(self) -> RoleSpec:
        """The record a worker receives."""
        return RoleSpec(self.cls, self.args, dict(self.kwargs), self.max_concurrency)

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name: str) -> NoReturn:
        raise FrozenInstanceError(f"cannot delete field {name!r}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Role):
            return NotImplemented
        mine = (self.cls, self.args, self.kwargs, self.max_concurrency)
        return mine == (other.cls, other.args, other.kwargs, other.max_concurrency)

    def __hash__(self) -> int:
        return hash(self.cls)  # the arguments may not hash (a config dict)

    def __repr__(self) -> str:
        shown = [self.cls.__qualname__, *map(short_repr, self.args)]
        shown += [f"{k}={short_repr(v)}" for k, v in self.kwargs.items()]
        options = f".options(max_concurrency={self.max_concurrency})"
        return f"Role({', '.join(shown)})" + (options if self.max_concurrency != 1 else "")

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild_role, (self.cls, self.args, dict(self.kwargs), self.max_concurrency)


def _rebuild_role(
    cls: type, args: tuple[Any, ...], kwargs: dict[str, Any], max_concurrency: int = 1
) -> Role[Any]:
    role: Role[Any] = object.__new__(Role)
    object.__setattr__(role, "cls", cls)
    object.__setattr__(role, "args", args)
    object.__setattr__(role, "kwargs", kwargs)
    object.__setattr__(role, "max_concurrency", max_concurrency)
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
    values: list[tuple[str, Any]] = [("the class", cls)]
    values += [(f"argument {i}", v) for i, v in enumerate(args)]
    values += [(f"keyword argument {k!r}", v) for k, v in kwargs.items()]
    for what, value in values:
        try:
            pickled(value)
        except Exception as exc:
            raise ConfigurationError(
                f"Role({cls.__qualname__}): {what} ({type(value).__name__}) cannot be pickled "
                f"to be sent to the workers: {describe(exc)}"
            ) from exc


def _check_class(cls: type) -> None:
    """The class's own check of itself, when it has one (``RolloutServer``: its ``chunks``).

    Raises:
        ConfigurationError: what the check said.
    """
    check = getattr(cls, "_asyncexec_check_class", None)
    if callable(check):
        try:
            check()
        except TypeError as exc:
            raise ConfigurationError(str(exc)) from exc


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
    return bytes(pickled(tuple(pickled(r.spec()) for r in roles)))


@dataclass(frozen=True)
class NamedMethod:
    """A method named with the class it is called through (see :func:`method`)."""

    cls: type
    name: str
    fn: Callable[..., Any]

    @property
    def __wrapped__(self) -> Callable[..., Any]:  # its signature is the method's
        return self.fn

    def __call__(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise TypeError(
            f"{qualname(self)} names a method for Executor.call(), stream() or run(); "
            "it cannot be called here"
        )

    def __repr__(self) -> str:
        return f"asyncexec.method({self.cls.__qualname__}, {self.name!r})"


def method(cls: type, fn: Callable[..., Any] | str) -> Callable[..., Any]:
    """Name a method with the class whose instance it is for, where ``cls.method`` cannot say.

    In Python, ``Actor.who`` is the very function ``Base.who`` when ``Actor`` inherits it, and
    ``SubCritic.values`` is ``Critic.values``: a call given ``Actor.who`` cannot tell which
    role's instance is meant when several colocated roles inherit it, and one given
    ``SubCritic.values`` runs on the ``Critic`` role's instance. ``asyncexec.method(Actor,
    Actor.who)`` (or ``asyncexec.method(Actor, "who")``) names the class: a call goes to the
    instance of the role whose class is ``cls`` itself, and is refused when no role's is::

        await ex.call(asyncexec.method(Actor, Actor.who), on=asyncexec.rank(0))

    Args:
        cls: the class the method is called through (a role's class, for the call to go).
        fn: the method (``cls.name``), or its name.

    Raises:
        ConfigurationError: ``cls`` is not a class, has no such method, or ``fn`` is not the
            method ``cls`` has under its name.
    """
    if not isinstance(cls, type):
        raise ConfigurationError(
            f"asyncexec.method() takes a class, got {type(cls).__name__}: {short_repr(cls)}"
        )
    name = fn if isinstance(fn, str) else getattr(fn, "__name__", None)
    if not isinstance(name, str) or not callable(getattr(cls, name, None)):
        raise ConfigurationError(f"{cls.__qualname__} has no method {short_repr(name or fn)}")
    found = getattr(cls, name)
    if not isinstance(fn, str) and not _defines(cls, name, fn):
        raise ConfigurationError(
            f"asyncexec.method({cls.__qualname__}, {qualname(fn)}): {qualname(fn)} is not "
            f"{cls.__qualname__}.{name}"
        )
    return NamedMethod(cls, name, found)


def method_of(fn: Callable[..., Any], roles: Sequence[Role[Any]]) -> RoleMethod | None:
    """Which role's method ``fn`` is, as ``RoleMethod(role_index, name)``; None for a function
    that is no class's method (it runs as ``execute()`` runs it).

    ``fn`` is a role's method when ``getattr(cls, fn.__name__) is fn`` for the role's class
    (inherited methods too). Static and class methods of a role's class count as its methods:
    they are called through the rank's instance, which changes nothing for them. A static method
    of another class is a plain function; a bound method of an object (``obj.method``) is a plain
    callable. A function defined in another class's body is refused, since it needs an instance
    that no rank holds.

    A method named with :func:`method` is the method of the role whose class is the one
    named, and no other's.

    Raises:
        ConfigurationError: ``fn`` is a method of a class that is not a role, or of several
            roles (a base class's method that two roles inherit).
    """
    if isinstance(fn, NamedMethod):
        return _named(fn, roles)
    name = getattr(fn, "__name__", None)
    if not isinstance(name, str):
        return None
    found = [i for i, role in enumerate(roles) if _defines(role.cls, name, fn)]
    if len(found) > 1:
        which = ", ".join(roles[i].name for i in found)
        first = roles[found[0]].name
        raise ConfigurationError(
            f"{qualname(fn)} is a method of several roles ({which}), which inherit it: the "
            "call cannot tell whose instance it is for; name the class: "
            f"asyncexec.method({first}, {first}.{name})"
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
        f"{qualname(fn)} is a method of {owner_name}, which is not a role of this executor "
        f"(roles: {names}){hint}"
    )


def _named(fn: NamedMethod, roles: Sequence[Role[Any]]) -> RoleMethod:
    for i, role in enumerate(roles):
        if role.cls is fn.cls:
            return RoleMethod(i, fn.name)
    names = ", ".join(r.name for r in roles) or "none"
    raise ConfigurationError(
        f"{qualname(fn)}: {fn.cls.__qualname__} is not a role of this executor (roles: {names})"
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


#: Whether each class seen has a coroutine method (see :func:`plain_only`).
_ASYNC: dict[type, bool] = {}


def plain_only(roles: Sequence[Role[Any]]) -> bool:
    """Whether a group with ``roles`` has worker classes and none of them has a coroutine
    method (an ``async def`` or an async generator, through its MRO): Ray's own rule for a
    sync actor, made per group. Such a group's workers are threaded sync actors (its plain
    calls cost what a sync Ray actor's do); any other group's are async actors."""
    return bool(roles) and not any(_has_async(role.cls) for role in roles)


def _has_async(cls: type) -> bool:
    """Whether ``cls`` has a coroutine method: each name as the class resolves it (a plain
    override of a base's ``async def`` is plain), a static or class method's function too."""
    found = _ASYNC.get(cls)
    if found is None:
        found, seen = False, set()
        for klass in cls.__mro__:
            for name, value in vars(klass).items():
                if name not in seen:
                    seen.add(name)
                    fn = getattr(value, "__func__", value)
                    found = found or inspect.iscoroutinefunction(fn)
                    found = found or inspect.isasyncgenfunction(fn)
        if len(_ASYNC) < 1024:  # a program has a few worker classes
            _ASYNC[cls] = found
    return found


def takes_self(cls: type, name: str) -> bool:
    """Whether ``cls.name`` is called with the instance as its first argument (not a static or
    class method)."""
    for klass in cls.__mro__:
        if name in vars(klass):
            return not isinstance(vars(klass)[name], staticmethod | classmethod)
    return True


def qualname(fn: Callable[..., Any]) -> str:
    if isinstance(fn, NamedMethod):
        return f"{fn.cls.__qualname__}.{fn.name}"
    return str(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn))
