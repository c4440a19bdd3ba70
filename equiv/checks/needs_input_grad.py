"""``needs-input-grad``: every other requires_grad pattern of the example's differentiable
storages (all proper non-empty subsets up to :data:`MAX_EXHAUSTIVE_PATTERN_GROUPS` of them, else
each one alone and each one left out), each pattern's gradients compared with the reference's.
Each gradient is judged as the gradients check judges backward #1 (the same floors, taken for
the pattern's own cotangent); one the gradients check already reported is left to it. Catches a
custom Function's backward gated on the wrong ``ctx.needs_input_grad`` index."""

from __future__ import annotations

import copy
import dataclasses
import functools
import itertools
from typing import Any, Callable

import torch

from equiv.errors import error_text
from equiv.examples import Template
from equiv.execution.calls import cotangent, format_tb, vjp
from equiv.execution.graph import function_nodes, slot_explanation
from equiv.execution.record import Execution, Sink
from equiv.execution.verdict import OracleVJP

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


def _rerun_oracle(ex: Execution, done: Any,
                  cots: list[torch.Tensor]) -> Callable[[], OracleVJP | None]:
    """This pattern's oracle with its cotangent, run on first use (once)."""
    t = _pattern_template(ex.template, {g.index for g in done.pairing.groups})
    names = [n for n, _, _ in done.pairing.pairs]
    return functools.cache(lambda: ex.oracle.rerun_vjp(t, names, cots))


def _oracle_grads(at: Callable[[], OracleVJP | None],
                  groups: list[Any]) -> Callable[[int], torch.Tensor | None]:
    """Gradient ``i`` of the oracle ``at()`` w.r.t. ``groups``, computed on first use (once)."""
    grads = functools.cache(lambda: None if (run := at()) is None else run.grads(groups))
    return lambda i: None if grads() is None else grads()[i]


def run(ex: Execution, sink: Sink) -> None:
    # a gradient (or cut value) the gradients check reported is wrong whatever requires grad
    reported = {f.argument for f in sink.findings if f.check == "gradients"}
    if None in reported:
        return  # the whole first backward failed (it raised, or disagrees with finite diffs)
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
            if name not in reported:
                sink.finding(NAME, f"{name} does not require grad in the implementation "
                            f"{when}, but the reference's does: the gradient flow is cut.",
                            argument=name,
                            fix="derive requires_grad from the inputs, not from a fixed "
                                "pattern.")
        if done.pairing.ok and _backward(ex, sink, done, gen, when, reported):
            return  # one pattern's finding is enough: it shrinks on its own


def _backward(ex: Execution, sink: Sink, done: Any, gen: torch.Generator, when: str,
              reported: set[str | None]) -> bool:
    """Both sides' VJPs of one pattern's rerun for a random cotangent, each gradient the
    gradients check has not reported judged as it judges them; True after a finding."""
    pairs = done.pairing.pairs
    cots = [cotangent(r, gen) for _, _, r in pairs]
    r_leaves = ex.leaves("ref", done.pairing, done.ref_side)
    i_leaves = ex.leaves("impl", done.pairing, done.impl_side)
    ref, err = vjp([r for _, _, r in pairs], r_leaves, cots)
    if err is not None:
        return False
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
        return True
    at = _rerun_oracle(ex, done, cots)
    oracle = _oracle_grads(at, done.pairing.groups)
    for i, (g, a, e) in enumerate(zip(done.pairing.groups, imp, ref)):
        name = ex.template.group_name(g)
        if name in reported:
            continue
        m = ex.oracle.judge(name, a, e, kind="gradients", group=g, cotangent=at,
                            oracle=lambda i=i: oracle(i))
        if m is None:
            continue
        zero = not bool(a.detach().abs().sum()) and bool(e.detach().abs().sum())
        # the evidence of a pattern-dependent backward: with every input requiring grad, and
        # this pattern's cotangent, the implementation's gradient is another one
        cause = None if reported or not _pattern_dependent(ex, cots, name, a) else (
            "the backward returned None (or zeros) for a needed gradient: it gates "
            "the computation on the wrong ctx.needs_input_grad index (needs_input_grad[i] "
            "belongs to forward input i)" if zero else
            "the backward computes this gradient differently depending on which inputs "
            "require grad (ctx.needs_input_grad): with every input requiring grad and the "
            "same cotangent it returns another one")
        sink.finding(NAME, f"gradient w.r.t. {name!r} differs from the reference {when}.",
                     argument=name, mismatch=m, likely_cause=cause,
                     fix=None if cause is None else
                     "check each `if ctx.needs_input_grad[i]:` against forward's "
                     "argument order (ctx excluded).")
        return True
    return False


def _pattern_dependent(ex: Execution, cots: list[torch.Tensor], name: str,
                       got: torch.Tensor) -> bool:
    """The implementation's gradient w.r.t. ``name`` with every input requiring grad, for the
    same cotangents, differs from ``got`` (this pattern's): its backward depends on the
    pattern. A rerun that raises or cannot pair is no evidence."""
    full, exc = ex.rerun(ex.template)
    if exc is not None or full is None or not full.pairing.ok:
        return False
    leaves = ex.leaves("impl", full.pairing, full.impl_side)
    grads, err = vjp([i for _, i, _ in full.pairing.pairs], leaves, [c.clone() for c in cots])
    if err is not None:
        return False
    for g, a in zip(full.pairing.groups, grads):
        if ex.template.group_name(g) == name:
            a = torch.zeros_like(got) if a is None else a.detach()
            return a.shape != got.shape or not torch.allclose(a.to(got.dtype), got.detach(),
                                                              rtol=1e-6, atol=1e-9,
                                                              equal_nan=True)
    return False

