"""``state-across-calls``: caches keyed by tensor identity, ``data_ptr`` or ``_version``. The
implementation is called, the same tensors then get other values the ways training loops write
weights, each followed by another call: in place (``copy_`` under ``torch.no_grad()``, as an
optimizer step does: version bumped), through ``.data.copy_`` (as EMA swaps and weight reloads
do: same storage, no version bump) and by assigning a new tensor to ``.data`` (new storage,
same tensor object). The values alternate between every storage reversed and the example's own.
Each call's result (and the arguments' final values) must equal what the implementation gives
on fresh tensors holding those values (the reversed ones), or the reference's (the example's
own). It runs on clean examples (valid, nothing found so far): five calls of the
implementation."""

from __future__ import annotations

from equiv.execution.contract_runs import calls_across_updates, judge_run
from equiv.execution.record import Execution, Sink

NAME = "state-across-calls"

# per update path: (what was done, what the second call is compared with is filled in below,
# the caches it defeats)
_HOW = {
    "copy_": ("every argument was copy_()'d new values in place (same tensors, same data_ptr, "
              "version counters bumped), as an optimizer step does",
              "tensor identity (id, data_ptr)"),
    ".data.copy_": ("every argument got new values through .data.copy_() (same tensors, same "
                    "data_ptr, version counters not bumped), as EMA swaps and weight reloads do",
                    "(data_ptr, _version), or tensor identity (a write through .data does not "
                    "bump _version)"),
    ".data =": ("every argument got a new tensor assigned to .data (same tensor objects, new "
                "storage; a view into a larger storage got its values through .data.copy_()), "
                "as swapping in new weights does",
                "the tensor object (id) while holding views of its old storage"),
}

_HEADLINE = {
    "copy_": "a second call, after the same tensors were updated in place, differs from a "
             "first call on new tensors holding the new values",
    ".data.copy_": "a call after the same tensors got new values through .data.copy_() (no "
                   "version bump) differs from the reference on those values",
    ".data =": "a call after new tensors were assigned to the arguments' .data (new storage) "
               "differs from a call on new tensors holding the new values",
}


def run(ex: Execution, sink: Sink) -> None:
    for k, step in enumerate(calls_across_updates(ex)):
        for what, m in judge_run(ex, step.run, step.expected, step.finals,
                                 shuffled=step.shuffled):
            if what.startswith("undeclared"):
                continue  # the mutation check owns undeclared writes
            done, keyed = _HOW[step.how]
            where = m.path if what == "output" else f"{what} {m.path!r}"
            sink.finding(
                NAME, f"{where} of {_HEADLINE[step.how]}.", argument=m.path, mismatch=m,
                details=f"{k + 1} update(s) after the first call; the last one: under "
                        f"torch.no_grad() {done}; then the call compared.\n{m.message}",
                likely_cause=f"the implementation caches something derived from its inputs "
                             f"keyed by {keyed}, so the update through {step.how} is not seen.",
                fix="key caches by the values themselves (a kept copy compared with "
                    "torch.equal), or do not cache across calls: id, data_ptr and _version "
                    "all miss some of the ways weights are updated.")
            return
