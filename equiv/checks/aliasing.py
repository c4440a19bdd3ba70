"""``aliasing``: outputs share storage with inputs, or with each other, only where the contract
(``mutates=``) or the reference does."""

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
    for path, t in impl_leaves:
        key = storage_key(t)
        if key is None or key not in impl_groups:
            continue
        g = impl_groups[key]
        if g in _allowed_groups(ex, path):
            continue
        r = ref_by_path.get(path)
        if isinstance(r, torch.Tensor) and ref_groups.get(storage_key(r)) == g:
            continue  # the reference returns a view of the same input: same contract
        names = ", ".join(sorted({template.slots[j].path for j in template.groups[g].slots}))
        sink.finding(
            NAME, f"output{path} shares storage with input {names}, which the contract does not "
            "allow.", argument=f"output{path}",
            details="Writes through one would change the other; the reference returns a new "
                    "tensor here.",
            fix=(f"return a new tensor (e.g. .clone()), or, if the implementation writes "
                 f"{names} in place and returns it, declare mutates={{{names!r}: 'out'}}."),
        )
    _outputs_sharing(sink, impl_leaves, impl_groups, ref_by_path)


def _outputs_sharing(sink: Sink, impl_leaves: list[tuple[str, torch.Tensor]],
                     impl_groups: dict[Any, int], ref_by_path: dict[str, Any]) -> None:
    """Outputs aliasing each other where the reference's do not."""
    seen: dict[Any, str] = {}
    ref_keys = {p: storage_key(v) for p, v in ref_by_path.items() if isinstance(v, torch.Tensor)}
    for path, t in impl_leaves:
        key = storage_key(t)
        if key is None or key in impl_groups:
            continue
        if key not in seen:
            seen[key] = path
            continue
        other = seen[key]
        if ref_keys.get(path) is None or ref_keys.get(path) != ref_keys.get(other):
            sink.finding(NAME, f"output{path} and output{other} share storage, but the "
                         "reference's do not.", argument=f"output{path}",
                         fix="return separate tensors (e.g. .clone() one of them).")


def _allowed_groups(ex: Any, path: str) -> set[int]:
    """Storage groups an output at ``path`` may share, by the mutates contract."""
    allowed = set()
    for arg, loc in ex.spec.mutates.items():
        prefix = "" if loc == "out" else f"[{loc!r}]"
        if path.startswith(prefix):
            allowed |= {s.group for s in ex.template.slots if s.path.split("[")[0] == arg}
    return allowed


def _group_keys(side: Any, template: Any) -> dict[Any, int]:
    out = {}
    for slot, t in zip(template.slots, side.tensors):
        key = storage_key(t)
        if key is not None:
            out[key] = slot.group
    return out
