"""``python -m asyncexec`` and the ``asyncexec`` console script: see ``asyncexec._cli._main``."""

from __future__ import annotations

import sys

from ._cli._main import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
