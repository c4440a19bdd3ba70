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
from equiv.execution.kinks import derivative_kink
from equiv.execution.oracle import by_differences, fd_only_note
from equiv.execution.pairing import reference_run
from equiv.execution.record import Execution, Sink

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
    nodes = function_nodes([i for _, i, _ in pairs])
    missing = _without_history(nodes, done.impl_side)  # read before backward frees them
    imp, err, _ = second([i for _, i, _ in pairs], i_leaves)
    labels = sorted({function_label(function_class(n)) for n in nodes})
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
        m = _judge(ex, sink, name, g, torch.zeros_like(leaf) if a is None else a,
                   torch.zeros_like(leaf) if e is None else e, lambda i=i: oracle(i))
        if m is None:
            continue
        cause = _cause(sink, who, missing)
        sink.finding(NAME, f"second-order gradient (double backward) w.r.t. "
                    f"{name!r} differs from the reference.", argument=name, mismatch=m,
                    likely_cause=cause, fix=_PARTLY_FIX if cause and cause.startswith(who) else None)


#: at most this many elements at a kink of the reference's derivative are set aside per value
_KINKS = 4


def _judge(ex: Execution, sink: Sink, name: str, group: Any, actual: torch.Tensor,
           expected: torch.Tensor, oracle: Any) -> Any:
    """``ex.oracle.judge`` of one second-order gradient, setting aside (with a note) elements at
    a kink of the reference's derivative (:func:`derivative_kink`), where a smooth
    implementation's second derivative legitimately differs from the reference's autograd one."""
    aside: list[str] = []
    o_memo: list[Any] = []

    def patched_oracle() -> Any:
        if not o_memo:
            o_memo.append(oracle())
        o = o_memo[0]
        if o is None or not aside:
            return o
        o = o.clone()
        o.view(-1)[kinks] = expected.detach().reshape(-1)[kinks].to(o.dtype).to(o.device)
        return o

    kinks: list[int] = []
    m = None
    for _ in range(_KINKS + 1):
        m = ex.oracle.judge(name, actual, expected, kind="second-order", group=group,
                            oracle=patched_oracle)
        where = None if m is None or len(aside) >= _KINKS else derivative_kink(ex, group, m)
        if where is None:
            break
        aside.append(where)
        flat = _flat(m.index, expected)
        kinks.append(flat)
        actual = actual.clone()
        actual.view(-1)[flat] = expected.reshape(-1)[flat].to(actual.dtype)
    if aside:
        sink.note(f"{NAME}: second-order gradient w.r.t. {name!r} not compared at "
                  f"{', '.join(aside)}: the reference's derivative has a kink there (its autograd "
                  "second derivative jumps), where a smooth implementation's legitimately "
                  "differs")
    return m


def _flat(index: tuple[int, ...], like: torch.Tensor) -> int:
    return sum(i * s for i, s in zip(index, like.contiguous().stride()))


#: the fix of a partly differentiable backward (only beside that confirmed cause)
_PARTLY_FIX = ("save inputs or outputs (not intermediates) and recompute the rest in backward "
               "with torch ops, or decorate backward with "
               "@torch.autograd.function.once_differentiable so double backward raises instead "
               "of returning a wrong value.")
_PARTLY = ("{who}'s backward is only partly differentiable: a value it uses has no autograd "
           "history ({what}), so its derivative is missing from double backward.")


def _cause(sink: Sink, who: str, missing: str | None) -> str | None:
    """The likely cause of a second-order mismatch, claimed only where it is seen: the forward
    or the first backward already differ; or the implementation's Function saved a value
    without autograd history that is not one of its inputs (``missing``: an intermediate)."""
    if any(f.check in ("forward", "mutation", "gradients") for f in sink.findings):
        return ("the forward values or the first-order gradients already differ on this "
                "example (those findings): fix them first.")
    return None if missing is None else _PARTLY.format(who=who, what=missing)


def _without_history(nodes: list[Any], side: Any) -> str | None:
    """``"ctx.name"``/``"saved tensor #i"`` of a custom Function node: a floating tensor saved
    in forward without autograd history that is not an input's storage, else None."""
    inputs = {t.untyped_storage().data_ptr() for t in getattr(side, "tensors", [])
              if isinstance(t, torch.Tensor)}
    for node in nodes:
        try:
            saved = [(f"saved tensor #{k} of {type(node).__name__}", t)
                     for k, t in enumerate(getattr(node, "saved_tensors", ()) or ())]
        except RuntimeError:  # freed by a backward without retain_graph
            saved = []
        saved += [(f"ctx.{k} of {type(node).__name__}", v)
                  for k, v in getattr(node, "__dict__", {}).items()]
        for what, t in saved:
            if (isinstance(t, torch.Tensor) and t.dtype.is_floating_point
                    and not t.requires_grad and t.untyped_storage().data_ptr() not in inputs):
                return f"{what}, an intermediate computed in forward"
    return None


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
