"""Regenerate dashboards/asyncexec.json from asyncexec's metric definitions:

    python dashboards/generate.py [PATH]

tests/observe/test_dashboard.py fails while the checked-in file differs from what this writes.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

# The checkout this file is in: its metric definitions, whichever asyncexec is installed.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from asyncexec._cli._dashboard import dashboard_json


def main(argv: list[str] | None = None) -> int:
    here = pathlib.Path(__file__).resolve().parent
    parser = argparse.ArgumentParser(
        description="Write the Grafana dashboard generated from asyncexec's metric definitions."
    )
    parser.add_argument(
        "path",
        nargs="?",
        type=pathlib.Path,
        default=here / "asyncexec.json",
        help="where to write it (default: %(default)s)",
    )
    path = parser.parse_args(argv).path
    if path.is_dir() or not path.parent.is_dir():
        parser.error(f"{path}: a file to write, in a folder that exists")
    path.write_text(dashboard_json())
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
