"""``equiv.assert_equivalent``: every eager check on one given example, without drawing, so it can
run inside a user's own Hypothesis test (no nested ``@given``)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from equiv._args import Args
from equiv._compat import tree_flatten
from equiv.compare import dtype_tolerances
from equiv.modes import ModeRun, parse_mode
from equiv.pipeline import execute_example
from equiv.execution.calls import quiet_anomaly
from equiv.report import GIVEN, ModeResult, Report
from equiv.run import _Found, _ModeDriver, _resolve, _with, _write_only_read
from equiv.spec import get_spec
from equiv.variants import NO_VARIANT


def assert_equivalent(impl: Callable[..., Any], *args: Any, **kwargs: Any) -> Report:
    """Run every eager check of ``impl``'s spec (``@equivalent_to``) on the example ``args``,
    ``kwargs``, on the device of its first tensor: no example is drawn, so this can live inside
    your own ``@hypothesis.given`` test, which then draws and shrinks the inputs.

    Raises the first finding's :class:`equiv.EquivalenceFailure` subclass (checks in catalog
    order: e.g. ``OutputMismatch`` when the forward differs) carrying ``.report`` with every
    finding; returns the passing :class:`equiv.Report` otherwise. An example on which
    both sides raise the same error type is invalid input: it passes (nothing to compare).
    The given tensors are never modified (each side runs on copies).
    """
    spec = get_spec(impl)
    cfg = _resolve(spec, None)
    example = Args(*args, **kwargs)
    tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    device = str(tensors[0].device) if tensors else "cpu"
    state = ModeRun(parse_mode("eager"), spec.impl, spec.ref)
    table = {getattr(torch, d): (rtol, atol) for d, rtol, atol in cfg.tolerances}
    with state.context(), dtype_tolerances(table), quiet_anomaly():
        outcome = execute_example(spec, cfg, example, 0, state, device)
        findings = list(outcome.findings)
        if findings:
            driver = _ModeDriver(spec, cfg, state, device, None, {})
            found = _Found(findings, example, 0)
            findings = _write_only_read(spec, cfg, state, device, found,
                                        driver._described(outcome, NO_VARIANT, example))
            driver.write_files(findings)
    name = getattr(spec.impl, "__name__", spec.name)
    findings = [_with(f, reproduce=f"equiv.assert_equivalent({name}, ...) on this example")
                for f in findings]
    status = "FAIL" if findings else "passed"
    report = Report(
        spec=spec.name, implementation=spec.implementation, reference=spec.reference,
        findings=tuple(findings), examples_run=1,
        invalid_examples=int(outcome.invalid is not None), first_failure_at=1 if findings else None,
        modes=("eager",), devices=(device,), checks=cfg.checks, notes=tuple(outcome.notes),
        settings=f"{GIVEN}: the eager checks, no example drawn (profile={cfg.profile})",
        runs=(ModeResult("eager", device, status, 1),),
    )
    if findings:  # the first check that failed on the example names the failure
        raise findings[0].failure_class(report)
    return report
