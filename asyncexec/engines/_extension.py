"""What runs inside vLLM's worker processes: a worker extension (``worker_extension_cls``) whose
methods ``AsyncLLM.collective_rpc`` calls by name on every worker of the engine (one on a CPU or
one GPU; one per rank under tensor parallelism, each loading its shard from the full state).

A state crosses into the engine as packed tensors (:func:`pack`): the engine's RPC encodes a
tensor nested in a mapping as a list of numbers, so each tensor goes as its raw bytes, its dtype
and its shape, and becomes a tensor again here over one copy of those bytes (a writable
buffer: torch makes a tensor over read-only ``bytes`` only with a warning, since nothing would
stop a write to it).

Imported by vLLM's worker process, by name; imports torch only (which that process has).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

__all__ = ["Packed", "WeightLoader", "pack", "unpack"]


class Packed(NamedTuple):
    """One tensor as it crosses the engine's RPC."""

    name: str
    dtype: str  # torch's name without "torch.": "bfloat16"
    shape: tuple[int, ...]
    data: bytes | memoryview


def pack(state: Mapping[str, Any], dtype: Any = None, *, views: bool = False) -> list[Packed]:
    """``state`` (name to tensor) as packed tensors, each cast to ``dtype`` when given (the
    engine's, so that the cast happens once, here, and not in every worker).

    ``views``: each tensor's bytes as a view of its memory (no copy, nothing allocated), for a
    call into the engine from this process, whose encoding copies them once anyway (msgpack,
    into the message): 256 MiB packed as ``bytes`` was another allocation and copy of the
    whole state, 0.03 s in a process's main thread but 0.16-1.0 s in the thread that installs
    weights in a server (the fresh pages of another thread's allocator). A view is not
    picklable: ``views=False`` (``bytes``) for a packed state that goes anywhere else.
    """
    import torch

    packed = []
    for name, tensor in state.items():
        t = tensor.detach()
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        t = t.contiguous().cpu()
        raw = t.reshape(-1).view(torch.uint8).numpy()
        data = raw.data if views else raw.tobytes()
        packed.append(Packed(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), data))
    return packed


def unpack(packed: list[Any]) -> Iterator[tuple[str, Any]]:
    """The tensors of :func:`pack`, as (name, tensor): each over a writable copy of its bytes
    when they arrive as ``bytes`` (read-only), over the buffer itself otherwise; no other copy
    (the view as the dtype and the shape shares the memory)."""
    import torch

    for name, dtype, shape, data in packed:
        if not len(data):  # a tensor of no element: torch makes none over an empty buffer
            yield name, torch.empty(shape, dtype=getattr(torch, dtype))
            continue
        flat = torch.frombuffer(
            bytearray(data) if isinstance(data, bytes) else data, dtype=torch.uint8
        )
        yield name, flat.view(getattr(torch, dtype)).reshape(shape)


class WeightLoader:
    """Mixed into vLLM's worker class: ``self`` is the worker (``self.model_runner``)."""

    model_runner: Any

    def asyncexec_load_weights(self, packed: list[Any]) -> int:
        """Load the packed state (parameter names as in the checkpoint) into the running model
        in place: vLLM's reload, which also redoes what the kernels prepare after loading (the
        CPU backend repacks its linear weights; a plain ``load_weights`` fails there). Returns
        the number of tensors loaded."""
        self.model_runner.reload_weights(weights_iterator=unpack(packed))
        return len(packed)
