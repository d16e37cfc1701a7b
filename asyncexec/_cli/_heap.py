"""The command line's heap, out of the garbage collector's way once the group has started.

What exists when the executor has started its group (Ray's objects, the imported modules, the
group's records) lives as long as the program; Python's full collections would still walk all of
it, and with Ray's heap behind it one is the event loop's longest stall through a lifecycle.
docs/operating.md has the figures and the advice; the programs asyncexec ships follow it.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import AsyncIterator

__all__ = ["frozen_heap"]


@contextlib.asynccontextmanager
async def frozen_heap() -> AsyncIterator[None]:
    """Collect once, then keep every object alive now out of later collections
    (``gc.freeze()``); undone on the way out (``gc.unfreeze()``), so that a program that calls
    the command line in-process (a test) gets its collector back as it was. Asynchronous, to
    be entered in the same ``async with`` as the executor, after it."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
