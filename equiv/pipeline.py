"""One example through the catalog: the core executes it, then every check that applies to the
mode and the record runs in catalog order. The runner (:mod:`equiv.run`) calls
:func:`execute_example` for each example Hypothesis draws, and again to replay a finding.

This is also the error boundary between the checks and the runner: a check that raises
anything but an :class:`~equiv.EquivError` is a bug in equiv, reported as
:class:`~equiv.InternalError` naming the spec and the check, never as a finding about the user's
code (the user's own exceptions are values inside the core, see :func:`equiv.execution.calls.call`).
"""

from __future__ import annotations

import dataclasses
import math
from types import ModuleType
from typing import Any

import torch

from equiv._catalog import CATALOG, ROWS, CheckRow
from equiv._contracts import ErrorArgs
from equiv._explain import first_finding_decides
from equiv._settings import settings as Settings
from equiv.checks import (
    aliasing,
    batch_invariance,
    determinism,
    double_backward,
    error_parity,
    forward,
    gradients,
    mark_dirty,
    memory,
    mutation,
    needs_input_grad,
    no_grad,
    opcheck,
    output_stability,
    repeated_backward,
    schedule,
    state_across_calls,
)
from equiv.errors import EquivError, InternalError, error_text
from equiv.examples import Template
from equiv.execution.calls import isolated, leaves
from equiv.execution.contract_runs import expected_error
from equiv.execution.pairing import check_mutated
from equiv.execution.record import Execution, Placement, Sink, execute
from equiv.execution.suspect import FIX as SUSPECT_FIX
from equiv.execution.suspect import reference_suspect
from equiv.execution.transforms import Unsupported, jvp_run, vmap_runs
from equiv.modes import ModeRun
from equiv.report import Finding
from equiv.spec import Spec
from equiv.variants import CONTIGUOUS, CotangentVariant, poisoning

_MODULES: dict[str, ModuleType] = {m.NAME: m for m in (
    error_parity, forward, mutation, aliasing, no_grad, gradients, repeated_backward, mark_dirty,
    needs_input_grad, double_backward, opcheck, output_stability, state_across_calls, schedule,
    determinism, batch_invariance, memory)}

assert set(_MODULES) == set(ROWS), "every catalog row needs exactly one check module"
assert all(_MODULES[r.name].__name__ == f"equiv.checks.{r.module}" for r in CATALOG)


@dataclasses.dataclass
class Outcome:
    """What one example produced: findings, or the reason it was rejected as invalid."""

    findings: list[Finding]
    invalid: str | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    template: Template | None = None
    #: every tensor of the example and of the reference's result had no element: shapes and
    #: dtypes were compared, but no value
    empty: bool = False
    #: a costly check ran on the example (a searched example stops at its first finding)
    costly_ran: bool = False


def narrowed(cfg: Settings, kind: str) -> Settings:
    """``cfg`` with the checks that run in mode kind ``kind``; functionalize keeps at least the
    forward check (the other checks do not apply there)."""
    if kind != "functionalize":
        return cfg
    kept = tuple(c for c in cfg.checks if kind in ROWS[c].modes)
    return Settings(cfg, checks=kept or ("forward",))


def rows_for(cfg: Settings, kind: str) -> list[CheckRow]:
    """The selected checks that run in mode kind ``kind``, in catalog order."""
    return [r for r in CATALOG if r.name in cfg.checks and kind in r.modes]


def execute_example(spec: Spec, cfg: Settings, args: Any, cot_seed: int, state: ModeRun,
                    device: str, *, place: Placement | None = None,
                    cotangent: CotangentVariant = CONTIGUOUS, costly: bool = True) -> Outcome:
    """Execute one example in ``state``'s mode and run every applicable check on it (the
    costly ones only when ``costly``), with ``cotangent`` the layout of the cotangents every
    backward of the core is handed; what the checks ran and compared on a valid example is
    added to ``state``'s account."""
    mode = state.mode
    sink = Sink(spec, cfg, place.mode if place is not None else mode.name, device)
    check_mutated(spec, args)
    with isolated(config=True):  # the Dynamo config user code may set, once per example
        outcome = _execute(spec, cfg, args, cot_seed, state, device, place, sink, cotangent,
                           costly)
    if outcome.invalid is None:
        state.cover(sink.ran, sink.compared, sink.uncompared)
    outcome.costly_ran = any(ROWS[name].costly for name in sink.ran if name in ROWS)
    return outcome


def _execute(spec: Spec, cfg: Settings, args: Any, cot_seed: int, state: ModeRun,
             device: str, place: Placement | None, sink: Sink,
             cotangent: CotangentVariant, costly: bool) -> Outcome:
    mode = state.mode
    kind = place.kind if place is not None else mode.kind
    if kind == "vmap":
        try:
            for run in vmap_runs(spec, cfg, args, cot_seed, mode.name, device, sink):
                n = len(sink.findings)
                _run_checks(cfg, run, sink, "vmap")
                if len(sink.findings) > n:
                    break
        except Unsupported as e:
            state.unsupported = str(e)
        return Outcome(sink.findings, None, sink.notes, sink.template)
    if kind == "jvp":
        try:
            run = jvp_run(spec, cfg, args, cot_seed, mode.name, device, sink)
        except Unsupported as e:
            state.unsupported = str(e)
            run = None
        if run is not None:
            _run_checks(cfg, run, sink, "jvp")
        return Outcome(sink.findings, None, sink.notes, sink.template)
    place = place or Placement(mode.name, mode.kind, device, state.impl_fn(),
                               state.ref_fn() if mode.kind == "autocast" else None,
                               state.ref_device, state.ref_dtype)
    if spec.write_only:  # the implementation's side: write-only buffers hold NaN at each call
        place = dataclasses.replace(place, impl_fn=poisoning(
            spec.signature, spec.write_only, place.impl_fn or spec.impl))
    ex = execute(spec, cfg, args, cot_seed, place, costly)
    ex.error_input = isinstance(args, ErrorArgs)
    ex.cot_variant = cotangent
    if kind == "functionalize" and ex.ref_exc is None and _unsupported(ex.impl_exc):
        state.unsupported = (f"unsupported: the implementation cannot run under functionalize "
                             f"({type(ex.impl_exc).__name__}: "
                             f"{error_text(ex.impl_exc).splitlines()[0][:200]})")
        return Outcome([], None, sink.notes, ex.template)
    sink.template, sink.dtype = ex.template, ex.template.dtype
    why = ex.rejection()
    if why is not None:  # both raised: the error contract is still checked
        _run_checks(cfg, ex, sink, kind)
        if sink.findings or expected_error(ex):
            return Outcome(sink.findings, None, sink.notes, ex.template)
        return Outcome([], why, sink.notes, ex.template)
    _run_checks(cfg, ex, sink, kind)
    return Outcome(sink.findings, None, sink.notes, ex.template, empty=_holds_no_value(ex))


def _holds_no_value(ex: Any) -> bool:
    """The example has tensors, all of them empty, and the reference returned only empty
    tensors (or None): nothing but shapes and dtypes could be compared."""
    slots = ex.template.slots
    if not slots or any(math.prod(s.size) for s in slots):
        return False
    return all(v is None or (isinstance(v, torch.Tensor) and v.numel() == 0)
               for _, v in leaves(ex.ref_result))


#: torch's words when a transform cannot run an implementation at all (not a bug in it)
_TRANSFORM_UNSUPPORTED = ("must override the setup_context staticmethod",
                          "functorch transforms", "We only support functionalizing operators",
                          "NYI: Functionalize rule for")


def _unsupported(exc: BaseException | None) -> bool:
    return exc is not None and any(w in error_text(exc) for w in _TRANSFORM_UNSUPPORTED)


def enabled(option: str, spec: Spec, cfg: Settings) -> bool:
    """The opt-in check behind ``option`` is switched on: by the spec, or for
    ``deterministic`` by the settings too."""
    value = getattr(spec, option, None)
    if value is not None and value is not False:  # batch_invariant=0 is on
        return True
    return bool(getattr(cfg, option, False))


def _run_checks(cfg: Settings, ex: Any, sink: Sink, kind: str) -> None:
    _run_rows(cfg, ex, sink, kind)
    for note in getattr(ex, "cache", {}).pop("precision-notes", ()):
        sink.note(note)
    if isinstance(ex, Execution) and ex.valid:
        _name_the_suspect(ex, sink)


#: the checks whose findings compare the implementation's values with the reference's
_AGAINST_REFERENCE = ("forward", "mutation", "gradients", "repeated-backward",
                      "needs-input-grad", "double-backward", "schedule")


def _name_the_suspect(ex: Execution, sink: Sink) -> None:
    """Findings comparing values with a reference that is itself the suspect (it returns other
    values for equal inputs, or depends on its arguments' layout) say so, in place of a likely
    cause about the implementation (a stale saved value, "save a clone")."""
    at = [i for i, f in enumerate(sink.findings) if f.check in _AGAINST_REFERENCE]
    if not at:
        return
    line = reference_suspect(ex)
    if line is None:
        return
    for i in at:
        sink.findings[i] = dataclasses.replace(sink.findings[i], likely_cause=line,
                                               fix=SUSPECT_FIX)


#: evidence in ``Execution.cache`` that no row after the named one reads, freed once the rows
#: are past it (each holds a copy of the example): the call on new values that
#: output-stability and state-across-calls share
_LAST_READ_BY = {"state-across-calls": ("shuffled-call",)}
#: the last check that reads the record's gradients (the implementation's backwards, the
#: reference's VJPs): the costly checks after it run without them held
_GRADIENTS_LAST_READ_BY = "mark-dirty"


def _run_rows(cfg: Settings, ex: Any, sink: Sink, kind: str) -> None:
    search = first_finding_decides()
    for row in rows_for(cfg, kind):
        _run_row(cfg, ex, sink, row)
        if search and sink.findings and sink.findings[0].check != "error-parity":
            break  # the example's verdict is its first finding's check: nothing more is read
        for key in _LAST_READ_BY.get(row.name, ()):
            getattr(ex, "cache", {}).pop(key, None)
        if row.name == _GRADIENTS_LAST_READ_BY and hasattr(ex, "release_gradients"):
            ex.release_gradients(reference=not sink.findings)  # a finding keeps its evidence


def _run_row(cfg: Settings, ex: Any, sink: Sink, row: CheckRow) -> None:
    if row.needs != "example" and not ex.valid:
        return
    if row.needs == "function" and not ex.function_nodes():
        return
    if row.needs == "clean" and sink.findings:
        return
    if row.costly and not getattr(ex, "costly", True):
        return
    if row.option and not enabled(row.option, ex.spec, cfg):
        return
    sink.ran.add(row.name)
    try:
        _MODULES[row.name].run(ex, sink)
    except EquivError:
        raise
    except Exception as e:  # a bug in equiv itself: never disguised as a finding
        raise InternalError(
            f"equiv failed inside its {row.name!r} check while checking {ex.spec.name} "
            f"(mode {ex.mode}, device {ex.device}): {type(e).__name__}: {error_text(e)}. "
            "This is a bug in equiv, not a finding about your code; please report it with "
            "this traceback and the example."
        ) from e
