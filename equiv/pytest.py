"""pytest integration: ``tests_for`` turns registered specs into test items.

In a test module::

    from equiv.pytest import tests_for
    from mypkg.kernels import relu_

    test_relu = tests_for(relu_)      # items test_kernels.py::relu_[eager-cpu], ...

or, without a test module, ``pytest --equiv-module mypkg.kernels`` (ini: ``equiv_modules``).
One item per (spec, mode, device); modes and devices come from the spec's decorator, else from
``--equiv-modes``/``--equiv-devices``, else from the settings profile. The hooks live in the
top-level ``_equiv_pytestplugin`` module, which imports nothing heavy.
"""

from __future__ import annotations

import re
import traceback
from types import ModuleType
from typing import Any, Iterator

import pytest

from equiv.errors import EquivalenceFailure, InvalidArgument
from equiv.spec import Spec, get_spec

__all__ = ["tests_for"]


class EquivTests:
    """What :func:`tests_for` returns: a marker object the plugin expands into items."""

    __equiv_tests__ = True

    def __init__(self, specs: tuple[Spec, ...]) -> None:
        self.specs = specs

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        # Callable so that, with the plugin disabled (-p no:equiv), pytest warns "cannot collect
        # 'test_x' because it is not a function" instead of silently running nothing.
        raise InvalidArgument(
            "tests_for(...) makes test items through equiv's pytest plugin, which is not "
            "active in this run (was it disabled with -p no:equiv?); call equiv.check(impl) "
            "in a test function instead.")

    def __repr__(self) -> str:
        return f"tests_for({', '.join(s.name for s in self.specs)})"


def tests_for(*targets: Any) -> EquivTests:
    """Test items for the specs of ``targets``: implementations decorated with
    ``@equivalent_to``, ``Spec`` objects, or modules (all specs defined there).

    Assign the result to a module-level name in a test module (``test_relu = tests_for(relu_)``);
    the equiv plugin collects one item per (spec, mode, device), named ``relu_[eager-cpu]``.
    """
    if not targets:
        raise InvalidArgument(
            "tests_for() needs at least one implementation decorated with @equivalent_to, "
            "or a module defining some: tests_for(relu_) or tests_for(mypkg.kernels).")
    specs: list[Spec] = []
    for t in targets:
        if isinstance(t, ModuleType):
            from equiv._loader import specs_in_module

            found = specs_in_module(t)
            if not found:
                raise InvalidArgument(
                    f"tests_for({t.__name__}): the module defines no @equivalent_to spec and "
                    "its import registered none (equivalent_to(ref, ...)(impl) counts).")
            specs.extend(found)
        else:
            specs.append(get_spec(t))
    return EquivTests(tuple(specs))


tests_for.__test__ = False  # type: ignore[attr-defined]  # its name starts with "test"


class EquivItem(pytest.Item):
    """One spec under one mode on one device."""

    _equiv_item = True

    def __init__(self, *, spec: Spec, mode: str, device: str, state: Any, **kw: Any) -> None:
        super().__init__(**kw)
        self.spec, self.mode, self.device, self._state = spec, mode, device, state
        self.add_marker(pytest.mark.equiv)
        # in every phase's report: the controller of xdist workers names a crashed item by it
        self.user_properties.append(("equiv_item", {
            "spec": spec.name, "implementation": spec.implementation,
            "reference": spec.reference, "mode": str(mode), "device": device}))

    def runtest(self) -> None:
        __tracebackhide__ = True
        from equiv._results import run_one

        result = run_one(self.spec, self.mode, self.device)
        self.user_properties.append(("equiv_result", result.to_dict()))
        if result.verdict == "skipped" and self._nowhere() is not None:
            raise _EquivUsageError(f"{self._nowhere()} (--equiv-devices, the spec's settings "
                                   "or the profile).")
        if result.verdict == "skipped":  # reported at the item, not inside pytest
            raise pytest.skip.Exception(result.reason, _use_item_location=True)
        if result.verdict == "error":
            raise _EquivUsageError(
                f"{result.reason}\nThis item's mode and device come from --equiv-modes/"
                "--equiv-devices, else from the spec's settings, else from the settings profile "
                f"({self._state.effective().profile!r}): fix the one that names "
                f"'{self.mode}'/'{self.device}'.")
        if result.verdict == "not-compiled":
            raise _NotCompiled(result.reason)
        if result.kind == "timeout":
            raise _NotCompiled(result.reason)
        if result.report is not None:
            result.report.raise_if_failed()

    def _nowhere(self) -> str | None:
        """Why none of this spec's devices can run here, or None (a mere skip)."""
        from equiv._results import combinations, nowhere_to_run

        return nowhere_to_run(d for _, d in combinations(self.spec, self._state.effective()))

    def repr_failure(self, excinfo: Any, style: Any = None) -> Any:
        from equiv._reports import visible

        exc = excinfo.value
        if isinstance(exc, EquivalenceFailure):
            return visible(f"{exc.report.render()}\n{self.reproduce_line()}")
        if isinstance(exc, (_EquivUsageError, _NotCompiled)):
            return visible(f"{exc}\n{self.reproduce_line()}")
        return super().repr_failure(excinfo, style=style)

    def reproduce_line(self) -> str:
        flags = self._state.reproduce_flags(self.mode, self.device)
        if isinstance(self.parent, EquivModule):
            return (f"Reproduce in pytest: pytest --equiv-module={self.parent.name} "
                    f"-k '{self.name}' {flags}")
        return f"Reproduce in pytest: pytest '{self.nodeid}' {flags}"

    def add_report_section(self, when: str, key: str, content: str) -> None:
        # torch.compile logs its structured trace (logger "torch.__trace") at DEBUG; pytest's
        # log capture would print hundreds of those lines under every failing compile item.
        if key == "log":
            content = _without_torch_trace(content)
        if content:
            super().add_report_section(when, key, content)

    def reportinfo(self) -> tuple[Any, int, str]:
        return self.path, 0, self.name


_RECORD = re.compile(r"^(CRITICAL|ERROR|WARNING|INFO|DEBUG|NOTSET|Level \d+)\s+(\S+?):")


def _without_torch_trace(text: str) -> str:
    """Captured log text minus the records of torch's structured-trace logger."""
    kept, keep = [], True
    for line in text.splitlines(keepends=True):
        m = _RECORD.match(line)
        if m:  # a record starts; continuation lines follow their record's fate
            keep = not m.group(2).startswith("torch.__trace")
        if keep:
            kept.append(line)
    return "".join(kept)


class _EquivUsageError(Exception):
    """A spec or option mistake found while running an item (shown without a traceback)."""


class _NotCompiled(Exception):
    """A compile mode compiled nothing, or an example ran past the timeout: no traceback,
    never a pass."""


class EquivModule(pytest.Collector):
    """The specs of one ``--equiv-module``; node id: the module name."""

    def __init__(self, *, specs: list[Spec], state: Any, **kw: Any) -> None:
        super().__init__(**kw)
        self._specs, self._state = specs, state

    def collect(self) -> list[Any]:
        return _make_items(self, self._specs, self._state)


def _items_for(collector: Any, name: str, obj: EquivTests, state: Any) -> list[Any]:
    items = _make_items(collector, list(obj.specs), state)
    for item in items:
        item.extra_keyword_matches.add(name)  # -k test_relu selects what test_relu made
    return items


def _make_items(parent: Any, specs: list[Spec], state: Any) -> list[Any]:
    from equiv._results import combinations

    cfg = state.effective()
    items, used = [], set()
    for spec in specs:
        base = _short(spec.name)
        if base in used:
            base = spec.name
        used.add(base)
        for mode, device in combinations(spec, cfg):
            params = f"{mode}-{device}"  # str(mode): mode objects print as their name
            items.append(EquivItem.from_parent(
                parent, name=f"{base}[{params}]", nodeid=parent.id.child(base).with_params(params),
                spec=spec, mode=mode, device=device, state=state))
    return items


def _short(name: str) -> str:
    """The last dotted part of a spec name, dots inside parentheses kept
    (``mod.partial(scale.inner)`` -> ``partial(scale.inner)``)."""
    depth = 0
    for i in range(len(name) - 1, -1, -1):
        depth += name[i] == ")"
        depth -= name[i] == "("
        if name[i] == "." and depth == 0:
            return name[i + 1:]
    return name


def _collect_modules(session: Any, state: Any) -> Iterator[Any]:
    """Items of every ``--equiv-module``; an import error is a collection error with the
    module's traceback, like a test file that fails to import."""
    from equiv._loader import load_target

    for target in state.modules:
        try:
            specs = load_target(target)
        except Exception:  # the user's module failed to import: show its traceback
            text = traceback.format_exc()
            raise pytest.UsageError(
                f"--equiv-module={target}: importing it failed:\n{text}"
                "Fix the module, or check the name (a dotted module importable from the "
                "rootdir, or a .py file path).") from None
        if not specs:
            raise pytest.UsageError(
                f"--equiv-module={target}: it defines no @equivalent_to spec; name the module "
                "that decorates the implementations.")
        node = EquivModule.from_parent(session, name=target, nodeid=target, specs=specs,
                                       state=state)
        yield from node.collect()


def crash_row(item: dict[str, Any], message: str) -> dict[str, Any]:
    """The report row of an item whose process died while running it (a crashed xdist
    worker: ``os._exit``, a segfault, a kill)."""
    from equiv._results import Result

    return Result(**item, verdict="error", reason=(
        f"{message}: the process running this item died (os._exit, a segmentation fault, a "
        "signal or the out-of-memory killer) before it finished, so nothing about it is "
        "known; run it alone (pytest -p no:xdist) to see how it ends.")).to_dict()


def _write_reports(state: Any, complete: bool = True) -> None:
    """The JSON and HTML reports of the session, each written atomically; ``complete=False``
    when the session ended early."""
    from equiv._html import render_html
    from equiv._reports import write_atomic
    from equiv._results import document, write_json

    cfg = state.effective()
    rows = sorted(state.results, key=lambda r: r["nodeid"])
    doc = document(rows, tool="pytest", profile=cfg.profile,
                   seed=None if cfg.derandomize else cfg.seed, modes=cfg.modes,
                   devices=cfg.devices, max_examples=cfg.max_examples,
                   reproduce=("pytest " + state.reproduce_flags(",".join(map(str, cfg.modes)),
                                                                ",".join(cfg.devices))),
                   complete=complete)
    if state.report_path:
        write_json(doc, state.report_path)
    if state.html_path:
        write_atomic(state.html_path, render_html(doc))
