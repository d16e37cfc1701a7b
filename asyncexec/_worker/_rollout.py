"""Rollout servers: the worker side of the pipeline's protocol.

A rollout server is a worker class (a role) that subclasses :class:`RolloutServer` and
implements ``chunks(prompt)``, an async generator that yields one chunk per generation step, and
``load_weights(state, version)``. The base runs ``chunks`` behind a *gate*: between two chunks
(the pause point) a generation may be parked (``pause("keep")``: it goes on after ``resume()``,
with whatever weights were installed meanwhile), ended (``pause("abort")``: its sample comes back
with ``aborted=True``), or held while weights are installed. A chunk never runs half on old
weights: an install waits until no chunk runs, and no chunk starts while one is pending. Each
chunk is tagged with the weights version it ran under.

Weights arrive as the weight channel delivers them: the base's ``__init__`` registers the
install with :func:`asyncexec.receive_weights`, so ``load_weights`` runs (in a thread of the
worker) with every generation parked at a pause point. Without a channel (local mode), the
driver calls :meth:`RolloutServer.install_weights` with the state itself.

Light imports only: this module runs in Ray's worker processes (``tests/worker/test_boundary.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator
from typing import Any, ClassVar, Literal

from .._wire._rollout import RolloutRequest, Sample
from . import _channel, _place
from ._gate import Gate, PauseMode
from ._session import get_context

__all__ = ["RolloutRequest", "RolloutServer", "Sample"]

#: After a resume, the replies of the generations that ``abort()`` handed back go one every
#: this long (their callers have their samples already).
HANDED_SPACING_S = 0.002


@contextlib.asynccontextmanager
async def _closing(steps: AsyncIterator[Any]) -> AsyncIterator[AsyncIterator[Any]]:
    """``steps``, closed after use when it is an async generator (ended early, or cancelled)."""
    try:
        yield steps
    finally:
        close = getattr(steps, "aclose", None)
        if close is not None:
            await close()


def _merged(
    server: RolloutServer, chunks: list[Any], versions: list[int | None]
) -> tuple[list[Any], list[int | None]]:
    """``chunks`` with each run of chunks made under one version merged by ``server.merge``
    (where it merges), and their versions."""
    out: list[Any] = []
    out_versions: list[int | None] = []
    start = 0
    for end in range(1, len(chunks) + 1):
        if end < len(chunks) and versions[end] == versions[start]:
            continue
        run = chunks[start:end]
        one = server.merge(run) if len(run) > 1 else None
        out.extend(run if one is None else [one])
        out_versions.extend(versions[start:end] if one is None else [versions[start]])
        start = end
    return out, out_versions


class RolloutServer:
    """Base class of a rollout server's worker class: a role whose ranks generate samples in
    chunks, with a pause point between chunks.

    ::

        class Server(asyncexec.RolloutServer):
            def __init__(self, cfg):
                super().__init__()              # hooks weight installs (before any other use)
                self.engine = make_engine(cfg)

            async def chunks(self, prompt):     # one chunk per generation step
                async for tokens in self.engine.steps(prompt):
                    yield tokens                # <- the pause point is between yields

            def load_weights(self, state, version):
                self.engine.load(state)         # no chunk runs meanwhile

    The driver calls :meth:`generate`, :meth:`pause`, :meth:`resume` and
    :meth:`weights_version` through dispatch (``servers.call(RolloutServer.generate, ...)``),
    or a :class:`~asyncexec.Pipeline` / :class:`~asyncexec.Router` does.

    An engine that runs its own loop (vLLM, SGLang) pauses itself: set ``pause_point =
    "engine"`` and implement :meth:`pause_engine` and :meth:`resume_engine` (see the docs' RL
    pipeline page for the mapping).

    Args:
        channel: the weight channel's name (as ``WeightChannel(..., name=)``) whose versions
            this server installs through :meth:`load_weights`.
    """

    #: Where generation pauses: ``"chunk"``, between two chunks of :meth:`chunks` (the chunks
    #: are the engine's steps); or ``"engine"``, in the engine, which :meth:`pause_engine`
    #: pauses (a chunk that waits for the paused engine's next output then holds neither a
    #: pause nor an install up).
    pause_point: ClassVar[Literal["chunk", "engine"]] = "chunk"
    #: With ``pause_point = "engine"``: whether :meth:`load_weights`, called while the engine
    #: generates, pauses the engine for the load itself (``VLLMServer`` does). A pipeline's
    #: "keep" update then pauses no server (see :meth:`pauses_for_its_loads`).
    load_pauses_engine: ClassVar[bool] = False

    def __init__(self, *, channel: str = _channel.DEFAULT_CHANNEL) -> None:
        self._rollout_gate = Gate()
        try:
            self._rollout_rank = get_context().world_rank
        except Exception:  # made outside a worker (a unit test): rank 0
            self._rollout_rank = 0
        #: The latest version delivered before this instance was made (one the worker held
        #: already comes with ``receive_weights``): loaded once the worker has made it (see
        #: ``_asyncexec_check_made``), not inside ``super().__init__()``, before the
        #: subclass's ``__init__`` has set up what ``load_weights`` loads into. An instance
        #: that no worker makes (made by hand) loads each version as it comes.
        self._rollout_early: tuple[Any, int] | None = None
        self._rollout_made = self._asyncexec_loop() is None
        self._rollout_channel = channel
        begun = _place.ROLE_BEGUN.get()
        if begun is not None:  # let go of by its worker should its making fail from here on
            begun.append(self)
        _channel.receive_weights(self._install_from_channel, channel=channel)

    @staticmethod
    def _asyncexec_loop() -> asyncio.AbstractEventLoop | None:
        """In ``__init__``: the worker's event loop, on which this instance's ``async def``
        methods will be called (None when the instance is not made by a worker). An engine
        that runs on an event loop can run on this one rather than on one of its own in a
        thread, and skip a hop between threads on every call."""
        return _place.ROLE_LOOP.get()

    @classmethod
    def pauses_for_its_loads(cls) -> bool:
        """Whether a load of weights into this server while it generates holds its generation
        for the load's time only, by itself: with ``pause_point = "chunk"`` always (a load
        waits for the chunk in progress, and no chunk starts until it ended), with ``"engine"``
        where :attr:`load_pauses_engine` says so. A pipeline's "keep" update then pauses no
        server: each server's generations wait for its own load only, not for the learner's
        state to be read and delivered to every server."""
        return cls.pause_point == "chunk" or cls.load_pauses_engine

    # The class checked when a role is made of it, the instance when its group starts ----------

    @classmethod
    def _asyncexec_check_class(cls) -> None:
        """Refuse a class whose ``chunks`` is not an async generator function (``Role(cls)``
        calls this when the executor is made, before anything starts).

        Raises:
            TypeError: naming the class and ``chunks(prompt)``.
        """
        chunks = inspect.unwrap(cls.chunks)
        if chunks is inspect.unwrap(RolloutServer.chunks):
            raise TypeError(
                f"{cls.__qualname__} must implement chunks(prompt), an async generator "
                "(`async def chunks(self, prompt): ... yield chunk`)"
            )
        if not inspect.isasyncgenfunction(chunks):
            if inspect.isgeneratorfunction(chunks):
                kind = "a plain generator function (make it `async def`)"
            elif inspect.iscoroutinefunction(chunks):
                kind = "a coroutine function (yield each chunk, return nothing)"
            else:
                kind = "a function"
            raise TypeError(
                f"{cls.__qualname__}.chunks(prompt) must be an async generator function "
                f"(`async def` with `yield`: one chunk per yield), not {kind}"
            )

    def _asyncexec_check_made(self) -> None:
        """Refuse an instance whose ``__init__`` did not call ``super().__init__()`` (the
        worker calls this once it is made, in a thread, so its group's start fails naming it);
        then load the version its channel delivered before (the one the worker held when the
        instance was made, or a newer one).

        Raises:
            TypeError: naming the class and ``super().__init__()``.
        """
        gate = self._gate()
        with gate.lock:
            self._rollout_made = True
            early, self._rollout_early = self._rollout_early, None
        if early is not None:
            gate.install(self.load_weights, *early)

    def _asyncexec_dropped(self) -> None:
        """The worker lets go of this instance (its roles made again, the worker reset or
        closed), before its ``close()``: no weight install reaches it from now on (one that is
        loading ends first), so none loads into what ``close()`` shuts down, and the channel
        no longer holds the instance."""
        channel = getattr(self, "_rollout_channel", None)
        if channel is not None:
            _channel.forget_install(self._install_from_channel, channel=channel)

    # What the user implements -----------------------------------------------------------------

    def chunks(self, prompt: Any) -> AsyncIterator[Any]:
        """Generate from ``prompt``: an async generator that yields one chunk (e.g. a list of
        tokens) per generation step. The pause point is between two yields."""
        raise NotImplementedError(f"{type(self).__qualname__} must implement chunks(prompt)")

    def load_weights(self, state: Any, version: int) -> None:
        """Install ``state`` as weights ``version``. Runs in a thread while no chunk runs."""
        raise NotImplementedError(
            f"{type(self).__qualname__} must implement load_weights(state, version)"
        )

    def finish(self, prompt: Any, chunks: list[Any]) -> Any:
        """The sample's output from its chunks (by default the list of chunks)."""
        return chunks

    def merge(self, chunks: list[Any]) -> Any:
        """One chunk in place of ``chunks``, consecutive chunks of one generation made under
        the same weights version, in the sample; None (the default) keeps them apart. A server
        whose chunks are small (an engine step each) merges them, so that its samples are cheap
        to send: a sample's chunks and versions then pair up as before, one version a chunk."""
        return None

    async def health(self) -> None:
        """Raise (or hang) when this server is unhealthy; the router's health watch calls it."""

    def chunk_version(self, chunk: Any, version: int | None) -> int | None:
        """The weights version that made ``chunk``; ``version`` is the one this server held when
        the chunk began, which is what is returned by default. An engine that runs its own loop
        (``pause_point = "engine"``) knows better: a chunk that waited through a pause and an
        install was made by the weights installed meanwhile (the vLLM server tags each of the
        engine's outputs with the version the engine held when it made them)."""
        return version

    async def pause_engine(self, mode: PauseMode) -> None:
        """Pause the engine itself, for ``pause_point = "engine"`` (vLLM:
        ``await engine.pause_generation(mode=mode)``); return once no step runs in it. With
        ``"abort"`` the engine ends its requests: a :meth:`chunks` that then ends counts as
        aborted. Called by :meth:`pause` (nothing by default)."""

    async def resume_engine(self) -> None:
        """Let the engine go on (vLLM: ``await engine.resume_generation()``); called by
        :meth:`resume` (nothing by default)."""

    # What the base provides -------------------------------------------------------------------

    def _gate(self) -> Gate:
        gate = getattr(self, "_rollout_gate", None)
        if not isinstance(gate, Gate):
            raise TypeError(
                f"{type(self).__qualname__}.__init__ must call super().__init__() "
                "(RolloutServer's, which sets up the pause point and weight installs)"
            )
        return gate

    async def generate(self, request: RolloutRequest) -> Sample:
        """Run ``chunks(request.prompt)`` through the gate: each chunk starts only when the
        server is neither paused nor installing weights, and is tagged with the version it ran
        under. Under ``pause("abort")`` the generation ends at its next pause point and the
        sample comes back with ``aborted=True`` and the chunks made so far; under
        :meth:`abort` that sample goes back in ``abort()``'s reply, and this call returns it
        too, after :meth:`resume`."""
        gate = self._gate()
        made: list[Any] = []
        versions: list[int | None] = []
        aborted = False
        sample: Sample | None = None
        gate.began()
        try:
            async with _closing(self.chunks(request.prompt)) as steps:
                while True:
                    if not await gate.enter():
                        aborted = True
                        break
                    try:
                        version = gate.version
                        chunk = await anext(steps)
                    except StopAsyncIteration:
                        # Ended while paused to abort: the engine may have cut it short.
                        aborted = gate.mode == "abort"
                        break
                    finally:
                        gate.leave()
                    made.append(chunk)
                    versions.append(self.chunk_version(chunk, version))
            made, versions = _merged(self, made, versions)
            output = made if aborted else self.finish(request.prompt, made)
            rank = self._rollout_rank
            sample = Sample(request.id, request.prompt, output, tuple(versions), rank, aborted)
        finally:
            handed = gate.ended(sample, aborted)
        assert sample is not None  # (the generation raised otherwise)
        if handed is not None:  # its caller has it from abort()'s reply: this one comes later
            await gate.wait_resumed()
            # After the resume's reply, and one at a time: the driver takes them in without
            # a stall (it needs none of them).
            await asyncio.sleep((handed + 1) * HANDED_SPACING_S)
        return sample

    async def pause(self, mode: PauseMode) -> int:
        """Pause generation at the next pause point: ``"keep"`` parks every generation there
        (until :meth:`resume`), ``"abort"`` ends each there (its sample has ``aborted=True``;
        requests that arrive while so paused end at once). Returns once no chunk runs, with the
        number of generations that were in flight."""
        if mode not in ("keep", "abort"):
            raise ValueError(f'pause() takes "keep" or "abort", got {mode!r}')
        gate = self._gate()
        in_flight = gate.pause(mode)
        await self.pause_engine(mode)
        if self.pause_point == "engine":
            gate.rested()
        else:
            await gate.wait_at_rest()
        return in_flight

    async def abort(self) -> tuple[int, list[Sample]]:
        """``pause("abort")`` that hands the aborted samples back in its own reply: every
        generation in flight ends at its next pause point (or finishes), and its aborted sample
        is in the list returned; its own :meth:`generate` call returns the same sample only
        after :meth:`resume`, one every ``HANDED_SPACING_S`` (its caller has it already: one
        reply for all of them, which the router uses). Requests that arrive once this
        returned, while paused, end at once as under ``pause("abort")``. Returns once no
        generation is left, with the number of generations that were in flight and the
        aborted samples."""
        gate = self._gate()
        in_flight = gate.pause("abort", collect=True)
        try:
            await self.pause_engine("abort")
            if self.pause_point == "engine":
                gate.rested()
            await gate.wait_empty()
        finally:
            handed = gate.collected()
        return in_flight, handed

    async def resume(self) -> None:
        """Let parked generations go on (with the weights installed meanwhile). With
        ``pause_point = "engine"``, the engine goes on once no install loads into it."""
        gate = self._gate()
        if self.pause_point == "engine":
            # An install let in by the engine's pause loads into an engine it takes as paused:
            # resumed meanwhile, the engine's steps would run on half-loaded weights, tagged
            # with the old version (a pipeline resumes its servers when a push fails or is
            # cancelled, while the installs go on in the workers).
            await gate.wait_loaded()
            try:
                await self.resume_engine()
            except BaseException:
                gate.rest_kept()
                raise
        else:
            await self.resume_engine()
        gate.resume()

    def weights_version(self) -> int | None:
        """The weights version this server holds (None before the first)."""
        return self._gate().version

    async def install_weights(self, state: Any, version: int) -> None:
        """Install ``state`` as ``version`` through :meth:`load_weights`, as a channel's delivery
        would: the driver's way without a weight channel (local mode, small states). A version
        not newer than the one held is skipped."""
        gate = self._gate()
        await asyncio.to_thread(gate.install, self.load_weights, state, version)

    def _install_from_channel(self, state: Any, version: int) -> None:
        gate = self._gate()
        with gate.lock:
            if not self._rollout_made:  # loaded once the instance is made
                early = self._rollout_early
                if early is None or version > early[1]:
                    self._rollout_early = (state, version)
                return
        gate.install(self.load_weights, state, version)
