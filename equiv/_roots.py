"""Roots and follow-ons: which findings of a run are consequences of an earlier one.

Decided from plain data only (check name, mode, device, the example's text, the involved
argument, the eager replay's attribution line), never by running anything. A finding is a
follow-on when an earlier finding explains it:

- on the same example (same mode and device): a gradient check after a ``forward``
  divergence; ``needs-input-grad`` and ``double-backward`` after ``gradients``;
  ``repeated-backward`` after ``gradients`` of the same argument;
- in a non-eager mode whose eager replay of its example fails the same check (its
  attribution says so): after the eager finding of that check, device and argument.

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
    """``findings`` with :attr:`Finding.caused_by` set (indices into this sequence)."""
    return [dataclasses.replace(f, caused_by=c) for f, c in zip(findings, causes(findings))]


def _explained_by(f: Finding, earlier: Sequence[Finding]) -> int | None:
    """The earlier finding that explains ``f`` (the first one), or None."""
    if not f.example or f.check == "flaky":
        return None
    for j, e in enumerate(earlier):
        if _same_example(e, f) and _explains(e, f):
            return j
    if f.mode != "eager" and (f.attribution or "").startswith(EAGER_TOO):
        for j, e in enumerate(earlier):
            if (e.mode == "eager" and e.device == f.device and e.check == f.check
                    and e.argument == f.argument and e.example):
                return j
    return None


def _same_example(a: Finding, b: Finding) -> bool:
    return (a.mode, a.device, a.example, a.example_code) == (b.mode, b.device, b.example,
                                                             b.example_code)


def _explains(e: Finding, f: Finding) -> bool:
    if e.check in _FORWARD:
        return f.check in _GRADIENT
    if e.check == "gradients":
        return f.check in _AFTER_GRADIENTS or (f.check == "repeated-backward"
                                               and e.argument == f.argument)
    return False
