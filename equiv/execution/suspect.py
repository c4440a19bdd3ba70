"""When the reference is the wrong side: probes run only for an example with a finding, whose
result says the reference (not the implementation) is the suspect, and how that was seen.

- **Equal inputs, other values.** The reference called once more on a fresh copy of the same
  example returns other values (or, for the same cotangent, other gradients): it reads memory
  it does not own (``torch.empty``, an index past a stride-0 argument's storage) or random
  state. No implementation can match it.
- **Layout dependence.** The reference called on contiguous copies of the same values returns
  other values, and the implementation agrees with those: the reference reads an argument's
  storage as if it were contiguous (a missing ``.contiguous()``).
"""

from __future__ import annotations

from typing import Any

import torch

from equiv._compat import tree_map
from equiv.compare import compare_leaf
from equiv.execution.calls import call, vjp
from equiv.execution.pairing import reference_run, split
from equiv.execution.record import Execution
from equiv.execution.verdict import named_values

#: what a finding about the reference's side says it should do instead
FIX = ("check the reference on its own (without equiv): call it twice on clones of the same "
       "inputs, and on .contiguous() copies; fix it, or choose another reference.")


def reference_suspect(ex: Execution) -> str | None:
    """The line naming the reference as the suspect, with how it was seen, or None (cached)."""
    if "reference-suspect" not in ex.cache:
        ex.cache["reference-suspect"] = _nondeterministic(ex) or _layout_dependent(ex)
    return ex.cache["reference-suspect"]


def _first(ex: Execution) -> dict[str, Any]:
    expected, finals, consumed = split(ex.spec, ex.ref_result)
    return named_values(expected, finals, consumed)


def _differing(a: dict[str, Any], b: dict[str, Any]) -> tuple[str, float] | None:
    """The first value (by name) that differs beyond the per-dtype default, and by how much."""
    for name, x in a.items():
        y = b.get(name)
        if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor)):
            continue
        m = compare_leaf(y.detach(), x.detach(), rtol=None, atol=None, path=name)
        if m is not None:
            return name, m.max_abs if m.max_abs is not None else float("nan")
    return None


def _nondeterministic(ex: Execution) -> str | None:
    if ex.ref_exc is not None or ex.ref_side is None:
        return None
    place = dict(device=ex.place.ref_device or ex.place.device, dtype=ex.place.ref_dtype)
    side = ex.template.instantiate(**place)
    run = reference_run(ex.spec, ex.ref_fn, side)
    if run.why is not None:
        return None
    found = _differing(_first(ex), run.values)
    if found is not None:
        name, by = found
        return (f"the reference is the suspect, not the implementation: called twice on equal "
                f"inputs it returned different values ({name}: max difference {by:.3g}); it "
                "reads memory it does not own (uninitialized, e.g. torch.empty, or out of "
                "bounds, e.g. past a stride-0 argument's storage) or random state.")
    return _backward_differs(ex, side, run.values)


def _backward_differs(ex: Execution, side: Any, values: dict[str, Any]) -> str | None:
    """The reference's VJP for cotangent 1 on the fresh copy against the record's."""
    pairing = ex.pairing()
    if not (pairing.ok and pairing.pairs) or ex.reference_grads_released:
        return None  # the record's own VJP is gone: a new call would be compared with a new one
    grads, err = ex.ref_grads(1)
    outs = [values.get(name) for name, _, _ in pairing.pairs]
    leaves = [side.leaves[g.index] for g in pairing.groups]
    if err is not None or not all(isinstance(o, torch.Tensor) and o.requires_grad
                                  for o in outs) or any(leaf is None for leaf in leaves):
        return None
    kept = [(o, c) for o, c in zip(outs, ex.cotangents()[0]) if c is not None]
    again, err = vjp([o for o, _ in kept], leaves,
                     [c.detach().to(device=o.device, dtype=o.dtype) for o, c in kept])
    if err is not None:
        return None
    names = [ex.template.group_name(g) for g in pairing.groups]
    found = _differing(dict(zip(names, grads)), dict(zip(names, again)))
    if found is None:
        return None
    name, by = found
    return (f"the reference is the suspect, not the implementation: its backward returned "
            f"different gradients on two calls with equal inputs and cotangents (w.r.t. "
            f"{name!r}: max difference {by:.3g}); it reads memory it does not own "
            "(uninitialized, or out of bounds, e.g. past a stride-0 argument's storage) or "
            "random state.")


class _Contiguous:
    """A side's arguments with every tensor replaced by a contiguous copy of its values."""

    def __init__(self, side: Any) -> None:
        def copy(v: Any) -> Any:
            if not isinstance(v, torch.Tensor):
                return v
            c = v.detach().contiguous().clone()
            return c.requires_grad_(v.requires_grad) if v.is_leaf or v.requires_grad else c

        self.args = tree_map(copy, tuple(side.bound.args))
        self.kwargs = tree_map(copy, dict(side.bound.kwargs))

    def call(self, fn: Any) -> Any:
        return fn(*self.args, **self.kwargs)


def _layout_dependent(ex: Execution) -> str | None:
    strided = [s.path for s, t in zip(ex.template.slots, ex.ref_side.tensors if ex.ref_side
                                      else ()) if not t.is_contiguous()]
    if not strided or ex.ref_exc is not None or ex.impl_exc is not None:
        return None
    place = dict(device=ex.place.ref_device or ex.place.device, dtype=ex.place.ref_dtype)
    result, exc = call(ex.ref_fn, _Contiguous(ex.template.instantiate(**place)))  # type: ignore
    if exc is not None:
        return None
    run = reference_run(ex.spec, ex.ref_fn, None, result, None, called=True)  # type: ignore
    first = _first(ex)
    found = _differing(first, run.values)
    impl = named_values(ex.impl_result, {a: ex.impl_side.argument(a) for a in ex.finals},
                        ex.consumed) if ex.impl_side is not None else {}
    if found is None or _differing({n: v for n, v in run.values.items() if n in impl},
                                   _cast(impl, run.values)) is not None:
        return None
    name, by = found
    return (f"the reference is the suspect, not the implementation: on contiguous copies of "
            f"the same values it returns other values ({name}: max difference {by:.3g}), and "
            f"the implementation agrees with those; it reads a non-contiguous argument's "
            f"storage as if it were contiguous, ignoring its strides ({', '.join(strided)}: a "
            "missing .contiguous()).")


def _cast(impl: dict[str, Any], like: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for n, v in impl.items():
        w = like.get(n)
        if isinstance(v, torch.Tensor) and isinstance(w, torch.Tensor):
            v = v.detach().to(device=w.device, dtype=w.dtype)
        out[n] = v
    return out

