"""The runner: drives Hypothesis over examples, collects findings, builds the report."""

from __future__ import annotations

import dataclasses
import random
import traceback
import warnings
from typing import Any, Callable

import hypothesis
import torch
from hypothesis import HealthCheck, Phase
from hypothesis import strategies as st
from hypothesis.errors import DeadlineExceeded, FlakyFailure, Unsatisfiable

from equiv import _values
from equiv._args import as_args
from equiv._catalog import CHECK_NAMES
from equiv._compat import no_source_constants
from equiv._contracts import ErrorArgs
from equiv._explain import searching, verdict_only
from equiv._settings import EXPLICIT_SEED, SKIPPABLE
from equiv._settings import settings as Settings
from equiv.compare import dtype_tolerances
from equiv._catalog import ROWS
from equiv.errors import GradientMismatch, InvalidArgument, error_text, user_error
from equiv.modes import Mode, ModeRun, NotCompiled, device_unavailable, parse_mode
from equiv._roots import EAGER_TOO, with_causes
from equiv._watchdog import ExampleTimeout, deadline_timeout, per_example
from equiv.execution.calls import frozen_heap, isolated, owned_process, quiet_anomaly
from equiv.execution.record import Placement
from equiv.pipeline import Outcome, execute_example, narrowed, rows_for
from equiv.report import Finding, ModeResult, Report, fold_notes
from equiv.spec import Spec, get_spec
from equiv.strategies import arguments_for, compile_arguments_for
from equiv.strategies._compile import compile_draws, prefer_sides_of_two
from equiv.roles import roles_of
from equiv.variants import (
    CONTIGUOUS,
    NO_VARIANT,
    CotangentVariant,
    Variant,
    cotangent_variants,
    excused,
    with_variants,
)


class _Found(Exception):
    """Internal: an example produced findings (one subclass per check, so Hypothesis tracks
    distinct bugs separately and shrinks each)."""

    def __init__(self, findings: list[Finding], example: Any = None, cot_seed: int = 0,
                 cotangent: CotangentVariant = CONTIGUOUS, costly: bool = True) -> None:
        super().__init__(findings[0].headline)
        self.findings = findings
        # for attribution and replay
        self.example, self.cot_seed, self.cotangent = example, cot_seed, cotangent
        self.costly = costly


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
    if spec.settings is not None:  # the decorator wins, for the options it sets
        chosen = {f: getattr(spec.settings, f) for f in spec.settings._explicit}
        if chosen:
            base = Settings(base, **chosen)
    return base


def check(impl: Callable[..., Any], *, max_examples: int | None = None, seed: int | None = None,
          settings: Settings | None = None, checks: tuple[str, ...] | None = None,
          modes: tuple[str, ...] | None = None, devices: tuple[str, ...] | None = None,
          reference_device: str | None = None, reference_dtype: Any = None,
          raise_on_failure: bool = True) -> Report:
    """Run every applicable check of ``impl``'s spec and return the :class:`Report`.

    Raises :class:`equiv.EquivalenceFailure` (an ``AssertionError``; the most specific subclass,
    e.g. ``GradientMismatch``) carrying ``.report`` when anything diverges, or when something
    requested was not checked (a compile mode that captured no graph, a mode skipped as
    unsupported, gradients compared on no example), unless ``raise_on_failure=False``.

    ``modes`` are stable names (``"eager"``, ``"compile[aot_eager]"``, ``"functionalize"``,
    ``"vmap"``...) or :func:`equiv.compiled` objects; ``devices`` are run when available and
    skipped with a reason otherwise. ``reference_device``/``reference_dtype`` run the reference
    elsewhere (e.g. ``"cpu"``, ``torch.float64``) and compare its results at the
    implementation's dtype and device (docs/numerics.md); the spec's own
    ``equivalent_to(reference_dtype=, reference_device=)`` win over these arguments. Runs with
    inference mode off and grad mode on, whatever the caller's; global torch state is restored.
    """
    spec = get_spec(impl)
    cfg = _resolve(spec, settings, max_examples=max_examples, seed=seed, checks=checks,
                   modes=modes, devices=devices)
    mode_objs = [parse_mode(m) for m in cfg.modes]  # unknown names: InvalidArgument here
    cfg = _selection(spec, cfg, mode_objs)
    reference = _reference_placement(spec.reference_device or reference_device,
                                     spec.reference_dtype or reference_dtype)
    with torch.inference_mode(False), isolated(config=True), torch.enable_grad(), \
            owned_process(), quiet_anomaly(), frozen_heap(), no_source_constants():
        report = _check(spec, cfg, mode_objs, reference)
    if raise_on_failure and not report.findings and not report.ok:
        first = report.runs[0]
        raise InvalidArgument(
            f"every requested mode was skipped for {spec.name} ({first.mode}: {first.reason}): "
            "nothing ran, which is not a pass. Request a mode the implementation runs under, "
            "e.g. modes=('eager',).")
    if raise_on_failure:
        report.raise_if_failed()
    return report


def _check(spec: Spec, cfg: Settings, mode_objs: list[Mode],
           reference: tuple[str | None, Any]) -> Report:
    run_seed = cfg.seed if cfg.seed is not None else (
        None if cfg.derandomize else random.SystemRandom().randrange(2**32))
    findings: list[Finding] = []
    notes: list[str] = [] if spec.grads else [
        "gradients not compared: equivalent_to(grads=False) (not part of the contract)"]
    stats = {"runs": 0, "invalid": 0, "first_failure": 0}
    available, runs = _devices(cfg, mode_objs)
    table = {getattr(torch, d): (rtol, atol) for d, rtol, atol in cfg.tolerances}
    coverage: dict[str, set[str]] = {"ran": set(), "compared": set()}
    with per_example(cfg.timeout) as unenforced:
        if unenforced is not None:
            warnings.warn(f"equiv: settings(timeout={cfg.timeout:g}) is not enforced for "
                          f"{spec.name}: {unenforced}", RuntimeWarning, stacklevel=3)
        for device in available:
            for mode in mode_objs:
                try:
                    with dtype_tolerances(table):
                        f, n, r = _run_mode(spec, cfg, mode, device, run_seed, stats,
                                            reference, coverage)
                except ExampleTimeout as e:
                    f, n, r = _timed_out(spec, mode, device, e)
                findings.extend(f)
                notes.extend(x for x in n if x not in notes)
                runs.append(r)
    _compared_something(spec, cfg, coverage, findings, runs)
    if runs and all(r.status == "skipped" for r in runs):
        notes.append(f"every requested mode was skipped ({runs[0].mode}: {runs[0].reason}): "
                     "nothing ran, which is not a pass")
    if reference != (None, None):
        notes.insert(0, f"reference run on {reference[0] or 'the same device'} in "
                        f"{reference[1] or 'the example dtype'}; compared at the implementation's "
                        "dtype and device with that dtype's tolerance")
    return Report(
        spec=spec.name, implementation=spec.implementation, reference=spec.reference,
        findings=tuple(with_causes(_dedupe(findings))), seed=run_seed,
        examples_run=stats["runs"],
        invalid_examples=stats["invalid"], first_failure_at=stats["first_failure"] or None,
        modes=tuple(m.name for m in mode_objs),
        devices=cfg.devices, checks=cfg.checks, notes=tuple(fold_notes(notes)),
        settings=cfg.summary(),
        runs=tuple(runs),
    )


def _devices(cfg: Settings, mode_objs: list[Mode]) -> tuple[list[str], list[ModeResult]]:
    """The available devices, and a skipped run per mode of each unavailable one; raises when
    none is available (nothing would run, which is not a pass)."""
    available, runs = [], []
    for device in cfg.devices:
        why = device_unavailable(device)
        if why is None:
            available.append(device)
        else:
            runs.extend(ModeResult(m.name, device, "skipped", reason=why) for m in mode_objs)
    if not available:
        raise InvalidArgument(
            f"every requested device was skipped ({'; '.join(r.reason for r in runs[:1])}): "
            f"nothing ran, which is not a pass. Request an available device, e.g. "
            f"devices=('cpu',), instead of devices={tuple(cfg.devices)!r}."
        )
    return available, runs


def _selection(spec: Spec, cfg: Settings, mode_objs: list[Mode]) -> Settings:
    """``cfg`` with the checks the spec's contract includes (``grads=False`` drops the gradient
    checks); an empty selection, or one no check of which applies, is an InvalidArgument."""
    for option, value in (("checks", cfg.checks), ("modes", cfg.modes)):
        if not value:
            raise InvalidArgument(
                f"check({option}=()) selects nothing: nothing would be checked, which is not a "
                f"pass. Omit {option}= to use the profile's, or name some, e.g. "
                f"{option}=({'forward' if option == 'checks' else 'eager'!r},).")
    chosen = cfg.checks
    if not spec.grads:
        chosen = tuple(c for c in chosen if ROWS[c].failure is not GradientMismatch)
    kinds = {m.kind for m in mode_objs}
    contract = spec.max_memory_ratio is not None or spec.max_retained_bytes is not None
    applicable = [c for c in chosen if kinds & set(ROWS[c].modes)
                  and (c != "memory" or contract)]
    if not applicable:
        why = ("'memory' checks a memory contract and the spec declares none (equivalent_to("
               "max_memory_ratio=..., max_retained_bytes=...)); without one it is only a loose "
               "default bound beside the other checks" if "memory" in chosen and not contract
               else f"none of them runs in modes {tuple(m.name for m in mode_objs)!r}")
        dropped = " (equivalent_to(grads=False) drops the gradient checks)" if chosen != \
            cfg.checks else ""
        raise InvalidArgument(
            f"check(checks={tuple(cfg.checks)!r}) selects nothing that applies to {spec.name}"
            f"{dropped}: {why}. Nothing would be compared, which is not a pass; select other "
            "checks, or omit checks= for every check.")
    return Settings(cfg, checks=chosen) if chosen != cfg.checks else cfg


#: checks that say when they compared something (the others compare whenever they run)
_SAY_WHEN_COMPARED = ("gradients", "opcheck", "repeated-backward", "schedule")


def _compared_something(spec: Spec, cfg: Settings, coverage: dict[str, set[str]],
                        findings: list[Finding], runs: list[ModeResult]) -> None:
    """Raise InvalidArgument when nothing was compared on any example: every requested mode
    skipped (each allowed), or no selected check compared anything (e.g. only ``opcheck`` for
    an implementation that calls no custom op)."""
    counted = (coverage["ran"] - set(_SAY_WHEN_COMPARED)) | coverage["compared"]
    if findings or counted:
        return
    if runs and all(r.status == "skipped" for r in runs):
        return  # every mode skipped (allowed): not ok, check() says so
    why = (" (the implementation calls no custom op, so opcheck had nothing to check)"
           if "opcheck" in coverage["ran"] else "")
    raise InvalidArgument(
        f"check(checks={tuple(cfg.checks)!r}) compared nothing for {spec.name} on any example"
        f"{why}: nothing was checked, which is not a pass. Select checks that apply, or omit "
        "checks= for every check.")


def _reference_placement(device: Any, dtype: Any) -> tuple[str | None, Any]:
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise InvalidArgument(f"check(reference_dtype={dtype!r}): give a floating torch.dtype, "
                              "e.g. torch.float64.")
    if device is not None:
        why = device_unavailable(str(device))
        if why is not None:
            raise InvalidArgument(f"check(reference_device={device!r}): {why}.")
        device = str(device)
    return device, dtype


def _inputs(spec: Spec, cfg: Settings, mode: Mode) -> Any:
    """The example strategy of one mode: the spec's, or derived from the signature in
    ``settings.dtypes`` (compile modes: one dtype and compile-friendly shapes of one rank, so
    recompilations stay bounded; eager explores the ranks and edge-case shapes)."""
    if not spec.derived_inputs:  # compile modes: avoid sides of 0/1, which Dynamo specialises
        return prefer_sides_of_two(spec.inputs) if mode.kind == "compile" else spec.inputs
    dtypes = [getattr(torch, d) for d in cfg.dtypes]
    if mode.kind == "autocast":  # autocast casts float32 only (float64 runs as written)
        dtypes = [torch.float32]
    if mode.kind == "compile":
        return compile_arguments_for(spec.signature, dtype=dtypes[0], reference=spec.ref,
                                     mutated=spec.mutates)
    return arguments_for(spec.signature, dtypes_=dtypes, reference=spec.ref,
                         mutated=spec.mutates, block_sizes=spec.block_sizes,
                         broadcast=mode.kind == "eager")


def _hypothesis_test(spec: Spec, cfg: Settings, mode: Mode, device: str, run_seed: int | None,
                     body: Callable[[Any, int, Variant, CotangentVariant], None],
                     ) -> Callable[[], None]:
    """The Hypothesis test of one (spec, mode, device): draws (example, variant, cotangent
    seed, cotangent variant) and calls ``body``; explicit ``examples=`` first (contiguous
    cotangents)."""
    # input variants run in eager mode only: under functionalize torch 2.13 crashed (SIGSEGV) on
    # an expanded in-place input, and new strides/aliasing recompile compiled modes
    kinds = spec.variants if mode.kind == "eager" else ()
    drawn = with_variants(_inputs(spec, cfg, mode), spec.signature, spec.mutates, kinds,
                          roles_of(spec), reference=spec.ref)
    if spec.error_inputs is not None:  # one example in four from error_inputs=
        errors = spec.error_inputs.map(lambda e: (ErrorArgs.of(e), NO_VARIANT))
        drawn = st.integers(0, 3).flatmap(lambda k: errors if k == 0 else drawn)
    # cotangent layouts: eager and compile modes differentiate through the core's backward
    cots = cotangent_variants() if mode.kind in ("eager", "compile") else st.just(CONTIGUOUS)
    strategy = st.tuples(drawn, st.integers(0, 2**31 - 1), cots)

    def test(drawn_: tuple[tuple[Any, Variant], int, CotangentVariant]) -> None:
        (example, variant), cot_seed, cotangent = drawn_
        body(example, cot_seed, variant, cotangent)

    hyp = hypothesis.settings(
        cfg.hypothesis_settings if cfg.hypothesis_settings is not None else None,
        max_examples=cfg.max_examples,
        deadline=cfg._hypothesis_deadline(),
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
        wrapped = hypothesis.example(((ex, NO_VARIANT), EXPLICIT_SEED, CONTIGUOUS))(wrapped)
    if run_seed is not None:
        wrapped = hypothesis.seed(run_seed)(wrapped)
    wrapped = hyp(wrapped)
    wrapped.hypothesis.inner_test._hypothesis_internal_add_digest = (  # type: ignore[attr-defined]
        f"{spec.name}|{mode.name}|{device}".encode()
    )
    return wrapped


class _ModeDriver:
    """The per-example body of one (spec, mode, device) run and what it accumulates."""

    def __init__(self, spec: Spec, cfg: Settings, state: ModeRun, device: str,
                 run_seed: int | None, stats: dict[str, int]) -> None:
        self.spec, self.cfg, self.state, self.device = spec, cfg, state, device
        self.run_seed, self.stats = run_seed, stats
        self.notes: list[str] = []
        self.last_invalid: list[str] = []
        #: signals raised while Hypothesis searched and shrank: it keeps each in its cache of
        #: results, so their frames (the example, the record) are cleared once it caught them
        self.searching: list[tuple[_Found, Any]] = []
        #: the ``.pt`` files of the printed code of each check's latest failing examples
        self.files: dict[str, list[dict[str, torch.Tensor]]] = {}

    def write_files(self, findings: list[Finding]) -> None:
        """Write the ``.pt`` files that the printed code of ``findings`` loads."""
        files = {path: values for latest in self.files.values() for by_path in latest
                 for path, values in by_path.items()}
        try:
            _values.write({path: values for path, values in files.items()
                           if any(repr(path) in f.example_code for f in findings)})
        except OSError as e:  # the reproduction then names a file that is not there
            self.notes.append(f"a printed reproduction's values could not be saved: {e}")
        self.files.clear()

    def release(self) -> None:
        """Drop what the signals of past (non-final) examples hold: their example and the
        locals of the frames their tracebacks reach (only plain findings stay)."""
        for e, context in self.searching:
            e.example = None
            traceback.clear_frames(e.__traceback__)
            # the frames' functions keep their closures, and so Hypothesis's context of that
            # example, whose printers hold the drawn values (used only to print a final one)
            printers = getattr(context, "known_object_printers", None)
            if hasattr(printers, "clear"):
                printers.clear()
        self.searching.clear()

    def __call__(self, example: Any, cot_seed: int, variant: Variant = NO_VARIANT,
                 cotangent: CotangentVariant = CONTIGUOUS) -> None:
        self.release()  # the previous example has finished: Hypothesis has caught its signal
        state = self.state
        if state.not_compiled is not None or state.unsupported is not None:
            return  # the mode stopped: nothing more is checked (reported, never a pass)
        try:
            args = as_args(example)
        except TypeError as e:
            raise _Abort(InvalidArgument(f"equivalent_to(inputs=...) produced a bad example: {e}"))
        costly = self._costly(cot_seed)
        state.after_failure += state.failing
        context = _build_context()
        search = context is not None and not getattr(context, "is_final", True)
        try:  # a failure Hypothesis will not report (it searches or shrinks) is only judged
            with searching(search):
                outcome = execute_example(self.spec, self.cfg, args, cot_seed, state,
                                          self.device, cotangent=cotangent, costly=costly)
        except NotCompiled:
            return
        except InvalidArgument as e:
            raise _Abort(e) from None
        self.stats["runs"] += 1
        self.notes.extend(n for n in outcome.notes if n not in self.notes)
        if outcome.invalid is not None or excused(variant, outcome.findings):
            self.stats["invalid"] += 1
            self.last_invalid[:] = [outcome.invalid or f"the implementation raised on the input "
                                    f"variant {variant.description!r} (must raise or match)"]
            hypothesis.reject()
        state.examples += 1
        state.valued += not outcome.empty
        # a searched example that stopped at a finding before the costly checks ran none
        state.costly_examples += costly and (outcome.costly_ran or not search)
        if outcome.findings:
            self.stats["first_failure"] = self.stats["first_failure"] or self.stats["runs"]
            state.failing = True
            # a searched example's printed code is read only where the search's own finding
            # is reported (a check flaky by nature): only then are its values kept
            findings = self._described(outcome, variant, args, keep=not search or
                                       outcome.findings[0].check in _BY_NATURE_FLAKY)
            signal = _signal(findings[0].check)(findings, args, cot_seed, cotangent, costly)
            if search:
                self.searching.append((signal, context))
            del outcome, args, example
            raise signal

    def _costly(self, cot_seed: int) -> bool:
        """Whether the costly checks run on this example: the first valid example and every
        ``costly_period``-th after it (so the share run is the setting's, whatever seeds
        Hypothesis favours), explicit examples, and every example once one has failed."""
        state = self.state
        return (cot_seed >= EXPLICIT_SEED or state.failing
                or state.examples % self.cfg.costly_period == 0)

    def _described(self, outcome: Outcome, variant: Variant, args: Any,
                   keep: bool = True) -> list[Finding]:
        """``outcome``'s findings with the example, its printed code and how to reproduce;
        ``keep``: the values that code loads from a ``.pt`` file are kept, to be written
        (the latest example's per check: the one reported)."""
        spec, template = self.spec, outcome.template
        name = spec.impl.__name__ if hasattr(spec.impl, "__name__") else spec.name
        example_text = template.describe(name) if template else ""
        # a target may print its own example (a module pair rebuilds both modules)
        own_code = getattr(spec.impl, "__equiv_code__", None)
        imports = _import_lines(spec.impl, name)
        stash = _values.Stash()
        code = own_code(args, stash) if own_code else (
            template.code(name, imports, check=bool(imports) and not imports[0].startswith("#"),
                          stash=stash) if template else "")
        if outcome.findings:  # a check's latest example replaces what was kept for it
            self.files[outcome.findings[0].check] = [stash.files] if keep and stash.files else []
        reproduce = (f"equiv.check({name}, seed={self.run_seed})" if self.run_seed is not None
                     else f"equiv.check({name}) with the same profile ({self.cfg.profile}: "
                     "derandomized)")
        return [_with(f, example=example_text, example_code=code, reproduce=reproduce,
                      details=f"{f.details}\ninput variant: {variant.description}".lstrip()
                      if variant else f.details)
                for f in outcome.findings]


def _run_mode(spec: Spec, cfg: Settings, mode: Mode, device: str, run_seed: int | None,
              stats: dict[str, int], reference: tuple[str | None, Any] = (None, None),
              coverage: dict[str, set[str]] | None = None,
              ) -> tuple[list[Finding], list[str], ModeResult]:
    """Drive Hypothesis over the examples of one (mode, device)."""
    state = ModeRun(mode, spec.impl, spec.ref)
    state.ref_device, state.ref_dtype = reference
    none_here = _no_check_runs(spec, cfg, mode, device)
    if none_here is not None:
        return [none_here], [], ModeResult(mode.name, device, "not checked",
                                           reason=none_here.headline)
    mcfg = narrowed(cfg, mode.kind)
    driver = _ModeDriver(spec, mcfg, state, device, run_seed, stats)
    if mode.kind == "functionalize":
        driver.notes.append("functionalize: gradients are not compared in this mode "
                            "(functionalize does not compose with autograd on mutated inputs)")
    wrapped = _hypothesis_test(spec, cfg, mode, device, run_seed, driver)
    with state.context(), compile_draws(mode.kind == "compile"):
        try:
            found, findings = _drive(spec, mode, device, wrapped, driver.last_invalid)
        finally:
            driver.release()
        # distinct bugs in catalog order (Hypothesis reports them in no fixed order)
        found.sort(key=lambda e: CHECK_NAMES.index(e.findings[0].check)
                   if e.findings[0].check in CHECK_NAMES else len(CHECK_NAMES))
        for e in found:  # the replays decide by which checks fail: nothing is explained
            with verdict_only():
                findings.extend(_attribute(spec, mcfg, state, device, e))
        driver.write_files(findings)
    if (mode.kind in SKIPPABLE and state.examples and not state.ran and not findings
            and state.unsupported is None):  # e.g. no example could be batched under vmap
        state.unsupported = (f"nothing could be checked under {mode.name}"
                             + (f": {'; '.join(driver.notes[:2])}" if driver.notes else ""))
    findings.extend(_unchecked(spec, cfg, mode, device, state, findings))
    driver.notes.extend(_costly_note(mcfg, mode, state))
    if coverage is not None:
        coverage["ran"] |= state.ran
        coverage["compared"] |= state.compared
    return findings, driver.notes, _mode_result(mode, device, state, findings)


def _no_check_runs(spec: Spec, cfg: Settings, mode: Mode, device: str) -> Finding | None:
    """The run-level finding for a requested mode in which none of the selected checks runs
    (e.g. ``checks=("no-grad",)`` under a compile mode): nothing would be checked there."""
    contract = spec.max_memory_ratio is not None or spec.max_retained_bytes is not None
    if any(mode.kind in ROWS[c].modes and (c != "memory" or contract) for c in cfg.checks):
        return None
    return _run_level(spec, mode, device, "not-checked",
                      f"none of the selected checks ({', '.join(cfg.checks)}) runs under "
                      f"{mode.name}: nothing was checked in this mode, which is not a pass.",
                      f"drop {mode.name} from modes=, or select checks that run under it "
                      "(docs/reference.md lists the modes of each check).")


def _unchecked(spec: Spec, cfg: Settings, mode: Mode, device: str, state: ModeRun,
               findings: list[Finding]) -> list[Finding]:
    """Run-level findings for what was requested and not checked: a compile mode that stopped
    compiling or captured no graph, a mode skipped as unsupported (unless ``allow_skip``
    names it), gradients compared on no example (unless ``grads=False``)."""
    if state.not_compiled is not None:
        return [_not_compiled(spec, mode, device, state.not_compiled)]
    if findings:  # the mode failed: that is its verdict (a compile attempt that raised
        return []  # compiled nothing, a transform may stop after a finding)
    if state.status(False) == "not compiled":
        breaks = "; ".join(state.graph_breaks)
        disabled = not breaks or "compiler.disable" in breaks
        fix = ("remove @torch.compiler.disable / TORCHDYNAMO_DISABLE, or drop "
               f"{mode.name} from modes=." if disabled else f"every graph broke ({breaks}): "
               "make the implementation traceable there (a fake-tensor kernel, "
               f"torch.library.custom_op with register_fake), or drop {mode.name} from modes=.")
        return [_run_level(spec, mode, device, "not-compiled",
                           f"mode {mode.name} was not compiled: {state.reason()}; nothing was "
                           "checked under the compiler, which is not a pass.", fix)]
    if state.unsupported is not None:
        if mode.kind in set(cfg.allow_skip) | set(spec.allow_skip):
            return []
        return [_run_level(spec, mode, device, "not-checked",
                           f"mode {mode.name} was skipped: {state.unsupported}; nothing was "
                           "checked in this mode, which is not a pass.",
                           f"declare equivalent_to(allow_skip=({mode.kind!r},)) (or "
                           f"settings(allow_skip=...)) to accept it, or drop {mode.name} from "
                           "modes=.")]
    if state.examples and not state.valued:
        return [_run_level(spec, mode, device, "not-checked",
                           f"every example under {mode.name} held only empty tensors (no "
                           "element in any argument or in the reference's result): shapes "
                           "and dtypes were compared, no value, which is not a pass.",
                           "make inputs= draw tensors with elements (empty ones may stay "
                           "among them).")]
    why = state.uncompared.get("gradients", "").removeprefix("gradients not compared: ")
    if why and "gradients" not in state.compared:
        return [_run_level(spec, mode, device, "not-checked",
                           f"gradients were compared on no example under {mode.name}: {why}; "
                           "the implementation's backward was not checked, which is not a pass.",
                           "make the reference differentiable (torch ops, no .detach() or "
                           "NumPy), or declare equivalent_to(grads=False) if gradients are not "
                           "part of the contract.")]
    why = state.uncompared.get("batch-invariance", "")
    if why and "batch-invariance" not in state.compared:
        return [_run_level(spec, mode, device, "not-checked",
                           f"batch invariance was compared on no example under {mode.name} "
                           f"({why.split('(', 1)[-1].rstrip(')')}), which is not a pass.",
                           "make inputs= draw a batch of 2 or more along the batch_invariant= "
                           "dim, in tensors that are not views of one another.")]
    return []


def _build_context() -> Any:
    """Hypothesis's context of the running example (its ``is_final``: replaying a minimal
    example to report it, whose signal then reaches the runner, rather than searching or
    shrinking); None when there is none."""
    try:
        from hypothesis.control import current_build_context

        return current_build_context()
    except Exception:  # no build context, or Hypothesis renamed it: keep every signal whole
        return None


def _costly_note(cfg: Settings, mode: Mode, state: ModeRun) -> list[str]:
    """The line saying on how many examples the costly checks ran (when not on all)."""
    costly = [r.name for r in rows_for(cfg, mode.kind) if r.costly]
    if not costly or cfg.costly_share >= 1 or not state.examples:
        return []
    ran = [c for c in costly if c in state.ran] or costly
    after = ", and on every example after the first failure" if state.after_failure else ""
    return [f"mode {mode.name}: the costly checks ({', '.join(ran)}) ran on "
            f"{state.costly_examples} of {state.examples} examples "
            f"(settings(costly_share={cfg.costly_share:g}){after})"]


def _run_level(spec: Spec, mode: Mode, device: str, check: str, headline: str,
               fix: str) -> Finding:
    return Finding(check=check, headline=headline, spec=spec.name,
                   implementation=spec.implementation, reference=spec.reference,
                   mode=mode.name, device=device, fix=fix)


def _timed_out(spec: Spec, mode: Mode, device: str, e: ExampleTimeout,
               ) -> tuple[list[Finding], list[str], ModeResult]:
    limit = ("hypothesis_settings(deadline=...)" if "deadline" in str(e)
             else "settings(timeout=...), --timeout")
    f = _run_level(spec, mode, device, "timeout",
                   f"{spec.name} under {mode.name} on {device}: {e} ({limit}; it counts both "
                   "sides, all checks and any compilation of that example).",
                   "look for a hang or an unbounded loop, or raise the limit.")
    return [f], [], ModeResult(mode.name, device, "FAIL", reason=str(e))


def _drive(spec: Spec, mode: Mode, device: str, wrapped: Callable[[], None],
           last_invalid: list[str]) -> tuple[list["_Found"], list[Finding]]:
    """Run the Hypothesis test; sort what it raised into found bugs and flaky findings."""
    found: list[_Found] = []
    findings: list[Finding] = []
    try:
        wrapped()
    except _Found as e:
        found.append(e)
    except _Abort as e:
        raise e.error from None
    except DeadlineExceeded as e:  # the user's Hypothesis deadline: a timeout, not a bug
        raise deadline_timeout(e) from None
    except FlakyFailure as e:  # before BaseExceptionGroup: FlakyFailure is one
        found += _irreproducible(e)
        findings += [] if _irreproducible(e) else [_flaky(spec, mode, device, e)]
    except BaseExceptionGroup as group:  # several distinct bugs (one may be flaky)
        found += [exc for exc in group.exceptions if isinstance(exc, _Found)]
        for exc in group.exceptions:
            if isinstance(exc, _Abort):
                raise exc.error from None
        flaky = [exc for exc in group.exceptions if isinstance(exc, FlakyFailure)]
        found += [x for exc in flaky for x in _irreproducible(exc)]
        findings += [_flaky(spec, mode, device, exc) for exc in flaky
                     if not _irreproducible(exc)]
        escaped = [exc for exc in group.exceptions
                   if not isinstance(exc, (_Found, FlakyFailure))]
        for exc in escaped:
            if isinstance(exc, DeadlineExceeded):
                raise deadline_timeout(exc) from None
        if escaped:  # one error stops the spec, without equiv's signals around it
            raise _escaped(spec, escaped[0])
    except Unsatisfiable:
        if not last_invalid:  # nothing reached either side
            raise InvalidArgument(
                f"no example for {spec.implementation}: the input strategy drew none (every "
                "draw was filtered out, or the strategy is empty, e.g. st.nothing()). Make "
                "inputs= draw examples (fewer .filter() rejections, or assume() less often)."
            ) from None
        raise InvalidArgument(
            f"no valid example for {spec.implementation}: every drawn example was invalid "
            f"input (last: {last_invalid[0]}). Make inputs= draw inputs the reference accepts"
            + (", with each mutated argument's final value of its shape and dtype."
               if spec.mutates else ".")
        ) from None
    except BaseException as e:  # SystemExit from user code that no call of a side caught
        if not user_error(e) or isinstance(e, Exception):
            raise
        raise _escaped(spec, e)
    return found, findings


def _escaped(spec: Spec, e: BaseException) -> BaseException:
    """What to raise for an error that escaped the Hypothesis test outside the calls equiv
    compares: a user's ``SystemExit``-like exception becomes an InvalidArgument naming it and
    the frame that raised it (chained to it); any other error is raised as it is."""
    if isinstance(e, Exception) or not user_error(e):
        e.__suppress_context__ = True
        return e
    tb = e.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    where = (f" at {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno} in "
             f"{tb.tb_frame.f_code.co_name}") if tb is not None else ""
    text = error_text(e)[:200]
    error = InvalidArgument(
        f"{spec.name}: user code raised {type(e).__name__}{f' ({text})' if text else ''}"
        f"{where}, outside the calls of the implementation and the reference that equiv "
        "compares (e.g. in an inputs= strategy), so it is neither side's error; equiv stopped "
        "this spec. Code under test must not exit the process: raise an exception instead.")
    error.__cause__ = e
    return error


#: checks whose findings are irreproducible by nature (their evidence is calls that differ)
_BY_NATURE_FLAKY = ("determinism",)


def _irreproducible(e: FlakyFailure) -> list["_Found"]:
    """The bugs of a flaky failure that only checks of :data:`_BY_NATURE_FLAKY` found:
    reported as found (a replay that agrees does not undo two calls that differed)."""
    return [x for x in e.exceptions if isinstance(x, _Found) and x.findings
            and all(f.check in _BY_NATURE_FLAKY for f in x.findings)]


def _flaky(spec: Spec, mode: Mode, device: str, e: FlakyFailure) -> Finding:
    first = [f for x in e.exceptions if isinstance(x, _Found) for f in x.findings]
    return Finding(
        check="flaky", headline="the result is flaky: an example failed once and passed when "
        "replayed (nondeterminism in the implementation or reference).",
        spec=spec.name, implementation=spec.implementation, reference=spec.reference,
        mode=mode.name, device=device,
        details="\n".join(["on its first run the example gave:"]
                          + [f"  {f.kind}: {f.headline}" for f in first]
                          + _suspects(first)) if first else str(e)[:500],
        example=first[0].example if first else "",
        reproduce=first[0].reproduce if first else "")


def _suspects(findings: list[Finding]) -> list[str]:
    """The first run's lines naming the reference as the suspect (it returned other values for
    equal inputs: what makes a replay pass), once each."""
    lines = {f.likely_cause for f in findings
             if (f.likely_cause or "").startswith("the reference is the suspect")}
    return [f"  likely cause: {line}" for line in sorted(lines)]


def _not_compiled(spec: Spec, mode: Mode, device: str, why: str) -> Finding:
    return Finding(
        check="not-compiled",
        headline=f"mode {mode.name} stopped compiling: {why}. Examples after that point were "
                 "not checked in this mode; this is not a pass.",
        spec=spec.name, implementation=spec.implementation, reference=spec.reference,
        mode=mode.name, device=device,
        fix="use dynamic shapes (equiv.compiled(..., dynamic=True)), fewer distinct shapes "
            "in inputs=, or a higher equiv.compiled(..., recompile_limit=N).",
    )


#: run-level findings: what was requested and not checked (never a check's divergence)
_RUN_LEVEL = ("not-compiled", "not-checked")


def _mode_result(mode: Mode, device: str, state: ModeRun, findings: list[Finding]) -> ModeResult:
    failed = any(f.check not in _RUN_LEVEL for f in findings)
    status = state.status(failed)
    if status == "passed" and findings:  # gradients compared on no example
        return ModeResult(mode.name, device, "not checked", state.examples,
                          findings[0].headline, info=state.info())
    if status == "FAIL" and all(f.attribution == FLAKY or f.check == "flaky" for f in findings
                                if f.check not in _RUN_LEVEL):
        status = "flaky"
    return ModeResult(
        mode.name, device, status, state.examples, "" if status == "FAIL" else state.reason(),
        compilations=state.compilations["impl"] if mode.is_compile else None,
        graph_breaks=sum(state.graph_breaks.values()) if mode.is_compile else None,
        break_reasons=tuple(state.graph_breaks), info=state.info(),
        recompile_reasons=tuple(state.recompiles),
    )

FLAKY = ("flaky: the minimal example did not reproduce this finding when replayed. Look for "
         "nondeterminism (CUDA atomics, RNG, uninitialised memory) or state carried between "
         "calls (a cache, a reused workspace).")


def _attribute(spec: Spec, cfg: Settings, state: ModeRun, device: str,
               found: "_Found") -> list[Finding]:
    """Replay the minimal example: a finding that does not reproduce is marked flaky (kept: it
    did diverge once, and state carried between calls is a bug too; the mode's status says
    'flaky' instead of 'FAIL'); for a non-eager mode, say whether eager and the reference in this
    mode diverge."""
    mode = state.mode
    findings = found.findings
    if found.example is None:
        return findings
    try:
        again = execute_example(spec, cfg, found.example, found.cot_seed, state, device,
                                cotangent=found.cotangent, costly=found.costly)
    except (NotCompiled, InvalidArgument):
        return findings
    if not {f.check for f in again.findings} & {f.check for f in findings}:
        return [f if f.check in _BY_NATURE_FLAKY else _with(f, attribution=FLAKY)
                for f in findings]
    findings = _write_only_read(spec, cfg, state, device, found, findings)
    if mode.kind == "eager":
        return findings
    eager_place = Placement("eager", "eager", device, None, None, state.ref_device,
                            state.ref_dtype)
    eager = execute_example(spec, cfg, found.example, found.cot_seed, state, device,
                            cotangent=found.cotangent, costly=found.costly, place=eager_place)
    eager_checks = {f.check for f in eager.findings}
    ref_diverges: set[str] = set()
    if mode.kind in ("compile", "functionalize"):
        ref_spec = dataclasses.replace(spec, impl=spec.ref, mutates={})
        try:
            ref_place = Placement(mode.name, mode.kind, device, state.ref_fn())
            ref_out = execute_example(ref_spec, cfg, found.example, found.cot_seed, state,
                                      device, cotangent=found.cotangent, costly=found.costly,
                                      place=ref_place)
            ref_diverges = {f.check for f in ref_out.findings}
        except (NotCompiled, InvalidArgument):
            pass
    return [_with(f, attribution=_attribution(f, mode, eager_checks, ref_diverges))
            for f in findings]


def _write_only_read(spec: Spec, cfg: Settings, state: ModeRun, device: str, found: "_Found",
                     findings: list[Finding]) -> list[Finding]:
    """Findings that vanish when the write-only arguments are not filled with NaN say that the
    implementation read those arguments' old contents."""
    if not spec.write_only:
        return findings
    clean = execute_example(dataclasses.replace(spec, write_only=()), cfg, found.example,
                            found.cot_seed, state, device, cotangent=found.cotangent,
                            costly=found.costly)
    gone = {f.check for f in findings} - {f.check for f in clean.findings}
    names = ", ".join(repr(n) for n in spec.write_only)
    line = (f"write-only argument {names} was read: the implementation was handed it filled "
            "with NaN (integers: a sentinel) and its result depends on those old contents; "
            "with the drawn values left in it, this example passes this check")
    return [_with(f, details=f"{f.details}\n{line}".lstrip()) if f.check in gone else f
            for f in findings]


def _attribution(f: Finding, mode: Mode, eager_checks: set[str], ref_diverges: set[str]) -> str:
    if f.check in eager_checks:
        return f"{EAGER_TOO}: not specific to {mode.name}."
    if ref_diverges:
        return (f"the compiler diverges from eager on this program (not specific to your "
                f"implementation): the reference run under {mode.name} also differs from the "
                f"eager reference on this example ({', '.join(sorted(ref_diverges))}).")
    if mode.kind in ("compile", "functionalize"):
        return (f"only the implementation under {mode.name} diverges: in eager mode it agrees "
                f"with the reference on this example, and the reference under {mode.name} "
                "agrees with the eager reference.")
    return (f"only under {mode.name}: in eager mode the implementation agrees with the reference "
            "on this example.")

def _import_lines(impl: Any, name: str) -> list[str]:
    """The line importing the implementation into a printed reproduction: ``from mod import
    name`` for a module-level function or class, else a comment saying where to define it."""
    mod, qn = getattr(impl, "__module__", None), getattr(impl, "__qualname__", "")
    if mod and mod != "__main__" and qn == name and name.isidentifier():
        return [f"from {mod} import {name}"]
    if not name.isidentifier():
        return []
    return [f"# {name}: defined in {mod or 'your code'} (not importable): define it here"]


def _with(f: Finding, **changes: Any) -> Finding:
    return dataclasses.replace(f, **changes)


def _dedupe(findings: list[Finding]) -> list[Finding]:
    seen, out = set(), []
    for f in findings:
        key = (f.check, f.headline, f.mode, f.device)
        if key not in seen:
            seen.add(key)
            out.append(f)
    return out
