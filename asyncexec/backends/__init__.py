"""Backends: set a framework up across the worker group.

``TorchBackend`` is loaded on first use (``asyncexec.backends.TorchBackend``), so that importing
asyncexec never imports its module; that module in turn imports torch only on the workers, inside
the hooks' functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._base import Backend, GroupHandle

if TYPE_CHECKING:
    from .torch import TorchBackend

__all__ = ["Backend", "GroupHandle", "TorchBackend"]


def __getattr__(name: str) -> Any:
    if name == "TorchBackend":
        from .torch import TorchBackend

        return TorchBackend
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
