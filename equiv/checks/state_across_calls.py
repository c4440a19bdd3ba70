"""``state-across-calls``: caches keyed by tensor identity or ``data_ptr``. The implementation is
called, the same tensors are then updated in place (``copy_`` under ``torch.no_grad()``, as an
optimizer step does) with other values (each storage reversed), and it is called again: the
second result (and the arguments' final values) must equal what the implementation gives on
fresh tensors holding the new values (the forward and mutation checks compare that with the
reference). It runs on every clean example (valid, nothing found so far): three calls of the
implementation."""

from __future__ import annotations

from equiv.execution.record import Execution, Sink, judge_run

NAME = "state-across-calls"


def run(ex: Execution, sink: Sink) -> None:
    again = ex.call_again_after_update()
    if again is None:
        return  # the new values may be invalid input: nothing to conclude
    second, fresh = again
    finals = {a: fresh.side.argument(a) for a in ex.spec.mutates}
    for what, m in judge_run(ex, second, fresh.result, finals, shuffled=True):
        if what.startswith("undeclared"):
            continue  # the mutation check owns undeclared writes
        where = m.path if what == "output" else f"{what} {m.path!r}"
        sink.finding(
            NAME, f"{where} of a second call, after the same tensors were updated in place, "
            "differs from a first call on new tensors holding the new values.", argument=m.path, mismatch=m,
            details=f"first call; then under torch.no_grad() every argument was copy_()'d new "
                    f"values (same tensors, same data_ptr); then the second call.\n{m.message}",
            likely_cause="the implementation caches something derived from its inputs keyed by "
                         "tensor identity (id, data_ptr), so the in-place update is not seen.",
            fix="key caches by value or by (data_ptr, _version), or do not cache across calls.")
        return
