"""PyTorch distributed: :class:`TorchBackend` (driver side) and the helpers a worker's function
uses (:func:`get_device`).

Importing this package is light on both sides: ``TorchBackend`` (which imports anyio and the
driver's modules) is loaded on first use, and the worker helpers import torch only when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._worker import cuda_device_index, get_device, torch_env

if TYPE_CHECKING:
    from ._driver import TorchBackend, resolve_backend

__all__ = ["TorchBackend", "cuda_device_index", "get_device", "resolve_backend", "torch_env"]


def __getattr__(name: str) -> Any:
    if name in ("TorchBackend", "resolve_backend"):
        from . import _driver

        return getattr(_driver, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
