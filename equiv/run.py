"""The runner: drives Hypothesis over examples, collects findings, builds the report."""

from __future__ import annotations

import random
from typing import Any, Callable

import hypothesis
from hypothesis import HealthCheck, Phase
from hypothesis import strategies as st
from hypothesis.errors import FlakyFailure, Unsatisfiable

from equiv._settings import settings as Settings
from equiv.checks.core import Outcome, run_example
from equiv.errors import InvalidArgument
from equiv.examples import as_args
from equiv.report import Finding, Report
from equiv.spec import Spec, get_spec

KNOWN_MODES = ("eager",)


class _Found(Exception):
    """Internal: an example produced findings (one subclass per check, so Hypothesis tracks
    distinct bugs separately and shrinks each)."""

    def __init__(self, findings: list[Finding]) -> None:
        super().__init__(findings[0].headline)
        self.findings = findings


_SIGNALS: dict[str, type[_Found]] = {}


def _signal(check: str) -> type[_Found]:
    if check not in _SIGNALS:
        _SIGNALS[check] = type(f"_Found_{check.replace('-', '_')}", (_Found,), {})
    return _SIGNALS[check]


class _Abort(Exception):
    """Internal: carries a usage error out of Hypothesis without shrinking it into noise."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def _resolve(spec: Spec, cfg: Settings | None, **overrides: Any) -> Settings:
    base = Settings.default()
    if cfg is not None:
        base = cfg
    given = {k: v for k, v in overrides.items() if v is not None}
    if given:
        base = Settings(base, **given)
    if spec.settings is not None:  # the decorator wins
        changed = {f: getattr(spec.settings, f) for f in ("max_examples", "checks", "modes",
                                                          "devices", "backward_repeats")
                   if getattr(spec.settings, f) != getattr(Settings(), f)}
        if changed:
            base = Settings(base, **changed)
    return base


def check(impl: Callable[..., Any], *, max_examples: int | None = None, seed: int | None = None,
          settings: Settings | None = None, checks: tuple[str, ...] | None = None,
          modes: tuple[str, ...] | None = None, devices: tuple[str, ...] | None = None,
          raise_on_failure: bool = True) -> Report:
    """Run every applicable check of ``impl``'s spec and return the :class:`Report`.

    Raises :class:`equiv.EquivalenceFailure` (an ``AssertionError``; the most specific subclass,
    e.g. ``GradientMismatch``) carrying ``.report`` when anything diverges, unless
    ``raise_on_failure=False``.
    """
    spec = get_spec(impl)
    cfg = _resolve(spec, settings, max_examples=max_examples, seed=seed, checks=checks,
                   modes=modes, devices=devices)
    for mode in cfg.modes:
        if mode not in KNOWN_MODES:
            raise InvalidArgument(
                f"unknown mode {mode!r}; available modes: {list(KNOWN_MODES)}."
            )
    run_seed = cfg.seed if cfg.seed is not None else (
        None if cfg.derandomize else random.SystemRandom().randrange(2**32))
    stats = {"runs": 0, "invalid": 0, "first_failure": 0}
    notes: list[str] = []
    last_invalid: list[str] = []
    mode, device = "eager", "cpu"

    def body(example: Any, cot_seed: int) -> None:
        try:
            args = as_args(example)
        except TypeError as e:
            raise _Abort(InvalidArgument(f"equivalent_to(inputs=...) produced a bad example: {e}"))
        try:
            outcome: Outcome = run_example(spec, args, cot_seed, cfg, mode=mode, device=device)
        except InvalidArgument as e:
            raise _Abort(e) from None
        stats["runs"] += 1
        for n in outcome.notes:
            if n not in notes:
                notes.append(n)
        if outcome.invalid is not None:
            stats["invalid"] += 1
            last_invalid[:] = [outcome.invalid]
            hypothesis.reject()
        if outcome.findings:
            stats["first_failure"] = stats["first_failure"] or stats["runs"]
            template = outcome.template
            name = spec.impl.__name__ if hasattr(spec.impl, "__name__") else spec.name
            example_text = template.describe(name) if template else ""
            code = template.code(name) if template else ""
            reproduce = (f"equiv.check({name}, seed={run_seed})" if run_seed is not None else
                         f"equiv.check({name}) with the same profile ({cfg.profile}: "
                         "derandomized)")
            findings = [
                _with(f, example=example_text, example_code=code, reproduce=reproduce)
                for f in outcome.findings
            ]
            raise _signal(findings[0].check)(findings)

    strategy = st.tuples(spec.inputs, st.integers(0, 2**31 - 1))

    def test(ex_and_seed: tuple[Any, int]) -> None:
        body(*ex_and_seed)

    hyp = hypothesis.settings(
        cfg.hypothesis_settings if cfg.hypothesis_settings is not None else None,
        max_examples=cfg.max_examples,
        deadline=None,
        derandomize=cfg.derandomize,
        phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                               HealthCheck.filter_too_much],
        verbosity=hypothesis.Verbosity.quiet,
        report_multiple_bugs=True,
        print_blob=False,
    )
    wrapped = hypothesis.given(strategy)(test)
    for ex in spec.examples:
        wrapped = hypothesis.example((ex, 0))(wrapped)
    if run_seed is not None:
        wrapped = hypothesis.seed(run_seed)(wrapped)
    wrapped = hyp(wrapped)
    wrapped.hypothesis.inner_test._hypothesis_internal_add_digest = (  # type: ignore[attr-defined]
        spec.name.encode()
    )

    findings: list[Finding] = []
    try:
        wrapped()
    except _Found as e:
        findings.extend(e.findings)
    except _Abort as e:
        raise e.error from None
    except FlakyFailure as e:
        first = [f for x in e.exceptions if isinstance(x, _Found) for f in x.findings]
        findings.append(Finding(
            check="flaky", headline="the result is flaky: an example failed once and "
            "passed when replayed (nondeterminism in the implementation or reference).",
            spec=spec.name, implementation=spec.implementation, reference=spec.reference,
            details="\n".join(["on its first run the example gave:"]
                               + [f"  {f.kind}: {f.headline}" for f in first]) if first
            else str(e)[:500],
            example=first[0].example if first else "",
            reproduce=first[0].reproduce if first else ""))
    except BaseExceptionGroup as group:  # several distinct bugs
        for exc in group.exceptions:
            if isinstance(exc, _Found):
                findings.extend(exc.findings)
            elif isinstance(exc, _Abort):
                raise exc.error from None
            else:
                raise
    except Unsatisfiable:
        raise InvalidArgument(
            f"no valid example for {spec.implementation}: the reference raised on every drawn "
            f"example (last: {last_invalid[0] if last_invalid else '?'}). Make inputs= draw "
            "inputs the reference accepts."
        ) from None
    report = Report(
        spec=spec.name, implementation=spec.implementation, reference=spec.reference,
        findings=tuple(_dedupe(findings)), seed=run_seed, examples_run=stats["runs"],
        invalid_examples=stats["invalid"], first_failure_at=stats["first_failure"] or None,
        modes=cfg.modes, devices=cfg.devices,
        checks=cfg.checks, notes=tuple(notes), settings=cfg.summary(),
    )
    if raise_on_failure:
        report.raise_if_failed()
    return report


def _with(f: Finding, **changes: Any) -> Finding:
    import dataclasses

    return dataclasses.replace(f, **changes)


def _dedupe(findings: list[Finding]) -> list[Finding]:
    seen, out = set(), []
    for f in findings:
        key = (f.check, f.headline, f.mode, f.device)
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out
