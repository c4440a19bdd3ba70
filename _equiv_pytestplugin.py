"""equiv's pytest plugin (entry point ``pytest11``).

A top-level module, like Hypothesis's ``_hypothesis_pytestplugin``: a submodule of ``equiv``
would import ``equiv`` (and so torch) when pytest loads it, and installing equiv must cost
nothing for unrelated test runs. This module imports only the standard library and pytest; the
work lives in ``equiv.pytest``, imported inside hooks once equiv is in use (an ``--equiv-*``
option or ini setting was given, or a test module imported equiv).
"""

from __future__ import annotations

import inspect
import os
import random
import sys
from typing import Any

import pytest

_STATE = pytest.StashKey["_State"]()
_RESULT_PROPERTY = "equiv_result"
_ITEM_PROPERTY = "equiv_item"


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("equiv", "equiv: implementation-vs-reference equivalence")
    group.addoption("--equiv-profile", default=None, metavar="NAME",
                    help="equiv settings profile: default, ci, thorough or a registered one "
                         "(default: $EQUIV_PROFILE, else ci when $CI is set, else default)")
    group.addoption("--equiv-modes", default=None, metavar="M1,M2",
                    help="comma-separated execution modes, e.g. eager,compile[aot_eager]")
    group.addoption("--equiv-devices", default=None, metavar="D1,D2",
                    help="comma-separated devices, e.g. cpu,cuda (unavailable ones are skipped)")
    group.addoption("--equiv-max-examples", default=None, type=int, metavar="N",
                    help="Hypothesis examples per spec, mode and device")
    group.addoption("--equiv-timeout", default=None, type=float, metavar="SECONDS",
                    help="per-example time limit: an example running longer is a TIMEOUT "
                         "(default: the profile's; ci: 300)")
    group.addoption("--equiv-seed", default=None, type=int, metavar="N",
                    help="seed for every equiv run (printed in the header; default: random)")
    group.addoption("--equiv-module", action="append", default=[], dest="equiv_modules",
                    metavar="MODULE",
                    help="collect the @equivalent_to specs of this dotted module or .py file "
                         "(repeatable; ini: equiv_modules)")
    group.addoption("--equiv-reference-dtype", default=None, metavar="DTYPE",
                    help="run references in this floating dtype, e.g. float64 (a spec's own "
                         "reference_dtype= wins)")
    group.addoption("--equiv-reference-device", default=None, metavar="DEVICE",
                    help="run references on this device, e.g. cpu (a spec's own "
                         "reference_device= wins)")
    group.addoption("--equiv-report", default=None, metavar="PATH",
                    help="write a JSON report of the equiv items (docs/report-schema.md)")
    group.addoption("--equiv-html", default=None, metavar="PATH",
                    help="write a self-contained HTML report of the equiv items")
    parser.addini("equiv_modules", type="args", default=[],
                  help="dotted modules or .py files whose @equivalent_to specs are collected")


class _State:
    """Per-session state, stored on the config (no module globals: in-process pytester runs
    and xdist workers each have their own)."""

    def __init__(self, config: Any) -> None:
        opt = config.getoption
        self.config = config
        self.profile: str | None = opt("equiv_profile")
        self.modes = _split(opt("equiv_modes"), "--equiv-modes", "eager,compile[aot_eager]")
        self.devices = _split(opt("equiv_devices"), "--equiv-devices", "cpu,cuda")
        self.max_examples: int | None = opt("equiv_max_examples")
        if self.max_examples is not None and self.max_examples < 1:
            raise pytest.UsageError(
                f"--equiv-max-examples={self.max_examples}: give a positive integer.")
        self.timeout: float | None = opt("equiv_timeout")
        if self.timeout is not None and not 0 < self.timeout < float("inf"):
            raise pytest.UsageError(
                f"--equiv-timeout={self.timeout:g}: give a number of seconds > 0, e.g. 60.")
        self.seed_given: int | None = opt("equiv_seed")
        workerinput = getattr(config, "workerinput", None)
        if self.seed_given is not None:
            self.seed = self.seed_given
        elif workerinput is not None and "equiv_seed" in workerinput:
            self.seed = workerinput["equiv_seed"]  # the controller's, so workers agree
        else:
            self.seed = random.Random().getrandbits(32)
        self.modules: list[str] = list(opt("equiv_modules")) + list(config.getini("equiv_modules"))
        self.report_path: str | None = opt("equiv_report")
        self.html_path: str | None = opt("equiv_html")
        self.is_worker = workerinput is not None
        self.previous: Any = None  # settings state before this session applied its options
        self.pushed_directory = False  # the report's folder is where .pt examples go
        self.header_shown = False
        self.results: list[dict[str, Any]] = []

    @property
    def requested(self) -> bool:
        """An equiv option or ini setting was given: importing equiv is then expected."""
        return any(v not in (None, [], ()) for v in (
            self.profile, self.modes, self.devices, self.max_examples, self.seed_given,
            self.timeout,
            self.modules, self.report_path, self.html_path))

    def apply(self) -> None:
        """Load the profile and put the options over it (once; undone at unconfigure)."""
        if self.previous is not None:
            return
        from equiv import InvalidArgument, settings

        overrides: dict[str, Any] = {}
        if self.max_examples is not None:
            overrides["max_examples"] = self.max_examples
        if self.modes:
            overrides["modes"] = self.modes
        if self.devices:
            overrides["devices"] = self.devices
        if self.timeout is not None:
            overrides["timeout"] = self.timeout
        try:
            profile = settings.get_profile(self.profile) if self.profile else None
        except InvalidArgument as e:
            raise pytest.UsageError(
                f"--equiv-profile={self.profile}: {e} Register it with "
                "equiv.settings.register_profile(...) in conftest.py, or pick one of those."
            ) from None
        try:
            derandomized = (profile or settings.default()).derandomize
        except InvalidArgument as e:  # $EQUIV_PROFILE names no registered profile
            raise pytest.UsageError(str(e)) from None
        if self.seed_given is not None:
            overrides.update(seed=self.seed_given, derandomize=False)
        elif not derandomized:
            overrides["seed"] = self.seed
        self.previous = settings._push_session(self.profile, **overrides)
        report = self.report_path or self.html_path
        if report:  # the .pt files of printed reproductions go beside the report
            from equiv import _values

            _values.push_directory(os.path.dirname(os.path.abspath(report)))
            self.pushed_directory = True

    def effective(self) -> Any:
        self.apply()
        from equiv import settings

        return settings.default()

    def header(self) -> str:
        cfg = self.effective()
        seed = "derandomized" if cfg.derandomize else f"--equiv-seed={cfg.seed}"
        return (f"equiv: profile={cfg.profile} modes={','.join(map(str, cfg.modes))} "
                f"devices={','.join(cfg.devices)} max_examples={cfg.max_examples} {seed}")

    def reproduce_flags(self, mode: str, device: str) -> str:
        cfg = self.effective()
        flags = [f"--equiv-profile={cfg.profile}", f"--equiv-modes={mode}",
                 f"--equiv-devices={device}"]
        if self.max_examples is not None:
            flags.append(f"--equiv-max-examples={self.max_examples}")
        if self.timeout is not None:
            flags.append(f"--equiv-timeout={self.timeout:g}")
        if not cfg.derandomize:
            flags.append(f"--equiv-seed={cfg.seed}")
        return " ".join(_quote(f) for f in flags)


def _split(value: str | None, option: str, example: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    parts, depth, cur = [], 0, ""
    for ch in value:  # split on commas outside brackets: compile[a,b] stays one mode
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    parts.append(cur.strip())
    if not all(parts):
        raise pytest.UsageError(
            f"{option}={value!r}: give a comma-separated list with no empty entries, "
            f"e.g. {option}={example}")
    return tuple(parts)


def _quote(flag: str) -> str:
    return f"'{flag}'" if any(c in flag for c in "[]*? ") else flag


def _state(config: Any) -> _State:
    return config.stash[_STATE]


def pytest_configure(config: Any) -> None:
    config.addinivalue_line("markers", "equiv: a test item generated from an equiv spec")
    state = _State(config)
    config.stash[_STATE] = state
    if config.pluginmanager.hasplugin("xdist"):
        config.pluginmanager.register(_XdistHooks(state), "equiv-xdist")
    if state.report_path is not None or state.html_path is not None:
        if not state.is_worker:
            _prepare_reports(state)
        config.pluginmanager.register(_ReportHooks(state), "equiv-reports")
    if state.requested or os.environ.get("EQUIV_PROFILE"):
        try:
            state.apply()  # fail fast on a bad profile/modes, before collection
        except pytest.UsageError:
            # an --equiv-module may register the profile $EQUIV_PROFILE names: resolved when
            # the items are made, after that module is imported
            if not (state.modules and "EQUIV_PROFILE" in os.environ and not state.profile):
                raise


def _prepare_reports(state: _State) -> None:
    """Validate the report paths and make them absolute (a test's chdir cannot move them),
    and remove stale reports there, before any test runs."""
    from equiv._reports import ReportPathError, prepare

    try:
        paths = prepare([("--equiv-report", state.report_path),
                         ("--equiv-html", state.html_path)])
    except ReportPathError as e:
        raise pytest.UsageError(f"{e}.") from None
    state.report_path, state.html_path = paths.get("--equiv-report"), paths.get("--equiv-html")


def pytest_unconfigure(config: Any) -> None:
    state = config.stash.get(_STATE, None)
    if state is not None and state.previous is not None:
        from equiv import settings

        settings._pop_session(state.previous)
        state.previous = None
    if state is not None and state.pushed_directory:
        from equiv import _values

        _values.pop_directory()
        state.pushed_directory = False


class _XdistHooks:
    """Registered only when pytest-xdist is installed: workers get the controller's seed."""

    def __init__(self, state: _State) -> None:
        self.state = state

    def pytest_configure_node(self, node: Any) -> None:
        node.workerinput["equiv_seed"] = self.state.seed

    def pytest_runtest_logreport(self, report: Any) -> None:
        """The controller collects nothing, so its header may have been left out: note that a
        worker ran an equiv item (its setup report carries the item's property)."""
        if report.when == "setup" and any(name == _ITEM_PROPERTY for name, _ in
                                          getattr(report, "user_properties", ())):
            self.ran_equiv = True

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        """The seed line, under xdist, when workers ran equiv items and no header showed it."""
        state = self.state
        if getattr(self, "ran_equiv", False) and not state.is_worker and not state.header_shown:
            try:
                terminalreporter.write_line(state.header())
            except pytest.UsageError:
                return
            state.header_shown = True


def pytest_report_header(config: Any) -> str | None:
    state = _state(config)
    if state.requested or "equiv" in sys.modules:
        try:
            text = state.header()
        except pytest.UsageError:  # $EQUIV_PROFILE resolved after the --equiv-modules load
            return None
        state.header_shown = True
        return text
    return None


def pytest_report_collectionfinish(config: Any, items: Any) -> str | None:
    state = _state(config)
    if not state.header_shown and any(_is_equiv_item(i) for i in items):
        state.header_shown = True
        return state.header()
    return None


def _is_equiv_item(item: Any) -> bool:
    return getattr(item, "_equiv_item", False)


def _is_equiv_tests(obj: object) -> bool:
    """Whether ``obj`` is what ``tests_for`` returns, read without running user code: a
    module-level lazy proxy whose ``__getattr__`` raises must not break collection."""
    try:
        return inspect.getattr_static(obj, "__equiv_tests__", False) is True
    except Exception:
        return False


@pytest.hookimpl(tryfirst=True)
def pytest_pycollect_makeitem(collector: Any, name: str, obj: object) -> Any:
    if _is_equiv_tests(obj):
        from equiv.pytest import _items_for

        return _items_for(collector, name, obj, _state(collector.config))
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session: Any, config: Any, items: list) -> None:
    state = _state(config)
    if state.modules:
        from equiv.pytest import _collect_modules

        items.extend(_collect_modules(session, state))
    _place_references(config, items)


def _place_references(config: Any, items: list) -> None:
    """--equiv-reference-dtype/--equiv-reference-device: the reference placement of every equiv
    item whose spec does not set its own."""
    dtype, device = (config.getoption("equiv_reference_dtype"),
                     config.getoption("equiv_reference_device"))
    if dtype is None and device is None:
        return
    import dataclasses

    from equiv import InvalidArgument
    from equiv.spec import validate_reference

    try:
        dtype, device = validate_reference(dtype, device, "--equiv")
    except InvalidArgument as e:
        raise pytest.UsageError(str(e)) from None
    for item in items:
        spec = getattr(item, "spec", None) if _is_equiv_item(item) else None
        if spec is not None:
            item.spec = dataclasses.replace(spec, reference_dtype=spec.reference_dtype or dtype,
                                            reference_device=spec.reference_device or device)


class _ReportHooks:
    """Registered per session (a plain object, not module state): gathers the results of equiv
    items, including those that xdist workers send back, and writes the report files."""

    def __init__(self, state: _State) -> None:
        self.state = state
        self.started: dict[str, dict[str, Any]] = {}  # equiv items set up, not yet reported

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.when == "setup":  # what a crash row names, should the item's worker die
            for name, value in getattr(report, "user_properties", ()):
                if name == _ITEM_PROPERTY and isinstance(value, dict):
                    self.started[report.nodeid] = value
            return
        if report.when == "???":  # xdist: the worker running this item crashed
            item = self.started.pop(report.nodeid, None)
            if item is not None:
                from equiv.pytest import crash_row

                message = str(getattr(report, "longrepr", "") or "the worker crashed")
                self.state.results.append(dict(crash_row(item, message), nodeid=report.nodeid))
            return
        if report.when != "call":  # every phase's report carries the item's user_properties
            return
        self.started.pop(report.nodeid, None)
        for name, value in getattr(report, "user_properties", ()):
            if name == _RESULT_PROPERTY and isinstance(value, dict):
                self.state.results.append(dict(value, nodeid=report.nodeid))

    def pytest_sessionfinish(self, session: Any, exitstatus: Any) -> None:
        state = self.state
        if state.is_worker or not (state.report_path or state.html_path):
            return
        from equiv.pytest import _write_reports

        ended_early = (int(exitstatus) == int(pytest.ExitCode.INTERRUPTED)
                       or bool(session.shouldstop) or bool(session.shouldfail))
        _write_reports(state, complete=not ended_early)
