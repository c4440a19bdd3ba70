"""``needs-input-grad``: every other requires_grad pattern of the example's differentiable
storages (all proper non-empty subsets up to :data:`MAX_EXHAUSTIVE_PATTERN_GROUPS` of them, else
each one alone and each one left out), each pattern's gradients compared with the reference's.
Catches a custom Function's backward gated on the wrong ``ctx.needs_input_grad`` index."""

from __future__ import annotations

import copy
import dataclasses
import itertools
from typing import Any

import torch

from equiv.errors import error_text
from equiv.examples import Template
from equiv.execution.calls import cotangent, format_tb, vjp
from equiv.execution.graph import function_nodes, slot_explanation
from equiv.execution.record import Execution, Sink

NAME = "needs-input-grad"
#: more differentiable storages than this: patterns are "each alone" and "each left out"
MAX_EXHAUSTIVE_PATTERN_GROUPS = 3


def requires_grad_patterns(n: int) -> list[tuple[int, ...]]:
    """Subsets of ``range(n)`` (positions that require grad) other than all and none: every one
    for ``n <= MAX_EXHAUSTIVE_PATTERN_GROUPS``, else each position alone and each left out."""
    if n < 2:
        return []
    if n <= MAX_EXHAUSTIVE_PATTERN_GROUPS:
        return [c for k in range(1, n) for c in itertools.combinations(range(n), k)]
    alone = [(i,) for i in range(n)]
    left_out = [tuple(j for j in range(n) if j != i) for i in range(n)]
    return alone + left_out


def _pattern_template(template: Template, keep: set[int]) -> Template:
    t = copy.copy(template)
    t.groups = [dataclasses.replace(g, requires_grad=g.requires_grad and g.index in keep)
                for g in template.groups]
    return t


def _lazy_oracle(ex: Execution, done: Any, cots: list[torch.Tensor]) -> Any:
    """Gradient ``i`` of the oracle for this pattern, computed on first use (once)."""
    memo: list[Any] = []

    def at(i: int) -> Any:
        if not memo:
            t = _pattern_template(ex.template, {g.index for g in done.pairing.groups})
            memo.append(ex.oracle_vjps(t, [n for n, _, _ in done.pairing.pairs],
                                       done.pairing.groups, [cots]))
        return None if memo[0] is None else memo[0][0][i]

    return at


def run(ex: Execution, sink: Sink) -> None:
    template = ex.template
    diff = [g for g in template.groups if g.requires_grad]
    names = {g.index: template.group_name(g) for g in diff}
    gen = torch.Generator().manual_seed(ex.cot_seed + 1)
    for pattern in requires_grad_patterns(len(diff)):
        keep = {diff[i].index for i in pattern}
        on = [names[i] for i in sorted(keep)]
        off = [names[g.index] for g in diff if g.index not in keep]
        when = (f"when only {', '.join(map(repr, on))} require{'s' if len(on) == 1 else ''} grad "
                f"({', '.join(map(repr, off))} not)")
        done, exc = ex.rerun(_pattern_template(template, keep))
        if exc is not None:
            sink.finding(NAME, f"the implementation raised {type(exc).__name__} "
                        f"{when}, where the reference returned.",
                        details=f"{type(exc).__name__}: {error_text(exc)[:400]}",
                        tb=format_tb(exc))
            return
        if done is None:
            continue
        for name in done.pairing.cut:
            sink.finding(NAME, f"{name} does not require grad in the implementation "
                        f"{when}, but the reference's does: the gradient flow is cut.",
                        argument=name,
                        fix="derive requires_grad from the inputs, not from a fixed pattern.")
        if not done.pairing.ok:
            continue
        pairs = done.pairing.pairs
        cots = [cotangent(r, gen) for _, _, r in pairs]
        r_leaves = ex.leaves("ref", done.pairing, done.ref_side)
        i_leaves = ex.leaves("impl", done.pairing, done.impl_side)
        ref, err = vjp([r for _, _, r in pairs], r_leaves, cots)
        if err is not None:
            continue
        imp, err = vjp([i for _, i, _ in pairs], i_leaves, [c.clone() for c in cots])
        if err is not None:
            slots = slot_explanation(err, function_nodes([i for _, i, _ in pairs]))
            headline, fix = slots if slots is not None else (
                f"the implementation's backward raised {type(err).__name__}.",
                "compute the gradient of every input for which ctx.needs_input_grad[i] is True, "
                "and return None for the others.")
            sink.finding(NAME, f"{when[0].upper()}{when[1:]}: {headline}",
                        details=f"{type(err).__name__}: {error_text(err)[:400]}",
                        tb=format_tb(err), fix=fix)
            return
        oracle = _lazy_oracle(ex, done, cots)
        for i, (g, a, e) in enumerate(zip(done.pairing.groups, imp, ref)):
            name = template.group_name(g)
            m = ex.judge(name, a, e, kind="gradients", group=g, oracle=lambda i=i: oracle(i))
            if m is None:
                continue
            zero = not bool(a.detach().abs().sum()) and bool(e.detach().abs().sum())
            cause = ("the backward returned None (or zeros) for a needed gradient: it gates "
                     "the computation on the wrong ctx.needs_input_grad index (needs_input_grad[i] "
                     "belongs to forward input i)" if zero else
                     "the backward computes this gradient differently depending on which inputs "
                     "require grad (ctx.needs_input_grad)")
            sink.finding(NAME, f"gradient w.r.t. {name!r} differs from the "
                        f"reference {when}.", argument=name, mismatch=m, likely_cause=cause,
                        fix="check each `if ctx.needs_input_grad[i]:` against forward's "
                            "argument order (ctx excluded).")
            return  # one pattern's finding is enough: it shrinks on its own
