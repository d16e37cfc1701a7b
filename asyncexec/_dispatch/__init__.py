"""A dispatched call, planned before anything is sent: worker classes and their methods
(``_role``), where a call goes and the load that chooses it (``_targets``), splitting arguments
over ranks and merging results (``_split``, ``_concat_check``), and the plan that puts them
together (``_plan``).

Pure: no Ray, no driver (the driver's dispatcher sends the plan; a worker reads its roles from
it). Each module is imported by its own name; this file imports nothing.
"""
