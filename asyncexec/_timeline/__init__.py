"""A timeline of an executor's life: the ring of events and its Chrome trace export
(``_timeline``), the RL pipeline's events on it (``_pipeline``) and the PNG drawing
(``_render``). Used by the driver only. Each module is imported by its own name; this file imports
nothing.
"""
