"""Exceptions: one root, misuse distinct from findings."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from equiv.report import Report

__all__ = [
    "EquivError",
    "InvalidArgument",
    "InternalError",
    "EquivalenceFailure",
    "OutputMismatch",
    "MutationMismatch",
    "AliasingMismatch",
    "GradientMismatch",
    "ErrorMismatch",
    "ScheduleMismatch",
    "MemoryMismatch",
]


class EquivError(Exception):
    """Root of every exception equiv raises."""


class InvalidArgument(EquivError, TypeError):
    """equiv was used wrongly (a registration or option mistake); the message names the fix."""


class InternalError(EquivError, RuntimeError):
    """equiv itself failed (a bug in equiv, not in the code under test); please report it."""


class EquivalenceFailure(EquivError, AssertionError):
    """The implementation diverged from its reference; ``.report`` holds every finding."""

    def __init__(self, report: "Report") -> None:
        self.report = report
        super().__init__(report.render())

    def __reduce__(self) -> tuple[Any, ...]:  # pickles across xdist workers
        return (type(self), (self.report,))


class OutputMismatch(EquivalenceFailure):
    """Returned outputs differ (values, dtype, shape, structure or stability)."""


class MutationMismatch(EquivalenceFailure):
    """A mutated argument ends with the wrong value, or an undeclared one was written."""


class AliasingMismatch(EquivalenceFailure):
    """Outputs share storage with inputs (or each other) against the contract."""


class GradientMismatch(EquivalenceFailure):
    """A vector-Jacobian product differs, on the first or a repeated backward."""


class ErrorMismatch(EquivalenceFailure):
    """One side raised where the other returned, or the two raised different errors."""


class ScheduleMismatch(EquivalenceFailure):
    """A hazardous schedule diverged silently instead of raising or matching."""


class MemoryMismatch(EquivalenceFailure):
    """The memory contract (peak ratio, retained bytes) was violated."""


for _cls in (
    EquivError, InvalidArgument, InternalError, EquivalenceFailure, OutputMismatch, MutationMismatch,
    AliasingMismatch, GradientMismatch, ErrorMismatch, ScheduleMismatch, MemoryMismatch,
):
    _cls.__module__ = "equiv"
del _cls
