"""The command line (``asyncexec run``, ``asyncexec demo``), its views and the logging set-up
offered to applications. Empty on purpose: a worker that runs the demo's function imports
``asyncexec._cli._demo`` only, never argparse, anyio or rich."""
