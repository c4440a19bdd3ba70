"""``determinism`` (opt-in: ``deterministic=True``): the implementation called twice on fresh,
equal inputs gives bitwise-equal outputs, final values of mutated arguments and gradients
(for the same cotangent). Split reductions summed in a varying order, atomics, an unseeded
random choice of blocks break it."""

from __future__ import annotations

from equiv.compare import Mismatch, compare_leaf
from equiv.execution.record import Execution, Sink
from equiv.execution.runs import ImplRun

NAME = "determinism"


def run(ex: Execution, sink: Sink) -> None:
    first = ex.impl_run()
    second = ex.impl_run()
    if first.exc is not None or second.exc is not None:
        if (first.exc is None) != (second.exc is None):
            raised = first if first.exc is not None else second
            sink.finding(NAME, "the implementation raised on one of two calls on equal inputs "
                         f"and returned on the other ({type(raised.exc).__name__}).",
                         likely_cause="the implementation's behaviour depends on state or "
                                      "randomness that is not part of its inputs.")
        return
    sink.mark_compared(NAME)
    for label, m in _differences(first, second):
        sink.finding(NAME, f"two calls on equal inputs gave different {label} (not bitwise "
                     "equal).", argument=m.path, mismatch=m, exact=True,
                     details=f"{m.message}\nthe implementation is not deterministic: the "
                             "second call differs from the first",
                     likely_cause="a reduction whose order changes from call to call (split "
                                  "or atomic accumulation, a random block order), or unseeded "
                                  "randomness.",
                     fix="fix the order in which partial results are combined (or use a "
                         "deterministic algorithm); drop deterministic=True if run-to-run "
                         "differences are acceptable.")
        return


def _differences(a: ImplRun, b: ImplRun) -> list[tuple[str, Mismatch]]:
    """(what differs, mismatch): outputs and final values, then gradients; ``a`` counts as
    the expected value."""
    out = []
    for name, v in a.values.items():
        m = compare_leaf(b.values.get(name), v, rtol=0, atol=0, path=name, exact=True)
        if m is not None:
            out.append((name, m))
    if a.grad_exc is None and b.grad_exc is None:
        for name, g in a.grads.items():
            m = compare_leaf(b.grads.get(name), g, rtol=0, atol=0, path=name, exact=True)
            if m is not None:
                out.append((f"gradients w.r.t. {name!r}", m))
    return out
