"""One result per (spec, mode, device), and the versioned JSON document built from them.

The pytest plugin and the ``equiv`` command both run specs through :func:`run_one` and write
reports with :func:`document`; the HTML report renders that document (rendering never computes).
Schema: docs/report-schema.md.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Iterable

from equiv._reports import strict, write_atomic
from equiv._settings import settings as Settings
from equiv.errors import InvalidArgument
from equiv.report import Finding, Report
from equiv.spec import Spec

SCHEMA = "equiv.results/1"

#: verdicts, as written in JSON (the table shows pass / FAIL / skipped / not compiled / ERROR)
VERDICTS = ("pass", "fail", "skipped", "not-compiled", "error")
LABELS = {"pass": "pass", "fail": "FAIL", "skipped": "skipped", "not-compiled": "not compiled",
          "error": "ERROR"}


@dataclasses.dataclass(frozen=True)
class Result:
    """The outcome of one spec under one mode on one device. Plain data: pickles."""

    spec: str
    implementation: str
    reference: str
    mode: str
    device: str
    verdict: str
    reason: str = ""
    report: Report | None = None
    #: a finer outcome within a "fail": "timeout" (an example ran past settings(timeout=)),
    #: "not-checked" (something requested was not checked: a mode skipped as unsupported,
    #: gradients compared on no example)
    kind: str = ""

    @property
    def label(self) -> str:
        return {"timeout": "TIMEOUT", "not-checked": "not checked"}.get(
            self.kind, LABELS[self.verdict])

    def to_dict(self) -> dict[str, Any]:
        r = self.report
        return {
            "spec": self.spec,
            "implementation": self.implementation,
            "reference": self.reference,
            "mode": self.mode,
            "device": self.device,
            "verdict": self.verdict,
            "reason": self.reason,
            "seed": r.seed if r else None,
            "examples_run": r.examples_run if r else 0,
            "invalid_examples": r.invalid_examples if r else 0,
            "checks": list(r.checks) if r else [],
            "notes": list(r.notes) if r else [],
            "settings": r.settings if r else "",
            "compile_counts": compile_counts(r, self.mode, self.device),
            "findings": [finding_dict(f) for f in (r.findings if r else ())],
        }


def finding_dict(f: Finding) -> dict[str, Any]:
    """A finding as JSON-able data (schema: docs/report-schema.md)."""
    return {
        "check": f.check,
        "kind": f.kind,
        "headline": f.headline,
        "spec": f.spec,
        "implementation": f.implementation,
        "reference": f.reference,
        "mode": f.mode,
        "device": f.device,
        "dtype": f.dtype,
        "argument": f.argument,
        "numbers": {
            "max_abs": f.max_abs,
            "max_rel": f.max_rel,
            "index": list(f.index) if f.index is not None else None,
            "rtol": f.rtol,
            "atol": f.atol,
            "rule": f.rule,
            "impl_error": f.impl_error,
            "baseline_error": f.baseline_error,
            "allowed": f.allowed,
            "k": f.k,
            "rounding_level": f.rounding_level,
        },
        "details": f.details,
        "example": {"summary": f.example, "code": f.example_code},
        "likely_cause": f.likely_cause,
        "fix": f.fix,
        "traceback": f.traceback,
        "reproduce": f.reproduce,
        "timeline": [_event(e) for e in (getattr(f, "timeline", None) or ())],
        "message": f.render(),
        # its root: {"result": index in the document's results (null: this one), "finding": i}
        "caused_by": None if f.caused_by is None else {"result": None, "finding": f.caused_by},
    }


def linked(results: Iterable[Result]) -> dict[tuple[int, int], tuple[int, int] | None]:
    """(result index, finding index) -> the (result, finding) of its root, or None for a root.
    The findings of one spec's results are linked together (equiv._roots): the same
    divergence in a second mode, run as its own result, follows the eager one."""
    from equiv._roots import causes

    by_spec: dict[str, list[tuple[int, int, Finding]]] = {}
    for r, res in enumerate(results):
        for i, f in enumerate(res.report.findings if res.report is not None else ()):
            by_spec.setdefault(res.spec, []).append((r, i, f))
    out: dict[tuple[int, int], tuple[int, int] | None] = {}
    for flat in by_spec.values():
        for (r, i, _), c in zip(flat, causes([f for _, _, f in flat])):
            out[r, i] = None if c is None else flat[c][:2]
    return out


def _event(e: Any) -> dict[str, Any]:
    """One timeline event as JSON: a key the recorder left unknown (None) is absent, never
    ``null`` (docs/report-schema.md types each key)."""
    if isinstance(e, dict):
        fields = e
    elif dataclasses.is_dataclass(e) and not isinstance(e, type):
        fields = dataclasses.asdict(e)
    elif callable(getattr(e, "to_dict", None)):
        fields = e.to_dict()
    else:
        return {"kind": "unknown", "repr": repr(e)}
    return {k: _plain(v) for k, v in fields.items() if v is not None}


def _plain(v: Any) -> Any:
    """JSON-able copy: mappings, sequences, numbers, strings; anything else as its str."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return _plain(dataclasses.asdict(v))
    return str(v)


def combinations(spec: Spec, cfg: Settings) -> list[tuple[Any, str]]:
    """(mode, device) pairs to run ``spec`` under: the decorator's modes/devices when it set
    them, else ``cfg``'s (the profile with the command-line options over it)."""
    modes, devices = cfg.modes, cfg.devices
    own = spec.settings
    if own is not None:
        if "modes" in own._explicit:
            modes = own.modes
        if "devices" in own._explicit:
            devices = own.devices
    return [(m, d) for m in modes for d in devices]


def device_unavailable(device: str) -> str | None:
    """Why ``device`` cannot run here (a skip reason), or None when it can."""
    import torch

    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as e:
        raise InvalidArgument(
            f"unknown device {device!r} ({e}); give torch device names such as 'cpu' or 'cuda'."
        ) from None
    if kind == "cuda" and not torch.cuda.is_available():
        return f"device {device!r} is not available here (torch.cuda.is_available() is False)"
    if kind == "mps" and not torch.backends.mps.is_available():
        return f"device {device!r} is not available here (torch.backends.mps.is_available() " \
            "is False)"
    return None


def nowhere_to_run(devices: Iterable[str]) -> str | None:
    """When none of ``devices`` is available here: why, as ``check(devices=...)`` says it
    (nothing ran, which is not a pass); else None. Unknown device names are left to the run."""
    try:
        reasons = [device_unavailable(d) for d in dict.fromkeys(devices)]
    except InvalidArgument:
        return None
    if not reasons or not all(reasons):
        return None
    return (f"every requested device was skipped ({reasons[0]}): nothing ran, which is not a "
            "pass. Request an available device, e.g. cpu")


def narrow(spec: Spec, mode: Any, device: str) -> Spec:
    """``spec`` restricted to one mode and device, even when its decorator names several."""
    own = spec.settings if spec.settings is not None else Settings()
    return dataclasses.replace(spec, settings=Settings(own, modes=(mode,), devices=(device,)))


def run_one(spec: Spec, mode: Any, device: str, **check_options: Any) -> Result:
    """Run ``spec`` under one mode (a name, or a mode object whose str is its name) on one
    device; never raises for findings, for a usage error or for an exception escaping the
    user's code (each is a result naming the spec), only for KeyboardInterrupt."""
    from equiv.run import check  # it enforces settings(timeout=...) per example

    base = dict(spec=spec.name, implementation=spec.implementation, reference=spec.reference,
                mode=str(mode), device=device)
    try:
        why = device_unavailable(device)
        if why is not None:
            return Result(verdict="skipped", reason=why, **base)
        report = check(narrow(spec, mode, device), modes=(mode,), devices=(device,),
                       raise_on_failure=False, **check_options)
    except InvalidArgument as e:
        return Result(verdict="error", reason=str(e), **base)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # SystemExit, an exception out of equiv itself...
        return Result(verdict="error", reason=_escaped(spec, e), **base)
    return _verdict(report, str(mode), device, base)


def nothing_ran(results: list[Result]) -> list[Result]:
    """``results`` where every row of a spec whose every (mode, device) was skipped becomes
    an error: nothing ran for that spec (each skip allowed or not), which is not a pass."""
    specs = {r.spec for r in results}
    empty = {s for s in specs if all(r.verdict == "skipped" for r in results if r.spec == s)}
    return [dataclasses.replace(
        r, verdict="error", kind="",
        reason=f"every requested mode of {r.spec} was skipped "
               f"({(r.reason.splitlines() or ['no reason given'])[0]}): nothing ran, which is "
               "not a pass. Request a mode the implementation runs under, e.g. --modes eager.")
        if r.spec in empty else r for r in results]


def _escaped(spec: Spec, e: BaseException) -> str:
    """The reason of an exception that escaped a run: what it was, and where it came from."""
    import traceback

    tb = "".join(traceback.format_exception(type(e), e, e.__traceback__, limit=-6))
    what = f"{type(e).__name__}({', '.join(map(repr, e.args))})"
    if isinstance(e, (SystemExit, GeneratorExit)) or not isinstance(e, Exception):
        head = (f"{spec.name}: {what} escaped the check (raised by the implementation or the "
                "reference); equiv stopped this spec. A kernel must not exit the process.")
    else:
        head = (f"{spec.name}: the run stopped with {what}, which is not a finding about the "
                "implementation: if the traceback ends in equiv's own code, please report a bug "
                "with this spec.")
    return f"{head}\n{tb.rstrip()}"


def _verdict(report: Report, mode: str, device: str, base: dict[str, Any]) -> Result:
    """One row of the verdicts table (docs/reference.md): findings fail; run-level findings
    name what was not checked (not compiled, not checked, a timeout)."""
    run = mode_run(report, mode, device)
    kinds = {f.check for f in report.findings}
    if kinds == {"not-compiled"}:  # a compile mode that fell back to eager: never a pass
        return Result(verdict="not-compiled", report=report, reason=report.findings[0].headline,
                      **base)
    if kinds == {"timeout"}:
        f = report.findings[0]
        return Result(verdict="fail", kind="timeout", report=report,
                      reason=f"TIMEOUT: {f.headline} {f.fix[:1].upper()}{f.fix[1:]}", **base)
    if kinds == {"not-checked"}:
        return Result(verdict="fail", kind="not-checked", report=report,
                      reason=report.findings[0].headline, **base)
    if report.findings:
        return Result(verdict="fail", report=report, **base)
    status = getattr(run, "status", None)
    if status == "not compiled":  # a compile mode that fell back to eager: never a pass
        return Result(verdict="not-compiled", report=report, reason=getattr(run, "reason", "")
                      or "the compile mode captured no graph (it ran eagerly)", **base)
    if status == "skipped":  # e.g. a transform the implementation does not support
        return Result(verdict="skipped", report=report, reason=getattr(run, "reason", ""), **base)
    return Result(verdict="pass", report=report, **base)


def mode_run(report: Report | None, mode: str, device: str) -> Any:
    """The report's record of what (mode, device) did (``Report.runs``, equiv.modes), or None
    when the runner keeps no such record."""
    for run in getattr(report, "runs", None) or ():
        if str(getattr(run, "mode", "")) == mode and getattr(run, "device", None) == device:
            return run
    return None


def compile_counts(report: Report | None, mode: str, device: str) -> dict[str, Any] | None:
    """Compilations and graph breaks of a compile mode, or None when not recorded."""
    run = mode_run(report, mode, device)
    if run is None or getattr(run, "compilations", None) is None:
        return None
    return {"compilations": run.compilations, "graph_breaks": getattr(run, "graph_breaks", None),
            "break_reasons": _plain(list(getattr(run, "break_reasons", ()) or ())),
            "recompile_reasons": _plain(list(getattr(run, "recompile_reasons", ()) or ()))}


def summary(results: Iterable[Result | dict[str, Any]]) -> dict[str, int]:
    counts = {v: 0 for v in VERDICTS}
    for r in results:
        counts[r["verdict"] if isinstance(r, dict) else r.verdict] += 1
    return counts


def document(results: Iterable[Result | dict[str, Any]], *, tool: str, profile: str,
             seed: int | None, modes: Iterable[str], devices: Iterable[str],
             max_examples: int, reproduce: str = "", complete: bool = True) -> dict[str, Any]:
    """The JSON report (schema ``equiv.results/1``, docs/report-schema.md). Deterministic: no
    timestamps, no addresses; strict JSON (non-finite numbers as ``"inf"``, ``"-inf"``,
    ``"nan"``). ``complete=False``: the run ended early, ``results`` are those that finished."""
    import equiv

    results = list(results)
    rows = [r if isinstance(r, dict) else r.to_dict() for r in results]
    objects = [r for r in results if not isinstance(r, dict)]
    if len(objects) == len(rows):
        for (r, i), root in linked(objects).items():
            rows[r]["findings"][i]["caused_by"] = None if root is None else {
                "result": root[0], "finding": root[1]}
    return strict({
        "schema": SCHEMA,
        "complete": complete,
        "equiv_version": equiv.__version__,
        "tool": tool,
        "profile": profile,
        "seed": seed,
        "modes": [str(m) for m in modes],
        "devices": list(devices),
        "max_examples": max_examples,
        "reproduce": reproduce,
        "summary": summary(rows),
        "results": rows,
    })


def json_text(doc: dict[str, Any]) -> str:
    """The report as strict JSON text (no ``NaN``/``Infinity`` literals)."""
    return json.dumps(strict(doc), indent=2, sort_keys=False, allow_nan=False) + "\n"


def write_json(doc: dict[str, Any], path: str) -> None:
    """Write the report to ``path`` atomically (a temporary file, then ``os.replace``)."""
    write_atomic(path, json_text(doc))
