"""A worker's remote methods as the driver calls them: :func:`proxy` gives a typed proxy of one
worker whose methods are the worker interface's (``_wire._interface``), each returning a
:class:`~._calls.Call` of what the interface says the method returns: its errors mapped to
asyncexec's, cancellable. No method is named by a string above the seam: mypy checks every
call's method, arguments and result against the interface (the proxy implements it, and
``tests/worker/test_worker_interface.py`` checks its signatures as it checks the workers')."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from ..._wire._interface import WorkerInterface, WorkerMethod
from ..._wire._protocol import (
    Outcome,
    Poll,
    PreemptionNotice,
    RunStart,
    WorkerContext,
    WorkerMetadata,
)
from ..._wire._tracing import Carried
from ._calls import Call, Caller, Member, Naming, submit, submit_n, submit_named

__all__ = ["WorkerProxy", "proxy"]


class WorkerProxy:
    """One worker's remote methods, each call made through the seam (see the module's
    docstring); ``naming`` (a call's plan) names the user's arguments in the messages of a call
    whose arguments do not pickle."""

    __slots__ = ("_caller", "_naming", "_who")

    def __init__(self, caller: Caller, who: Member, naming: Naming | None = None) -> None:
        self._caller = caller
        self._who = who
        self._naming = naming

    def __repr__(self) -> str:
        return f"<WorkerProxy rank {self._who.rank}>"

    def _call(self, method: WorkerMethod, /, *args: Any, **kwargs: Any) -> Call[Any]:
        naming = self._naming
        if naming is None:
            return submit(self._caller, self._who, method, *args, **kwargs)
        return submit_named(self._caller, self._who, naming, method, *args, **kwargs)

    # Start-up, calls and roles.

    def describe(self) -> Call[WorkerMetadata]:
        return self._call("describe")

    def setup(
        self,
        env: Mapping[str, str],
        context: WorkerContext,
        init_hook: Callable[[], object] | None,
        data_context: Any = None,
    ) -> Call[Outcome]:
        return self._call("setup", env, context, init_hook, data_context)

    def execute(
        self, fn: Callable[..., Any] | Carried, /, *args: Any, **kwargs: Any
    ) -> Call[Outcome]:
        return self._call("execute", fn, *args, **kwargs)

    def make_roles(
        self,
        payload: bytes,
        checkpoint: Any = None,
        context: Callable[[], AbstractContextManager[Any]] | None = None,
    ) -> Call[Outcome]:
        return self._call("make_roles", payload, checkpoint, context)

    def call_role(self, role_index: int, name: str, /, *args: Any, **kwargs: Any) -> Call[Outcome]:
        return self._call("call_role", role_index, name, *args, **kwargs)

    def call_method(
        self, key: str | Carried | list[Any], /, *args: Any, **kwargs: Any
    ) -> Call[Any]:
        return self._call("call_method", key, *args, **kwargs)

    def call_method_sync(
        self, key: str | Carried | list[Any], /, *args: Any, **kwargs: Any
    ) -> Call[Any]:
        return self._call("call_method_sync", key, *args, **kwargs)

    # A run.

    def start_run(self, payload: bytes, start: RunStart) -> Call[None]:
        return self._call("start_run", payload, start)

    def poll(self, ack: int, max_items: int) -> Call[Poll]:
        return self._call("poll", ack, max_items)

    def salvage(self) -> Call[Poll | None]:
        return self._call("salvage")

    def buffered(self) -> Call[int]:
        return self._call("buffered")

    def stop_run(self, timeout_s: float) -> Call[bool]:
        return self._call("stop_run", timeout_s)

    def reset(
        self, stop_timeout_s: float, reset_hook: Callable[[], object] | None
    ) -> Call[Outcome]:
        return self._call("reset", stop_timeout_s, reset_hook)

    # Weight channels.

    def channel_read(self, name: str, timeout_s: float, mapping: bool) -> Call[tuple[str, Any]]:
        return self._call("channel_read", name, timeout_s, mapping)

    def channel_read_parts(self, name: str, timeout_s: float, mapping: bool) -> tuple[Any, Any]:
        """:meth:`channel_read` as two references (the state's type and the state), to pass
        to other workers' calls or to await through ``result_of`` (a Ray cluster's only)."""
        first, second = submit_n(
            self._caller, self._who, "channel_read", 2, name, timeout_s, mapping
        )
        return first, second

    def channel_receive(self, name: str, version: int, *shards: Any) -> Call[None]:
        return self._call("channel_receive", name, version, *shards)

    def channel_port(self, name: str, group_id: str, timeout_s: float) -> Call[tuple[str, int]]:
        return self._call("channel_port", name, group_id, timeout_s)

    def channel_cuda(self) -> Call[bool]:
        return self._call("channel_cuda")

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
    ) -> Call[None]:
        return self._call(
            "channel_join", name, group_id, address, port, rank, size, backend, timeout_s
        )

    def channel_snapshot(self, name: str, version: int, timeout_s: float) -> Call[Any]:
        return self._call("channel_snapshot", name, version, timeout_s)

    def channel_send(self, name: str, version: int, group_id: str) -> Call[int]:
        return self._call("channel_send", name, version, group_id)

    def channel_receive_torch(
        self, name: str, version: int, parts: list[Any], device: str, reuse: bool
    ) -> Call[int]:
        return self._call("channel_receive_torch", name, version, parts, device, reuse)

    def channel_close(self, name: str) -> Call[None]:
        return self._call("channel_close", name)

    # Health and the worker's life.

    def notify_preemption(self, notice: PreemptionNotice | None) -> Call[None]:
        return self._call("notify_preemption", notice)

    def ping(self) -> Call[int]:
        return self._call("ping")

    def wait_closed(self) -> Call[None]:
        return self._call("wait_closed")

    def close(self) -> Call[None]:
        return self._call("close")


if TYPE_CHECKING:  # the proxy's methods are the interface's (mypy checks them)
    _IMPLEMENTS: type[WorkerInterface] = WorkerProxy


#: ``proxy(caller, who, naming=None)``: ``who``'s remote methods, called through the seam for
#: ``caller`` (whose attempt and node table its errors take); ``naming`` names the user's
#: arguments in messages. The class itself: a call's hot path makes one object, no more.
proxy = WorkerProxy
