"""A timeline of an executor's life (or of several executors', on one clock): the ring of
events (``_timeline``), its Chrome trace export with a lane for each call in flight at once
(``_export``), the RL pipeline's events on it (``_pipeline``) and the PNG drawing
(``_render``). Used by the driver only. Each module is imported by its own name; this file imports
nothing.
"""
