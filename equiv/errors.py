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


def user_error(e: BaseException) -> bool:
    """True for an exception raised by the user's code that is evidence about it: every
    ``Exception``, and ``SystemExit``/``GeneratorExit``-like ``BaseException``s; never
    ``KeyboardInterrupt`` nor equiv's own signals (``NotCompiled``, ``ExampleTimeout``)."""
    if isinstance(e, Exception):
        return True
    if isinstance(e, KeyboardInterrupt):
        return False
    return not type(e).__module__.startswith("equiv")


def error_text(exc: BaseException) -> str:
    """``str(exc)`` for messages and comparisons; ``<unprintable E: __str__ raised
    RuntimeError>`` when the exception's ``__str__`` raises or returns no string."""
    try:
        return str(exc)
    except BaseException as e:  # the user's __str__ failed: its failure is the text
        if not user_error(e):
            raise
        return f"<unprintable {type(exc).__name__}: __str__ raised {type(e).__name__}>"


for _cls in (
    EquivError, InvalidArgument, InternalError, EquivalenceFailure, OutputMismatch, MutationMismatch,
    AliasingMismatch, GradientMismatch, ErrorMismatch, ScheduleMismatch, MemoryMismatch,
):
    _cls.__module__ = "equiv"
del _cls
