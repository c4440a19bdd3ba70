"""Runs of the implementation alone, for properties of the implementation itself rather than
of its agreement with the reference: run-to-run determinism and batch invariance.

:func:`impl_run` calls the implementation on a fresh copy of a template and captures, right
after the call, every returned output and mutated argument's final value (detached clones),
then takes the VJP for a cotangent drawn from a seed (or given) w.r.t. every storage group
that requires grad. :func:`sliced_template` builds the example that holds one index of a batch
dimension.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from equiv._args import Args
from equiv._compat import tree_flatten, tree_unflatten
from equiv.examples import Side, Template
from equiv.execution.calls import call, cotangent, vjp
from equiv.execution.verdict import named_values


@dataclasses.dataclass
class ImplRun:
    """One fresh call of the implementation: its side, its error, and by name its values
    (``"output[0]"``, ``"final value of x"``: detached clones taken right after the call),
    the cotangents of the differentiated ones and the gradients by storage group name."""

    side: Side
    exc: BaseException | None
    values: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    cotangents: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    grads: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    grad_exc: BaseException | None = None


def impl_run(fn: Callable[..., Any], mutated: list[str], template: Template, device: Any,
             cot_seed: int, cotangents: dict[str, torch.Tensor] | None = None) -> ImplRun:
    """``fn`` on a fresh copy of ``template`` (see :class:`ImplRun`); ``cotangents`` by value
    name (a value without one is left out of the VJP), default drawn from ``cot_seed``."""
    side = template.instantiate(device=device)
    result, exc = call(fn, side)
    run = ImplRun(side, exc)
    if exc is not None:
        return run
    named = named_values(result, {a: side.argument(a) for a in mutated}, False)
    tensors = {n: v for n, v in named.items() if isinstance(v, torch.Tensor)}
    with torch.no_grad():
        run.values = {n: v.detach().clone() for n, v in tensors.items()}
    diff = {n: v for n, v in tensors.items()
            if v.requires_grad and (v.dtype.is_floating_point or v.dtype.is_complex)}
    if cotangents is None:
        gen = torch.Generator().manual_seed(cot_seed)
        cotangents = {n: cotangent(v, gen) for n, v in diff.items()}
    run.cotangents = {n: c for n, c in cotangents.items() if n in diff}
    groups = [g for g in template.groups if side.leaves[g.index] is not None]
    if not run.cotangents or not groups:
        return run
    names = list(run.cotangents)
    grads, run.grad_exc = vjp([diff[n] for n in names], [side.leaves[g.index] for g in groups],
                              [run.cotangents[n].to(diff[n].device) for n in names])
    run.grads = {template.group_name(g): t for g, t in zip(groups, grads)}
    return run


def batch_size(template: Template, dim: int) -> int | None:
    """The batch size along ``dim``: that of the first tensor argument with that dimension."""
    return next((s.size[dim] for s in template.slots if len(s.size) > dim), None)


def sliceable(template: Template, dim: int, batch: int) -> str | None:
    """Why the example cannot be cut into single batch entries, else None: an argument that is
    a view into a larger storage or shares storage (entries cut from it would not), or a
    batched argument that is not contiguous (another layout changes torch's own reduction
    order, so a layout variant of the batch is no batch-invariance evidence)."""
    for g in template.groups:
        if not g.simple or len(g.slots) > 1:
            return f"{template.group_name(g)} is a view or shares storage"
        s = template.slots[g.slots[0]]
        if len(s.size) > dim and s.size[dim] == batch and s.stride != _contiguous(s.size):
            return f"{s.path} is not contiguous"
    return None


def _contiguous(size: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(torch.empty(size, device="meta").stride())


def sliced_template(template: Template, mutated: list[str], dim: int, index: int,
                    batch: int) -> Template:
    """The example holding only entry ``index`` of dimension ``dim`` (size 1 kept) of every
    tensor argument whose size along ``dim`` is ``batch``; other arguments (weights) whole."""
    side = template.instantiate(grad=False)
    slot_of = {id(t): j for j, t in enumerate(side.tensors)}

    def cut(v: Any) -> Any:
        if not isinstance(v, torch.Tensor) or id(v) not in slot_of:
            return v
        slot = template.slots[slot_of[id(v)]]
        if v.dim() > dim and v.shape[dim] == batch:
            v = v.narrow(dim, index, 1)
        return v.detach().clone().requires_grad_(slot.requires_grad)

    flat, spec = tree_flatten((side.bound.args, side.bound.kwargs))
    args, kwargs = tree_unflatten([cut(v) for v in flat], spec)
    return Template(template.signature, Args(*args, **kwargs), mutated)
