"""Backends: set a framework up across the worker group."""

from ._base import Backend, GroupHandle

__all__ = ["Backend", "GroupHandle"]
