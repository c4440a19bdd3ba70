"""``forward``: the returned outputs equal the reference's (values, dtype, shape, structure)."""

from __future__ import annotations

from typing import Any

from equiv.compare import compare_leaf, compare_trees
from equiv.execution.record import Sink

NAME = "forward"


def run(ex: Any, sink: Sink) -> None:
    spec = ex.spec
    if ex.kind == "vmap":
        if ex.impl_result is None and ex.consumed:
            return
        for m in compare_trees(ex.impl_result, ex.expected, rtol=spec.rtol, atol=spec.atol):
            sink.finding(NAME, f"{m.path} under vmap (batch dimension {ex.where}) differs from "
                         "the reference under vmap.", argument=m.path, mismatch=m,
                         details=f"{ex.detail}\n{m.message}")
        return
    if ex.kind == "jvp":
        _jvp(ex, sink)
        return
    if ex.impl_result is None and ex.consumed:
        return  # an in-place implementation returning nothing: all is in its arguments
    for m in compare_trees(ex.impl_result, ex.expected, rtol=spec.rtol, atol=spec.atol):
        sink.finding(NAME, f"{m.path} differs from the reference.", argument=m.path, mismatch=m)


def _jvp(ex: Any, sink: Sink) -> None:
    if len(ex.impl_out) != len(ex.ref_out):
        sink.finding(NAME, f"under jvp the implementation produced {len(ex.impl_out)} "
                     f"differentiable results, the reference {len(ex.ref_out)}.")
        return
    for name, a, e in zip(ex.names, ex.impl_out, ex.ref_out):
        m = compare_leaf(a, e, rtol=ex.spec.rtol, atol=ex.spec.atol, path=name)
        if m is not None:
            sink.finding(NAME, f"{name} under jvp differs from the reference's.", argument=name,
                         mismatch=m)
