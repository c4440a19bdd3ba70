"""equiv: prove a fast, mutating PyTorch implementation equivalent to a pure reference."""

from equiv._settings import settings
from equiv.errors import (
    AliasingMismatch,
    EquivalenceFailure,
    EquivError,
    ErrorMismatch,
    GradientMismatch,
    InternalError,
    InvalidArgument,
    MemoryMismatch,
    MutationMismatch,
    OutputMismatch,
    ScheduleMismatch,
)
from equiv._args import Args
from equiv._schedule import Schedule
from equiv.modes import Mode, compiled
from equiv.report import Finding, ModeResult, Report
from equiv.run import check
from equiv._assert import assert_equivalent
from equiv._bench import bench
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
    "InternalError",
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
    "assert_equivalent",
    "bench",
    "check",
    "compiled",
    "equivalent_to",
    "registry",
    "settings",
]
