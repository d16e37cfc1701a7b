"""The hand-written floor of ``engines.py`` (vLLM's ``AsyncLLM`` in plain Ray async actors, used
directly) and the state holder both sides push from.

Imported by Ray's workers by module name (this folder is on their ``PYTHONPATH``); vLLM, torch and
safetensors are imported inside the methods, never at import.
"""

from __future__ import annotations

import asyncio
import glob
import os
import time
from collections.abc import Mapping
from typing import Any

import ray

from asyncexec.engines._extension import pack
from asyncexec.engines._vllm import EXTENSION, SAMPLING, _one_process_on_a_cpu, sampling_settings

__all__ = ["HandEngine", "HandHolder", "StateHolder", "generated_tokens", "read_state"]


def generated_tokens() -> float:
    """The tokens the engines of this process have generated so far (vLLM's own counter,
    ``vllm:generation_tokens``, kept by its stat logger in the engine's client): every token,
    of requests that finished, were aborted or were cancelled. NaN without the counter."""
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return float("nan")
    total, found = 0.0, False
    for metric in REGISTRY.collect():
        if metric.name in ("vllm:generation_tokens", "vllm:generation_tokens_total"):
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    total, found = total + sample.value, True
    return total if found else float("nan")


def read_state(folder: str, dtype: str = "bfloat16") -> dict[str, Any]:
    """The model's state as its checkpoint names it (the names the engine's loader takes), each
    tensor cast to ``dtype``: what a learner serves."""
    import torch
    from safetensors.torch import load_file

    state: dict[str, Any] = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        state.update(load_file(path))
    return {k: v.to(getattr(torch, dtype)).contiguous() for k, v in state.items()}


class StateHolder:
    """A learner that only holds a state and serves it over the weight channel as it is (no
    copy: the floor puts the same tensors once)."""

    def __init__(self, folder: str, dtype: str = "bfloat16") -> None:
        import asyncexec

        self.state = read_state(folder, dtype)
        asyncexec.serve_weights(lambda: self.state)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.state.values())


@ray.remote
class HandHolder:
    """The floor's learner: the same state, put into the object store once per push."""

    def __init__(self, folder: str, dtype: str = "bfloat16") -> None:
        self.state = read_state(folder, dtype)

    def put(self) -> list[Any]:
        return [ray.put(self.state)]  # in a list: the driver passes the reference on

    def ping(self) -> int:
        return os.getpid()


@ray.remote
class HandEngine:
    """An ``AsyncLLM`` in a plain Ray async actor, on the actor's own event loop: the least a
    user writes by hand. The same engine settings and sampling as ``VLLMServer`` (its worker
    extension included: the floor loads weights with it)."""

    def __init__(self) -> None:
        self.engine: Any = None
        self.sampling: dict[str, Any] = {}
        self.ids = 0
        self.tasks: list[asyncio.Task[Any]] = []
        self.first = 0

    def ping(self) -> int:
        return os.getpid()

    async def start(
        self, folder: str, engine: Mapping[str, Any], sampling: Mapping[str, Any]
    ) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        settings = {"worker_extension_cls": EXTENSION, **engine}
        self.sampling = {**SAMPLING, **sampling}
        # The same engine as a server's: on a CPU, its one worker in its core process.
        with _one_process_on_a_cpu(settings):
            self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=folder, **settings))

    async def generate(self, prompt: Mapping[str, Any]) -> tuple[int, str | None]:
        """One request to its end: its tokens (over its completions) and its finish reason."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            **sampling_settings(self.sampling, prompt.get("sampling") or {}),
            output_kind=RequestOutputKind.DELTA,
        )
        self.ids += 1
        tokens, reason, first = 0, None, True
        inputs = {"prompt_token_ids": list(prompt["prompt_token_ids"])}
        async for out in self.engine.generate(inputs, params, f"hand-{self.ids}"):
            if first:
                self.first += 1
                first = False
            for c in out.outputs:
                tokens += len(c.token_ids)
                reason = c.finish_reason or reason
        return tokens, reason

    # Pause to resume: requests left running inside the engine --------------------------------

    async def begin(self, prompts: list[Mapping[str, Any]]) -> None:
        self.first = 0
        self.tasks = [asyncio.create_task(self.generate(p)) for p in prompts]

    def generated(self) -> float:
        return generated_tokens()

    def started(self) -> int:
        """How many of the requests begun have had their first output."""
        return self.first

    async def finish(self) -> list[tuple[int, str | None]]:
        done = await asyncio.gather(*self.tasks)
        self.tasks = []
        return list(done)

    async def pause(self, mode: str) -> float:
        """``pause_generation`` as ``VLLMServer`` calls it. With ``"abort"``, then until every
        request begun has ended (its ``generate`` loop has had its last, aborted output): what
        ``Router.pause("abort")`` waits for too (each generation ended, its aborted sample back)
        before it returns. With ``"keep"``, vLLM's pause returning (no step runs) on both sides.
        Returns the seconds the engine's own pause took."""
        t0 = time.perf_counter()
        await self.engine.pause_generation(mode=mode, clear_cache=mode == "abort")
        took = time.perf_counter() - t0
        if mode == "abort" and self.tasks:
            await asyncio.wait(self.tasks)
        return took

    async def resume(self) -> None:
        await self.engine.resume_generation()

    # Weights -----------------------------------------------------------------------------------

    async def load(self, state: Mapping[str, Any]) -> None:
        """The same load as ``VLLMServer.load_weights``: packed in the engine's dtype, loaded in
        place by the worker extension, the prefix cache reset."""
        await self.engine.collective_rpc(
            "asyncexec_load_weights",
            args=(pack(state, self.engine.model_config.dtype, views=True),),
        )
        await self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None
