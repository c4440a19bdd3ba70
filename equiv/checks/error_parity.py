"""``error-parity``: one side raised where the other returned, or they raised different errors.

An example on which both sides raise the same type of error is invalid input: the runner
rejects it before any check runs."""

from __future__ import annotations

from typing import Any

from equiv.execution.calls import format_tb
from equiv.execution.record import Sink

NAME = "error-parity"

_LEAF_FIX = ("the implementation writes in place into an argument that is not declared: declare "
             "it with mutates={'<name>': <where its final value is in the reference's result>}, "
             "or write into a copy.")


def run(ex: Any, sink: Sink) -> None:
    if ex.kind == "vmap":
        _transform(sink, ex.impl_exc, f"under vmap (batch dimension {ex.where})",
                   "the reference under vmap")
    elif ex.kind == "jvp":
        _transform(sink, ex.impl_exc, "under jvp", "the reference under jvp")
    else:
        _recorded(ex, sink)


def _recorded(ex: Any, sink: Sink) -> None:
    ref_exc, impl_exc = ex.ref_exc, ex.impl_exc
    where = "" if ex.mode == "eager" else f" under {ex.mode}"
    if ref_exc is not None:
        got = ("returned normally" if impl_exc is None
               else f"raised {type(impl_exc).__name__}: {str(impl_exc)[:300]}")
        sink.finding(
            NAME,
            f"the reference raised {type(ref_exc).__name__} but the implementation{where} "
            f"{got}.",
            details=f"reference error: {type(ref_exc).__name__}: {str(ref_exc)[:300]}",
            tb=format_tb(impl_exc) if impl_exc is not None else None,
            fix="reject this input in the implementation the way the reference does, or "
                "restrict inputs= to inputs the reference accepts.",
        )
    elif impl_exc is not None:
        sink.finding(
            NAME,
            f"the implementation{where} raised {type(impl_exc).__name__} where the reference "
            "returned normally.",
            details=f"{type(impl_exc).__name__}: {str(impl_exc)[:400]}",
            tb=format_tb(impl_exc),
            fix=_LEAF_FIX if "leaf Variable that requires grad" in str(impl_exc) else None,
        )


def _transform(sink: Sink, exc: BaseException | None, where: str, ref: str) -> None:
    if exc is None:
        return
    sink.finding(NAME, f"the implementation {where} raised {type(exc).__name__} where {ref} "
                 "returned.", details=f"{type(exc).__name__}: {str(exc)[:400]}",
                 tb=format_tb(exc))
