"""The check catalog: one row per check, in the order checks run and are reported.

Everything that lists checks is derived from this table: ``settings(checks=...)`` validation,
the runner's pipeline (:mod:`equiv.run`), the failure class a finding raises
(:attr:`equiv.Finding.failure_class`), the report schema and the docs' check table (a test keeps
``docs/reference.md`` in step). A check is one row here plus one module ``equiv/checks/<module>.py``
defining ``run(ex, sink)``; a check module never imports another check module.
"""

from __future__ import annotations

import dataclasses

from equiv.errors import (
    AliasingMismatch,
    EquivalenceFailure,
    ErrorMismatch,
    GradientMismatch,
    MemoryMismatch,
    MutationMismatch,
    OutputMismatch,
    ScheduleMismatch,
)

#: mode kinds (equiv.modes.Mode.kind)
EVERY_MODE = ("eager", "compile", "functionalize", "vmap", "jvp", "autocast")
_RECORDED = ("eager", "compile", "functionalize", "autocast")  # modes whose example runs both sides as written


@dataclasses.dataclass(frozen=True)
class CheckRow:
    """One check: its name, the failure class its findings raise, where it runs, what it needs.

    ``needs``: ``"example"`` runs on every executed example, even when a side raised;
    ``"valid"`` only where both sides returned; ``"function"`` also needs a custom
    ``autograd.Function`` node in the implementation's graph; ``"clean"`` needs a valid example
    on which no earlier check found anything (its extra runs would only repeat a known bug).
    ``costly``: its extra runs cost several times the example's own; it runs on a share of
    the examples (``settings(costly_share=...)``). ``option``: an opt-in check, run only where
    the spec (or, for ``deterministic``, the settings) set that option.
    """

    name: str
    failure: type[EquivalenceFailure]
    module: str
    modes: tuple[str, ...]
    needs: str
    summary: str
    costly: bool = False
    option: str = ""


CATALOG: tuple[CheckRow, ...] = (
    CheckRow("error-parity", ErrorMismatch, "error_parity", EVERY_MODE, "example",
             "errors as contract: both raise or neither, same type and message, no partial "
             "write before raising"),
    CheckRow("forward", OutputMismatch, "forward", EVERY_MODE, "valid",
             "returned outputs: values, dtype, shape, structure"),
    CheckRow("mutation", MutationMismatch, "mutation", ("eager", "compile", "functionalize",
                                                        "vmap", "autocast"), "valid",
             "final values of mutated arguments; undeclared writes"),
    CheckRow("aliasing", AliasingMismatch, "aliasing", _RECORDED, "valid",
             "views as contract: outputs share input storage as the reference/aliases= say, an "
             "in-place kernel returns its argument, outputs overlap only where the reference's do"),
    CheckRow("no-grad", OutputMismatch, "no_grad", ("eager",), "clean",
             "the forward contract with no input requiring grad and under torch.no_grad()",
             costly=True),
    CheckRow("gradients", GradientMismatch, "gradients", ("eager", "compile", "vmap", "jvp",
                                                          "autocast"),
             "valid", "vector-Jacobian product for a random cotangent (vmap mode: batched "
             "gradients, a batch of cotangents at once; jvp mode: the tangent)"),
    CheckRow("repeated-backward", GradientMismatch, "repeated_backward",
             ("eager", "compile", "autocast"),
             "valid", "a second backward through the retained graph, same and new cotangent"),
    CheckRow("mark-dirty", GradientMismatch, "mark_dirty", ("eager",), "function",
             "in-place writes inside a custom Function's forward declared with ctx.mark_dirty"),
    CheckRow("needs-input-grad", GradientMismatch, "needs_input_grad", ("eager",), "function",
             "every other requires_grad pattern of the inputs"),
    CheckRow("double-backward", GradientMismatch, "double_backward", ("eager",), "function",
             "second-order gradients (create_graph=True)", costly=True),
    CheckRow("opcheck", EquivalenceFailure, "opcheck", ("eager", "compile"), "valid",
             "torch.library.opcheck on the custom ops the implementation calls"),
    CheckRow("output-stability", OutputMismatch, "output_stability", _RECORDED, "valid",
             "returned outputs unchanged by backward and by a second call", costly=True),
    CheckRow("state-across-calls", OutputMismatch, "state_across_calls", ("eager",), "clean",
             "a second call after the same tensors were updated in place matches the reference",
             costly=True),
    CheckRow("schedule", ScheduleMismatch, "schedule", ("eager",), "clean",
             "hazardous schedules raise or match the reference at forward-time values",
             costly=True),
    CheckRow("determinism", EquivalenceFailure, "determinism", ("eager", "compile"), "valid",
             "opt-in (deterministic=True): two calls on fresh, equal inputs give bitwise-equal "
             "outputs, mutated arguments and gradients", option="deterministic"),
    CheckRow("batch-invariance", EquivalenceFailure, "batch_invariance", ("eager", "compile"),
             "valid", "opt-in (batch_invariant=DIM): each entry of the batch equals bitwise the "
             "implementation on that entry alone, gradients included", option="batch_invariant"),
    CheckRow("memory", MemoryMismatch, "memory", ("eager",), "valid",
             "the memory contract: peak ratio and bytes retained by the graph (default: a loose "
             "bound on retained bytes, on a share of examples)"),
)

ROWS: dict[str, CheckRow] = {row.name: row for row in CATALOG}
#: every check, in run and report order
CHECK_NAMES: tuple[str, ...] = tuple(ROWS)
#: check name -> the failure class raised when only that kind of finding occurs
FAILURE_CLASSES: dict[str, type[EquivalenceFailure]] = {r.name: r.failure for r in CATALOG}
NEEDS = ("example", "valid", "function", "clean")

assert len(ROWS) == len(CATALOG), "duplicate check name in the catalog"
assert all(r.needs in NEEDS and set(r.modes) <= set(EVERY_MODE) for r in CATALOG)
