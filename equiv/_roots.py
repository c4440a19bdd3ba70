"""Roots and follow-ons: which findings of a run are consequences of an earlier one.

Decided from plain data only (check name, mode, device, the example's text, the involved
argument, the eager replay's attribution line), never by running anything. A finding is a
follow-on when an earlier finding explains it:

- on the same example (same mode and device): a gradient check after a ``forward``
  divergence; another output's ``forward`` divergence after the first (one call);
  ``needs-input-grad`` and ``double-backward`` after ``gradients``; ``repeated-backward``
  after ``gradients`` of the same argument; a gradient check after a ``mark-dirty`` finding
  that saw its gradient consequence on this example (``mark-dirty`` is moved before the
  gradient findings it explains); on any example of the mode, an in-place kernel returning
  a view in place of its argument after the ``mark-dirty`` finding of that argument (moved
  before it too); a gradient check whose timeline's likely cause is the saved
  value of an argument that the ``mutation`` finding shows written;
- in a non-eager mode whose eager replay of its example fails the same check (its
  attribution says so): after the eager finding of that check, device and argument, or, for
  a gradient check, after the eager ``mark-dirty`` finding of that argument (gradients
  through its new value skip the unrecorded write).

Anything else, and anything unsure (no example text, flaky, run-level), stays a root.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from equiv.report import Finding

#: the attribution of a non-eager finding whose example fails the same check in eager mode
EAGER_TOO = "the implementation fails this check in eager mode too on this example"

#: checks whose divergence on an example explains the gradient checks' on it (a wrong
#: mutation need not: ``x.detach().add_()`` beside a cut gradient is two bugs)
_FORWARD = ("forward",)
#: gradient checks (their VJPs differentiate the forward's values)
_GRADIENT = ("gradients", "repeated-backward", "needs-input-grad", "double-backward")
#: the line of a ``mark-dirty`` finding's details that saw a gradient difference
_GRADIENT_SEEN = "Gradient consequence on this example: "
#: after ``gradients`` on the same example, whatever the argument
_AFTER_GRADIENTS = ("needs-input-grad", "double-backward")


def causes(findings: Sequence[Finding]) -> list[int | None]:
    """For each finding, the index of its root among ``findings`` (always an earlier one),
    or None for a root."""
    out: list[int | None] = []
    for i, f in enumerate(findings):
        j = _explained_by(f, findings[:i])
        out.append(None if j is None else (out[j] if out[j] is not None else j))
    return out


def with_causes(findings: Sequence[Finding]) -> list[Finding]:
    """``findings`` with :attr:`Finding.caused_by` set (indices into the returned list: a
    ``mark-dirty`` finding is moved before the gradient findings of its example it explains)."""
    ordered = _causes_first(findings)
    return [dataclasses.replace(f, caused_by=c) for f, c in zip(ordered, causes(ordered))]


def _causes_first(findings: Sequence[Finding]) -> list[Finding]:
    """``findings`` with each ``mark-dirty`` finding that saw a gradient consequence moved
    before the first gradient finding of its example (it is that finding's explanation)."""
    out: list[Finding] = []
    for f in findings:
        at = len(out)
        if f.check == "mark-dirty" and f.example:
            at = next((i for i, e in enumerate(out) if _dirty_explains(f, e)), at)
        out.insert(at, f)
    return out


def _dirty_explains(d: Finding, f: Finding) -> bool:
    """The ``mark-dirty`` finding ``d`` explains ``f``: a gradient finding on its example whose
    difference it saw, or (on any example of the mode) an in-place kernel returning a view in
    place of the argument (a Function returning an input it did not mark dirty returns a new
    view of it)."""
    if f.check in _GRADIENT:
        return _same_example(d, f) and _GRADIENT_SEEN in d.details
    return (f.check == "aliasing" and (d.mode, d.device) == (f.mode, f.device)
            and f" not {d.argument} itself" in f.headline)


def _explained_by(f: Finding, earlier: Sequence[Finding]) -> int | None:
    """The earlier finding that explains ``f`` (the first one), or None."""
    if not f.example or f.check == "flaky":
        return None
    for j, e in enumerate(earlier):
        if _same_example(e, f) and _explains(e, f):
            return j
    if f.check == "aliasing":
        j = next((j for j, e in enumerate(earlier)
                  if e.check == "mark-dirty" and _dirty_explains(e, f)), None)
        if j is not None:
            return j
    if f.mode != "eager" and (f.attribution or "").startswith(EAGER_TOO):
        for j, e in enumerate(earlier):
            if (e.mode == "eager" and e.device == f.device and e.check == f.check
                    and e.argument == f.argument and e.example):
                return j
        for j, e in enumerate(earlier):  # eager fails it too: the write gradients skip
            if (e.mode == "eager" and e.device == f.device and e.check == "mark-dirty"
                    and f.check in _GRADIENT and e.argument == f.argument):
                return j
    return None


def _same_example(a: Finding, b: Finding) -> bool:
    return (a.mode, a.device, a.example, a.example_code) == (b.mode, b.device, b.example,
                                                             b.example_code)


def _explains(e: Finding, f: Finding) -> bool:
    if e.check in _FORWARD:
        return f.check in _GRADIENT or f.check == e.check
    if e.check == "mark-dirty":
        return f.check in _GRADIENT and _GRADIENT_SEEN in e.details
    if e.check == "mutation" and e.argument:
        return f.check in _GRADIENT and _stale_save_of(f, e.argument)
    if e.check == "gradients":
        return f.check in _AFTER_GRADIENTS or (f.check == "repeated-backward"
                                               and e.argument == f.argument)
    return False


def _stale_save_of(f: Finding, argument: str) -> bool:
    """``f``'s likely cause (from its timeline) is ``argument``'s saved value overwritten."""
    cause = f.likely_cause or ""
    return (cause.startswith((f"saved {argument!r} ", f"{argument!r} stashed as "))
            and " was overwritten by " in cause)
