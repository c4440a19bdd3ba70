"""``forward``: the returned outputs equal the reference's (values, dtype, shape, structure)."""

from __future__ import annotations

from typing import Any

from equiv._compat import tree_flatten
from equiv.compare import Mismatch, compare_leaf, compare_trees
from equiv.execution.calls import leaves
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
    for m in _outputs(ex):
        sink.finding(NAME, f"{m.path} differs from the reference.", argument=m.path, mismatch=m)


def _outputs(ex: Any) -> list[Mismatch]:
    """Each returned leaf judged against the reference's (structure first, exactly)."""
    actual, expected = leaves(ex.impl_result), leaves(ex.expected)
    if _structure(ex.impl_result) != _structure(ex.expected):
        return compare_trees(ex.impl_result, ex.expected, rtol=ex.spec.rtol, atol=ex.spec.atol)
    out = []
    for (p, a), (_, e) in zip(actual, expected):
        name = f"output{p}"
        m = ex.oracle.judge(name, a, e, oracle=lambda n=name: ex.oracle.value(n),
                            baseline=lambda n=name: ex.oracle.baseline_value(n),
                            rounding=lambda n=name: ex.oracle.rounding_spread(n), precision=True)
        if m is not None:
            out.append(m)
    return out


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


def _structure(tree: Any) -> Any:
    return tree_flatten(tree, is_leaf=lambda x: x is None)[1]
