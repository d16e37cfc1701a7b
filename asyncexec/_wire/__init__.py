"""What crosses the process boundary, imported by both sides: the typed records the driver and
a worker exchange (``_protocol``), the worker's remote methods as one protocol (``_interface``),
the rollout records of the RL pipeline (``_rollout``), checkpoints (``_checkpoint``), the trace
context carried into the workers (``_tracing``), and the one pickler both sides send with
(``_pickle``).

The standard library only (Ray's cloudpickle in ``_pickle``, imported when a value is pickled):
a worker process imports this wing, never the driver's. Each module is imported by its own name;
this file imports nothing.
"""
