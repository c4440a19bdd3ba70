"""``no-grad``: the forward contract on the inference path. Kernels often take a fast path when
no input requires grad, or under ``torch.no_grad()``; every other check calls them with inputs
requiring grad under ``enable_grad``. Here the implementation runs twice more on fresh copies —
with no input requiring grad, and under ``torch.no_grad()`` — and its outputs, its writes to the
arguments and the storage its outputs share with inputs must be what the reference and the
graded call say. It runs on every clean example (valid, nothing found so far: two more forwards of
the implementation)."""

from __future__ import annotations

from typing import Any

import torch

from equiv._compat import equal
from equiv.errors import error_text
from equiv.execution.calls import format_tb, leaves, storage_key
from equiv.execution.contract_runs import judge_run, no_grad_run
from equiv.execution.record import Execution, Sink

NAME = "no-grad"

#: bound at import, as in equiv.compare: a spec may replace ``torch.equal``
_equal = equal

_HOW = {"inputs": "with no input requiring grad", "no_grad": "under torch.no_grad()"}


def run(ex: Execution, sink: Sink) -> None:
    for how, words in _HOW.items():
        r = no_grad_run(ex, how)
        if r.exc is not None:
            sink.finding(NAME, f"the implementation raised {type(r.exc).__name__} {words}, "
                         "where it returns with inputs requiring grad.",
                         details=f"{type(r.exc).__name__}: {error_text(r.exc)[:400]}",
                         tb=format_tb(r.exc))
            return
        # bitwise the graded call's values, which the forward and mutation checks passed on
        # this example (judged with their floors): nothing of this path to report
        other_path = _differs_from_graded(ex, r)
        for what, m in judge_run(ex, r, ex.expected, ex.finals) if other_path else ():
            where = m.path if what == "output" else f"{what} {m.path!r}"
            sink.finding(NAME, f"{where} {words} differs from the reference.",
                         argument=m.path, mismatch=m, likely_cause=_PATH_CAUSE)
            return
        if _aliasing_differs(ex, r, sink, words):
            return


_PATH_CAUSE = ("the implementation takes another code path when no gradient is needed (an "
               "inference fast path), and that path is wrong: its values differ from the "
               "implementation's own with gradients on this example.")


def _differs_from_graded(ex: Execution, r: Any) -> bool:
    """The no-grad call's outputs or arguments differ (bitwise, NaN equal to NaN) from the
    graded call's on this example: the evidence of another code path."""
    now = leaves(r.result) + [(str(i), t) for i, t in enumerate(r.side.tensors)]
    graded = leaves(ex.impl_result) + [(str(i), t) for i, t in enumerate(ex.impl_side.tensors)]
    if len(now) != len(graded):
        return True
    for (_, a), (_, b) in zip(now, graded):
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            return True
        if isinstance(a, torch.Tensor):
            if a.shape != b.shape or a.dtype != b.dtype:
                return True
            a, b = a.detach(), b.detach().to(a.device)
            if _bitwise_equal(a, b):  # one pass; NaN and other misses take the full test
                continue
            same = (a == b) | (a.isnan() & b.isnan()) if a.is_floating_point() else a == b
            if not bool(same.all()):
                return True
    return False


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal``, False where the dtype has no such kernel (complex32 on CPU)."""
    try:
        return _equal(a, b)
    except (RuntimeError, NotImplementedError):
        return False


def _shares(side: Any, result: Any, template: Any) -> dict[str, set[str]]:
    """Output path -> the arguments whose storage it shares."""
    by_key = {}
    for slot, t in zip(template.slots, side.tensors):
        key = storage_key(t)
        if key is not None:
            by_key.setdefault(key, set()).add(slot.path.split("[")[0])
    return {p: by_key.get(storage_key(t), set()) for p, t in leaves(result)
            if isinstance(t, torch.Tensor)}


def _aliasing_differs(ex: Execution, r: Any, sink: Sink, words: str) -> bool:
    graded = _shares(ex.impl_side, ex.impl_result, ex.template)
    now = _shares(r.side, r.result, ex.template)
    for path, args in now.items():
        if graded.get(path, set()) == args:
            continue
        was = ", ".join(sorted(graded.get(path, set()))) or "no input"
        got = ", ".join(sorted(args)) or "no input"
        sink.finding(NAME, f"output{path} {words} shares storage with {got}; with gradients it "
                     f"shares storage with {was}.", argument=f"output{path}",
                     details="A view on one path and a copy on the other: callers that write "
                             "through the result (or rely on it being new) break on one path.",
                     fix="return the same kind of tensor (a view of the same input, or a new "
                         "tensor) whether or not gradients are needed.")
        return True
    return False
