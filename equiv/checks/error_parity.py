"""``error-parity``: errors are part of the contract.

- One side raised where the other returned (the compiled implementation must raise where the
  eager reference does, too).
- Both raised: the same type (``raises=`` fixes it); the messages match the spec's ``match=``
  regex where it declares one, and on ``error_inputs=`` examples without it the reference's
  first line is a prefix of the implementation's message (an incidental invalid input is judged
  by type only). And every argument must be left as the reference left it: no partial write
  before raising.
- ``error_inputs=`` examples: both sides must raise.

An implementation that raises where the reference returns a final value no write in place can
leave (another shape or dtype than the mutated argument) is not judged: the example is outside
the contract, and the runner rejects it as invalid input.

An example on which both sides raise the same error is otherwise invalid input (the runner
rejects it) unless it is an ``error_inputs=`` example or its error is the declared ``raises=``:
then it is a checked, passing example.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from equiv.compare import compare_leaf
from equiv.errors import error_text
from equiv.execution.calls import format_tb
from equiv.execution.record import Sink

NAME = "error-parity"

_LEAF_FIX = ("the implementation writes in place into an argument that is not declared: declare "
             "it with mutates={'<name>': <where its final value is in the reference's result>}, "
             "or write into a copy.")


_TYPE_FIX = ("raise the same exception type as the reference; if this input is outside the "
             "kernel's contract, draw only valid inputs (inputs=...).")


def run(ex: Any, sink: Sink) -> None:
    if ex.kind == "vmap":
        _transform(sink, ex.impl_exc, f"under vmap (batch dimension {ex.where})",
                   "the reference under vmap")
    elif ex.kind == "jvp":
        _transform(sink, ex.impl_exc, "under jvp", "the reference under jvp")
    elif ex.ref_exc is not None and ex.impl_exc is not None:
        _both_raised(ex, sink)
    else:
        _recorded(ex, sink)


def _recorded(ex: Any, sink: Sink) -> None:
    ref_exc, impl_exc = ex.ref_exc, ex.impl_exc
    where = "" if ex.mode == "eager" else f" under {ex.mode}"
    if ref_exc is None and impl_exc is None:
        if getattr(ex, "error_input", False):
            sink.finding(NAME, "both sides returned normally on an error_inputs= example, where "
                         "both must raise.", fix="make error_inputs= draw only inputs the "
                         "reference rejects (and the implementation must reject them too).")
        return
    if ref_exc is not None:
        sink.finding(
            NAME,
            f"the reference raised {type(ref_exc).__name__} but the implementation{where} "
            "returned normally.",
            details=f"reference error: {type(ref_exc).__name__}: {error_text(ref_exc)[:300]}",
            fix="reject this input in the implementation the way the reference does, or "
                "restrict inputs= to inputs the reference accepts.",
        )
    elif ex.unwritable_final() is None:  # else the example is outside the contract
        sink.finding(
            NAME,
            f"the implementation{where} raised {type(impl_exc).__name__} where the reference "
            "returned normally.",
            details=f"{type(impl_exc).__name__}: {error_text(impl_exc)[:400]}",
            tb=format_tb(impl_exc),
            fix=_LEAF_FIX if "leaf Variable that requires grad" in error_text(impl_exc) else None,
        )


def _first_line(exc: BaseException) -> str:
    text = error_text(exc).strip()
    return text.splitlines()[0].strip() if text else ""


def _both_raised(ex: Any, sink: Sink) -> None:
    ref_exc, impl_exc, spec = ex.ref_exc, ex.impl_exc, ex.spec
    where = "" if ex.mode == "eager" else f" under {ex.mode}"
    details = (f"reference: {type(ref_exc).__name__}: {error_text(ref_exc)[:300]}\n"
               f"implementation: {type(impl_exc).__name__}: {error_text(impl_exc)[:300]}")
    want = spec.raises or type(ref_exc)
    if spec.raises is None and not isinstance(impl_exc, want):
        sink.finding(NAME, f"the reference raised {type(ref_exc).__name__} but the "
                     f"implementation{where} raised {type(impl_exc).__name__}: "
                     f"{error_text(impl_exc)[:300]}", details=details, tb=format_tb(impl_exc),
                     fix=_TYPE_FIX)
        return
    if not isinstance(impl_exc, want) or not isinstance(ref_exc, want):
        who = "the reference" if not isinstance(ref_exc, want) else f"the implementation{where}"
        got = ref_exc if who == "the reference" else impl_exc
        sink.finding(NAME, f"both sides raised, but {who} raised {type(got).__name__}, not "
                     f"{want.__name__}.", details=details, tb=format_tb(impl_exc),
                     fix="raise the same exception type as the reference (or declare raises=).")
        return
    if spec.match is not None:
        bad = [(n, e) for n, e in (("reference", ref_exc), ("implementation", impl_exc))
               if not re.search(spec.match, error_text(e))]
        if bad:
            sink.finding(NAME, f"the {bad[0][0]}'s {type(bad[0][1]).__name__} message does not "
                         f"match match={spec.match!r}.", details=details, tb=format_tb(impl_exc),
                         fix="raise the message the spec's match= regex describes.")
            return
    elif ex.error_input:  # a declared error input: the reference's message is the contract
        ref_line, impl_text = _first_line(ref_exc), error_text(impl_exc).strip()
        ok = impl_text.startswith(ref_line) or (ex.mode != "eager" and ref_line in impl_text)
        if not ok:
            sink.finding(NAME, f"both sides raised {type(ref_exc).__name__}, but the "
                         f"implementation{where}'s message does not start with the "
                         "reference's.", details=details, tb=format_tb(impl_exc),
                         fix="raise the reference's message, or declare the messages both may "
                             "have with match=<regex>.")
            return
    _side_effects(ex, sink, details)


def _side_effects(ex: Any, sink: Sink, details: str) -> None:
    """Both raised: every argument must hold what the reference left in it."""
    template = ex.template
    for slot, got, ref in zip(template.slots, ex.impl_side.tensors, ex.ref_side.tensors):
        with torch.no_grad():
            want = ref.detach().to(device=got.device, dtype=got.dtype)
            m = compare_leaf(got.detach(), want, rtol=0, atol=0, path=slot.path, exact=True)
        if m is None:
            continue
        sink.finding(
            NAME, f"both sides raised {type(ex.ref_exc).__name__}, but the implementation wrote "
            f"into {slot.path} before raising; the reference left it unchanged.",
            argument=slot.path, mismatch=m, exact=True, details=f"{details}\n{m.message}",
            tb=format_tb(ex.impl_exc),
            fix="validate the inputs (indices, shapes) before the first write, as the reference "
                "does, so a failed call leaves its arguments untouched.")
        return


def _transform(sink: Sink, exc: BaseException | None, where: str, ref: str) -> None:
    if exc is None:
        return
    sink.finding(NAME, f"the implementation {where} raised {type(exc).__name__} where {ref} "
                 "returned.", details=f"{type(exc).__name__}: {error_text(exc)[:400]}",
                 tb=format_tb(exc))
