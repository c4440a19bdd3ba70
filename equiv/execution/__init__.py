"""The execution core: the one place that runs a side and pairs its results with the reference's.

For one example in one mode and device, :func:`~equiv.execution.record.execute` instantiates
each side (alias-preserving copies, :mod:`equiv.examples`), calls it, splits the reference's result
into returned outputs and final values of mutated arguments, pairs them with the implementation's,
groups storages, draws cotangents and takes VJPs (cached, in a fixed order). The resulting
:class:`~equiv.execution.record.Execution` is the record every check reads; a check that needs
another run (a schedule, a replay under the timeline recorder, another requires_grad pattern, a
second call) asks the core for it. No module here knows a check's name.

- :mod:`.calls`: calling user code (never raising its errors), leaves, cotangents, VJPs.
- :mod:`.pairing`: the reference's result split, both sides' values paired, a reference rerun.
- :mod:`.record`: :class:`Execution` (the record), :class:`Sink` (findings and notes as data).
- :mod:`.oracle`: :class:`Oracle` (``ex.oracle``), the float64 oracle and the baseline that
  judge the record's values, rounding spreads, finite differences.
- :mod:`.contract_runs`: the implementation's calls for its contracts (no-grad, other values,
  calls across updates, memory).
- :mod:`.state`: what the arguments must hold after a call; writes outside their views.
- :mod:`.kinks`: the reference's kinks at a mismatch's worst element.
- :mod:`.script`: scripted runs (schedules) and replays under the recorder.
- :mod:`.transforms`: the ``vmap`` and ``jvp`` runs of both sides.
- :mod:`.graph`: custom ``autograd.Function`` nodes in a graph and autograd's slot errors.
"""
