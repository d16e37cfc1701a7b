"""Pipeline: rollouts from servers to a learner under a staleness bound, batches of B, weight
updates while generating, exactly-once consumption. The budget's rule is in ``_budget``;
admission and the requests' tasks in ``_admission``; what it shows in ``_stats``."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterable, Iterable, Mapping
from types import TracebackType
from typing import Any, Literal

import anyio
import anyio.abc

from ..._errors import ConfigurationError, ExecutorStateError
from ..._logging import get_logger
from ..._timeline._pipeline import pipeline_track
from .._config import check_count
from .._executor import Executor
from .._metrics import pipeline_meters
from .._taskgroups import task_group, teardown
from ..channel import WeightChannel
from ._admission import Admission, Item
from ._budget import Budget
from ._consumed import Consumed
from ._events import PipelineClosed
from ._router import Router
from ._servers import servers_of
from ._sinks import pipeline_observer
from ._stats import Meter, PipelineBatch, PipelineStatistics
from ._updates import Updates

__all__ = ["Pipeline"]

Mode = Literal["strict", "aggregate"]
OnUpdate = Literal["keep", "wait", "abort"]
OnExpire = Literal["requeue", "wait"]
_NO_STATE: Any = object()
#: The statistics the ``pipeline_ended`` log line has.
_ENDED = ("version", "consumed", "staleness_max", "beyond_bound", "expired", "trainer_idle_ratio")


class Pipeline:
    """Samples from rollout servers to a learner, in batches, with a bound on their staleness.

    ::

        async with asyncexec.Pipeline(router, prompts, batch_size=64, staleness=1,
                                      channel=channel) as pipe:
            async for batch in pipe:
                ...train on batch.samples...
                await pipe.update_weights()          # channel.push(), generation paused
                checkpoint["pipeline"] = pipe.state_dict()

    The learner's version ``v`` counts the updates done; a sample's staleness is ``v`` minus
    the version of its oldest chunk when the learner gets it. Prompts are admitted while the
    samples admitted and not consumed stay within the budget ``(S + 1) * B`` (less the batch
    already taken at ``v``), and batches take finished samples oldest version first. In
    ``"strict"`` mode no sample is ever staler than S: a batch does not go while a sample in
    flight would expire after it (``on_expire``: what it does about those); ``"aggregate"``
    (SkyRL's) never waits, its staleness measured. S = 0 is the synchronous loop (the docs).

    Args:
        router: a :class:`~asyncexec.Router`, or an :class:`~asyncexec.Executor` whose role
            subclasses :class:`~asyncexec.RolloutServer` (requests then go to the least loaded
            server, up to 4 in flight each, sent again when a server dies).
        prompts: an iterable or async iterable of prompts (not a str, nor a mapping); a
            prompt's id is its position in it, unless the prompt is a
            :class:`~asyncexec.RolloutRequest` (its own id, hashable). An id that comes again,
            or one that is not hashable, fails the pipeline (see :meth:`__anext__`).
        batch_size: B, the samples per batch (the last batch may be smaller, when the source
            ends).
        staleness: S, the bound (0: the synchronous loop).
        mode: ``"strict"`` (every sample within S) or ``"aggregate"``.
        on_expire: strict mode, S >= 1: what a batch does about samples in flight that would
            expire after it, once B samples are finished: ``"requeue"`` (cancel them; their
            prompts go back at the head of the queue at the next version, regenerated on its
            weights) or ``"wait"`` (wait for them).
        max_requeues: with ``"requeue"``, how often one prompt may be expired; after that a
            batch waits for its sample (a bound on the bias toward short samples).
        on_update: what :meth:`update_weights` does to the rollouts in flight: ``"keep"``
            (they park at their next pause point while their server loads, and go on with
            the new weights, a version per chunk; no server is paused for the whole update
            unless its engine must be: ``RolloutServer.pauses_for_its_loads``), ``"wait"``
            (admission stops, they finish, then the push) or ``"abort"`` (they end at their
            next pause point; their prompts go back at the head of the queue).
        channel: the :class:`~asyncexec.WeightChannel` from the learner to the servers (its
            ``max_staleness`` must be 1); when it has pushed nothing yet, the pipeline pushes
            the learner's weights once it is entered, before anything is generated. The
            samples' versions are the learner's (``version``'s scale), not the channel's.
            None: :meth:`update_weights` takes the state and sends it to every server (local
            mode, small states); a chunk made before the first install counts as version 0.
        consumed: :meth:`state_dict` from the learner's checkpoint: those ids are never handed
            again, the version goes on from it.

    Raises:
        ConfigurationError: an argument out of range, ``router`` is neither a Router nor an
            executor of rollout servers, or ``channel`` goes into other servers (or is not the
            Router's own channel).
    """

    def __init__(
        self,
        router: Any,
        prompts: Iterable[Any] | AsyncIterable[Any],
        *,
        batch_size: int = 64,
        staleness: int = 1,
        mode: Mode = "strict",
        on_expire: OnExpire = "requeue",
        max_requeues: int = 4,
        on_update: OnUpdate = "keep",
        channel: WeightChannel | None = None,
        consumed: Mapping[str, Any] | None = None,
    ) -> None:
        _check_arguments(prompts, batch_size, staleness, mode, on_update, channel)
        _check_expiry(on_expire, max_requeues)
        self.on_expire: OnExpire = on_expire
        _check_channel_target(channel, router)
        self.servers = servers_of(router, channel)
        self.batch_size, self.staleness, self.mode = batch_size, staleness, mode
        self.on_update: OnUpdate = on_update
        self.channel = channel
        self._consumed = Consumed.from_state(consumed)
        name = self.servers.executor.config.name
        self.log = get_logger(pipeline=name)
        self._budget: Budget[Item] = Budget(
            batch_size, staleness, strict=mode == "strict", version=self._consumed.version
        )
        self._meter = Meter()
        #: Every event of the pipeline goes through it: statistics, metrics, log, timeline.
        track = pipeline_track(self.servers.executor.timeline)
        self._observer = pipeline_observer(
            self._meter, pipeline_meters(name, self.servers.name), self.log, track
        )
        requeues = max_requeues if on_expire == "requeue" else 0  # how often a prompt expires
        self._admission = Admission(
            prompts, self.servers, self._budget, self._consumed, self._observer, self.log, requeues
        )
        self._tg: anyio.abc.TaskGroup | None = None
        self._stack: contextlib.AsyncExitStack | None = None  # holds the router and ``_tg``
        self._state: Literal["new", "open", "closed"] = "new"
        self._updates = Updates(
            self.servers, channel, self._budget, self._admission, self._observer
        )

    def __repr__(self) -> str:
        b = self._budget
        return (
            f"<Pipeline {self.mode} S={self.staleness} B={self.batch_size} v={b.version} "
            f"in_flight={b.in_flight_count} buffered={b.finished_count} {self._state}>"
        )

    @property
    def version(self) -> int:
        """The learner's version: the updates done (from the checkpoint's, when resumed)."""
        return self._budget.version

    def statistics(self) -> PipelineStatistics:
        """A snapshot of the counters (see :class:`~asyncexec.PipelineStatistics`)."""
        b = self._budget
        return self._meter.snapshot(b.version, b.in_flight_count, b.finished_count)

    def state_dict(self) -> dict[str, Any]:
        """The ids consumed so far and the version, compact (a watermark and the ids above
        it): save it with the learner's checkpoint, give it back as ``consumed=``."""
        self._consumed.version = self._budget.version
        return self._consumed.state()

    # Lifecycle --------------------------------------------------------------------------------

    async def __aenter__(self) -> Pipeline:
        if self._state != "new":
            raise ExecutorStateError("a Pipeline is entered once")
        if self.channel is not None:
            if self.channel.version == 0:
                # The servers generate with the learner's weights from the first chunk: a
                # chunk made on their own ones would be counted as made by a version of the
                # learner's that it was not made by (after a resume, by far the wrong one).
                await self.channel.push()
                self.log.info("pipeline_first_push", version=self.version)
            # The channel's version now stands for the learner's version now.
            self._admission.mark(self.channel.version, self._budget.version)
        async with contextlib.AsyncExitStack() as stack:
            await stack.enter_async_context(self.servers.held())
            self._tg = tg = await stack.enter_async_context(task_group())
            self._state = "open"
            self._meter.restart()
            tg.start_soon(self._admission.run, tg)
            self._stack = stack.pop_all()  # left in __aexit__, with the body's exception
        self.log.info(
            "pipeline_started",
            batch_size=self.batch_size,
            staleness=self.staleness,
            mode=self.mode,
            on_expire=self.on_expire,
            on_update=self.on_update,
            version=self.version,
            consumed=len(self._consumed),
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._state = "closed"
        tg, self._tg = self._tg, None
        stack, self._stack = self._stack, None
        try:
            if tg is not None and stack is not None:
                # Requests in flight: their samples are not needed. Stopped over turns of the
                # loop (``STOP_PER_TURN`` a turn), then the rest of the group, then the
                # servers' router.
                with teardown("pipeline_update"):  # one going on in the background: its resume
                    await self._updates.ended()
                with teardown("pipeline_requests"):
                    await self._admission.stop()
                tg.cancel_scope.cancel()
                await stack.__aexit__(exc_type, exc, tb)
        except BaseException as raised:
            self._updates.close(raised)  # a delivery that failed too: a note of it
            raise
        finally:
            self._observer.emit(PipelineClosed())
        stats = self.statistics()
        self.log.info("pipeline_ended", **{k: getattr(stats, k) for k in _ENDED})
        # A delivery that failed in the background and that no batch or update raised: the
        # servers do not hold the version the learner counted.
        self._updates.close(exc)

    def _check_open(self) -> None:
        if self._state != "open":
            raise ExecutorStateError(
                "the pipeline is closed" if self._state == "closed" else "use `async with`"
            )

    # Batches ----------------------------------------------------------------------------------

    def __aiter__(self) -> Pipeline:
        return self

    async def __anext__(self) -> PipelineBatch:
        """The next batch: waits until the budget's rule lets one go (see the class).

        Raises:
            StopAsyncIteration: the source is exhausted and every sample was handed.
            ExecutorStateError: no batch can come before an update (S = 0 and the batch of
                this version was taken).
            ChannelError: the delivery of an update that went on in the background failed.

        What fails the pipeline's own tasks is not raised here: a prompt's id that comes again
        from the source (``ConfigurationError`` naming it; its first pending, or consumed in
        this pipeline) or that is not hashable (``ConfigurationError`` naming it and its
        position), a server's error, or the error of the application's logging processor under
        a batch's ``pipeline_batch`` line (the batch is handed). Whatever the body awaits then
        (this call, a training step, an update) is cancelled, and the error comes out of the
        pipeline's ``async with``.
        """
        self._check_open()
        self._updates.check()
        started = time.monotonic()
        admission, budget = self._admission, self._budget
        while not budget.ready(final=admission.final):
            self._updates.check()
            if admission.expire():
                continue
            if admission.final and not budget.in_flight_count and not budget.finished_count:
                raise StopAsyncIteration
            stuck = not budget.in_flight_count and not admission.may_admit()
            if stuck and admission.open and not admission.final:
                raise ExecutorStateError(
                    f"no batch can come at version {budget.version} (staleness "
                    f"{self.staleness}): update_weights() first"
                )
            await admission.wait_changed()
        waited_s = time.monotonic() - started
        batch = admission.hand(waited_s, self.staleness)
        if self.mode == "strict" and batch.staleness_max > self.staleness:
            _warn_unversioned(self.log, batch, self.staleness)
        return batch

    # Weight updates ---------------------------------------------------------------------------

    async def update_weights(
        self, state: Any = _NO_STATE, *, on_update: OnUpdate | None = None, wait: bool = True
    ) -> int:
        """Push the learner's weights to the servers as the next version, around the rollouts
        in flight as ``on_update`` says (the pipeline's, unless given); the learner's version
        goes up by one. Returns the new version.

        Args:
            state: without a channel, the state to install on every server
                (``RolloutServer.install_weights``); with one, nothing (the channel reads it).
            on_update: ``"keep"``, ``"wait"`` or ``"abort"`` for this update.
            wait: False (with a channel): return once the servers are paused as ``on_update``
                says and the learner's state is read, so that the learner trains on while the
                state is delivered and the servers resume. The version is counted at the read
                (the next batch may be handed meanwhile: its samples' versions are the ones
                the servers held); the next ``update_weights()`` waits for the delivery, and a
                delivery that failed is raised by the next batch or update, else by the
                pipeline's exit (a note of the body's error when the body raised).

        Raises:
            ExecutorStateError: strict mode and no batch was taken at this version; or
                another update is going on.
            ConfigurationError: no channel and no state, or a state and a channel;
                ``wait=False`` without a channel.
            ChannelError: the push failed (the servers are resumed first); or the delivery of
                the update before, which went on in the background, failed.
        """
        self._check_open()
        mode: OnUpdate = self.on_update if on_update is None else on_update
        _check_choice("on_update", mode, ("keep", "wait", "abort"))
        if (self.channel is None) == (state is _NO_STATE):
            raise ConfigurationError(
                "update_weights() takes a state when the pipeline has no channel, and none "
                "when it has one"
            )
        if not isinstance(wait, bool):
            raise ConfigurationError(f"update_weights(wait=) takes a bool, got {wait!r}")
        if not wait and self.channel is None:
            raise ConfigurationError(
                "update_weights(wait=False) needs the pipeline's channel: a state handed in is "
                "installed as it is, and returning before that would let the learner change it "
                "meanwhile"
            )
        await self._updates.run(mode, state, None if wait else self._tg)
        return self.version


def _warn_unversioned(log: Any, batch: PipelineBatch, bound: int) -> None:
    """Say why a strict batch holds samples beyond its bound when chunks made before any
    weights were installed (no channel) put them there: they count as version 0, so a
    pipeline resumed at version v > S counts them v behind."""
    pairs = zip(batch.samples, batch.staleness, strict=True)
    beyond = [s.id for s, st in pairs if st > bound and None in s.versions]
    if not beyond:
        return
    log.warning(
        "pipeline_unversioned_samples",
        version=batch.version,
        beyond_bound=len(beyond),
        ids=beyond[:5],
        hint=(
            "chunks made before the servers were given any weights count as version 0; "
            "install the learner's weights at the pipeline's version first "
            "(servers.call(RolloutServer.install_weights, state, version)), or give the "
            "pipeline a WeightChannel"
        ),
    )


def _check_arguments(
    prompts: Any, batch_size: Any, staleness: Any, mode: Any, on_update: Any, channel: Any
) -> None:
    check_count("batch_size", batch_size)
    check_count("staleness", staleness, minimum=0)
    _check_choice("mode", mode, ("strict", "aggregate"))
    _check_choice("on_update", on_update, ("keep", "wait", "abort"))
    if not isinstance(prompts, Iterable | AsyncIterable):
        raise ConfigurationError(f"prompts must be an iterable, got {prompts!r:.100}")
    if isinstance(prompts, str | bytes):
        raise ConfigurationError(
            f"prompts must be an iterable of prompts, not a str (one prompt per character): "
            f"got {prompts!r:.100}; give [prompt] for one"
        )
    if isinstance(prompts, Mapping):
        raise ConfigurationError(
            f"prompts must be an iterable of prompts, not a mapping (its keys would be the "
            f"prompts): got {prompts!r:.100}; give [RolloutRequest(id, prompt) for id, prompt "
            "in prompts.items()] to keep its keys as ids, or prompts.values()"
        )
    if channel is not None and not isinstance(channel, WeightChannel):
        raise ConfigurationError(f"channel must be a WeightChannel, got {channel!r}")
    if channel is not None and channel.max_staleness != 1:
        raise ConfigurationError(
            "the pipeline's channel must have max_staleness=1 (a push returns once every "
            f"server holds it: the versions count from there), got {channel.max_staleness}"
        )


def _check_channel_target(channel: WeightChannel | None, router: Any) -> None:
    """Refuse a channel into other servers than ``router``'s (a Router or an Executor), or
    another than the Router's own."""
    if channel is None or not isinstance(router, Router | Executor):
        return  # (``servers_of`` names a wrong ``router``)
    servers = router.servers if isinstance(router, Router) else router
    if channel.target is not servers:
        raise ConfigurationError(
            "channel must be a WeightChannel into the pipeline's servers "
            f"({servers.config.name!r}); it goes into {channel.target.config.name!r}"
        )
    if isinstance(router, Router) and router.channel not in (None, channel):
        raise ConfigurationError(
            "channel must be the router's channel (the one a rejoining server installs "
            "from), or the router must have none"
        )


def _check_expiry(on_expire: Any, max_requeues: Any) -> None:
    _check_choice("on_expire", on_expire, ("requeue", "wait"))
    check_count("max_requeues", max_requeues)


def _check_choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        allowed = " or ".join(f'"{c}"' for c in choices)
        raise ConfigurationError(f"{name} must be {allowed}, got {value!r}")
