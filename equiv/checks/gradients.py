"""``gradients``: the implementation's vector-Jacobian product for a random cotangent equals the
reference's (backward #1); backward leaves the caller's cotangent untouched; no differentiated
value has its gradient flow cut. Under ``jvp``: the forward-mode derivative for a random
tangent. Under ``vmap``: batched gradients, the backward for a batch of cotangents at once
(vmap over the VJP). A diverging example is replayed under the timeline recorder to explain it."""

from __future__ import annotations

import dataclasses
from typing import Any

from equiv.compare import compare_leaf
from equiv.errors import error_text
from equiv.execution.calls import format_tb
from equiv.execution.graph import slot_explanation
from equiv.execution.kinks import kink_cause, subgradient_choice, undefined_cause
from equiv.execution.record import Sink, cotangent_written, name_cotangent
from equiv.execution.verdict import fd_message
from equiv.execution.script import explain_backwards

NAME = "gradients"

_AFTER_FORWARD = ("the forward values already differ on this example (the forward or mutation "
                  "finding): the gradients may differ only because of them; fix the forward "
                  "first.")

_CUT_CAUSE = ("a write through .data, .detach() or under torch.no_grad() produced this value "
              "outside autograd.")
_CUT_FIX = ("compute it with differentiable ops, or wrap the kernel in a torch.autograd.Function "
            "with a backward.")
_FUNCTION_CAUSE = (" Or a custom autograd.Function marked it with ctx.mark_non_differentiable "
                   "while the reference's is differentiable.")
_FUNCTION_FIX = (" If no gradient should flow through this output, say so in the reference: "
                 "return it .detach()-ed (the reference decides which outputs are "
                 "differentiable).")


def run(ex: Any, sink: Sink) -> None:
    if ex.kind == "jvp":
        _tangents(ex, sink)
        return
    if ex.kind == "vmap":
        _batched(ex, sink)
        return
    first = len(sink.findings)
    _first_backward(ex, sink)
    _undifferentiated(ex, sink)
    if len(sink.findings) > first:
        name_cotangent(ex, sink, first)
    if len(sink.findings) > first and not _rounding(sink, first):
        explain_backwards(ex, sink, first)
        if ex.function_nodes():
            _function_words(sink, first)


def _first_backward(ex: Any, sink: Sink) -> None:
    pairing = ex.pairing()
    for name in pairing.cut:
        sink.finding(NAME, f"{name} does not require grad in the implementation, but the "
                     "reference's does: the gradient flow is cut.", argument=name,
                     likely_cause=_CUT_CAUSE, fix=_CUT_FIX)
    if not pairing.ok:
        if not pairing.pairs:
            _finite_differences(ex, sink, None)
        return
    ref, err = ex.ref_grads(1)
    if err is not None:
        _finite_differences(ex, sink, f"reference backward raised {type(err).__name__}: "
                                      f"{error_text(err)[:200]}")
        return
    b = ex.backward(1)
    if b.error is not None:
        slots = slot_explanation(b.error, ex.function_nodes())
        headline, fix = slots if slots is not None else (
            f"the implementation's backward raised {type(b.error).__name__} where the "
            "reference's did not.", None)
        sink.finding(NAME, headline, details=f"{type(b.error).__name__}: {str(b.error)[:400]}",
                     tb=format_tb(b.error), fix=fix)
        return
    sink.mark_compared(NAME)
    for name, headline, m, fix in cotangent_written(ex, b, 1):
        sink.finding(NAME, headline, argument=name, mismatch=m, exact=True, fix=fix)
    forward_differs = any(f.check in ("forward", "mutation") for f in sink.findings)
    for i, (g, a, e) in enumerate(zip(pairing.groups, b.grads, ref)):
        name = ex.template.group_name(g)
        m = ex.oracle.judge(name, a, e, kind="gradients", group=g, cotangent=1,
                            oracle=lambda i=i: _at(ex.oracle.grads(1), i),
                            baseline=lambda i=i: _at(ex.oracle.baseline_grads(1), i),
                            rounding=lambda i=i: ex.oracle.gradient_spread(1, i))
        if m is not None and not forward_differs:
            choice = subgradient_choice(ex, name, i, a, e, m, 1)
            if choice is not None:
                sink.note(choice)
                continue
        if m is not None:
            sink.finding(NAME, f"gradient w.r.t. {name!r} differs from the reference on "
                         "backward #1.", argument=name, mismatch=m,
                         likely_cause=_AFTER_FORWARD if forward_differs else (
                             kink_cause(ex, g, m) or undefined_cause(ex, i, 1, m)))


def _undifferentiated(ex: Any, sink: Sink) -> None:
    """Say which outputs' gradients were not compared because the reference returns them
    without gradient while the implementation's require grad (the reference decides)."""
    pairing = ex.pairing()
    if not (pairing.pairs and pairing.undifferentiated):
        return  # a reference differentiating nothing is judged by finite differences
    names = ", ".join(pairing.undifferentiated)
    sink.note(f"gradients through {names} not compared: the reference returns it without "
              "gradient (detached, or computed outside autograd) while the implementation's "
              "requires grad; the reference decides which outputs are differentiable (detach "
              "it in the implementation too, or make the reference's differentiable)")


def _at(values: list[Any] | None, i: int) -> Any:
    return None if values is None else values[i]


def _rounding(sink: Sink, first: int) -> bool:
    """Every new finding is a rounding-level numeric one: no replay explains a precision bug."""
    return all(f.rounding_level for f in sink.findings[first:])


def _finite_differences(ex: Any, sink: Sink, why: str | None) -> None:
    """The reference cannot differentiate (its backward raised, or its result has no autograd
    history: NumPy, a detached result): the implementation's VJP against central differences
    of the reference in float64 (:mod:`equiv.numerics`), else a note."""
    fd, detail = ex.oracle.finite_differences()
    if fd is None:
        if why is not None or detail is not None:
            sink.not_compared(NAME, f"gradients not compared: "
                              f"{why or 'the reference is not differentiable'} and {detail}")
        return
    sink.mark_compared(NAME)
    if not fd.ok:
        sink.finding(NAME, "the implementation's vector-Jacobian product disagrees with finite "
                     "differences of the reference (which cannot differentiate"
                     + (": " + why if why else ": its result has no autograd history") + ").",
                     details=fd_message(fd),
                     fix="check the backward formula (sign, scale, a missing term) against the "
                         "reference's derivative.")


def _function_words(sink: Sink, first: int) -> None:
    """A cut gradient next to a custom Function may come from ctx.mark_non_differentiable."""
    for k in range(first, len(sink.findings)):
        f = sink.findings[k]
        if "the gradient flow is cut" in f.headline:
            sink.findings[k] = dataclasses.replace(
                f, likely_cause=(f.likely_cause or "") + _FUNCTION_CAUSE,
                fix=(f.fix or "") + _FUNCTION_FIX)


def _tangents(ex: Any, sink: Sink) -> None:
    if len(ex.impl_out) != len(ex.ref_out):
        return  # the forward check reports it
    sink.mark_compared(NAME)
    for name, a, e, ta, te in zip(ex.names, ex.impl_out, ex.ref_out, ex.impl_tan, ex.ref_tan):
        if compare_leaf(a, e, rtol=ex.spec.rtol, atol=ex.spec.atol, path=name) is not None:
            continue  # the forward check reports it
        m = compare_leaf(ta, te, rtol=ex.spec.rtol, atol=ex.spec.atol, path=name)
        if m is not None:
            sink.finding(NAME, f"the forward-mode derivative (jvp) of {name} differs from the "
                         "reference's for the same tangent.", argument=name, mismatch=m,
                         likely_cause="a wrong forward-mode formula: a custom "
                         "autograd.Function's jvp staticmethod, or an op whose forward AD "
                         "disagrees with its backward.")


_BATCHED_CAUSE = ("the backward is not batch-aware: it writes into a preallocated buffer of the "
                  "unbatched shape, reads .item() or data_ptr(), or takes sizes from saved "
                  "shapes instead of from grad_output.")


def _batched(ex: Any, sink: Sink) -> None:
    b = ex.batched_vjp()
    if b is None:
        return
    if b.unsupported is not None:
        sink.note(f"vmap: batched gradients not checked: the implementation's backward cannot "
                  f"run under vmap ({b.unsupported})")
        return
    if b.error is not None:
        sink.finding(NAME, f"the implementation's backward raised {type(b.error).__name__} on a "
                     f"batched gradient (vmap over the VJP, {b.detail}) where the reference's "
                     "VJP for each cotangent did not.",
                     details=f"{type(b.error).__name__}: {str(b.error)[:400]}",
                     tb=format_tb(b.error), likely_cause=_BATCHED_CAUSE)
        return
    for name, a, e in zip(b.names, b.impl, b.expected):
        m = compare_leaf(a, e, rtol=ex.spec.rtol, atol=ex.spec.atol, path=name)
        if m is not None:
            where = ("" if b.plain_ok else " (the unbatched backward differs too: see the "
                     "gradients check in eager mode)")
            sink.finding(NAME, f"batched gradient (vmap over the VJP, {b.detail}) w.r.t. "
                         f"{name!r} differs from the reference's VJP for each cotangent{where}.",
                         argument=name, mismatch=m,
                         likely_cause=_BATCHED_CAUSE if b.plain_ok else None)
