"""What a simulated worker (see ``_sim``) runs of the user's code: ``execute()``'s functions, the
instances of the group's roles and their methods, the init and reset hooks; and what it holds of
the group's: its context (``get_context()`` works in that code) and the driver's preemption
notice. Weight channels are refused: a simulated worker holds no weights.

The user's code runs on the driver's loop, in the worker's place (as a local worker's runs in
its thread): a plain function or method inline, one call at a time, as a plain Ray actor runs
its methods; a coroutine (an ``async def`` method, or what a function returned) as a task of
the worker's, concurrently with the others, as on an async actor. Its answer is pickled as an
actor's is. A killed worker's tasks are cancelled and their calls fail, as a dead actor's do.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import inspect
import pickle
from collections.abc import Awaitable, Callable
from contextlib import AbstractContextManager
from typing import Any, Literal, Protocol

from ..._errors import ExecutorStateError
from ..._wire._interface import parse_key, unpacked
from ..._wire._pickle import loads_here
from ..._wire._protocol import Outcome, PreemptionNotice, RoleFailure, RoleSpec
from ..._wire._tracing import Carried, plain
from ..._worker import PLACE, Place, cancelled_by_caller, error_outcome, value_outcome
from ._local import LocalCallCancelled
from ._sim_answers import Pending, Ready, ready

__all__ = ["SimCalls"]

ContextFactory = Callable[[], AbstractContextManager[Any]]


class _Clock(Protocol):
    def timed(self, callback: Callable[[], None]) -> None: ...


class SimCalls:
    """The methods of a simulated worker that run the user's code (a mixin of ``SimWorker``,
    which holds the attributes)."""

    __slots__ = ()

    cluster: _Clock
    place: Place
    #: The worker's tasks (its coroutines in progress), each with the answer it owes.
    tasks: dict[asyncio.Task[None], Pending]
    #: Those of its tasks that the driver cancelled (see ``SimWorker.cancel``).
    cancelled: set[asyncio.Task[None]]

    def setup(
        self,
        env: Any,
        context: Any,
        init_hook: Callable[[], object] | None,
        data_context: Any = None,
    ) -> Awaitable[Outcome]:
        self.place.context = context
        if init_hook is None:
            return ready(Outcome("ok"))
        return self._call_here(init_hook, (), {})

    def execute(
        self, fn: Callable[..., Any] | Carried, /, *args: Any, **kwargs: Any
    ) -> Awaitable[Outcome]:
        return self._call_here(plain(fn), args, kwargs)  # (without a call's trace context)

    def make_roles(
        self, payload: bytes, checkpoint: Any = None, context: ContextFactory | None = None
    ) -> Awaitable[Outcome]:
        return self._later(self._remake(payload, checkpoint, context), outcome=True)

    async def _remake(
        self, payload: bytes, checkpoint: Any, context: ContextFactory | None
    ) -> Outcome:
        await self.drop_roles()  # the instances it held let go first (as ``_roles.make``)
        return await self._make(payload, checkpoint, context)

    async def drop_roles(self) -> list[BaseException]:
        """Let go of the instances (as the actor's ``_roles.drop``): each one's ``close()``,
        where its class has one, in reverse role order; the errors they raised."""
        roles, self.place.roles = self.place.roles, None
        errors: list[BaseException] = []
        for instance in reversed(roles if isinstance(roles, list) else []):
            close = getattr(instance, "close", None)
            if callable(close):
                try:
                    await _invoke(close, (), {}, None)  # (no backend here: no context)
                except Exception as exc:
                    errors.append(exc)
        return errors

    def call_role(
        self, role_index: int, name: str, /, *args: Any, **kwargs: Any
    ) -> Awaitable[Outcome]:
        roles, name = self.place.roles, plain(name)  # (without a call's trace context)
        try:
            if not isinstance(roles, list):
                raise ExecutorStateError("this worker holds no instances of roles yet")
            if not 0 <= role_index < len(roles):
                raise ExecutorStateError(
                    f"this worker holds {len(roles)} role(s), not role {role_index}"
                )
            fn = getattr(roles[role_index], name, None)
            if not callable(fn):
                raise ExecutorStateError(
                    f"{type(roles[role_index]).__qualname__} has no method {name!r}"
                )
        except ExecutorStateError as exc:
            return ready(error_outcome(exc))
        return self._call_here(fn, args, kwargs)

    def call_method(
        self, key: str | Carried | list[Any], /, *args: Any, **kwargs: Any
    ) -> Awaitable[Any]:
        """``call_role`` of the method ``key`` (answered as an outcome: the driver takes both);
        the key and the arguments may come as one list (``_interface.packed``)."""
        lead, args = unpacked(key, args)
        lead = plain(lead)  # (without a call's trace context)
        try:
            role_index, name = parse_key(lead)
        except (TypeError, ValueError):
            return ready(error_outcome(ExecutorStateError(f"not a role method: {lead!r}")))
        return self.call_role(role_index, name, *args, **kwargs)

    #: A plain method runs inline here in any case (as on its Ray concurrency group).
    call_method_sync = call_method

    def notify_preemption(self, notice: PreemptionNotice | None) -> Awaitable[None]:
        self.place.preemption = notice
        return ready(None)

    def forget(self) -> None:
        """Drop what the worker holds of the group's (a pooled worker going back)."""
        self.place.roles = self.place.context = self.place.preemption = None

    def fail_tasks(self, error: BaseException) -> None:
        """The worker is gone: its tasks are cancelled and their calls fail with ``error``."""
        for task, pending in list(self.tasks.items()):
            task.cancel()
            pending.fail(error)
        self.tasks.clear()
        self.cancelled.clear()

    # Weight channels: refused.

    def channel_read(
        self, name: str, timeout_s: float, mapping: bool
    ) -> Awaitable[tuple[str, Any]]:
        return _no_channels()

    def channel_receive(self, name: str, version: int, *shards: Any) -> Awaitable[None]:
        return _no_channels()

    def channel_port(
        self, name: str, group_id: str, timeout_s: float
    ) -> Awaitable[tuple[str, int]]:
        return _no_channels()

    def channel_cuda(self) -> Awaitable[bool]:
        return _no_channels()

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
    ) -> Awaitable[None]:
        return _no_channels()

    def channel_snapshot(self, name: str, version: int, timeout_s: float) -> Awaitable[Any]:
        return _no_channels()

    def channel_send(self, name: str, version: int, group_id: str) -> Awaitable[int]:
        return _no_channels()

    def channel_receive_torch(
        self, name: str, version: int, parts: list[Any], device: str, reuse: bool
    ) -> Awaitable[int]:
        return _no_channels()

    def channel_close(self, name: str) -> Awaitable[None]:
        return _no_channels()

    # Running the user's code.

    def _call_here(
        self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Awaitable[Outcome]:
        """Call ``fn`` in the worker's place; a coroutine it returns goes on as a task."""
        token = PLACE.set(self.place)
        try:
            result = fn(*args, **kwargs)
        except Exception as exc:
            return ready(error_outcome(exc))
        finally:
            PLACE.reset(token)
        if inspect.isawaitable(result):
            return self._later(result)
        return ready(value_outcome(result))

    def _later(self, awaitable: Awaitable[Any], *, outcome: bool = False) -> Pending:
        """Await ``awaitable`` in a task of the worker's (in its place); the answer, when it
        ends, is its outcome (``outcome``: it is one)."""
        pending = Pending()

        async def run() -> None:
            try:
                value = await awaitable
            except asyncio.CancelledError as exc:
                if cancelled_by_caller():  # by the driver, or a kill (see ``ended``)
                    raise
                answer = error_outcome(exc)  # the code's own (it awaited a cancelled task)
            except Exception as exc:
                answer = error_outcome(exc)
            else:
                answer = value if outcome else value_outcome(value)
            self.tasks.pop(task, None)
            self.cancelled.discard(task)  # cancelled, and it ended anyway: not kept
            task.remove_done_callback(ended)  # (its callback would keep the task a while)
            self.cluster.timed(lambda: pending.answer(answer))

        def ended(task: asyncio.Task[None]) -> None:
            # Cancelled, perhaps before it started (``run`` never saw it): the answer fails.
            self.tasks.pop(task, None)
            if task in self.cancelled:  # by the driver (a kill has failed it already)
                self.cancelled.discard(task)
                pending.fail(LocalCallCancelled(f"the call was cancelled on {self!r}"))
            if inspect.iscoroutine(awaitable):
                awaitable.close()  # never started: no "never awaited" warning

        inside = contextvars.copy_context()
        inside.run(PLACE.set, self.place)
        task = asyncio.get_running_loop().create_task(run(), context=inside)
        task.add_done_callback(ended)
        self.tasks[task] = pending
        return pending

    async def _make(
        self, payload: bytes, checkpoint: Any, context: ContextFactory | None
    ) -> Outcome:
        """The instances of the roles in ``payload``, in role order (as the actor's
        ``_roles.make``): each checked as its class checks a made instance (a
        ``RolloutServer``'s called ``super().__init__()``), then ``restore(checkpoint)`` when
        given."""
        blobs: tuple[bytes, ...] = pickle.loads(payload)
        instances: list[object] = []
        for index, blob in enumerate(blobs):
            stage: Literal["load", "init", "restore"] = "load"
            try:
                spec: RoleSpec = loads_here(blob)  # the driver's classes left as they are
                stage = "init"
                instance = await _invoke(spec.cls, spec.args, spec.kwargs, context)
                made = getattr(instance, "_asyncexec_check_made", None)
                if callable(made):  # the class's check of a made instance (RolloutServer's)
                    made()
                restore = getattr(instance, "restore", None)
                if checkpoint is not None and callable(restore):
                    stage = "restore"
                    await _invoke(restore, (checkpoint,), {}, context)
            except Exception as exc:
                return error_outcome(exc)._replace(value=RoleFailure(index, stage))
            instances.append(instance)
        self.place.roles = instances
        return Outcome("ok")


async def _invoke(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    context: ContextFactory | None,
) -> Any:
    with context() if context is not None else contextlib.nullcontext():
        result = fn(*args, **kwargs)
        if inspect.isawaitable(result):
            result = await result
    return result


def _no_channels() -> Ready:
    error = NotImplementedError("a simulated worker holds no weights (a channel needs workers)")
    return Ready(None, error)
