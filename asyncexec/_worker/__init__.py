"""The worker side: what runs inside each worker process.

It imports the standard library, ray and ``asyncexec._protocol`` (with the small modules both
sides share: errors and checkpoints) only, never the driver's modules, anyio, structlog or
tenacity: ``tests/test_boundary.py`` checks it in a fresh interpreter.
"""
