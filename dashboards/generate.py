"""Regenerate dashboards/asyncexec.json from asyncexec's metric definitions:

    python dashboards/generate.py [PATH]

tests/test_dashboard.py fails while the checked-in file differs from what this writes.
"""

from __future__ import annotations

import pathlib
import sys

from asyncexec._cli._dashboard import dashboard_json

if __name__ == "__main__":
    here = pathlib.Path(__file__).resolve().parent
    path = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else here / "asyncexec.json"
    path.write_text(dashboard_json())
    print(f"wrote {path}")
