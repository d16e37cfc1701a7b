"""``python -m benchmarks.chaos``: the chaos runner's command line (see :mod:`benchmarks.chaos`)."""

from benchmarks.chaos.runner import main

if __name__ == "__main__":
    raise SystemExit(main())
