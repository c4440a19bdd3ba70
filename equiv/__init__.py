"""equiv: prove a fast, mutating PyTorch implementation equivalent to a pure reference."""

from equiv._settings import settings
from equiv.errors import (
    AliasingMismatch,
    EquivalenceFailure,
    EquivError,
    ErrorMismatch,
    GradientMismatch,
    InvalidArgument,
    MemoryMismatch,
    MutationMismatch,
    OutputMismatch,
    ScheduleMismatch,
)
from equiv.checks.schedules import Schedule
from equiv.examples import Args
from equiv.modes import Mode, compiled
from equiv.report import Finding, ModeResult, Report
from equiv.run import check
from equiv.spec import Spec, equivalent_to, registry
import equiv.modules  # noqa: E402,F401  (registers nn.Module pairs with equivalent_to)

__version__ = "0.1.0"

__all__ = [
    "Args",
    "AliasingMismatch",
    "EquivError",
    "EquivalenceFailure",
    "ErrorMismatch",
    "Finding",
    "GradientMismatch",
    "InvalidArgument",
    "MemoryMismatch",
    "Mode",
    "ModeResult",
    "MutationMismatch",
    "OutputMismatch",
    "Report",
    "Schedule",
    "ScheduleMismatch",
    "Spec",
    "check",
    "compiled",
    "equivalent_to",
    "registry",
    "settings",
]
