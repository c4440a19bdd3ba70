"""The ``vmap`` mode: ``torch.func.vmap`` of the implementation against ``vmap`` of the
reference, with the batch dimension placed first and then last.

A hand-written vmap rule (an ``autograd.Function.vmap`` staticmethod) is never exercised in eager;
this is where a rule that ignores ``in_dims`` shows. An implementation or reference that cannot
run under vmap is reported as unsupported (the mode is skipped with the reason), never as a pass.
"""

from __future__ import annotations

from typing import Any

import torch

from equiv._compat import tree_flatten, tree_unflatten
from equiv._settings import settings as Settings
from equiv.checks.core import Outcome, _format_tb, _leaves, _Run
from equiv.compare import compare_leaf, compare_trees
from equiv.examples import Args, Template
from equiv.modes import ModeRun, normalise_error
from equiv.spec import Spec

BATCH = 3

_UNSUPPORTED_WORDS = ("vmap", "Batching rule", "generate_vmap_rule", "batched")


def run_transform_example(spec: Spec, example: Args, cot_seed: int, cfg: Settings,
                          state: ModeRun, device: str) -> Outcome:
    run = _Run(spec, cfg, cot_seed, state.mode.name, device)
    template = Template(spec.signature, example, spec.mutates.keys())
    run.template = template
    if any(not g.simple for g in template.groups):
        run.notes.append("vmap: examples whose arguments share storage (views, the same tensor "
                         "twice) are not batched; they are checked in the other modes")
        return Outcome([], None, run.notes, template)
    base = template.instantiate(grad=False, device=device)
    if any(isinstance(v, torch.Tensor) for v in tree_flatten(base.bound.kwargs)[0]):
        run.notes.append("vmap: tensor keyword arguments are not batched; such examples are "
                         "checked in the other modes only")
        return Outcome([], None, run.notes, template)
    gen = torch.Generator().manual_seed(cot_seed)
    for dim in (0, -1):
        _one_layout(spec, run, state, base.bound.args, base.bound.kwargs, dim, gen)
        if run.findings or state.unsupported:
            break
    return Outcome(run.findings, None, run.notes, template)


def _batched(args: tuple[Any, ...], dim: int, gen: torch.Generator) -> tuple[Any, Any]:
    flat, treespec = tree_flatten(args)
    out, dims = [], []
    for x in flat:
        if isinstance(x, torch.Tensor):
            samples = [x]
            for _ in range(BATCH - 1):
                noise = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(x.device)
                samples.append((x + noise.to(x.dtype)) if x.dtype.is_floating_point else x)
            out.append(torch.stack(samples, dim=dim))
            dims.append(dim)
        else:
            out.append(x)
            dims.append(None)
    batched = tree_unflatten(out, treespec)
    in_dims = tuple(tree_unflatten(dims, treespec))
    return batched, in_dims


def _clone(args: Any) -> Any:
    flat, treespec = tree_flatten(args)
    return tree_unflatten([x.clone() if isinstance(x, torch.Tensor) else x for x in flat],
                          treespec)


def _one_layout(spec: Spec, run: _Run, state: ModeRun, args: tuple[Any, ...],
                kwargs: dict[str, Any], dim: int, gen: torch.Generator) -> None:
    from torch.func import vmap

    where = "first (in_dims=0)" if dim == 0 else "last (in_dims=-1)"
    batched, in_dims = _batched(args, dim, gen)
    ref_args, impl_args = _clone(batched), _clone(batched)
    before = _clone(batched)
    try:
        with torch.no_grad():
            ref_result = vmap(lambda *a: spec.ref(*a, **kwargs), in_dims=in_dims,
                              out_dims=dim)(*ref_args)
    except Exception as e:
        state.unsupported = (f"unsupported: the reference cannot run under vmap "
                             f"({type(e).__name__}: {str(e).splitlines()[0][:160]})")
        return
    try:
        with torch.no_grad():
            impl_result = vmap(lambda *a: spec.impl(*a, **kwargs), in_dims=in_dims,
                               out_dims=dim)(*impl_args)
    except Exception as e:
        e = normalise_error(e)
        text = str(e)
        if any(w in text for w in _UNSUPPORTED_WORDS):
            state.unsupported = (f"unsupported: the implementation cannot run under vmap "
                                 f"({type(e).__name__}: {text.splitlines()[0][:200]})")
            return
        run.finding("error-parity", f"the implementation under vmap (batch dimension {where}) "
                    f"raised {type(e).__name__} where the reference under vmap returned.",
                    details=f"{type(e).__name__}: {text[:400]}", tb=_format_tb(e))
        return
    expected, finals, consumed = run._split(ref_result)  # ReferenceError_ propagates
    detail = f"batch dimension {where}, batch of {BATCH}"
    if not (impl_result is None and consumed):
        for m in compare_trees(impl_result, expected, rtol=spec.rtol, atol=spec.atol):
            run.finding("forward", f"{m.path} under vmap (batch dimension {where}) differs from "
                        "the reference under vmap.", argument=m.path,
                        details=f"{detail}\n{m.message}")
            _numbers(run, m)
    names = list(spec.signature.parameters)
    for i, name in enumerate(names[:len(args)]):
        actual = impl_args[i]
        if name in finals:
            ms = compare_trees(actual, finals[name], rtol=spec.rtol, atol=spec.atol,
                               root=name)
            what = "the final value of mutated argument"
        else:
            ms = compare_trees(actual, before[i], rtol=0, atol=0, root=name, exact=True)
            what = "undeclared argument changed:"
        for m in ms:
            run.finding("mutation", f"{what} {m.path!r} under vmap (batch dimension {where}) "
                        "differs from the reference.", argument=m.path,
                        details=f"{detail}\n{m.message}")
            _numbers(run, m)


def _numbers(run: _Run, m: Any) -> None:
    """Carry the mismatch numbers onto the finding just added."""
    import dataclasses

    if run.findings and m.max_abs is not None:
        run.findings[-1] = dataclasses.replace(run.findings[-1], max_abs=m.max_abs,
                                               max_rel=m.max_rel, index=m.index)


# -- jvp: forward-mode AD ---------------------------------------------------------------------
_JVP_UNSUPPORTED = ("forward AD", "forward-mode", "jvp", "Forward AD", "not implemented",
                    "NotImplementedError")


def run_jvp_example(spec: Spec, example: Args, cot_seed: int, cfg: Settings,
                    state: ModeRun, device: str) -> Outcome:
    """``torch.func.jvp`` of (returned outputs, final values of mutated arguments) of the
    implementation against the reference's, for one random tangent."""
    from torch.func import jvp

    run = _Run(spec, cfg, cot_seed, state.mode.name, device)
    template = Template(spec.signature, example, spec.mutates.keys())
    run.template = template
    if any(not g.simple for g in template.groups):
        run.notes.append("jvp: examples whose arguments share storage are checked in the other "
                         "modes only")
        return Outcome([], None, run.notes, template)
    base = template.instantiate(grad=False, device=device)
    flat, treespec = tree_flatten((base.bound.args, base.bound.kwargs))
    where = [i for i, x in enumerate(flat)
             if isinstance(x, torch.Tensor) and x.dtype.is_floating_point]
    if not where:
        return Outcome([], None, run.notes, template)
    gen = torch.Generator().manual_seed(cot_seed)
    primals = tuple(flat[i].detach() for i in where)
    tangents = tuple(torch.randn(p.shape, generator=gen, dtype=torch.float64).to(p)
                     for p in primals)
    mutated = list(spec.mutates)
    consumed_box: list[bool] = [False]

    def rebuild(ts: tuple[torch.Tensor, ...]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        leaves = list(flat)
        for i, t in zip(where, ts):
            leaves[i] = t.clone()  # jvp writes through in-place ops: never the caller's tensor
        return tree_unflatten(leaves, treespec)

    names: list[str] = []

    def ref_side(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args, kwargs = rebuild(ts)
        result = spec.ref(*args, **kwargs)
        expected, finals, consumed = run._split(result)
        consumed_box[0] = consumed
        pairs = [] if consumed else [(f"output{p}", v) for p, v in _leaves(expected)]
        for name in mutated:
            pairs += [(f"final value of {name}{p}", v) for p, v in _leaves(finals[name])]
        names[:] = [n for n, v in pairs if _float(v)]
        return tuple(v for _, v in pairs if _float(v))

    def impl_side(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
        args, kwargs = rebuild(ts)
        bound = spec.signature.bind(*args, **kwargs)
        result = spec.impl(*args, **kwargs)
        leaves = [] if consumed_box[0] else tree_flatten(result)[0]
        for name in mutated:
            leaves += tree_flatten(bound.arguments[name])[0]
        return tuple(x for x in leaves if _float(x))

    try:
        r_out, r_tan = jvp(ref_side, primals, tangents)
    except Exception as e:
        state.unsupported = (f"unsupported: the reference has no forward-mode derivative "
                             f"({type(e).__name__}: {str(e).splitlines()[0][:160]})")
        return Outcome([], None, run.notes, template)
    try:
        i_out, i_tan = jvp(impl_side, primals, tangents)
    except Exception as e:
        e = normalise_error(e)
        text = f"{type(e).__name__}: {e}"
        if any(w in text for w in _JVP_UNSUPPORTED):
            state.unsupported = (f"unsupported: the implementation has no forward-mode "
                                 f"derivative ({text.splitlines()[0][:200]})")
            return Outcome([], None, run.notes, template)
        run.finding("error-parity", f"the implementation under jvp raised {type(e).__name__} "
                    "where the reference under jvp returned.", details=text[:400],
                    tb=_format_tb(e))
        return Outcome(run.findings, None, run.notes, template)
    if len(i_out) != len(r_out):
        run.finding("forward", f"under jvp the implementation produced {len(i_out)} "
                    f"differentiable results, the reference {len(r_out)}.")
        return Outcome(run.findings, None, run.notes, template)
    for name, a, e, ta, te in zip(names, i_out, r_out, i_tan, r_tan):
        m = compare_leaf(a, e, rtol=spec.rtol, atol=spec.atol, path=name)
        if m is not None:
            run.finding("forward", f"{name} under jvp differs from the reference's.",
                        argument=name, mismatch=m)
            continue
        m = compare_leaf(ta, te, rtol=spec.rtol, atol=spec.atol, path=name)
        if m is not None:
            run.finding("gradients", f"the forward-mode derivative (jvp) of {name} differs "
                        "from the reference's for the same tangent.", argument=name,
                        mismatch=m, likely_cause="a wrong forward-mode formula: a custom "
                        "autograd.Function's jvp staticmethod, or an op whose forward AD "
                        "disagrees with its backward.")
    return Outcome(run.findings, None, run.notes, template)


def _float(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.dtype.is_floating_point


