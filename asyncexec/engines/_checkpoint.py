"""The tensors of a model's checkpoint by name and shape, read from the headers of its
safetensors files (no tensor is read), and a state checked against them before any of it goes
into an engine.

vLLM loads a state one tensor after another into the running model: a tensor it cannot load (a
name the model does not have, a shape that does not fit) fails the load after the tensors before
it went in, and the engine then holds some of the new weights under the old version. A state is
therefore checked whole first, and one that does not fit the checkpoint is refused with nothing
loaded.

The standard library only.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping
from typing import Any

__all__ = ["check_fits", "checkpoint_shapes", "misfits"]

#: The most misfits an error lists by name.
SHOWN = 8


def checkpoint_shapes(folder: str) -> dict[str, tuple[int, ...]] | None:
    """The shape of each tensor of the safetensors checkpoint in ``folder``, by name (from each
    file's header: 8 bytes of length, then JSON); None where there is none to read (``folder``
    is a hub model's name, or its checkpoint is in other files)."""
    if not os.path.isdir(folder):
        return None
    files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    if not files:
        return None
    shapes: dict[str, tuple[int, ...]] = {}
    for file in files:
        with open(os.path.join(folder, file), "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        for name, entry in header.items():
            if name != "__metadata__":
                shapes[name] = tuple(entry["shape"])
    return shapes


def misfits(state: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """What in ``state`` does not fit the checkpoint's ``shapes``: a name it does not hold, a
    tensor of another shape (one line each). A head tied to the embeddings is saved once, under
    the embeddings' name, though a model's ``state_dict()`` holds it under both: ``lm_head.*``
    fits a checkpoint that holds no ``lm_head`` tensor (vLLM skips it there)."""
    headless = not any(name.startswith("lm_head.") for name in shapes)
    found = []
    for name, tensor in state.items():
        shape = getattr(tensor, "shape", None)
        if shape is None:  # not a tensor: the load says what it is
            continue
        expected = shapes.get(name)
        if expected is None:
            if not (headless and name.startswith("lm_head.")):
                found.append(f"{name}: the checkpoint holds no tensor of this name")
        elif tuple(shape) != expected:
            found.append(f"{name}: shape {tuple(shape)}, the checkpoint's is {expected}")
    return found


def check_fits(
    state: Mapping[str, Any],
    shapes: Mapping[str, tuple[int, ...]],
    *,
    model: str,
    version: int,
    held: int | None,
) -> None:
    """Refuse ``state``, weights ``version`` of ``model`` for a server that holds ``held``,
    when any of it does not fit the checkpoint's ``shapes`` (see :func:`misfits`).

    Raises:
        ValueError: naming the first :data:`SHOWN` misfits, and how many more there are.
    """
    found = misfits(state, shapes)
    if found:
        more = f"; and {len(found) - SHOWN} more" if len(found) > SHOWN else ""
        raise ValueError(
            f"weights version {version} do not fit the checkpoint of {model} (nothing was "
            f"loaded; the server keeps version {held}): " + "; ".join(found[:SHOWN]) + more
        )
