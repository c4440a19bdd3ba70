"""The ``equiv`` command (also ``python -m equiv``).

``equiv check PATH_OR_MODULE...`` imports the files, folders and modules, runs every registered
spec under each mode and device, and prints a summary table then each finding in full.
``equiv list PATH_OR_MODULE...`` lists the specs and their contracts.
``equiv lab [--out PATH] [--open]`` writes the function lab page (docs/lab/index.html), its
autograd panel recorded afresh from a real run, and opens it in a browser only with ``--open``.

Exit status: 0 all passed, 1 findings (or a timeout, or a compile mode that compiled nothing),
2 usage or import error (the import traceback is printed), 130 interrupted (Ctrl-C; the summary
of what finished is printed first). Verdicts follow docs/reference.md "Verdicts".
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import random
import sys
import traceback
from typing import Any, Callable, Iterator, Sequence, TextIO

EXIT_OK, EXIT_FINDINGS, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def _comma_list(value: str) -> tuple[str, ...]:
    parts, depth, cur = [], 0, ""
    for ch in value:  # commas inside brackets stay: compile[a,b] is one mode
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    parts.append(cur.strip())
    if not all(parts):
        raise argparse.ArgumentTypeError(
            f"{value!r}: give a comma-separated list with no empty entries, e.g. eager,cpu")
    return tuple(parts)


def _sizes(value: str) -> tuple[int, ...]:
    """``--sizes 1e3,1e5``: element counts (``1000`` or ``1e3``)."""
    try:
        sizes = tuple(int(float(v)) for v in value.split(",") if v.strip())
    except ValueError:
        sizes = ()
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(
            f"{value!r}: give element counts >= 1 separated by commas, e.g. 1e3,1e5")
    return sizes


def _positive(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: give a positive integer")
    return n


def _workers(value: str) -> int:
    """``-n N``: worker processes; ``auto``: one per available core; 0: in this process."""
    if value.strip().lower() == "auto":
        from equiv._workers import available_cores

        return available_cores()
    try:
        n = int(value)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(
            f"{value!r}: give a number of worker processes >= 0 or auto, e.g. -n 2 (0: run "
            "in this process)")
    return n


def _seconds(value: str) -> float:
    try:
        n = float(value)
    except ValueError:
        n = 0.0
    if not 0 < n < float("inf"):
        raise argparse.ArgumentTypeError(f"{value!r}: give a number of seconds > 0, e.g. 60")
    return n


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="equiv", description="Prove fast, mutating PyTorch implementations equivalent to "
        "their pure references.", epilog="Exit status: 0 all pass, 1 findings, 2 usage or "
        "import error, 130 interrupted.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{check,list,bench,lab}")
    p = sub.add_parser("check", help="run every registered spec found in the targets",
                       description="Import the targets and run every @equivalent_to spec.")
    p.add_argument("targets", nargs="+", metavar="PATH_OR_MODULE",
                   help=".py files, folders of them (not recursive; a package "
                        "folder is imported as its package, with submodules) or dotted "
                        "module names")
    p.add_argument("--modes", type=_comma_list, default=None, metavar="M1,M2",
                   help="execution modes, e.g. eager,compile[aot_eager] (default: the profile's)")
    p.add_argument("--devices", type=_comma_list, default=None, metavar="D1,D2",
                   help="devices, e.g. cpu,cuda; unavailable ones are skipped (all "
                        "unavailable: an error)")
    p.add_argument("--profile", default=None, metavar="NAME",
                   help="settings profile: default, ci, thorough (default: $EQUIV_PROFILE, "
                        "else ci when $CI is set, else default)")
    p.add_argument("--max-examples", type=_positive, default=None, metavar="N",
                   help="Hypothesis examples per spec, mode and device")
    p.add_argument("--timeout", type=_seconds, default=None, metavar="SECONDS",
                   help="per-example time limit: an example (both sides, all checks) running "
                        "longer is a TIMEOUT (default: the profile's; ci: 300)")
    p.add_argument("--seed", type=int, default=None, metavar="N",
                   help="seed for every run (default: random, printed)")
    p.add_argument("--reference-dtype", default=None, metavar="DTYPE",
                   help="run references in this floating dtype, e.g. float64 (a spec's own "
                        "reference_dtype= wins)")
    p.add_argument("--reference-device", default=None, metavar="DEVICE",
                   help="run references on this device, e.g. cpu (a spec's own "
                        "reference_device= wins)")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="write the JSON report (docs/report-schema.md)")
    p.add_argument("--html", default=None, metavar="FILE",
                   help="write a self-contained HTML report")
    p.add_argument("--progress", choices=("auto", "on", "off"), default="auto",
                   help="progress bar on stderr (auto: only on a terminal)")
    p.add_argument("-n", "--workers", type=_workers, default=0, metavar="N",
                   help="run the specs in N worker processes (auto: one per core; default 0: "
                        "in this process); same seeds, verdicts and report")
    b = sub.add_parser("bench", help="time each spec's implementation against its reference "
                       "(after a quick equivalence check), docs/bench.md")
    b.add_argument("targets", nargs="+", metavar="PATH_OR_MODULE")
    b.add_argument("--sizes", type=_sizes, default=None, metavar="N1,N2",
                   help="elements of the largest tensor argument (default 1e3,1e5,1e6)")
    b.add_argument("--device", default="cpu", metavar="DEVICE", help="cpu (default) or cuda")
    b.add_argument("--min-time", type=float, default=0.2, metavar="SECONDS",
                   help="seconds each measurement runs at least (default 0.2)")
    b.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    b.add_argument("--html", default=None, metavar="FILE",
                   help="write an HTML page with plots of time and memory against size")
    q = sub.add_parser("list", help="list the specs found in the targets and their contracts")
    q.add_argument("targets", nargs="+", metavar="PATH_OR_MODULE")
    for command in (p, q, b):
        command.add_argument("-k", dest="keyword", default=None, metavar="EXPR",
                             help="only the specs whose name matches EXPR (pytest's -k: "
                                  "case-insensitive substrings with and, or, not, parentheses)")
    lab = sub.add_parser("lab", help="write the function lab page (and open it with --open)",
                         description="Write the function lab: a self-contained page on why a "
                         "backward rule must know which forward input it belongs to; its "
                         "autograd panel is recorded from a real run now.")
    lab.add_argument("--out", default="equiv-lab.html", metavar="PATH",
                     help="where to write the page (default: equiv-lab.html)")
    lab.add_argument("--open", action="store_true",
                     help="open the page in the default web browser")
    return parser


def _placed(specs: list[Any], dtype: str | None, device: str | None) -> list[Any]:
    """--reference-dtype/--reference-device over every spec that does not set its own."""
    if dtype is None and device is None:
        return specs
    import dataclasses

    from equiv.spec import validate_reference

    dtype, device = validate_reference(dtype, device, "--reference")
    return [dataclasses.replace(s, reference_dtype=s.reference_dtype or dtype,
                                reference_device=s.reference_device or device) for s in specs]


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None,
         err: TextIO | None = None) -> int:
    out = out or sys.stdout
    err = err or sys.stderr
    args = _parser().parse_args(argv)  # usage errors exit 2 (argparse)
    if args.command == "lab":
        return _lab(args, out, err)

    import equiv

    _search_path(from_command_line=argv is None)
    if args.command == "check":
        problem = _prepare_reports(args)
        if problem:
            print(f"equiv: {problem}; nothing was run.", file=err)
            return EXIT_USAGE
    specs = _load(args, err)
    if isinstance(specs, int):
        return specs
    if args.command == "list":
        _list(specs, out)
        _registered(args, out)
        return EXIT_OK
    if args.command == "bench":
        from equiv import _bench

        try:
            return _bench.main(specs, sizes=args.sizes, device=args.device,
                               min_time=args.min_time, json_path=args.json,
                               html_path=args.html, out=out, err=err)
        except equiv.InvalidArgument as e:
            print(f"equiv: {e}", file=err)
            return EXIT_USAGE
    try:
        specs = _placed(specs, args.reference_dtype, args.reference_device)
    except equiv.InvalidArgument as e:
        print(f"equiv: {e}", file=err)
        return EXIT_USAGE

    overrides: dict[str, Any] = {}
    for name in ("modes", "devices", "max_examples", "timeout"):
        if getattr(args, name) is not None:
            overrides[name] = getattr(args, name)
    try:
        profile = equiv.settings.get_profile(args.profile) if args.profile else None
        derandomized = (profile or equiv.settings.default()).derandomize
        if args.seed is not None:
            overrides.update(seed=args.seed, derandomize=False)
        elif not derandomized:
            overrides["seed"] = random.SystemRandom().randrange(2**32)
        previous = equiv.settings._push_session(args.profile, **overrides)
        args.session = (args.profile, overrides)  # what -n workers started afresh push
    except equiv.InvalidArgument as e:
        print(f"equiv: {e}", file=err)
        return EXIT_USAGE
    try:
        return _check(args, specs, out, err)
    finally:
        equiv.settings._pop_session(previous)


def _search_path(from_command_line: bool) -> None:
    """Modules of the current folder import (as with ``python -m``), from the end of
    ``sys.path``: a target named like a module equiv or torch imports (``html.py``,
    ``sympy.py``) cannot hide it. Run as a command, the current folder ``python -m`` put first
    moves to the end too."""
    cwd = os.getcwd()
    if from_command_line:
        sys.path[:] = [p for p in sys.path if p not in ("", cwd)]
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)


def _prepare_reports(args: argparse.Namespace) -> str | None:
    """Validate --json/--html, make them absolute and remove stale reports there (before any
    user code runs); the problem, or None."""
    from pathlib import Path

    from equiv._reports import ReportPathError, prepare

    sources = [Path(t) for t in args.targets if Path(t).is_file()]
    for t in args.targets:
        if Path(t).is_dir():
            sources += Path(t).glob("*.py")
    try:
        paths = prepare([("--json", args.json), ("--html", args.html)], sources)
    except ReportPathError as e:
        return str(e)
    except OSError as e:
        return f"a stale report could not be removed ({e})"
    args.json, args.html = paths.get("--json"), paths.get("--html")
    return None


def _load(args: argparse.Namespace, err: TextIO) -> list[Any] | int:
    """The specs of every target, selected by -k; an exit status when there are none (each
    target must register at least one). Sets ``args.found``: (target, specs it registered)."""
    from equiv._loader import TargetNotFound, load_target

    specs: list[Any] = []
    args.found = []
    for target in args.targets:
        try:
            found = load_target(target)
        except TargetNotFound as e:
            print(f"equiv: {_visible(str(e))}", file=err)
            return EXIT_USAGE
        except KeyboardInterrupt:
            print("equiv: interrupted", file=err)
            return EXIT_INTERRUPTED
        except BaseException as e:  # the user's module failed (SystemExit too): exit 2
            print(f"equiv: could not import {target}:", file=err)
            print(_visible("".join(traceback.format_exception(type(e), e, e.__traceback__))),
                  end="", file=err)
            return EXIT_USAGE
        if not found:
            print(f"equiv: no specs found in {target}: importing it registered no spec "
                  "(decorate implementations with @equivalent_to, or call "
                  "equivalent_to(ref, ...)(impl) in it).", file=err)
            return EXIT_USAGE
        args.found.append((target, len(found)))
        specs += [s for s in found if all(s.name != t.name for t in specs)]
    chosen = _selected(specs, args.keyword, err)
    args.selected = None if isinstance(chosen, int) else (len(chosen), len(specs))
    return chosen


def _selected(specs: list[Any], keyword: str | None, err: TextIO) -> list[Any] | int:
    """The specs whose name matches ``-k EXPR`` (all without one)."""
    if keyword is None:
        return specs
    from equiv._compat import keyword_matcher

    try:
        matches = keyword_matcher(keyword)
    except ValueError as e:
        print(f"equiv: -k {keyword!r}: {e}", file=err)
        return EXIT_USAGE
    chosen = [s for s in specs if matches(s.name)]
    if not chosen:
        print(f"equiv: -k {keyword!r} matches none of the {len(specs)} specs found "
              f"({', '.join(_visible(s.name, lines=False) for s in specs[:8])}"
              f"{', ...' if len(specs) > 8 else ''}).", file=err)
        return EXIT_USAGE
    return chosen


def _registered(args: argparse.Namespace, out: TextIO) -> None:
    """One line per target: how many specs importing it registered (before -k)."""
    print(file=out)
    for target, n in getattr(args, "found", ()):
        print(f"equiv: {_visible(target, lines=False)}: {n} spec{'s' if n != 1 else ''} "
              "registered", file=out)
    if args.keyword is not None and getattr(args, "selected", None):
        print(f"equiv: -k {_visible(args.keyword, lines=False)} selected "
              f"{args.selected[0]} of {args.selected[1]} specs", file=out)


def _visible(text: Any, lines: bool = True) -> str:
    from equiv._reports import visible

    return visible(text, lines=lines)


def _lab(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from pathlib import Path

    from equiv._lab import write_page

    try:
        path = write_page(args.out).resolve()
    except OSError as e:
        print(f"equiv: could not write {args.out}: {e}", file=err)
        return EXIT_USAGE
    print(f"equiv: wrote the function lab to {path}", file=out)
    if args.open:
        import webbrowser

        if not webbrowser.open(Path(path).as_uri()):
            print(f"equiv: no browser could be opened; open {path} yourself", file=err)
    return EXIT_OK


def _list(specs: list[Any], out: TextIO) -> None:
    for s in specs:
        tol = "dtype default" if s.rtol is None else f"rtol={s.rtol:g}, atol={s.atol:g}"
        print(_visible(s.name, lines=False), file=out)
        print(f"  reference: {_visible(s.reference, lines=False)}", file=out)
        print(_visible(f"  signature: {s.impl.__name__ if hasattr(s.impl, '__name__') else s.name}"
                       f"{s.signature}", lines=False), file=out)
        print(f"  mutates:   {dict(s.mutates) or '{} (pure)'}", file=out)
        print(f"  inputs:    {'derived from the signature' if s.derived_inputs else 'given'}"
              f"; {len(s.examples)} explicit example(s); tolerance: {tol}", file=out)
        if s.settings is not None:
            own = {f: getattr(s.settings, f) for f in sorted(s.settings._explicit)}
            if own:
                shown = ", ".join(f"{k}={v!r}" for k, v in own.items())
                print(f"  settings:  {shown} (from the decorator; wins over options)", file=out)


def _check(args: argparse.Namespace, specs: list[Any], out: TextIO, err: TextIO) -> int:
    import equiv
    from equiv import _values
    from equiv._results import LABELS, document, linked, nothing_ran

    cfg = equiv.settings.default()
    seed_text = "derandomized" if cfg.derandomize else f"--seed={cfg.seed}"
    print(f"equiv: profile={cfg.profile} modes={','.join(map(str, cfg.modes))} "
          f"devices={','.join(cfg.devices)} max_examples={cfg.max_examples} {seed_text}",
          file=out)
    tasks = _task_list(specs, cfg)
    results: list[Any] = []
    interrupted = False
    pid = os.getpid()
    report = args.json or args.html
    try:  # the .pt files of printed reproductions go beside the report
        with _values.example_directory(os.path.dirname(report) if report else None):
            _run_tasks(tasks, results, args, err)
    except KeyboardInterrupt:  # show what finished, then stop with 130
        interrupted = True
    if os.getpid() != pid:  # a process user code forked: only the one that started reports
        os._exit(0)
    if not interrupted:
        results[:] = nothing_ran(results)
    links = linked(results)
    _table(results, out, links)
    _registered(args, out)
    skipped = [r for r in results if r.verdict == "skipped"]
    if skipped:  # what was not checked, and why (one line each)
        print(file=out)
        for r in skipped:
            print(_visible(f"skipped: {r.spec} [{r.mode}-{r.device}]: "
                           f"{(r.reason.splitlines() or [''])[0][:200]}", lines=False), file=out)
    unchecked = [(r, n) for r in results if r.verdict == "pass" and r.report is not None
                 for n in r.report.notes if " not compared" in n]
    if unchecked:  # a pass that left something out says what (one line each)
        print(file=out)
        for r, note in unchecked:
            print(_visible(f"not compared: {r.spec} [{r.mode}-{r.device}]: {note}",
                           lines=False), file=out)
    for ri, r in enumerate(results):
        if r.verdict in ("pass", "skipped"):
            continue
        print(file=out)
        print(_visible(f"== {r.label}: {r.spec} [{r.mode}-{r.device}] ==", lines=False),
              file=out)
        if r.report is not None and r.report.findings:
            print(_visible(_rendered(results, ri, links)), file=out)
        else:
            print(_visible(r.reason), file=out)
    counts = {v: sum(r.verdict == v for r in results) for v in LABELS}
    print(file=out)
    print(", ".join(f"{n} {LABELS[v]}" for v, n in counts.items() if n) or "nothing finished",
          file=out)
    reproduce = _reproduce(args, cfg)
    if args.json or args.html:  # an interrupted run's report says it is incomplete
        doc = document(results, tool="equiv check", profile=cfg.profile,
                       seed=None if cfg.derandomize else cfg.seed, modes=cfg.modes,
                       devices=cfg.devices, max_examples=cfg.max_examples, reproduce=reproduce,
                       complete=not interrupted)
        if not _write_reports(args, doc, err):
            return EXIT_USAGE
    if interrupted:
        written = " (marked incomplete)" if args.json or args.html else ""
        print(f"equiv: interrupted after {len(results)} of {len(tasks)} runs "
              f"(spec x mode x device); report files{written} hold only those.", file=out)
        return EXIT_INTERRUPTED
    if any(r.verdict in ("fail", "not-compiled", "error") for r in results) \
            and not cfg.derandomize:
        print(f"Reproduce: {reproduce}", file=out)
    if counts["error"]:
        return EXIT_USAGE
    if counts["fail"] or counts["not-compiled"]:
        return EXIT_FINDINGS
    return EXIT_OK


def _task_list(specs: list[Any], cfg: Any) -> list[tuple[Any, Any, str]]:
    """Every (spec, mode, device) to run, in the order of the table."""
    from equiv._results import combinations

    return [(s, m, d) for s in specs for m, d in combinations(s, cfg)]


def _runner(tasks: list[Any]) -> Callable[[Any, Any, str], Any]:
    """``one(spec, mode, device)``: the result of that run (an error row for a spec none of
    whose devices is available)."""
    from equiv._results import Result, nowhere_to_run, run_one

    devices: dict[str, list[str]] = {}
    for s, _, d in tasks:
        devices.setdefault(s.name, []).append(d)
    nowhere = {name: nowhere_to_run(ds) for name, ds in devices.items()}

    def one(s: Any, m: Any, d: str) -> Any:
        why = nowhere[s.name]
        if why is None:
            return run_one(s, m, d)
        return Result(spec=s.name, implementation=s.implementation, reference=s.reference,
                      mode=str(m), device=d, verdict="error", reason=f"{why} (--devices)")

    return one


def _run_tasks(tasks: list[Any], results: list[Any], args: argparse.Namespace,
               err: TextIO) -> None:
    """Run each (spec, mode, device) into ``results`` (appended as they finish, so an
    interrupted run keeps what finished)."""
    one = _runner(tasks)
    show = args.progress == "on" or (args.progress == "auto" and err.isatty())
    with _progress(show, len(tasks), err) as advance:
        if args.workers:
            _run_in_workers(tasks, one, results, args, advance)
            return
        for s, m, d in tasks:
            advance(f"{s.name} [{m}-{d}]", len(results))
            results.append(one(s, m, d))


@contextlib.contextmanager
def _progress(show: bool, total: int,
              err: TextIO) -> Iterator[Callable[[str, int], None]]:
    """A progress bar on ``err`` when ``show``: ``advance(description, completed)`` as the
    ``total`` runs go (nothing is shown without ``show``)."""
    if not show:
        yield lambda description, completed: None
        return
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn)

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=Console(file=err), transient=True) as bar:
        job = bar.add_task("equiv", total=total)
        yield lambda description, completed: bar.update(job, description=description,
                                                        completed=completed)


def _run_in_workers(tasks: list[Any], one: Callable[..., Any], results: list[Any],
                    args: argparse.Namespace, advance: Callable[[str, int], None]) -> None:
    """``-n N``: each run in a worker process; ``results`` in the order of ``tasks`` (those
    that finished, when interrupted)."""
    from equiv._results import Result
    from equiv._workers import run_in_workers

    workers, method = args.workers, _start_method(tasks)
    run: Callable[[int], Any] = lambda i: one(*tasks[i])  # noqa: E731
    if method == "spawn":
        run = functools.partial(_spawned_run, {
            "targets": args.targets, "keyword": args.keyword, "path": list(sys.path),
            "cwd": os.getcwd(), "reference": (args.reference_dtype, args.reference_device),
            "session": args.session})

    finished: dict[int, Any] = {}

    def crashed(i: int, how: str) -> Any:
        s, m, d = tasks[i]
        return Result(spec=s.name, implementation=s.implementation, reference=s.reference,
                      mode=str(m), device=d, verdict="error",
                      reason=f"{s.name}: the worker process checking it under {m} on {d} {how} "
                             "before returning a result (os._exit in the implementation or the "
                             "reference, a segmentation fault, a kill, the out-of-memory "
                             "killer); the other runs went on, and a run with a crash is not a "
                             "pass.")

    def done(i: int, result: Any) -> None:
        finished[i] = result
        advance(f"{len(finished)} of {len(tasks)} runs done ({workers} workers)", len(finished))

    try:
        run_in_workers(len(tasks), run, crashed, done, workers, method)
    finally:
        results[:] = [finished[i] for i in sorted(finished)]


def _start_method(tasks: list[Any]) -> str:
    """``fork`` (the workers inherit the imported targets), or ``spawn`` when a run uses an
    available accelerator: CUDA cannot run in a process forked from one that touched it."""
    import torch

    from equiv._results import device_unavailable
    from equiv.errors import InvalidArgument

    if torch.cuda.is_initialized():
        return "spawn"
    for d in {d for _, _, d in tasks}:
        try:
            if torch.device(d).type != "cpu" and device_unavailable(d) is None:
                return "spawn"
        except (RuntimeError, TypeError, InvalidArgument):
            continue
    return "fork"


#: in a spawned worker: the command's runs, rebuilt once (tasks, runner)
_SPAWNED: list[Any] = []


def _spawned_run(payload: dict[str, Any], index: int) -> Any:
    """Run ``index`` in a spawned worker: the first call imports the command's targets and
    pushes its settings here, as the command did, so the runs are the command's."""
    import io

    import equiv

    if not _SPAWNED:
        sys.path[:] = payload["path"]
        os.chdir(payload["cwd"])
        loaded = argparse.Namespace(targets=payload["targets"], keyword=payload["keyword"])
        specs = _load(loaded, io.StringIO())
        if isinstance(specs, int):
            raise RuntimeError("the targets did not import in a worker as in the command")
        profile, overrides = payload["session"]
        equiv.settings._push_session(profile, **overrides)
        tasks = _task_list(_placed(specs, *payload["reference"]), equiv.settings.default())
        _SPAWNED[:] = [tasks, _runner(tasks)]
    tasks, one = _SPAWNED
    return one(*tasks[index])


def _write_reports(args: argparse.Namespace, doc: dict[str, Any], err: TextIO) -> bool:
    """Write the reports at their absolute paths, each atomically."""
    from equiv._reports import write_atomic
    from equiv._results import write_json

    try:
        if args.json:
            write_json(doc, args.json)
        if args.html:
            from equiv._html import render_html

            write_atomic(args.html, render_html(doc))
    except OSError as e:
        print(f"equiv: could not write a report file: {e}", file=err)
        return False
    return True


def _rendered(results: list[Any], ri: int, links: dict[tuple[int, int], Any]) -> str:
    """Result ``ri``'s report: each root with its follow-ons (from every result of the spec)
    folded under it; a follow-on of a root in another result names that root."""
    from equiv.report import count_findings, render_findings

    keys = [k for k in links if results[k[0]].spec == results[ri].spec]
    findings = [results[r].report.findings[i] for r, i in keys]
    causes = [None if links[k] is None else keys.index(links[k]) for k in keys]
    shown = [n for n, k in enumerate(keys) if k[0] == ri]
    roots = sum(causes[n] is None for n in shown)
    report = results[ri].report
    lines = [report.headline(count_findings(roots, len(shown) - roots)), *report.preamble()]
    return "\n".join(lines + render_findings(findings, causes, shown))


def _table(results: list[Any], out: TextIO, links: dict[tuple[int, int], Any]) -> None:
    rows = [("spec", "mode", "device", "verdict", "examples", "findings")]
    for ri, r in enumerate(results):
        valid = r.report.examples_run - r.report.invalid_examples if r.report else None
        n = len(r.report.findings) if r.report else 0
        roots = sum(links.get((ri, i)) is None for i in range(n))
        rows.append((_visible(r.spec, lines=False), _visible(r.mode, lines=False),
                     _visible(r.device, lines=False), r.label,
                     str(valid) if r.report else "-",
                     (str(roots) + (f" (+{n - roots})" if n > roots else "")) if r.report
                     else "-"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for j, row in enumerate(rows):
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip(), file=out)
        if j == 0:
            print("  ".join("-" * w for w in widths), file=out)


def _reproduce(args: argparse.Namespace, cfg: Any) -> str:
    keyword = ["-k", args.keyword] if getattr(args, "keyword", None) is not None else []
    parts = ["equiv", "check", *args.targets, *keyword, f"--profile={cfg.profile}",
             f"--modes={','.join(map(str, cfg.modes))}", f"--devices={','.join(cfg.devices)}",
             f"--max-examples={cfg.max_examples}"]
    if not cfg.derandomize:
        parts.append(f"--seed={cfg.seed}")
    if args.timeout is not None:
        parts.append(f"--timeout={args.timeout:g}")
    return " ".join(f"'{p}'" if any(c in p for c in "[] ()") else p for p in parts)
