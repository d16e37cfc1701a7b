"""One request through the router: its attempts (each a plain asyncio task, on one server,
holding that server's slot until the remote call ends), its deadline per attempt, its
retries, and its answer returned once: the first sample that comes back is the answer, and every
later one is dropped and counted (``duplicates_dropped``; ``late_dropped`` for answers that come
after the request gave up).

Who owns the attempts. :class:`Requests` does, as a task group would, without being one: every
attempt's task is in its registry until it ends (a done callback takes it out); the router's
close cancels every one and waits for them all, bounded by ``teardown()`` (an attempt whose call
never answers its cancellation is left rather than hold the close); and an attempt that fails
other than through its call (a defect in its own bookkeeping) fails the router and answers its
request with that error, as a task group's failed task cancels its group and is raised, instead
of being lost with its caller waiting. It is not one of the router's anyio task group: a task
group's task holds more objects a request in flight (a task handle, its finished event, a
wrapper coroutine, a done callback and its cells, the task's state and a weak reference), which
every collection of the older generations walks, for no saving in the driver's time a request.
The registry and the callback add no object a request (the callback is bound once, and run in
one context).

See ``_router`` for the rules of where a request goes and when it is sent again.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import time
from collections import deque
from collections.abc import Hashable, Iterator, Mapping
from types import MappingProxyType
from typing import Any, Literal

import anyio
import anyio.lowlevel

from ..._dispatch._role import qualname
from ..._dispatch._targets import rank as on_rank
from ..._errors import ExecutorStateError, WorkerHungError, describe
from ..._wire._rollout import RolloutRequest, Sample
from ..._wire._tracing import as_call, as_first_call, tracer, under_request
from .._executor import ExecutorState
from .._taskgroups import teardown
from ._events import (
    AnswerDropped,
    RequestAnswered,
    RequestReceived,
    RequestRetried,
    RequestTimedOut,
)
from ._health import GONE
from ._router_host import RequestsHost
from ._router_state import Balance

__all__ = ["Requests"]

#: Requests a pause to abort answers in one turn of the event loop (each wakes its caller).
HAND_BACK = 16
#: The states of the servers' executor in which a request is refused.
_SHUT = frozenset({ExecutorState.CLOSING, ExecutorState.CLOSED})


#: Why an attempt was cancelled: its server taken out by the health watch, its stoppable
#: request's caller cancelled, or the router closing.
_Why = Literal["taken_out", "stopped", "closed"]


class _Answer:
    """One attempt: its server, its task, and what came of it (its sample, or its error).

    An attempt is a plain task, not one of the router's anyio task group: a task group's task
    is a task handle with a cancel scope of its own, two events, a wrapper coroutine and a done
    callback with its cells besides, each walked by every collection of the older generations
    while the request is in flight. It runs in its own cancel scope (an anyio one: its
    cancellation waits out the shielded parts of the call's path, as a task group's would),
    cancelled through :meth:`cancel`, which says why."""

    __slots__ = (
        "error",
        "handed",
        "held",
        "inbox",
        "rank",
        "sample",
        "scope",
        "task",
        "why",
        "worker",
    )

    def __init__(self, rank: int, worker: str | None, sample: Sample | None = None) -> None:
        self.rank = rank
        self.worker = worker
        self.sample = sample
        self.error: BaseException | None = None
        self.inbox: _Inbox | None = None  # the request's, where the answer goes
        self.task: asyncio.Task[None] | None = None
        self.scope = anyio.CancelScope()  # (cancelled before it is entered: at its entry)
        self.why: _Why | None = None  # cancelled, and why
        #: Its aborted sample came back in the server's pause reply (``hand_back``): the
        #: attempt's own reply, later, is dropped uncounted.
        self.handed = False
        #: Its generation ended in a pause to abort that collected it: its slot was given back
        #: then, and its own reply comes after the resume.
        self.held = False

    @property
    def taken_out(self) -> bool:
        """It was cancelled by the health watch (or by its stopped request: sent nowhere)."""
        return self.why in ("taken_out", "stopped")

    def cancel(self, why: _Why = "taken_out") -> None:
        """Stop the attempt (the health watch: its server is taken out)."""
        if self.why is None:
            self.why = why
            self.scope.cancel()


class _Inbox:
    """A request's answers, from its attempts (and a pause's hand-back), in the order they
    came. Lighter than a memory object stream, whose ``receive()`` waits inside its ``except
    WouldBlock`` (the exception and two tracebacks with their frames kept alive a request in
    flight) with two streams, a deque, two dicts and two events besides: every collection of
    the older generations walks what the requests in flight hold."""

    __slots__ = ("closed", "items", "scope", "waiter")

    def __init__(self) -> None:
        self.items: deque[_Answer] = deque()
        self.waiter: asyncio.Future[None] | None = None
        #: The request's wait for a slot to send itself again, cancelled by the next answer.
        self.scope: anyio.CancelScope | None = None
        self.closed = False

    def put(self, answer: _Answer) -> bool:
        """Deliver ``answer``; False when the request is over (it takes no more)."""
        if self.closed:
            return False
        self.items.append(answer)
        if self.scope is not None:
            self.scope.cancel()
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        return True

    def arm(self) -> asyncio.Future[None]:
        """A future settled by the next answer: awaited as it is (``await inbox.arm()``, no
        coroutine of its own a waiting request), then ``disarm()``."""
        self.waiter = asyncio.get_running_loop().create_future()
        return self.waiter

    def disarm(self) -> None:
        self.waiter = None

    def close(self) -> list[_Answer]:
        """The request is over: what came and was not taken."""
        self.closed = True
        rest = list(self.items)
        self.items.clear()
        return rest


class _Fate:
    """What became of a request, as its attempts see it: whether it was answered, and its
    attempts in flight."""

    __slots__ = ("answered", "attempts")

    def __init__(self) -> None:
        self.answered = False
        self.attempts: list[_Answer] = []


class Requests:
    """The requests of one router (``router``: the :class:`~asyncexec.Router`, seen through
    :class:`~._router_host.RequestsHost`)."""

    def __init__(self, router: RequestsHost) -> None:
        self.router = router
        #: The attempts in flight by server and request id (each knows its request's inbox: a
        #: pause to abort answers them from the servers' replies).
        self.live: dict[tuple[int, Hashable], list[_Answer]] = {}
        self.held = 0  # attempts collected by a pause to abort whose own replies are to come
        self._held_in = anyio.Event()
        self._resuming = 0  # resumes in flight: the hand-back waits for them
        self._resumed = anyio.Event()
        #: Every attempt's task until it ends: what the router's close cancels and waits for.
        self.attempts: dict[asyncio.Task[None], _Answer] = {}
        # The attempts' done callback, bound once and run in one context: no object an attempt.
        self._ended_cb = self._ended
        self._context = contextvars.copy_context()

    @contextlib.contextmanager
    def resuming(self) -> Iterator[None]:
        """A resume is in flight: a hand-back waits until it has ended (its callers' wake-ups
        would hold the resume's replies back, 16 a turn of the loop)."""
        self._resuming += 1
        try:
            yield
        finally:
            self._resuming -= 1
            if not self._resuming:
                self._resumed.set()
                self._resumed = anyio.Event()

    async def after_resume(self) -> None:
        """Until no resume is in flight (at once when none is)."""
        while self._resuming:
            await self._resumed.wait()

    async def wait_held(self) -> None:
        """Until the attempts collected by a pause to abort have had their own replies."""
        while self.held:
            await self._held_in.wait()

    async def run(
        self, request: RolloutRequest, deadline_s: float | None, retry: bool, stop: bool = False
    ) -> Sample:
        """See ``Router.generate``; ``stop``: ``Router.generate_stoppable``."""
        router = self.router
        router.check_open()
        _check_servers(router)
        await router.pacer.wait_turn()  # many requests at once: their starts spread over turns
        router.observer.emit(RequestReceived())
        inbox = _Inbox()
        fate = _Fate()
        tried: list[int] = []
        limit = len(router.balance.servers) + 1  # attempts at most
        sent_at = 0.0  # when the latest attempt was sent (0: make one at once)
        try:
            while True:
                # (An answer already in, of an attempt that ended, is read first.)
                if not inbox.items and (not fate.attempts or _due(sent_at, deadline_s)):
                    if tried and (not retry or len(tried) >= limit):
                        raise self._gave_up(request, tried, deadline_s)
                    # With attempts in flight, an answer that comes while this one waits for
                    # a slot is read first (it is the answer, or the reason to send again).
                    r = await self._take(request, tried, inbox if fate.attempts else None)
                    if r is not None:
                        if tried:  # another attempt of this request
                            router.observer.emit(RequestRetried())
                        tried.append(r)
                        sent_at = time.monotonic()
                        self._start(r, request, inbox, fate, first=len(tried) == 1)
                answer: _Answer | None
                if deadline_s is None:  # (the future awaited here: no coroutine of its own)
                    while not inbox.items:
                        try:
                            await inbox.arm()
                        finally:
                            inbox.disarm()
                    answer = inbox.items.popleft()
                else:
                    answer = await _next(inbox, sent_at, deadline_s)
                if answer is None:
                    continue  # the deadline passed: another attempt, or give up
                if answer.sample is not None:
                    fate.answered = True
                    router.observer.emit(RequestAnswered(answer.rank))
                    if request.key is not None:
                        router.sessions.pin(request.key, answer.rank, answer.worker)
                    return answer.sample
                error = answer.error
                assert error is not None
                if not retry or not (answer.taken_out or isinstance(error, GONE)):
                    raise error
                if len(tried) >= limit:
                    if fate.attempts or inbox.items:
                        # Sent as often as it may be, but other attempts may answer yet (or
                        # answered): it waits for them (to the latest one's deadline).
                        continue
                    error.add_note(f"sent {len(tried)} times: every server it went to failed")
                    raise error
                # At info: the server's loss is the warning (``server_lost``, ``server_taken_out``),
                # once, not once for each of its requests (hundreds in an engine's batch).
                router.log.info(
                    "request_sent_again",
                    function=f"{router.methods.cls.__qualname__}.generate",
                    rank=answer.rank,
                    error=describe(error),
                )
                sent_at = 0.0
        except BaseException:  # cancelled, or given up (its deadline, an attempt's error)
            if stop:
                _stop_attempts(fate)
            raise
        finally:
            self._drop_rest(inbox, fate)

    def _start(
        self, r: int, request: RolloutRequest, inbox: _Inbox, fate: _Fate, first: bool
    ) -> None:
        """Attempt ``request`` on server ``r`` (whose slot it holds): a plain task, in its
        server's record and the request's (to be cancelled) and in ``live`` until it ends."""
        server = self.router.balance.servers[r]
        answer = _Answer(r, server.worker)
        answer.inbox = inbox
        server.scopes.add(answer)
        fate.attempts.append(answer)
        self.live.setdefault((r, request.id), []).append(answer)
        task = asyncio.get_running_loop().create_task(self._attempt(answer, request, fate, first))
        answer.task = task
        self.attempts[task] = answer
        task.add_done_callback(self._ended_cb, context=self._context)

    def _ended(self, task: asyncio.Task[None]) -> None:
        """An attempt's task ended. One that raised other than through its call (which its
        request is answered with) is a defect of the request path: it fails the router and
        answers its request, as a failed task would fail its task group."""
        answer = self.attempts.pop(task, None)
        if task.cancelled() or (error := task.exception()) is None:
            return
        if not isinstance(error, Exception):
            return  # a KeyboardInterrupt, SystemExit: asyncio raises it from the loop itself
        self.router.log.error("router_attempt_failed", error=describe(error))
        self.router.fail(error)
        inbox = answer.inbox if answer is not None else None
        if answer is not None and inbox is not None:
            answer.inbox = None
            answer.sample, answer.error = None, error
            inbox.put(answer)

    async def close(self) -> None:
        """The router closes: cancel every attempt in flight, and wait until each has ended
        (its caller is answered with ``ExecutorStateError``)."""
        tasks = list(self.attempts)  # (every one: also on a server record replaced since)
        for task in tasks:
            self.attempts[task].cancel("closed")
        if tasks:
            # Bounded: an attempt whose call never answers its cancellation (a server stuck
            # in a blocking call) is left behind rather than hold the close for ever.
            with teardown("router_attempts"):
                await asyncio.wait(tasks)

    async def _take(
        self, request: RolloutRequest, tried: list[int], inbox: _Inbox | None = None
    ) -> int | None:
        """A server for ``request`` under the cap (waiting for one), counted as holding it;
        None when ``inbox`` (the request's, while attempts of it are in flight) has an answer
        first: a request past its deadline, waiting for a slot to send itself again, takes
        the answer of its earlier attempt as it comes, not once a slot is free."""
        router = self.router
        balance: Balance = router.balance
        key = request.key

        def check() -> None:
            router.check_open()
            _check_servers(router)
            router.watch.follow_group()

        session = None if key is None or tried else (lambda: router.sessions.get(key))
        if inbox is None:
            r = await balance.acquire(tried, session, check)
        else:
            if inbox.items:
                return None
            taken: int | None = None
            with anyio.CancelScope() as scope:  # cancelled by the inbox's next answer
                inbox.scope = scope
                try:
                    taken = await balance.acquire(tried, session, check)
                finally:
                    inbox.scope = None
            if taken is None:
                return None
            if inbox.items:  # an answer came in the turn the slot did: the slot is not needed
                balance.release(taken)
                return None
            r = taken
        if key is not None:  # the session's server from now on
            router.sessions.pin(key, r, balance.servers[r].worker)
        return r

    def _traced(self, call: Any, rank: int, first: bool) -> Any:
        """``call`` (an attempt's, on server ``rank``) as it is awaited: as it is unless
        traced; else standing for the call, named by what runs (``PolicyServer.generate``),
        the request's span (the first attempt: ``_tracing.as_first_call``) or an
        ``asyncexec.router.attempt`` span of its own (``_tracing.as_call``)."""
        if tracer() is None:
            return call
        attributes = _attempt_attributes(self.router.methods.generate, rank)
        if first:
            return as_first_call(call, "asyncexec.router.attempt", attributes)
        return as_call(under_request("asyncexec.router.attempt", attributes), call)

    async def _attempt(
        self, answer: _Answer, request: RolloutRequest, fate: _Fate, first: bool
    ) -> None:
        """An attempt of ``request`` on server ``answer.rank``: its answer (or error) to the
        request. The server's slot is held until the remote call ends, or until the attempt is
        cancelled (:meth:`_Answer.cancel`: the health watch took the server out, the stoppable
        request was stopped, or the router closes)."""
        router = self.router
        r = answer.rank
        server = router.balance.servers[r]
        try:
            with answer.scope:
                await router.pacer.wait_turn()
                call = router.servers.call(router.methods.generate, request, on=on_rank(r))
                sample: Sample = await self._traced(call, r, first)
                answer.sample = sample
                if sample.aborted:  # a pause to abort's: the resume's end comes first
                    await self.after_resume()
        except anyio.get_cancelled_exc_class():
            # Not through its scope: the task itself (the loop closing).
            answer.error = ExecutorStateError("the router closed while the request ran")
            raise
        except Exception as exc:
            answer.error = exc
            if isinstance(exc, GONE):
                router.watch.lost(r, answer.worker)
        finally:
            if answer.scope.cancelled_caught and answer.error is None and answer.sample is None:
                answer.error = (
                    ExecutorStateError("the router closed while the request ran")
                    if answer.why == "closed"
                    else WorkerHungError(r, detail="taken out by the health watch")
                )
            _forget(self.live, (r, request.id), answer)
            server.scopes.discard(answer)
            with contextlib.suppress(ValueError):
                fate.attempts.remove(answer)
            if not answer.held:  # (a held one gave its slot back then)
                router.balance.release(r)
            else:
                self.held -= 1
                if not self.held:
                    self._held_in.set()
                    self._held_in = anyio.Event()
            inbox = answer.inbox
            answer.inbox = None
            if not answer.handed and (inbox is None or not inbox.put(answer)):
                self._dropped(answer, fate)

    async def hand_back(self, replies: dict[int, tuple[int, list[Sample]]]) -> None:
        """The servers' aborted samples, from their pause replies (``RolloutServer.abort``,
        by rank): each answers the oldest attempt in flight there of its request, and gives
        its slot back (the attempt's own reply, after the resume, is dropped); ``HAND_BACK``
        a turn of the event loop (each wakes its caller). A sample whose request is over (it
        gave up, or its caller left) answers nothing: that attempt's own reply counts as
        before, as does one that comes before its sample is handed. While a resume is in
        flight (:meth:`resuming`) none is handed, nor does an aborted sample's own reply
        answer its caller: the resume's end comes first."""
        woken = 0
        for r, (_, samples) in replies.items():
            for sample in samples:
                await self.after_resume()
                if self._hand(r, sample):
                    woken += 1
                    if woken % HAND_BACK == 0:
                        await anyio.lowlevel.checkpoint()

    def _hand(self, r: int, sample: Sample) -> bool:
        router = self.router
        found = self.live.get((r, sample.id), ())
        answer = next((x for x in found if not x.held), None)
        if answer is None or answer.inbox is None:
            return False
        inbox = answer.inbox
        # The generation ended on the server: its slot is free (its reply comes later).
        answer.held = True
        self.held += 1
        router.balance.release(r)
        if not inbox.put(_Answer(r, answer.worker, sample=sample)):
            return False  # the request is over: the attempt's own reply counts as before
        answer.handed = True
        return True

    def _drop_rest(self, inbox: _Inbox, fate: _Fate) -> None:
        """Close the request's answers: those already there, and those still to come, are
        dropped (counted)."""
        for answer in inbox.close():
            self._dropped(answer, fate)

    def _dropped(self, answer: _Answer, fate: _Fate) -> None:
        if answer.sample is None:
            return
        self.router.observer.emit(AnswerDropped(answer.rank, duplicate=fate.answered))

    def _gave_up(
        self, request: RolloutRequest, tried: list[int], deadline_s: float | None
    ) -> TimeoutError:
        self.router.observer.emit(RequestTimedOut(tuple(tried), deadline_s))
        return TimeoutError(
            f"request {request.id!r}: no answer within {deadline_s} s of its attempt "
            f"(sent {len(tried)} time(s), to ranks {tried})"
        )


@functools.lru_cache(maxsize=1024)
def _attempt_attributes(generate: Any, rank: int) -> Mapping[str, Any]:
    """An attempt's span attributes: what it runs (``PolicyServer.generate``) and on which
    server; the same few for every request, so made once (the SDK copies them)."""
    return MappingProxyType({"asyncexec.function": qualname(generate), "asyncexec.rank": rank})


def _due(sent_at: float, deadline_s: float | None) -> bool:
    """Whether another attempt is due: at once (``sent_at`` 0), or the latest attempt's
    deadline passed."""
    if sent_at == 0.0:
        return True
    return deadline_s is not None and time.monotonic() >= sent_at + deadline_s


async def _next(inbox: _Inbox, sent_at: float, deadline_s: float) -> _Answer | None:
    """The next answer, or None once the latest attempt's deadline passes with none come."""
    with anyio.move_on_after(max(0.0, sent_at + deadline_s - time.monotonic())):
        while not inbox.items:
            try:
                await inbox.arm()
            finally:
                inbox.disarm()
        return inbox.items.popleft()
    # An answer may have come in the turn of the loop the deadline's cancellation did (the
    # wait was cancelled first): it is the answer, not a reason to send the request again.
    return inbox.items.popleft() if inbox.items else None


def _check_servers(router: RequestsHost) -> None:
    """Refuse a request while the servers' executor closes or is closed: no server of it
    comes back (until it is entered again), so the request would wait for one until the
    router gives its servers up, minutes later (as a request in flight, this one raises)."""
    if router.servers.state in _SHUT:
        raise ExecutorStateError(
            f"the router's servers ({router.servers.config.name!r}) are closed: close the "
            "Router before its Executor"
        )


def _stop_attempts(fate: _Fate) -> None:
    """A stoppable request ended without an answer (its caller was cancelled, or it gave up):
    its attempts in flight are cancelled too, and so their remote calls (an ``async def``
    ``generate`` stops on its server and frees its slot, rather than run to its end)."""
    for answer in list(fate.attempts):
        answer.cancel("stopped")


def _forget(live: dict[tuple[int, Hashable], list[_Answer]], key: Any, answer: _Answer) -> None:
    found = live.get(key)
    if found is not None:
        with contextlib.suppress(ValueError):
            found.remove(answer)
        if not found:
            del live[key]
