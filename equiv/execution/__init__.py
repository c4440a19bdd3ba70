"""The execution core: the one place that runs a side and pairs its results with the reference's.

For one example in one mode and device, :func:`~equiv.execution.record.execute` instantiates
each side (alias-preserving copies, :mod:`equiv.examples`), calls it, splits the reference's result
into returned outputs and final values of mutated arguments, pairs them with the implementation's,
groups storages, draws cotangents and takes VJPs (cached, in a fixed order). The resulting
:class:`~equiv.execution.record.Execution` is the record every check reads; a check that needs
another run (a schedule, a replay under the timeline recorder, another requires_grad pattern, a
second call) asks the record for it. No module here knows a check's name.

- :mod:`.calls`: calling user code (never raising its errors), leaves, cotangents, VJPs.
- :mod:`.record`: :class:`Execution`, :class:`Sink` (findings and notes as data), pairing.
- :mod:`.script`: scripted runs (schedules) and replays under the recorder.
- :mod:`.transforms`: the ``vmap`` and ``jvp`` runs of both sides.
- :mod:`.graph`: custom ``autograd.Function`` nodes in a graph and autograd's slot errors.
"""
