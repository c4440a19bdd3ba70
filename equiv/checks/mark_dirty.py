"""``mark-dirty``: an argument written in place inside a custom ``autograd.Function``'s forward
must be declared with ``ctx.mark_dirty``: its version counter moved during the call while its
``grad_fn`` was not rebased (a tracked in-place write always rebases it)."""

from __future__ import annotations

from equiv.compare import compare_leaf
from equiv.execution.graph import edge_matches, function_class, function_label, function_nodes
from equiv.execution.record import Execution, Sink

NAME = "mark-dirty"


def run(ex: Execution, sink: Sink) -> None:
    template, side = ex.template, ex.impl_side
    assert side is not None
    before, after = ex.impl_history  # the core's call: the tensors' state around it
    nodes = function_nodes(ex.impl_result, [side.argument(a) for a in ex.spec.mutates])
    seen: set[int] = set()
    for j, (slot, t) in enumerate(zip(template.slots, side.tensors)):
        (grad_fn, version, rg), (grad_fn_after, version_after, _) = before[j], after[j]
        if id(t) in seen or not rg:
            continue
        seen.add(id(t))
        if version_after == version or grad_fn_after is not grad_fn:
            continue  # not written, or written and tracked (its history was rebased)
        owners = [n for n in nodes if edge_matches(n, t, grad_fn)]
        names = sorted({function_label(function_class(n)) for n in owners})
        where = (f"inside {' or '.join(names)}.forward without ctx.mark_dirty({slot.path})"
                 if names else "outside autograd (inside a custom Function's forward without "
                 "ctx.mark_dirty, or under torch.no_grad())")
        consequence = _gradient_consequence(ex)
        history = type(grad_fn).__name__ if grad_fn is not None else "a leaf"
        details = (f"version counter {version} -> {version_after} during the call, but its "
                   f"autograd history is unchanged ({history}), so gradients through its new "
                   "value skip the write.")
        if consequence:
            details += "\nGradient consequence on this example: " + consequence
        else:
            details += ("\nNo gradient difference on this example, but autograd's in-place checks "
                        "for this tensor and its views are bypassed.")
        sink.finding(
            NAME,
            f"argument {slot.path!r} was written in place {where}.",
            argument=slot.path, details=details,
            likely_cause="an in-place write that autograd did not record: its version counter "
                         "moved but its grad_fn was not rebased onto the Function's node.",
            fix=(f"call ctx.mark_dirty({slot.path}) in forward for every input written in place "
                 "(and return it), or write into a clone."),
        )


def _gradient_consequence(ex: Execution) -> str | None:
    """What the unrecorded write did to backward #1 on this example (the core's cached run)."""
    p = ex.pairing()
    if p.cut:
        return (f"{p.cut[0]} does not require grad in the implementation, but the reference's "
                "does: the gradient flow is cut.")
    if not p.ok or ex.ref_grads(1)[1] is not None:
        return None
    b = ex.backward(1)
    if b.error is not None:
        return f"the implementation's backward raised {type(b.error).__name__}."
    for g, a, e in zip(p.groups, b.grads, ex.ref_grads(1)[0]):
        name = ex.template.group_name(g)
        if compare_leaf(a, e, rtol=ex.spec.rtol, atol=ex.spec.atol, path=name) is not None:
            return f"gradient w.r.t. {name!r} differs from the reference on backward #1."
    return None
