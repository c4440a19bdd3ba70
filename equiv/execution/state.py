"""What the arguments must hold after a call (:func:`expected_state`, :func:`state_with`: the
reference's final values for mutated arguments, the drawn values for the others) and the writes
a call made outside every argument's view (:func:`outside_writes`)."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from equiv._compat import numpy_view, tree_flatten
from equiv.examples import Group, Side, Template
from equiv.execution.calls import brief
from equiv.execution.pairing import ReferenceError_

if TYPE_CHECKING:
    from equiv.execution.record import Execution


def expected_state(ex: Execution) -> tuple[Side, dict[int, torch.Tensor]]:
    """A copy of the example holding what every argument must hold after the call: the
    reference's final values for mutated arguments, the drawn values for the others. Final
    values an expanded (self-overlapping) argument cannot hold come back by slot index."""
    return state_with(ex.template, ex.finals, ex.device)


def state_with(template: Template, finals: dict[str, Any], device: Any,
               dtype: torch.dtype | None = None) -> tuple[Side, dict[int, torch.Tensor]]:
    """:func:`expected_state` for any final values (``dtype``: that of the floating slots)."""
    written = {template.slots[j].group for j, slot in enumerate(template.slots)
               if slot.path.split("[")[0] in finals}
    expected = template.instantiate(grad=False, device=device, dtype=dtype, fresh=written)
    unrepresentable: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for arg, final in finals.items():
            target = expected.argument(arg)
            t_leaves, f_leaves = tree_flatten(target)[0], tree_flatten(final)[0]
            if len(t_leaves) != len(f_leaves):
                raise ReferenceError_(
                    f"the reference's final value for mutated argument {arg!r} has "
                    f"{len(f_leaves)} leaves but the argument has {len(t_leaves)}."
                )
            for t, f in zip(t_leaves, f_leaves):
                if not isinstance(t, torch.Tensor):
                    continue
                if not isinstance(f, torch.Tensor) or f.shape != t.shape:
                    raise ReferenceError_(
                        f"the reference's final value for mutated argument {arg!r} is "
                        f"{brief(f)}, which does not fit the argument's shape "
                        f"{tuple(t.shape)}: check mutates= and the reference's result."
                    )
                try:
                    t.copy_(f.detach().to(t.dtype))
                except RuntimeError:  # t overlaps itself (stride 0): compare with f itself
                    j = next(j for j, e in enumerate(expected.tensors) if e is t)
                    unrepresentable[j] = f.detach().to(t.dtype)
    return expected, unrepresentable


@dataclasses.dataclass(frozen=True)
class OutsideWrite:
    """Elements of one storage group that no argument's view reaches, changed by a call:
    how many, and the first (its storage index, value before and after)."""

    group: Group
    count: int
    index: int
    before: Any
    after: Any


def outside_writes(template: Template, side: Side) -> list[OutsideWrite]:
    """The writes ``side``'s call made outside every argument's view, one per storage group
    (only groups that are views into larger storages have such elements)."""
    out = []
    for g in template.groups:
        if g.simple:
            continue
        now = side.storage(g)
        gaps = template.gaps(g, now.device)
        if gaps is None:
            continue
        before = g.values.to(now.device)
        changed = _differs_where(now, before, gaps)
        if changed is not None:
            k = int(changed[0])
            out.append(OutsideWrite(g, changed.numel(), k, before[k].item(), now[k].item()))
    return out


def _differs_where(a: torch.Tensor, b: torch.Tensor, where: torch.Tensor) -> torch.Tensor | None:
    """The flat indices where ``a`` differs from ``b`` (NaN equal to NaN) within the mask
    ``where``, or None when there are none. ``!=`` alone decides the common case (no such
    element): the NaN test runs only when some element differs (in NumPy where it is
    cheaper, :func:`~equiv._compat.numpy_view`)."""
    x, y, m = numpy_view(a), numpy_view(b), numpy_view(where)
    if x is not None and y is not None and m is not None:
        differs = np.not_equal(x, y)
        differs &= m
        if not differs.any():
            return None
    changed = (a != b) & where
    if not bool(changed.any()):
        return None
    if a.dtype.is_floating_point or a.dtype.is_complex:
        changed &= ~(a.isnan() & b.isnan())
    changed = changed.nonzero().reshape(-1)
    return changed if changed.numel() else None

