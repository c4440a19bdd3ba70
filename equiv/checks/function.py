"""Checks for custom ``torch.autograd.Function``s and ``torch.library`` custom ops (issue 6).

They run on top of the core checks, from one hook in ``_Run.run`` (:func:`check_functions`), on
examples where both sides returned normally:

- **gradient slots** (all modes): autograd's raw errors about what a backward returned (wrong
  number of gradients, a gradient for a non-tensor input, a gradient of the wrong shape) get a
  headline naming the Function, the forward input and the fix. The check stays ``gradients``.
- **cut gradients through a Function**: the core's "gradient flow is cut" finding names
  ``ctx.mark_non_differentiable`` as a cause. Rule: the reference says which outputs are
  differentiable. An output the Function marks non-differentiable passes when the reference's
  output does not require grad either (an integer output, or one the reference ``.detach()``-es);
  it is a finding when the reference's output is differentiable.

Only in eager mode, and only when a custom Function node is in the implementation's graph (found
by walking ``grad_fn.next_functions`` from its outputs), to keep the cost bounded:

- ``mark-dirty``: an argument that requires grad whose version counter moved during the call
  while its ``grad_fn`` was not rebased (a tracked in-place write always rebases it; an in-place
  write inside ``forward`` without ``ctx.mark_dirty`` does not), with its gradient consequence.
- ``needs-input-grad``: every other requires_grad pattern of the example's differentiable
  storages (all proper non-empty subsets up to 3 of them, else each one alone and each one left
  out), each pattern's gradients compared with the reference's.
- ``double-backward``: the gradient of the vector-Jacobian product w.r.t. the inputs
  (``create_graph=True``) compared with the reference's where both support it. A
  ``@once_differentiable`` backward, or one computed entirely outside autograd (its result has no
  path back to the inputs: double backward would silently be zero), is a note; a backward that is
  partly differentiable (e.g. it uses an intermediate saved in forward) and so gives a wrong
  second derivative is a finding.

Once per spec, on the first valid example (any mode): ``opcheck`` runs
``torch.library.opcheck`` on every custom (non-aten) op the implementation calls, with the
arguments it called it with (recorded with a ``TorchFunctionMode``).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import itertools
import re
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch
from torch.overrides import TorchFunctionMode

from equiv._compat import (
    custom_function_node_type,
    custom_op_overload,
    op_schema,
    op_types,
    tree_flatten,
)

if TYPE_CHECKING:  # pragma: no cover
    from equiv.checks.core import _Run
    from equiv.examples import Side, Template

#: more differentiable storages than this: patterns are "each alone" and "each left out"
MAX_EXHAUSTIVE_PATTERN_GROUPS = 3
_MAX_NODES = 5000  # graph walk bound


# ============================================================================ registration
def callable_for(impl: Any) -> Callable[..., Any]:
    """What equiv calls for ``impl``: ``Fn.apply`` for an ``autograd.Function`` subclass, the op
    for a custom op (``torch.library.custom_op`` object, ``torch.ops.ns.op[.overload]``), else
    ``impl`` itself. The wrapper carries a usable signature (``forward``'s, without ``ctx`` for
    old-style Functions; the op schema's) and a readable name (``Fn.apply``, ``torch.ops.ns.op``).
    """
    if isinstance(impl, type) and issubclass(impl, torch.autograd.Function):
        return _function_apply(impl)
    overload = custom_op_overload(impl)
    if overload is not None:
        return _op_call(overload)
    return impl


def own_spec(impl: Any, specs: Iterable[Any]) -> Any:
    """``impl``'s own ``__equiv_spec__``: a Function subclass does not inherit its parent's;
    ``Fn.apply`` and every spelling of a registered custom op (``torch.ops.ns.op``, its
    overload, the ``custom_op`` object) find the spec registered for them."""
    if isinstance(impl, type):
        return vars(impl).get("__equiv_spec__")
    spec = getattr(impl, "__equiv_spec__", None)
    if spec is not None:
        return spec
    owner = getattr(impl, "__self__", None)  # Fn.apply: a method bound to the class
    if isinstance(owner, type) and issubclass(owner, torch.autograd.Function):
        return vars(owner).get("__equiv_spec__")
    overload = custom_op_overload(impl)
    if overload is not None:
        for spec in specs:
            if getattr(spec.impl, "__equiv_wraps__", None) is overload:
                return spec
    return None


def _setup_context_defined(fn_cls: type) -> bool:
    return fn_cls.setup_context is not torch.autograd.Function.setup_context


def forward_parameters(fn_cls: type) -> list[inspect.Parameter]:
    """The parameters ``Fn.apply`` takes: ``forward``'s, minus ``ctx`` for old-style Functions."""
    params = list(inspect.signature(fn_cls.forward).parameters.values())
    if not _setup_context_defined(fn_cls) and params:
        params = params[1:]
    return params


def _function_apply(fn_cls: type) -> Callable[..., Any]:
    try:
        sig = inspect.Signature(forward_parameters(fn_cls))
    except (TypeError, ValueError) as e:
        from equiv.errors import InvalidArgument

        raise InvalidArgument(
            f"cannot read the signature of {fn_cls.__qualname__}.forward ({e}); decorate a plain "
            f"Python function with named parameters that calls {fn_cls.__qualname__}.apply."
        ) from None

    def apply(*args: Any, **kwargs: Any) -> Any:
        return fn_cls.apply(*args, **kwargs)

    apply.__signature__ = sig  # type: ignore[attr-defined]
    apply.__name__ = f"{fn_cls.__name__}.apply"
    apply.__qualname__ = f"{fn_cls.__qualname__}.apply"
    apply.__module__ = fn_cls.__module__
    apply.__equiv_wraps__ = fn_cls  # type: ignore[attr-defined]
    return apply


_SCHEMA_ANNOTATIONS = {"Tensor": torch.Tensor, "float": float, "int": int, "SymInt": int,
                       "bool": bool}


def _op_call(overload: Any) -> Callable[..., Any]:
    schema = op_schema(overload)
    params = []
    for a in schema.arguments:
        kind = (inspect.Parameter.KEYWORD_ONLY if a.kwarg_only
                else inspect.Parameter.POSITIONAL_OR_KEYWORD)
        default = a.default_value if a.has_default_value() else inspect.Parameter.empty
        ann = _SCHEMA_ANNOTATIONS.get(str(a.type), str(a.type))
        params.append(inspect.Parameter(a.name, kind, default=default, annotation=ann))
    ns, _, name = schema.name.partition("::")
    overload_name = schema.overload_name

    def op(*args: Any, **kwargs: Any) -> Any:
        return overload(*args, **kwargs)

    op.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    op.__name__ = f"torch.ops.{ns}.{name}" + (f".{overload_name}" if overload_name else "")
    # the default overload's schema has overload_name "": torch.ops.ns.op(...) calls it
    op.__qualname__ = op.__name__
    op.__module__ = "builtins"  # so the report names it torch.ops.ns.op, not a module path
    op.__equiv_wraps__ = overload  # type: ignore[attr-defined]
    return op


# ============================================================================ graph helpers
def function_nodes(*trees: Any) -> list[Any]:
    """The custom Function nodes (``BackwardCFunction``) reachable from the tensors in ``trees``."""
    node_t = custom_function_node_type()
    stack = []
    for tree in trees:
        for leaf in tree_flatten(tree)[0]:
            if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None:
                stack.append(leaf.grad_fn)
    seen: set[int] = set()
    found = []
    while stack and len(seen) < _MAX_NODES:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, node_t):
            found.append(node)
        stack.extend(n for n, _ in getattr(node, "next_functions", ()))
    return found


def _function_class(node: Any) -> type | None:
    return getattr(node, "_forward_cls", None)


def _function_label(cls: type | None) -> str:
    if cls is None:
        return "a custom Function"
    name = cls.__name__
    if name.startswith("GeneratedBackwardFor_"):
        return f"the autograd formula of custom op {name[len('GeneratedBackwardFor_'):]}"
    return name


def _input_names(cls: type | None) -> list[str] | None:
    if cls is None or cls.__name__.startswith("GeneratedBackwardFor_"):
        return None
    try:
        return [p.name for p in forward_parameters(cls)]
    except (TypeError, ValueError):
        return None


def _edge_matches(node: Any, t: torch.Tensor, grad_fn: Any) -> bool:
    for n, _ in getattr(node, "next_functions", ()):
        if n is None:
            continue
        if grad_fn is not None and n is grad_fn:
            return True
        if grad_fn is None and getattr(n, "variable", None) is t:
            return True
    return False


# ============================================================================ the hook
def check_functions(run: "_Run", impl_side: "Side", impl_result: Any, ref_side: "Side",
                    ref_result: Any, finals: dict[str, Any], consumed: bool) -> None:
    """Every Function/custom-op check on one valid example (called by ``_Run.run``)."""
    finals_impl = [impl_side.argument(a) for a in finals]
    nodes = function_nodes(impl_result, finals_impl)
    _explain_gradient_errors(run, nodes)
    _explain_cut_gradients(run, nodes)
    if "opcheck" in run.cfg.checks:
        _opcheck_once(run)
    if run.mode != "eager" or not nodes:
        return
    template = run.template
    assert template is not None
    if "mark-dirty" in run.cfg.checks:
        _check_mark_dirty(run, template)
    if "needs-input-grad" in run.cfg.checks:
        _check_needs_input_grad(run, template)
    if "double-backward" in run.cfg.checks:
        _check_double_backward(run, template)


def _impl_fn(run: "_Run") -> Callable[..., Any]:
    return getattr(run, "impl_fn", run.spec.impl)


def _ref_fn(run: "_Run") -> Callable[..., Any]:
    return getattr(run, "ref_fn", run.spec.ref)


def _instantiate(run: "_Run", template: "Template") -> "Side":
    return template.instantiate(device=run.device)


# ============================================================================ gradient slots
_NUMBER = re.compile(r"function (\w+) returned an incorrect number of gradients "
                     r"\(expected (\d+), got (\d+)\)")
_NON_TENSOR = re.compile(r"function (\w+) returned a gradient different than None at position "
                         r"(\d+), but the corresponding forward input was not a Variable")
_SHAPE = re.compile(r"Function (\w+) returned an invalid gradient at index (\d+) - got "
                    r"\[([^\]]*)\] but expected shape compatible with \[([^\]]*)\]")
_INVALID = re.compile(r"Function (\w+) returned an invalid gradient at index (\d+) - (.*)")


def _explain_gradient_errors(run: "_Run", nodes: list[Any]) -> None:
    """Rewrite the core's raw "backward raised" findings about gradient slots."""
    by_node_name = {type(n).__name__: _function_class(n) for n in nodes}
    for k, f in enumerate(run.findings):
        if f.check not in ("gradients", "repeated-backward") or "backward raised" not in f.headline:
            continue
        new = _slot_headline(f.details, by_node_name)
        if new is not None:
            headline, fix = new
            run.findings[k] = dataclasses.replace(f, headline=headline, fix=fix)


def _slot_headline(details: str, classes: dict[str, type | None]) -> tuple[str, str] | None:
    def who(node_name: str) -> tuple[str, list[str] | None]:
        cls = classes.get(node_name)
        label = _function_label(cls) if cls is not None else node_name.removesuffix("Backward")
        return label, _input_names(cls)

    m = _NUMBER.search(details)
    if m:
        label, names = who(m[1])
        inputs = f" ({', '.join(names)})" if names and len(names) == int(m[2]) else ""
        return (f"{label}.backward returned {m[3]} gradients, but {label}.forward takes {m[2]} "
                f"inputs{inputs}: backward must return exactly one gradient per forward input.",
                "return one value per forward input, in order: a gradient for each tensor input "
                "that needs one, None for the others (non-tensor arguments included).")
    m = _NON_TENSOR.search(details)
    if m:
        label, names = who(m[1])
        pos = int(m[2])  # 1-based in autograd's message
        arg = f"{names[pos - 1]!r} " if names and pos <= len(names) else ""
        return (f"{label}.backward returned a gradient for forward input {arg}(position {pos}), "
                "which is not a tensor: only tensor inputs can receive a gradient.",
                f"return None in slot {pos} of {label}.backward's result.")
    m = _SHAPE.search(details)
    if m:
        label, names = who(m[1])
        i = int(m[2])
        arg = f"{names[i]!r}" if names and i < len(names) else f"input {i}"
        return (f"{label}.backward returned a gradient of shape [{m[3]}] for forward input {arg}, "
                f"which has shape [{m[4]}].",
                f"return a gradient with the shape of {arg} (reduce broadcast dimensions with "
                ".sum_to_size(...)).")
    m = _INVALID.search(details)
    if m:
        label, names = who(m[1])
        i = int(m[2])
        arg = f"{names[i]!r}" if names and i < len(names) else f"input {i}"
        return (f"{label}.backward returned an invalid gradient for forward input {arg}: "
                f"{m[3].strip()}.",
                f"return a gradient with the shape, dtype and device of {arg}.")
    return None


def _explain_cut_gradients(run: "_Run", nodes: list[Any]) -> None:
    """A cut gradient next to a custom Function may come from ctx.mark_non_differentiable."""
    if not nodes:
        return
    for k, f in enumerate(run.findings):
        if f.check == "gradients" and "the gradient flow is cut" in f.headline:
            run.findings[k] = dataclasses.replace(
                f,
                likely_cause=(f.likely_cause or "") + " Or a custom autograd.Function marked it "
                "with ctx.mark_non_differentiable while the reference's is differentiable.",
                fix=(f.fix or "") + " If no gradient should flow through this output, say so in "
                "the reference: return it .detach()-ed (the reference decides which outputs are "
                "differentiable).",
            )


# ============================================================================ mark_dirty
def _check_mark_dirty(run: "_Run", template: "Template") -> None:
    side = _instantiate(run, template)
    before = [(t.grad_fn, t._version, t.requires_grad) for t in side.tensors]
    result, exc = _core()._call(_impl_fn(run), side)
    if exc is not None:
        return  # not reproducible on a fresh copy: the core checks report what they saw
    nodes = function_nodes(result, [side.argument(a) for a in run.spec.mutates])
    seen: set[int] = set()
    for j, (slot, t) in enumerate(zip(template.slots, side.tensors)):
        grad_fn, version, rg = before[j]
        if id(t) in seen or not rg:
            continue
        seen.add(id(t))
        if t._version == version or t.grad_fn is not grad_fn:
            continue  # not written, or written and tracked (its history was rebased)
        owners = [n for n in nodes if _edge_matches(n, t, grad_fn)]
        names = sorted({_function_label(_function_class(n)) for n in owners})
        where = (f"inside {' or '.join(names)}.forward without ctx.mark_dirty({slot.path})"
                 if names else "outside autograd (inside a custom Function's forward without "
                 "ctx.mark_dirty, or under torch.no_grad())")
        consequence = [f.headline for f in run.findings
                       if f.check in ("gradients", "repeated-backward")]
        history = type(grad_fn).__name__ if grad_fn is not None else "a leaf"
        details = (f"version counter {version} -> {t._version} during the call, but its autograd "
                   f"history is unchanged ({history}), so gradients through its new value skip "
                   "the write.")
        if consequence:
            details += "\nGradient consequence on this example: " + consequence[0]
        else:
            details += ("\nNo gradient difference on this example, but autograd's in-place checks "
                        "for this tensor and its views are bypassed.")
        run.finding(
            "mark-dirty",
            f"argument {slot.path!r} was written in place {where}.",
            argument=slot.path, details=details,
            likely_cause="an in-place write that autograd did not record: its version counter "
                         "moved but its grad_fn was not rebased onto the Function's node.",
            fix=(f"call ctx.mark_dirty({slot.path}) in forward for every input written in place "
                 "(and return it), or write into a clone."),
        )


def _core() -> Any:
    from equiv.checks import core

    return core


# ============================================================================ shared pieces
@dataclasses.dataclass
class _Pass:
    """Both sides of one example run once: the differentiated pairs and their leaves."""

    impl_side: Any
    ref_side: Any
    pairs: list[tuple[str, torch.Tensor, torch.Tensor]]
    cut: list[str]
    groups: list[Any]


def _run_both(run: "_Run", template: "Template") -> tuple[_Pass | None, BaseException | None]:
    core = _core()
    ref_side = _instantiate(run, template)
    ref_result, ref_exc = core._call(_ref_fn(run), ref_side)
    if ref_exc is not None:
        return None, None
    impl_side = _instantiate(run, template)
    impl_result, impl_exc = core._call(_impl_fn(run), impl_side)
    if impl_exc is not None:
        return None, impl_exc
    _, finals, consumed = run._split(ref_result)
    pairs: list[tuple[str, Any, Any]] = []
    if not (impl_result is None and consumed):
        il, rl = core._leaves(impl_result), core._leaves(ref_result)
        if [p for p, _ in il] == [p for p, _ in rl]:
            pairs += [(f"output{p}", i, r) for (p, i), (_, r) in zip(il, rl)]
    for arg, final in finals.items():
        il, rl = core._leaves(impl_side.argument(arg)), core._leaves(final)
        if len(il) == len(rl):
            pairs += [(f"final value of {arg}{p}", i, r) for (p, i), (_, r) in zip(il, rl)]
    kept, cut = [], []
    for name, i, r in pairs:
        if not (core._is_diff(r) and r.requires_grad and isinstance(i, torch.Tensor)):
            continue
        (kept if i.requires_grad else cut).append((name, i, r))
    groups = [g for g in template.groups
              if impl_side.leaves[g.index] is not None and ref_side.leaves[g.index] is not None]
    return _Pass(impl_side, ref_side, kept, [n for n, _, _ in cut], groups), None


# ============================================================================ needs_input_grad
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


def _pattern_template(template: "Template", keep: set[int]) -> "Template":
    t = copy.copy(template)
    t.groups = [dataclasses.replace(g, requires_grad=g.requires_grad and g.index in keep)
                for g in template.groups]
    return t


def _check_needs_input_grad(run: "_Run", template: "Template") -> None:
    core = _core()
    diff = [g for g in template.groups if g.requires_grad]
    names = {g.index: template.group_name(g) for g in diff}
    gen = torch.Generator().manual_seed(run.cot_seed + 1)
    for pattern in requires_grad_patterns(len(diff)):
        keep = {diff[i].index for i in pattern}
        on = [names[i] for i in sorted(keep)]
        off = [names[g.index] for g in diff if g.index not in keep]
        when = (f"when only {', '.join(map(repr, on))} require{'s' if len(on) == 1 else ''} grad "
                f"({', '.join(map(repr, off))} not)")
        done, exc = _run_both(run, _pattern_template(template, keep))
        if exc is not None:
            run.finding("needs-input-grad", f"the implementation raised {type(exc).__name__} "
                        f"{when}, where the reference returned.",
                        details=f"{type(exc).__name__}: {str(exc)[:400]}",
                        tb=core._format_tb(exc))
            return
        if done is None:
            continue
        for name in done.cut:
            run.finding("needs-input-grad", f"{name} does not require grad in the implementation "
                        f"{when}, but the reference's does: the gradient flow is cut.",
                        argument=name,
                        fix="derive requires_grad from the inputs, not from a fixed pattern.")
        if not done.pairs or not done.groups:
            continue
        cots = [core._cotangent(r, gen) for _, _, r in done.pairs]
        r_leaves = [done.ref_side.leaves[g.index] for g in done.groups]
        i_leaves = [done.impl_side.leaves[g.index] for g in done.groups]
        ref, err = core._vjp([r for _, _, r in done.pairs], r_leaves, cots)
        if err is not None:
            continue
        imp, err = core._vjp([i for _, i, _ in done.pairs], i_leaves, [c.clone() for c in cots])
        if err is not None:
            slots = _slot_headline(str(err), {
                type(n).__name__: _function_class(n)
                for n in function_nodes([i for _, i, _ in done.pairs])})
            headline, fix = slots if slots is not None else (
                f"the implementation's backward raised {type(err).__name__}.",
                "compute the gradient of every input for which ctx.needs_input_grad[i] is True, "
                "and return None for the others.")
            run.finding("needs-input-grad", f"{when[0].upper()}{when[1:]}: {headline}",
                        details=f"{type(err).__name__}: {str(err)[:400]}",
                        tb=core._format_tb(err), fix=fix)
            return
        for g, a, e in zip(done.groups, imp, ref):
            name = template.group_name(g)
            m = core.compare_leaf(a, e, rtol=run.spec.rtol, atol=run.spec.atol, path=name)
            if m is None:
                continue
            zero = not bool(a.detach().abs().sum()) and bool(e.detach().abs().sum())
            cause = ("the backward returned None (or zeros) for a needed gradient: it gates "
                     "the computation on the wrong ctx.needs_input_grad index (needs_input_grad[i] "
                     "belongs to forward input i)" if zero else
                     "the backward computes this gradient differently depending on which inputs "
                     "require grad (ctx.needs_input_grad)")
            run.finding("needs-input-grad", f"gradient w.r.t. {name!r} differs from the "
                        f"reference {when}.", argument=name, mismatch=m, likely_cause=cause,
                        fix="check each `if ctx.needs_input_grad[i]:` against forward's "
                            "argument order (ctx excluded).")
            return  # one pattern's finding is enough: it shrinks on its own


# ============================================================================ double backward
def _check_double_backward(run: "_Run", template: "Template") -> None:
    core = _core()
    done, exc = _run_both(run, template)
    if done is None or exc is not None or not done.pairs or not done.groups:
        return  # the core checks report a failing call
    gen = torch.Generator().manual_seed(run.cot_seed + 2)
    cots = [core._cotangent(r, gen) for _, _, r in done.pairs]
    r_leaves = [done.ref_side.leaves[g.index] for g in done.groups]
    i_leaves = [done.impl_side.leaves[g.index] for g in done.groups]
    vs = [core._cotangent(leaf, gen) for leaf in r_leaves]

    def second(outs: list[torch.Tensor], leaves: list[torch.Tensor]) -> tuple[Any, Any, bool]:
        # cotangents that require grad: only then does a @once_differentiable backward hang its
        # results off an error node (without, they silently have no history)
        given = [c.clone().requires_grad_() for c in cots]
        try:
            first = torch.autograd.grad(outs, leaves, given, create_graph=True, allow_unused=True)
        except Exception as e:  # the user's backward raised
            return None, e, False
        live = [(g, v) for g, v in zip(first, vs) if g is not None and g.requires_grad]
        if any(_is_delayed_error(n) for n in _graph_nodes([g for g, _ in live])):
            return None, _OnceDifferentiable(), False
        if not live:
            return [None] * len(leaves), None, False
        try:
            h = torch.autograd.grad([g for g, _ in live], leaves, [v for _, v in live],
                                    allow_unused=True)
        except Exception as e:
            return None, e, True
        return [None if x is None else x.detach() for x in h], None, True

    ref, err, _ = second([r for _, _, r in done.pairs], r_leaves)
    if err is not None:
        note = (f"double backward not compared: the reference's raised {type(err).__name__}: "
                f"{str(err)[:160]}")
        if note not in run.notes:
            run.notes.append(note)
        return
    imp, err, _ = second([i for _, i, _ in done.pairs], i_leaves)
    labels = sorted({_function_label(_function_class(n)) for n in
                     function_nodes([i for _, i, _ in done.pairs])})
    who = " and ".join(labels) or "a custom Function"
    if err is not None:
        if isinstance(err, _OnceDifferentiable):
            note = (f"double backward not supported by {who} (@once_differentiable): "
                    "second-order gradients not compared")
            if note not in run.notes:
                run.notes.append(note)
            return
        run.finding("double-backward", f"double backward through {who} raised "
                    f"{type(err).__name__} where the reference's did not.",
                    details=f"{type(err).__name__}: {str(err)[:400]}", tb=core._format_tb(err),
                    fix="make backward differentiable (torch ops only), or decorate it with "
                        "@torch.autograd.function.once_differentiable to declare that it is not.")
        return
    if all(a is None for a in imp) and any(e is not None for e in ref):
        # backward computes entirely outside autograd: like @once_differentiable, but silent
        note = (f"double backward not supported by {who}: its backward computes outside autograd "
                "(.detach(), .data, tensors saved without history), so double backward would "
                "silently give zero; second-order gradients not compared. Decorate backward with "
                "@torch.autograd.function.once_differentiable to make that an error")
        if note not in run.notes:
            run.notes.append(note)
        return
    for g, a, e, leaf in zip(done.groups, imp, ref, r_leaves):
        name = template.group_name(g)
        m = core.compare_leaf(torch.zeros_like(leaf) if a is None else a,
                              torch.zeros_like(leaf) if e is None else e,
                              rtol=run.spec.rtol, atol=run.spec.atol, path=name)
        if m is None:
            continue
        run.finding("double-backward", f"second-order gradient (double backward) w.r.t. "
                    f"{name!r} differs from the reference.", argument=name, mismatch=m,
                    likely_cause=f"{who}'s backward is only partly differentiable: a value it "
                                 "uses has no autograd history (an intermediate saved in forward "
                                 "that is not an output, or a .detach()), so its derivative is "
                                 "missing from double backward.",
                    fix="save inputs or outputs (not intermediates) and recompute the rest in "
                        "backward with torch ops, or decorate backward with "
                        "@torch.autograd.function.once_differentiable so double backward raises "
                        "instead of returning a wrong value.")


class _OnceDifferentiable(Exception):
    """Internal: the first-order gradients hang off a @once_differentiable error node."""


def _graph_nodes(tensors: list[torch.Tensor]) -> list[Any]:
    stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
    seen: dict[int, Any] = {}
    while stack and len(seen) < _MAX_NODES:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        stack.extend(n for n, _ in getattr(node, "next_functions", ()))
    return list(seen.values())


def _is_delayed_error(node: Any) -> bool:
    # torch.autograd.function.once_differentiable wraps its results in a DelayedError node
    return type(node).__name__ in ("Error", "DelayedError")


# ============================================================================ opcheck
#: id(spec) -> (weak reference to the spec, [(op name, result dict or exception)])
_OPCHECKED: dict[int, tuple[Any, list[tuple[str, Any, str]]]] = {}

_ALLOWED_NAMESPACES = {"aten", "prim", "prims", "debugprims", "_refs"}


class _OpRecorder(TorchFunctionMode):
    """Records the first call of each custom (non-aten) op with copies of its arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[Any, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        overload_t, packet_t = op_types()
        op = func.default if isinstance(func, packet_t) and hasattr(func, "default") else func
        if (isinstance(op, overload_t) and op.namespace not in _ALLOWED_NAMESPACES
                and op not in self.calls):
            self.calls[op] = _copy_args(args, kwargs)
        return func(*args, **kwargs)


def _copy_args(args: Any, kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Leaf copies of the tensors (requires_grad kept; one object stays one object)."""
    made: dict[int, torch.Tensor] = {}

    def cp(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if id(x) not in made:
                with torch.no_grad():
                    c = x.detach().clone()
                made[id(x)] = c.requires_grad_(x.requires_grad and c.is_floating_point())
            return made[id(x)]
        if isinstance(x, (list, tuple)):
            return type(x)(cp(v) for v in x)
        return x

    return tuple(cp(a) for a in args), {k: cp(v) for k, v in kwargs.items()}


def _opcheck_once(run: "_Run") -> None:
    spec = run.spec
    entry = _OPCHECKED.get(id(spec))
    if entry is None or entry[0]() is not spec:
        results = _run_opcheck(run)
        if results is None:
            return
        _OPCHECKED[id(spec)] = (weakref.ref(spec), results)
        entry = _OPCHECKED[id(spec)]
    for op_name, outcome, example in entry[1]:
        _report_opcheck(run, op_name, outcome, example)


def _run_opcheck(run: "_Run") -> list[tuple[str, Any, str]] | None:
    template = run.template
    assert template is not None
    side = _instantiate(run, template)
    recorder = _OpRecorder()
    try:
        with torch.enable_grad(), recorder:  # as written (eager), whatever the mode
            run.spec.impl(*side.bound.args, **side.bound.kwargs)
    except Exception:  # the core checks report a failing call; retry on the next example
        return None
    results = []
    for op, (args, kwargs) in list(recorder.calls.items())[:8]:
        name = str(op_schema(op).name)
        example = _describe_call(name, args, kwargs)
        try:
            outcome: Any = torch.library.opcheck(op, args, kwargs, raise_exception=False)
        except Exception as e:  # opcheck itself could not run this op
            outcome = e
        results.append((name, outcome, example))
    return results


def _describe_call(name: str, args: Any, kwargs: Any) -> str:
    from equiv.examples import tensor_summary

    def show(x: Any) -> str:
        if isinstance(x, torch.Tensor):
            return tensor_summary(x)
        if isinstance(x, (list, tuple)):
            return "[" + ", ".join(show(v) for v in x) + "]"
        return repr(x)

    parts = [show(a) for a in args] + [f"{k}={show(v)}" for k, v in kwargs.items()]
    return f"{name}({', '.join(parts)})"


def _report_opcheck(run: "_Run", op_name: str, outcome: Any, example: str) -> None:
    if isinstance(outcome, BaseException):
        note = (f"opcheck could not run on custom op {op_name}: {type(outcome).__name__}: "
                f"{str(outcome)[:160]}")
        if note not in run.notes:
            run.notes.append(note)
        return
    failed = {k: v for k, v in outcome.items() if isinstance(v, BaseException)}
    if not failed:
        passed = ", ".join(k for k, v in outcome.items() if v == "SUCCESS")
        note = (f"opcheck passed for custom op {op_name} ({passed}); it compares the op only with "
                "itself: equiv compared it with the reference")
        if note not in run.notes:
            run.notes.append(note)
        return
    first_name, first = next(iter(failed.items()))
    lines = [f"{k}: {type(v).__name__}: {_first_line(v)}" for k, v in failed.items()]
    run.finding(
        "opcheck",
        f"torch.library.opcheck failed for custom op {op_name}: {', '.join(failed)}.",
        argument=op_name,
        details="opcheck ran on the call " + example + "\n" + "\n".join(lines),
        fix=_opcheck_fix(first_name),
    )


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else ""


def _opcheck_fix(test: str) -> str:
    return {
        "test_schema": "declare every argument the op writes in mutates_args (and make the "
                       "schema's aliasing match what the kernel returns).",
        "test_autograd_registration": "register a backward with torch.library.register_autograd "
                                      "(or op.register_autograd).",
        "test_faketensor": "register a fake (meta) kernel with op.register_fake that returns "
                           "tensors of the right shape and dtype.",
    }.get(test, "see the opcheck message above; torch.compile relies on this test (register a "
                "fake kernel, keep the schema honest).")

