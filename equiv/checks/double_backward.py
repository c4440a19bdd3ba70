"""``double-backward``: the gradient of the vector-Jacobian product w.r.t. the inputs
(``create_graph=True``) equals the reference's, where both support it. A ``@once_differentiable``
backward, or one computed entirely outside autograd (double backward would silently be zero), is
a note; a backward that is partly differentiable, and so gives a wrong second derivative, is a
finding."""

from __future__ import annotations

from typing import Any

import torch

from equiv.errors import error_text, user_error
from equiv.execution.calls import cotangent, format_tb
from equiv.execution.graph import (
    function_class,
    function_label,
    function_nodes,
    graph_nodes,
    is_delayed_error,
)
from equiv.execution.record import (
    Execution,
    Sink,
    by_differences,
    fd_only_note,
    reference_run,
)

NAME = "double-backward"


def run(ex: Execution, sink: Sink) -> None:
    why = by_differences(ex)
    if why is not None:
        sink.note(fd_only_note(NAME, "double backward (second-order gradients)", why))
        return
    done, exc = ex.rerun(ex.template)
    if done is None or exc is not None or not done.pairing.ok:
        return  # the core checks report a failing call
    gen = torch.Generator().manual_seed(ex.cot_seed + 2)
    pairs = done.pairing.pairs
    cots = [cotangent(r, gen) for _, _, r in pairs]
    r_leaves = ex.leaves("ref", done.pairing, done.ref_side)
    i_leaves = ex.leaves("impl", done.pairing, done.impl_side)
    vs = [cotangent(leaf, gen) for leaf in r_leaves]

    def second(outs: list[torch.Tensor], leaves: list[torch.Tensor],
               cast: bool = False) -> tuple[Any, Any, bool]:
        # cotangents that require grad: only then does a @once_differentiable backward hang its
        # results off an error node (without, they silently have no history)
        cs = [c.to(o.dtype) for c, o in zip(cots, outs)] if cast else cots
        vv = [v.to(leaf.dtype) for v, leaf in zip(vs, leaves)] if cast else vs
        given = [c.clone().requires_grad_() for c in cs]
        first, e = _grad(outs, leaves, given, create_graph=True)
        if e is not None:
            return None, e, False
        live = [(g, v) for g, v in zip(first, vv) if g is not None and g.requires_grad]
        if any(is_delayed_error(n) for n in graph_nodes([g for g, _ in live])):
            return None, _OnceDifferentiable(), False
        if not live:
            return [None] * len(leaves), None, False
        h, e = _grad([g for g, _ in live], leaves, [v for _, v in live])
        if e is not None:
            return None, e, True
        return [None if x is None else x.detach() for x in h], None, True

    ref, err, _ = second([r for _, _, r in pairs], r_leaves)
    if err is not None:
        sink.note(f"double backward not compared: the reference's raised "
                  f"{type(err).__name__}: {error_text(err)[:160]}")
        return
    imp, err, _ = second([i for _, i, _ in pairs], i_leaves)
    labels = sorted({function_label(function_class(n)) for n in
                     function_nodes([i for _, i, _ in pairs])})
    who = " and ".join(labels) or "a custom Function"
    if err is not None:
        if isinstance(err, _OnceDifferentiable):
            sink.note(f"double backward not supported by {who} (@once_differentiable): "
                      "second-order gradients not compared")
            return
        sink.finding(NAME, f"double backward through {who} raised "
                    f"{type(err).__name__} where the reference's did not.",
                    details=f"{type(err).__name__}: {error_text(err)[:400]}", tb=format_tb(err),
                    fix="make backward differentiable (torch ops only), or decorate it with "
                        "@torch.autograd.function.once_differentiable to declare that it is not.")
        return
    if all(a is None for a in imp) and any(e is not None for e in ref):
        # backward computes entirely outside autograd: like @once_differentiable, but silent
        note = (f"double backward not supported by {who}: its backward computes outside autograd "
                "(.detach(), .data, tensors saved without history), so double backward would "
                "silently give zero; second-order gradients not compared. Decorate backward with "
                "@torch.autograd.function.once_differentiable to make that an error")
        sink.note(note)
        return
    oracle = _lazy_oracle(ex, done, second, r_leaves)
    for i, (g, a, e, leaf) in enumerate(zip(done.pairing.groups, imp, ref, r_leaves)):
        name = ex.template.group_name(g)
        m = ex.judge(name, torch.zeros_like(leaf) if a is None else a,
                     torch.zeros_like(leaf) if e is None else e, kind="second-order", group=g,
                     oracle=lambda i=i: oracle(i))
        if m is None:
            continue
        sink.finding(NAME, f"second-order gradient (double backward) w.r.t. "
                    f"{name!r} differs from the reference.", argument=name, mismatch=m,
                    likely_cause=f"{who}'s backward is only partly differentiable: a value it "
                                 "uses has no autograd history (an intermediate saved in forward "
                                 "that is not an output, or a .detach()), so its derivative is "
                                 "missing from double backward.",
                    fix="save inputs or outputs (not intermediates) and recompute the rest in "
                        "backward with torch ops, or decorate backward with "
                        "@torch.autograd.function.once_differentiable so double backward raises "
                        "instead of returning a wrong value.")


def _grad(outs: list[torch.Tensor], leaves: list[torch.Tensor], cots: list[torch.Tensor],
          create_graph: bool = False) -> tuple[Any, BaseException | None]:
    """``torch.autograd.grad`` (unused leaves: None), or the error the user's backward raised."""
    try:
        return torch.autograd.grad(outs, leaves, cots, create_graph=create_graph,
                                   allow_unused=True), None
    except BaseException as e:  # the user's backward raised (SystemExit too)
        if not user_error(e):
            raise
        return None, e


def _lazy_oracle(ex: Execution, done: Any, second: Any, r_leaves: list[torch.Tensor]) -> Any:
    """Second-order gradient ``i`` of the float64 reference, computed on first use (once)."""
    memo: list[Any] = []

    def at(i: int) -> Any:
        if not memo:
            side = ex.side(dtype=torch.float64)
            run = reference_run(ex.spec, ex.ref_fn, side)
            outs = [run.values.get(n) for n, _, _ in done.pairing.pairs]
            leaves = [side.leaves[g.index] for g in done.pairing.groups]
            ok = run.why is None and all(isinstance(o, torch.Tensor) and o.requires_grad
                                         for o in outs) and None not in leaves
            memo.append(second(outs, leaves, cast=True)[0] if ok else None)
        if memo[0] is None:
            return None
        x = memo[0][i]
        return torch.zeros(r_leaves[i].shape, dtype=torch.float64) if x is None else x

    return at


class _OnceDifferentiable(Exception):
    """Internal: the first-order gradients hang off a @once_differentiable error node."""
