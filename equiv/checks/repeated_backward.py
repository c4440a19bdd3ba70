"""``repeated-backward``: a second backward through the retained graph, with a second
cotangent, equals the reference's VJP for it (backward #2). When it does not, backward #3 (the
first cotangent again) tells whether backward #1 changed what the graph saved."""

from __future__ import annotations

from typing import Any

from equiv.compare import compare_leaf
from equiv.execution.calls import format_tb
from equiv.execution.kinks import kink_cause, subgradient_choice, undefined_cause
from equiv.execution.oracle import by_differences, fd_only_note
from equiv.execution.record import Sink, cotangent_written, name_cotangent
from equiv.execution.script import explain_backwards

NAME = "repeated-backward"

_STATEFUL = ("backward #1 modified a value saved for backward (a saved tensor or a reused "
             "buffer).")


_SECOND = "a second backward, with a new cotangent, through the retained graph"


def run(ex: Any, sink: Sink) -> None:
    if ex.cfg.backward_repeats < 2:
        return
    why = by_differences(ex)
    if why is not None:
        sink.not_compared(NAME, fd_only_note(NAME, _SECOND, why))
        return
    if not ex.pairing().ok:
        return
    if ex.backward(1).error is not None:
        return  # the gradients check reports a failing first backward
    if any(f.check == "gradients" for f in sink.findings):
        return  # a wrong first backward: a second through the same graph adds nothing
    first = len(sink.findings)
    _repeat(ex, sink)
    if len(sink.findings) > first:
        name_cotangent(ex, sink, first)
    if len(sink.findings) > first and not all(f.rounding_level for f in sink.findings[first:]):
        explain_backwards(ex, sink, first)


def _repeat(ex: Any, sink: Sink) -> None:
    pairing = ex.pairing()
    names = [ex.template.group_name(g) for g in pairing.groups]
    ref2, err = ex.ref_grads(2)
    if err is not None:
        return
    b2 = ex.backward(2)
    sink.mark_compared(NAME)
    if b2.error is not None:
        sink.finding(NAME, "a second backward through the retained graph raised "
                     f"{type(b2.error).__name__} in the implementation.",
                     details=f"{type(b2.error).__name__}: {str(b2.error)[:400]}",
                     tb=format_tb(b2.error),
                     likely_cause="backward frees or overwrites a value the graph still needs "
                                  "(retain_graph=True was given).")
        return
    for name, headline, m, fix in cotangent_written(ex, b2, 2):
        sink.finding(NAME, headline, argument=name, mismatch=m, exact=True, fix=fix)
    oracle, baseline = ex.oracle.grads, ex.oracle.baseline_grads
    for i, (name, a, e) in enumerate(zip(names, b2.grads, ref2)):
        m = ex.oracle.judge(name, a, e, kind="gradients", group=pairing.groups[i], cotangent=2,
                            oracle=lambda i=i: None if oracle(2) is None else oracle(2)[i],
                            baseline=lambda i=i: None if baseline(2) is None else baseline(2)[i],
                            rounding=lambda i=i: ex.oracle.gradient_spread(2, i))
        choice = None if m is None else subgradient_choice(ex, name, i, a, e, m, 2)
        if choice is not None:
            sink.note(f"backward #2: {choice}")
            continue
        if m is not None:
            again = _first_again(ex, i, name)
            sink.finding(NAME, f"gradient w.r.t. {name!r} differs from the reference on "
                         "backward #2 (a second cotangent through the retained graph).",
                         argument=name, mismatch=m,
                         details="\n".join(x for x in (m.message, again) if x),
                         likely_cause=_STATEFUL if again else
                         kink_cause(ex, pairing.groups[i], m) or undefined_cause(ex, i, 2, m))


def _first_again(ex: Any, i: int, name: str) -> str:
    """The line saying backward #3 (the first cotangent again) differs from #1 for the
    gradient ``i`` (``name``), or ""."""
    b1, b3 = ex.backward(1), ex.backward(3)
    if b3.error is not None:
        return (f"backward #3 (the first cotangent again) raised {type(b3.error).__name__} "
                "where backward #1 returned")
    m = compare_leaf(b3.grads[i], b1.grads[i], rtol=ex.spec.rtol, atol=ex.spec.atol, path=name)
    if m is None:
        return ""
    return ("backward #3 (the first cotangent again) differs from backward #1: "
            + m.message.splitlines()[0])
