"""The worker's remote methods, as one typed protocol: what the driver may call on a worker.

Four classes implement :class:`WorkerInterface`: the Ray actor's code
(``asyncexec._worker._actor``), the threaded Ray actor's, which runs that code on a loop of its own
and answers with plain methods (``asyncexec._worker._threaded``), the local worker, which hosts that
same code in a thread of the driver's process (``_driver/cluster/_local.py``), and the simulated
worker (``_driver/cluster/_sim.py``), which answers every call on the driver's own loop. mypy checks
each against it, and ``tests/worker/test_worker_interface.py`` checks that every method is there
with the same parameters. The driver names a method in a handle's ``call`` as a
:data:`WorkerMethod`, so mypy checks the name at every call site (the arguments are checked by the
tests that run them).

A method returns an awaitable: the actor's are ``async def``; a simulated worker's answer at once
or later without a task of their own (the threaded actor's return values: Ray makes either
kind an ``ObjectRef`` for the driver). A Ray actor's graceful exit is Ray's, not the worker's:
the cluster's ``kill`` asks for it.

The driver calls a role's method with ``call_method(key, *args)`` (``call_method_sync`` for a
plain method of a role that runs one call at a time): the role and the method's name travel as
one key (:func:`method_key`), and a value of a :data:`BARE_TYPES` type comes back as it is, any
other value or failure as an :class:`Outcome` (:func:`as_outcome` makes either an outcome).
``call_role(role_index, name, *args)`` is the same call answered as an outcome. The Ray handle
sends the key and the arguments of such a call as ONE argument when it can (:func:`packed`: no
keyword arguments, no ``ObjectRef`` among them, which Ray resolves only at the top): each
argument of a Ray call costs its own serialisation on the driver and on the worker. The
worker's ``call_method`` and ``call_method_sync`` take either form (:func:`unpacked`).

Both sides import this module; it imports only the standard library and ``_protocol``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any, Literal, Protocol

from ._protocol import Outcome, Poll, PreemptionNotice, RunStart, WorkerContext, WorkerMetadata
from ._tracing import Carried

__all__ = [
    "BARE_TYPES",
    "WORKER_METHODS",
    "WorkerInterface",
    "WorkerMethod",
    "as_outcome",
    "method_key",
    "packed",
    "parse_key",
    "unpacked",
]

#: What a role method's call returns as it is when it succeeds (``call_method``): a value of
#: these types travels as Ray sends it (no record around it, nothing pickled); any other
#: value, and every failure, as an :class:`Outcome`. A bare value is never an ``Outcome``.
BARE_TYPES: frozenset[type] = frozenset({type(None), bool, int, float, str, bytes})


def method_key(role_index: int, name: str) -> str:
    """How ``call_method`` names method ``name`` of role ``role_index``: one small string (Ray
    serialises each argument of a call apart: one argument, not two)."""
    return f"{role_index}:{name}"


def parse_key(key: str) -> tuple[int, str]:
    """The role index and the method's name of a :func:`method_key`.

    Raises:
        ValueError: not such a key.
    """
    index, sep, name = key.partition(":") if isinstance(key, str) else ("", "", "")
    if sep and name and index.isdigit():
        return int(index), name
    raise ValueError(f"not a role method's key: {key!r}")


def packed(args: tuple[Any, ...]) -> list[Any]:
    """``call_method``'s method key and positional arguments (``args``, the key first) as the
    one argument the Ray handle sends: a list, which Ray's serialiser writes as MessagePack
    where its items are of plain types (a tuple, or any other object, would be pickled).
    The key may be wrapped (a trace context carried with it): :func:`unpacked` leaves it as
    it is."""
    return list(args)


def unpacked(lead: Any, args: tuple[Any, ...]) -> tuple[Any, tuple[Any, ...]]:
    """The method key and the arguments of a ``call_method`` (``call_method_sync``) whose
    leading argument is ``lead`` and the rest ``args``: those of a :func:`packed` call, or
    ``lead`` and ``args`` as they are (a key is never a list)."""
    if type(lead) is list:
        return lead[0], tuple(lead[1:])
    return lead, args


def as_outcome(answer: Any) -> Outcome:
    """A role method's answer (``call_method``'s: a bare value or an outcome) as an outcome."""
    return answer if type(answer) is Outcome else Outcome("ok", answer)


class WorkerInterface(Protocol):
    """A worker's remote methods (see the actor's code for what each does)."""

    # Start-up, calls and roles.

    def describe(self) -> Awaitable[WorkerMetadata]: ...

    def setup(
        self,
        env: Mapping[str, str],
        context: WorkerContext,
        init_hook: Callable[[], object] | None,
        data_context: Any = None,
    ) -> Awaitable[Outcome]: ...

    def execute(
        self, fn: Callable[..., Any] | Carried, /, *args: Any, **kwargs: Any
    ) -> Awaitable[Outcome]: ...

    def make_roles(
        self,
        payload: bytes,
        checkpoint: Any = None,
        context: Callable[[], AbstractContextManager[Any]] | None = None,
    ) -> Awaitable[Outcome]: ...

    def call_role(
        self, role_index: int, name: str, /, *args: Any, **kwargs: Any
    ) -> Awaitable[Outcome]: ...

    def call_method(
        self, key: str | Carried | list[Any], /, *args: Any, **kwargs: Any
    ) -> Awaitable[Any]: ...

    def call_method_sync(
        self, key: str | Carried | list[Any], /, *args: Any, **kwargs: Any
    ) -> Awaitable[Any]: ...

    # A run.

    def start_run(self, payload: bytes, start: RunStart) -> Awaitable[None]: ...

    def poll(self, ack: int, max_items: int) -> Awaitable[Poll]: ...

    def salvage(self) -> Awaitable[Poll | None]: ...

    def buffered(self) -> Awaitable[int]: ...

    def stop_run(self, timeout_s: float) -> Awaitable[bool]: ...

    def reset(
        self, stop_timeout_s: float, reset_hook: Callable[[], object] | None
    ) -> Awaitable[Outcome]: ...

    # Weight channels.

    def channel_read(
        self, name: str, timeout_s: float, mapping: bool
    ) -> Awaitable[tuple[str, Any]]: ...

    def channel_receive(self, name: str, version: int, *shards: Any) -> Awaitable[None]: ...

    def channel_port(
        self, name: str, group_id: str, timeout_s: float
    ) -> Awaitable[tuple[str, int]]: ...

    def channel_cuda(self) -> Awaitable[bool]: ...

    def channel_join(
        self,
        name: str,
        group_id: str,
        address: str,
        port: int,
        rank: int,
        size: int,
        backend: str,
        timeout_s: float,
    ) -> Awaitable[None]: ...

    def channel_snapshot(self, name: str, version: int, timeout_s: float) -> Awaitable[Any]: ...

    def channel_send(self, name: str, version: int, group_id: str) -> Awaitable[int]: ...

    def channel_receive_torch(
        self, name: str, version: int, parts: list[Any], device: str, reuse: bool
    ) -> Awaitable[int]: ...

    def channel_close(self, name: str) -> Awaitable[None]: ...

    # Health and the worker's life.

    def notify_preemption(self, notice: PreemptionNotice | None) -> Awaitable[None]: ...

    def ping(self) -> Awaitable[int]: ...

    def wait_closed(self) -> Awaitable[None]: ...

    def close(self) -> Awaitable[None]: ...


#: A worker method's name as a handle's ``call`` takes it (mypy checks the name at every call;
#: ``tests/worker/test_worker_interface.py`` that these are the interface's).
WorkerMethod = Literal[
    "buffered",
    "call_method",
    "call_method_sync",
    "call_role",
    "channel_close",
    "channel_cuda",
    "channel_join",
    "channel_port",
    "channel_read",
    "channel_receive",
    "channel_receive_torch",
    "channel_send",
    "channel_snapshot",
    "close",
    "describe",
    "execute",
    "make_roles",
    "notify_preemption",
    "ping",
    "poll",
    "reset",
    "salvage",
    "setup",
    "start_run",
    "stop_run",
    "wait_closed",
]


#: The names of the worker's remote methods.
WORKER_METHODS: frozenset[str] = frozenset(
    name
    for name, value in vars(WorkerInterface).items()
    if callable(value) and not name.startswith("_")
)
