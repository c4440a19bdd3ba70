"""``batch-invariance`` (opt-in: ``batch_invariant=DIM``): each entry of the batch dimension
``DIM`` of the implementation's result equals bitwise the implementation called on that entry
alone (the dimension kept, with size 1), and so do the gradients of the batched arguments for
the cotangent sliced the same way. An argument is batched when its size along ``DIM`` is the
batch size (that of the first tensor argument having ``DIM``); the others (weights) are
passed whole and their gradients, sums over the batch, are not compared. Compared on examples
whose batched arguments are contiguous (a layout variant changes torch's own reduction
order). A kernel that picks another reduction order above a batch size breaks it."""

from __future__ import annotations

import torch

from equiv.compare import compare_leaf
from equiv.execution.record import Execution, Sink
from equiv.execution.runs import ImplRun, batch_size, sliceable, sliced_template

NAME = "batch-invariance"


def run(ex: Execution, sink: Sink) -> None:
    dim = ex.spec.batch_invariant
    assert dim is not None
    batch = batch_size(ex.template, dim)
    why = None if batch is None else sliceable(ex.template, dim, batch)
    if batch is None or batch < 2 or why is not None:
        sink.not_compared(NAME, f"{NAME}: not compared on this example ("
                          f"{why or f'no batch of 2 or more along dim {dim}'})")
        return
    full = ex.impl_run()
    if full.exc is not None:
        return
    mutated = list(ex.spec.mutates)
    for i in range(batch):
        template = sliced_template(ex.template, mutated, dim, i, batch)
        cots = {n: _entry(c, dim, i, batch) for n, c in full.cotangents.items()}
        alone = ex.impl_run(template, None if None in cots.values() else cots)
        if alone.exc is not None:
            sink.finding(NAME, f"the implementation raised on entry {i} of dim {dim} alone "
                         f"({type(alone.exc).__name__}) but not on the whole batch.",
                         likely_cause="the implementation assumes a batch size above 1.")
            return
        sink.mark_compared(NAME)
        found = _difference(full, alone, dim, i, batch, None not in cots.values())
        if found is not None:
            label, m = found
            sink.finding(
                NAME, f"entry {i} of dim {dim} of {label} differs from the implementation "
                f"called on that entry alone (not bitwise equal).", argument=m.path,
                mismatch=m, exact=True,
                details=f"{m.message}\nbatch of {batch} along dim {dim}, entry {i} called "
                        "alone with the dim kept (size 1)",
                likely_cause="the kernel takes another reduction order (split, tiled or "
                             "chunked) depending on the batch size.",
                fix="reduce each entry in the same order whatever the batch size; drop "
                    "batch_invariant= if batch-size-dependent rounding is acceptable.")
            return


def _entry(t: torch.Tensor, dim: int, i: int, batch: int) -> torch.Tensor | None:
    """Entry ``i`` of ``t`` along ``dim`` (size 1 kept), or None where ``t`` has no batch."""
    if t.dim() <= dim or t.shape[dim] != batch:
        return None
    return t.narrow(dim, i, 1)


def _difference(full: ImplRun, alone: ImplRun, dim: int, i: int, batch: int,
                grads: bool) -> tuple[str, object] | None:
    """The first batched value, then gradient, whose entry ``i`` differs from ``alone``'s."""
    for name, v in full.values.items():
        entry = _entry(v, dim, i, batch)
        if entry is not None:
            m = compare_leaf(alone.values.get(name), entry, rtol=0, atol=0, path=name,
                             exact=True)
            if m is not None:
                return name, m
    if not grads or full.grad_exc is not None or alone.grad_exc is not None:
        return None
    for name, g in full.grads.items():
        entry = _entry(g, dim, i, batch)
        if entry is not None and name in alone.grads:
            m = compare_leaf(alone.grads[name], entry, rtol=0, atol=0, path=name, exact=True)
            if m is not None:
                return f"the gradient w.r.t. {name!r}", m
    return None
