"""``output-stability``: outputs the first call returned are unchanged by backward and by a
second call of the implementation on other values (a reused buffer would be overwritten)."""

from __future__ import annotations

from equiv.compare import compare_trees
from equiv.execution.calls import detached
from equiv.execution.contract_runs import shuffled_call
from equiv.execution.record import Execution, Sink

NAME = "output-stability"


def run(ex: Execution, sink: Sink) -> None:
    if not ex.snapshotted:  # the core snapshots the outputs wherever the costly checks run
        raise AssertionError("output-stability ran on an example without the outputs' snapshot")
    for m in compare_trees(detached(ex.impl_result), ex.out_snapshot, rtol=0, atol=0,
                           exact=True):
        sink.finding(NAME, f"{m.path} returned by the first call changed during backward.",
                     argument=m.path, mismatch=m, exact=True,
                     likely_cause="backward writes into a tensor the forward returned.")
        return
    _, _, exc = shuffled_call(ex)
    if exc is not None:
        return  # the shuffled values may be invalid input: nothing to conclude
    for m in compare_trees(detached(ex.impl_result), ex.out_snapshot, rtol=0, atol=0,
                           exact=True):
        sink.finding(NAME, f"a second call to the implementation changed {m.path} returned by "
                     "the first call.", argument=m.path, mismatch=m, exact=True,
                     likely_cause="the implementation returns a reused workspace or buffer "
                                  "(e.g. a module-level cache) instead of a new tensor.",
                     fix="return a fresh tensor, or .clone() the workspace before returning.")
        return
