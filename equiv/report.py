"""Findings and reports, and their text rendering (rendering never computes)."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any, Iterable, Sequence

from equiv._catalog import FAILURE_CLASSES
from equiv.errors import EquivalenceFailure
from equiv.numerics import oracle_name
from equiv.timeline import render as render_timeline


@dataclasses.dataclass(frozen=True)
class Finding:
    """A failed check with its evidence. Plain data: pickles, compares, serialises."""

    check: str
    headline: str
    spec: str = ""
    implementation: str = ""
    reference: str = ""
    mode: str = "eager"
    device: str = "cpu"
    dtype: str = "-"
    argument: str | None = None
    details: str = ""
    max_abs: float | None = None
    max_rel: float | None = None
    index: tuple[int, ...] | None = None
    rtol: float | None = None
    atol: float | None = None
    example: str = ""
    example_code: str = ""
    likely_cause: str | None = None
    fix: str | None = None
    traceback: str | None = None
    reproduce: str = ""
    #: for a non-eager mode: whether eager, and the reference in this mode, diverge too
    attribution: str | None = None
    #: the numeric verdict (equiv.numerics): "baseline" (k x the reference's own error at this
    #: dtype + a floor, against float64) or "dtype-default" (no float64 oracle could be run);
    #: None for other comparisons. Errors are max abs over the value, in float64.
    rule: str | None = None
    impl_error: float | None = None
    baseline_error: float | None = None
    allowed: float | None = None
    k: float | None = None
    rounding_level: bool | None = None
    #: events of the implementation's run under the timeline recorder (JSON-able dicts);
    #: derived evidence, so left out of ==/hash (a Finding stays hashable)
    timeline: tuple[dict[str, Any], ...] = dataclasses.field(default=(), compare=False)
    #: the index in the report's findings of the root finding this one is a consequence of
    #: (the gradients after a forward mismatch on the same example, the same divergence in a
    #: second mode...), or None for a root (equiv._roots decides)
    caused_by: int | None = None

    @property
    def failure_class(self) -> type[EquivalenceFailure]:
        return FAILURE_CLASSES.get(self.check, EquivalenceFailure)

    @property
    def kind(self) -> str:
        return self.failure_class.__name__

    @property
    def message(self) -> str:
        return self.render()

    def render(self) -> str:
        if self.rtol is None:
            tol = "default for the dtype (torch.testing.assert_close, or settings(tolerances=...))"
        elif self.rtol == 0 and self.atol == 0:
            tol = "exact (bitwise, NaN equal to NaN)"
        else:
            tol = f"rtol={self.rtol:g}, atol={self.atol:g}"

        lines = [
            f"{self.kind}: {self.headline}",
            f"  implementation: {self.implementation}    reference: {self.reference}",
            f"  mode: {self.mode}   device: {self.device}   dtype: {self.dtype}   "
            f"check: {self.check}",
        ]
        if self.argument:
            lines.append(f"  involved: {self.argument}")
        if self.details:
            lines.extend("  " + ln for ln in self.details.splitlines())
        if self.max_abs is not None:
            lines.append(f"  tolerance: {tol}")
        if self.rule is not None:
            lines.append(f"  verdict: {self._verdict()}")
        if self.traceback:
            lines.append("  Traceback of the implementation's error:")
            lines.extend("    " + ln for ln in self.traceback.rstrip().splitlines())
        if self.example:
            lines.append("Minimal failing example:")
            lines.append("  " + self.example)
        if self.example_code:
            lines.append("  As code:")
            lines.extend("    " + ln for ln in self.example_code.splitlines())
        if self.attribution:
            lines.append(f"Attribution: {self.attribution}")
        if self.timeline:
            lines.append("Timeline (implementation, replayed under the recorder):" if
                         self.mode == "eager" else
                         "Timeline (implementation replayed in eager mode under the recorder: "
                         f"the steps of the {self.mode} graph are not recorded):")
            text = render_timeline(self.timeline, max_events=80)
            lines.extend("  " + ln for ln in text.splitlines())
        if self.likely_cause:
            lines.append(f"Likely cause: {self.likely_cause}")
        if self.fix:
            lines.append(f"Fix: {self.fix}")
        if self.reproduce:
            lines.append(f"Reproduce: {self.reproduce}")
        return "\n".join(lines)

    def _verdict(self) -> str:
        if self.rule == "baseline":
            level = " (rounding-level)" if self.rounding_level else ""
            error = (f"{self.impl_error:.3g}" if self.impl_error is None
                     or math.isfinite(self.impl_error) else "non-finite (NaN or inf, above)")
            return (f"baseline-relative (k={self.k:g}): implementation error {error} "
                    f"vs {oracle_name(self.dtype)}, the reference's own error "
                    f"{self.baseline_error:.3g} at this dtype, allowed {self.allowed:.3g}{level}")
        return "per-dtype default tolerance (no float64 oracle: see the note)"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["kind"] = self.kind
        d["timeline"] = [dict(e) for e in self.timeline]
        return d


@dataclasses.dataclass(frozen=True)
class ModeResult:
    """What one (mode, device) actually did: ``status`` is one of ``passed``, ``FAIL``,
    ``flaky`` (findings that did not reproduce on replay; still findings), ``not compiled`` (a
    compile mode that fell back to eager or captured no graph: never a pass) or ``skipped``
    (device unavailable, transform unsupported), with the reason and, for compile modes, the
    compilation and graph-break counts."""

    mode: str
    device: str
    status: str
    examples: int = 0
    reason: str = ""
    compilations: int | None = None
    graph_breaks: int | None = None
    break_reasons: tuple[str, ...] = ()
    info: str = ""
    #: compile modes: why Dynamo recompiled the implementation, one "frame: failed guard" each
    recompile_reasons: tuple[str, ...] = ()

    def render(self) -> str:
        text = (f"{self.mode} on {self.device}: {self.status} ({self.examples} "
                f"example{'' if self.examples == 1 else 's'}")
        text += f"; {self.info})" if self.info else ")"
        if self.reason:
            text += f": {self.reason}"
        return text


#: how the settings line of a report of ``equiv.assert_equivalent`` begins (nothing drawn)
GIVEN = "equiv.assert_equivalent on the given example"


@dataclasses.dataclass(frozen=True)
class Report:
    """All findings of one run of one spec, with what was run."""

    spec: str
    implementation: str
    reference: str
    findings: tuple[Finding, ...] = ()
    seed: int | None = None
    examples_run: int = 0
    invalid_examples: int = 0
    first_failure_at: int | None = None  # examples run up to and including the first failure
    modes: tuple[str, ...] = ("eager",)
    devices: tuple[str, ...] = ("cpu",)
    checks: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    settings: str = ""
    #: per (mode, device): passed / FAIL / not compiled / skipped, with compile counts
    runs: tuple[ModeResult, ...] = ()

    @property
    def ok(self) -> bool:
        """No finding (run-level ones included: what was requested and not checked), and at
        least one (mode, device) ran when the report records its runs."""
        return not self.findings and (not self.runs or any(r.status != "skipped"
                                                           for r in self.runs))

    def roots(self) -> tuple[Finding, ...]:
        """The findings no earlier one explains (:attr:`Finding.caused_by` is None)."""
        return tuple(f for f in self.findings if f.caused_by is None)

    def headline(self, verdict: str | None = None) -> str:
        """The summary line; it counts root findings (``verdict`` replaces that count)."""
        verdict = verdict or ("equivalent" if self.ok else count_findings(
            len(self.roots()), len(self.findings) - len(self.roots())))
        plural = "" if self.examples_run == 1 else "s"
        seed = ("the given example" if self.settings.startswith(GIVEN) else "derandomized"
                if self.seed is None else f"seed {self.seed}")
        return (
            f"equiv: {self.implementation} vs {self.reference}: {verdict} "
            f"({self.examples_run} example{plural}, {self.invalid_examples} rejected as invalid; "
            f"modes {', '.join(self.modes)}; devices {', '.join(self.devices)}; {seed})"
        )

    def preamble(self) -> list[str]:
        """The lines between the headline and the findings: settings, runs, notes."""
        parts = [f"  settings: {self.settings}"] if self.settings else []
        parts.extend(f"  mode {r.render()}" for r in self.runs)
        parts.extend(f"  note: {n}" for n in self.notes)
        return parts

    def render(self) -> str:
        parts = [self.headline(), *self.preamble()]
        causes = [f.caused_by for f in self.findings]
        parts.extend(render_findings(self.findings, causes, range(len(self.findings))))
        return "\n".join(parts)

    __str__ = render

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["ok"] = self.ok
        d["findings"] = [f.to_dict() for f in self.findings]
        d["runs"] = [dataclasses.asdict(r) for r in self.runs]
        d["schema"] = "equiv.report/1"
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    def raise_if_failed(self) -> "Report":
        """Raise the most specific :class:`EquivalenceFailure` subclass covering every finding."""
        if self.ok:
            return self
        if not self.findings:  # nothing ran: every (mode, device) skipped
            raise EquivalenceFailure(self)
        classes = {f.failure_class for f in self.findings}
        cls = classes.pop() if len(classes) == 1 else EquivalenceFailure
        raise cls(self)


#: what differs between two notes of one kind from different examples: element listings
#: (``x[0, 1] (from above), ...``), then any other number
_LISTING = re.compile(r"[\w.']+\[[^\]]*\](?: \([^)]*\))?(?:(?:, | and )[\w.']+\[[^\]]*\]"
                      r"(?: \([^)]*\))?)*(?: and \d+ more elements)?")
_NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def fold_notes(notes: Iterable[str]) -> list[str]:
    """One note per kind: notes that differ only in the elements they list or in numbers (the
    same note from other examples) become the first of them and how many more there were."""
    first: dict[str, str] = {}
    count: dict[str, int] = {}
    for note in notes:
        kind = _NUMBER.sub("#", _LISTING.sub("@", note))
        first.setdefault(kind, note)
        count[kind] = count.get(kind, 0) + 1
    return [note + (f" (and {count[k] - 1} more like it from other examples)"
                    if count[k] > 1 else "") for k, note in first.items()]


def count_findings(roots: int, follow_ons: int) -> str:
    """"2 findings (+3 follow-ons)": the roots, and the findings they explain."""
    if not roots and follow_ons:
        return f"only follow-on findings ({follow_ons}) of findings shown elsewhere"
    text = f"{roots} finding{'s' if roots != 1 else ''}"
    return text + (f" (+{follow_ons} follow-on{'s' if follow_ons != 1 else ''})"
                   if follow_ons else "")


def _how(root: Finding, f: Finding) -> list[str]:
    """The line telling how ``root`` caused the follow-on ``f`` when ``f``'s likely cause (its
    timeline's) is about the root's argument: a write that staled its saved value."""
    cause = f.likely_cause or ""
    if root.argument and cause.startswith((f"saved {root.argument!r} ",
                                           f"{root.argument!r} stashed as ")):
        return [f"    how: {cause}"]
    return []


def follow_on_label(f: Finding) -> str:
    return f"{f.check} ({f.mode}{'' if f.device == 'cpu' else ', ' + f.device})"


def render_findings(findings: Sequence[Finding], causes: Sequence[int | None],
                    shown: Iterable[int]) -> list[str]:
    """The text of the findings at indices ``shown``: each root in full with its follow-ons
    (from all of ``findings``; ``causes[i]`` is the root index of finding ``i`` or None)
    folded under it, one line each; a follow-on whose root is not shown names its root."""
    shown = list(shown)
    roots = [i for i in shown if causes[i] is None]
    lines: list[str] = []
    for k, i in enumerate(roots, 1):
        lines.append("")
        if len(roots) > 1:
            lines.append(f"[{k}/{len(roots)}]")
        lines.append(findings[i].render())
        mine = [j for j, c in enumerate(causes) if c == i]
        if mine:
            lines.append(f"+{len(mine)} follow-on finding{'s' if len(mine) != 1 else ''}: "
                         + ", ".join(follow_on_label(findings[j]) for j in mine))
            for j in mine:
                lines.append(f"  {follow_on_label(findings[j])}: {findings[j].kind}: "
                             f"{findings[j].headline}")
                lines.extend(_how(findings[i], findings[j]))
    for j in shown:
        c = causes[j]
        if c is not None and c not in shown:
            root = findings[c]
            lines += ["", f"follow-on {follow_on_label(findings[j])}: {findings[j].kind}: "
                      f"{findings[j].headline}",
                      f"  a consequence of {follow_on_label(root)}: {root.kind}: "
                      f"{root.headline} (shown in full there)"]
    return lines
