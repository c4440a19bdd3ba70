"""``aliasing``: views as a contract, both ways.

- An output shares storage with an input only where the contract (``mutates=``, ``aliases=``)
  or the reference does; and where the reference returns a view of an input (``x.view(...)``,
  ``x[1:]``, ``x.t()``), the implementation must return a view of that input too (callers that
  write through the result rely on it). ``aliases=`` declares either direction explicitly.
- An output that overlaps itself (stride 0, ``expand``) where the reference's does not is a
  finding when no argument overlaps itself: writes through it reach several elements (a
  broadcast fast path may return a stride-0 result for a stride-0 input).
- An in-place kernel declared ``mutates={"x": "out"}`` that returns a tensor must return ``x``
  itself (same storage and view geometry), not a temporary holding its values.
- Outputs aliasing each other are judged by element overlap, not shared storage: disjoint
  ``chunk()`` views of one fused buffer are fine where the reference's are disjoint too; where
  the reference's overlap (``return y, y[0]``), the implementation's must too (``aliases=
  {location: None}`` declares a copy the contract). An output the reference returns as a view
  of a mutated argument's final value (``mutates={"x": 0}``, ``return y, y[0]``) may be a view
  of that argument.
"""

from __future__ import annotations

from typing import Any

import torch

from equiv.execution.calls import leaves, storage_key
from equiv.execution.record import Sink

NAME = "aliasing"


def run(ex: Any, sink: Sink) -> None:
    template = ex.template
    impl_groups = _group_keys(ex.impl_side, template)
    ref_groups = _group_keys(ex.ref_side, template)
    impl_leaves = [(p, t) for p, t in leaves(ex.impl_result) if isinstance(t, torch.Tensor)]
    ref_by_path = dict(leaves(ex.ref_result))
    if _returns_argument(ex, sink):
        return
    first = len(sink.findings)
    for path, t in impl_leaves:
        declared = _declared(ex, path)
        g = impl_groups.get(storage_key(t))
        r = ref_by_path.get(path)
        ref_g = ref_groups.get(storage_key(r)) if isinstance(r, torch.Tensor) else None
        if declared is not False:  # the output must be a view: of the declared arg or ref's
            want = _groups_of(template, declared) if declared else (
                {ref_g} if ref_g is not None and ex.mode_kind != "functionalize" else set())
            if want and g not in want:
                _missing_view(ex, sink, path, want, declared)
                continue
        if g is None or g in _allowed_groups(ex, path, ref_by_path):
            continue
        if declared is not False and (g == ref_g or g in _groups_of(template, declared)):
            continue  # the reference (or aliases=) makes it a view of the same input
        names = _names(template, {g})
        why = ("aliases= declares it a new tensor" if declared is False
               else "the reference returns a new tensor here")
        sink.finding(
            NAME, f"output{path} shares storage with input {names}, which the contract does not "
            "allow.", argument=f"output{path}",
            details=f"Writes through one would change the other; {why}.",
            fix=(f"return a new tensor (e.g. .clone()), or, if the implementation writes "
                 f"{names} in place and returns it, declare mutates={{{names!r}: 'out'}}."),
        )
    _outputs_overlapping(sink, impl_leaves, impl_groups, ref_by_path)
    if len(sink.findings) == first and not any(
            st == 0 and size > 1 for slot in template.slots
            for size, st in zip(slot.size, slot.stride)):  # an expanded input may pass through
        _self_overlapping(sink, impl_leaves, ref_by_path)
    if len(sink.findings) == first:
        _views_kept(ex, sink, impl_leaves, ref_by_path)


def _missing_view(ex: Any, sink: Sink, path: str, want: set[int], declared: Any) -> None:
    names = _names(ex.template, want)
    source = (f"aliases= declares output{path} a view of {names}" if declared
              else f"the reference returns a view of input {names} as output{path}")
    sink.finding(
        NAME, f"output{path} is a new tensor, but {source}.", argument=f"output{path}",
        details="A caller that writes through the result expects to change the input; "
                "with a copy the write goes nowhere.",
        fix=f"return a view of {names} (view/reshape/slicing/transpose, no .contiguous() or "
            "clone), or declare aliases={<location>: None} if a copy is the contract.",
    )


def _returns_argument(ex: Any, sink: Sink) -> bool:
    """mutates={"x": "out"}: a returned tensor must be ``x`` itself (same storage and view)."""
    if ex.mode_kind != "eager":
        return False  # compiled and functionalized programs may return an equal new tensor
    arg = next((a for a, loc in ex.spec.mutates.items() if loc == "out"), None)
    out, x = ex.impl_result, ex.impl_side.argument(arg) if arg else None
    if not (isinstance(out, torch.Tensor) and isinstance(x, torch.Tensor)) or out is x:
        return False
    same = (storage_key(out) == storage_key(x) and out.shape == x.shape
            and out.stride() == x.stride() and out.storage_offset() == x.storage_offset())
    if same:
        return False
    how = ("a view with other geometry of its storage" if storage_key(out) == storage_key(x)
           else "a new tensor holding its final values")
    sink.finding(
        NAME, f"the in-place kernel declared mutates={{{arg!r}: 'out'}} returns {how}, not "
        f"{arg} itself.", argument="output",
        details=f"Code like `y = kernel_({arg}); y.add_(1)` expects y to be {arg}: a write "
                f"through the result must reach {arg}.",
        fix=f"return {arg} (the argument written in place), as torch's in-place ops do.",
    )
    return True


def _declared(ex: Any, path: str) -> Any:
    """What ``aliases=`` says about the output at ``path``: an argument name, False (a new
    tensor), or None (undeclared: the reference decides)."""
    for loc, arg in ex.spec.aliases.items():
        prefix = "" if loc == "out" else f"[{loc!r}]"
        if path.startswith(prefix):
            return arg if arg is not None else False
    return None


def _groups_of(template: Any, arg: Any) -> set[int]:
    if not arg:
        return set()
    return {s.group for s in template.slots if s.path.split("[")[0] == arg}


def _names(template: Any, groups: set[int]) -> str:
    return ", ".join(sorted({template.slots[j].path for g in groups
                             for j in template.groups[g].slots}))


def _element_bytes(t: torch.Tensor) -> torch.Tensor:
    """Byte offsets, in its storage, of every byte of ``t``'s elements (sorted, unique)."""
    off = torch.tensor([t.storage_offset()], dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride()):
        off = (off[:, None] + torch.arange(size, dtype=torch.int64)[None, :] * stride).flatten()
    size = t.element_size()
    return torch.unique(off[:, None] * size + torch.arange(size)[None, :])


def overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Do ``a`` and ``b`` share at least one element of memory?"""
    if storage_key(a) is None or storage_key(a) != storage_key(b):
        return False
    if a.numel() == 0 or b.numel() == 0:
        return False
    ea, eb = _element_bytes(a), _element_bytes(b)
    if ea[-1] < eb[0] or eb[-1] < ea[0]:
        return False
    return bool(torch.isin(ea, eb).any())


def _outputs_overlapping(sink: Sink, impl_leaves: list[tuple[str, torch.Tensor]],
                         impl_groups: dict[Any, int], ref_by_path: dict[str, Any]) -> None:
    """Outputs sharing elements of memory where the reference's do not."""
    fresh = [(p, t) for p, t in impl_leaves if storage_key(t) not in impl_groups]
    for k, (path, t) in enumerate(fresh):
        for other, u in fresh[:k]:
            if storage_key(t) != storage_key(u) or not overlap(t, u):
                continue
            r, q = ref_by_path.get(path), ref_by_path.get(other)
            if isinstance(r, torch.Tensor) and isinstance(q, torch.Tensor) and overlap(r, q):
                continue
            sink.finding(NAME, f"output{path} and output{other} overlap in memory, but the "
                         "reference's do not.", argument=f"output{path}",
                         details="A write through one output changes the other (disjoint "
                                 "views of one buffer, e.g. chunk(), would be fine).",
                         fix="return separate tensors (e.g. .clone() one of them).")
            return


def _repeated_dim(t: torch.Tensor) -> int | None:
    """A dim along which ``t`` repeats one slice in memory (stride 0, size > 1), else None."""
    return next((d for d, (size, stride) in enumerate(zip(t.shape, t.stride()))
                 if stride == 0 and size > 1), None)


def _self_overlapping(sink: Sink, impl_leaves: list[tuple[str, torch.Tensor]],
                      ref_by_path: dict[str, Any]) -> None:
    """An output that overlaps itself (``expand``: stride 0) where the reference's does not:
    a write to one element changes others (and in-place ops on it raise)."""
    for path, t in impl_leaves:
        d, r = _repeated_dim(t), ref_by_path.get(path)
        if d is None or not isinstance(r, torch.Tensor) or _repeated_dim(r) is not None:
            continue
        sink.finding(NAME, f"output{path} overlaps itself (stride 0 along dim {d}: one slice "
                     "repeated in memory), but the reference's does not.",
                     argument=f"output{path}",
                     details="A write to one element changes every element sharing its memory, "
                             "and torch refuses in-place ops on it; the reference returns "
                             "separate elements.",
                     fix="materialize the result (.expand(...).clone() or .repeat(...)), or "
                         "return what the reference returns.")
        return


def _views_kept(ex: Any, sink: Sink, impl_leaves: list[tuple[str, torch.Tensor]],
                ref_by_path: dict[str, Any]) -> None:
    """Outputs the reference returns overlapping (one a view of the other) that the
    implementation returns as separate tensors (a write through one no longer reaches the
    other). Not under functionalize, whose programs may return equal new tensors."""
    if ex.mode_kind == "functionalize":
        return
    for k, (path, t) in enumerate(impl_leaves):
        for other, u in impl_leaves[:k]:
            r, q = ref_by_path.get(path), ref_by_path.get(other)
            if not (isinstance(r, torch.Tensor) and isinstance(q, torch.Tensor)) or \
                    _declared(ex, path) is False or _declared(ex, other) is False:
                continue
            if not overlap(r, q) or overlap(t, u):
                continue
            sink.finding(NAME, f"output{path} and output{other} are separate tensors, but the "
                         f"reference returns output{path} as a view of output{other} (they "
                         "overlap in memory).", argument=f"output{path}",
                         details="A caller that writes through one output expects the other "
                                 "to change; with a copy the write goes nowhere.",
                         fix=f"return output{path} as a view of output{other} (slicing, view, "
                             f"no .clone()), or declare aliases={{{_location(path)}: None}} "
                             "if a copy is the contract.")
            return


def _location(path: str) -> str:
    """The ``aliases=`` key of the output at ``path`` (``[1]`` -> ``1``, ``['h']`` ->
    ``'h'``, the whole result -> ``'out'``)."""
    if not path:
        return "'out'"
    return path[1:].split("]")[0]


def _allowed_groups(ex: Any, path: str, ref_by_path: dict[str, Any]) -> set[int]:
    """Storage groups an output at ``path`` may share, by the mutates contract: a mutated
    argument's, at the location of its final value, or where the reference's output shares
    storage with that final value (a view of it)."""
    allowed = set()
    r = ref_by_path.get(path)
    for arg, loc in ex.spec.mutates.items():
        prefix = "" if loc == "out" else f"[{loc!r}]"
        final = [v for p, v in ref_by_path.items() if p.startswith(prefix)
                 and isinstance(v, torch.Tensor)]
        if path.startswith(prefix) or (
                isinstance(r, torch.Tensor) and storage_key(r) is not None
                and any(storage_key(v) == storage_key(r) for v in final)):
            allowed |= {s.group for s in ex.template.slots if s.path.split("[")[0] == arg}
    return allowed


def _group_keys(side: Any, template: Any) -> dict[Any, int]:
    out = {}
    for slot, t in zip(template.slots, side.tensors):
        key = storage_key(t)
        if key is not None:
            out[key] = slot.group
    return out
