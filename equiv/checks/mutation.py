"""``mutation``: mutated arguments end with the reference's final values; no undeclared write
(by value, or by a moved version counter); no write outside the arguments' views; undeclared
arguments keep their structure and non-tensor values (lists, dicts, numbers in them)."""

from __future__ import annotations

from typing import Any

from equiv.compare import compare_leaf, compare_trees
from equiv.examples import Template
from equiv.execution.record import Sink
from equiv.execution.state import OutsideWrite, expected_state, outside_writes

NAME = "mutation"


def run(ex: Any, sink: Sink) -> None:
    if ex.kind == "vmap":
        _vmap(ex, sink)
    elif ex.kind == "recorded":
        _recorded(ex, sink)


def _recorded(ex: Any, sink: Sink) -> None:
    spec, template, side = ex.spec, ex.template, ex.impl_side
    expected, unrepresentable = expected_state(ex)
    after = side.versions()
    for j, slot in enumerate(template.slots):
        group = template.groups[slot.group]
        actual = side.tensors[j].detach()
        exp = unrepresentable.get(j, expected.tensors[j])
        arg = slot.path.split("[")[0]
        if group.mutated:
            m = ex.oracle.judge(slot.path, actual, exp, oracle=lambda j=j: ex.oracle.state(j),
                                baseline=lambda j=j: ex.oracle.baseline_state(j))
            if m is not None:
                what = ("the final value of mutated argument" if arg in spec.mutates else
                        "argument (sharing storage with a mutated argument)")
                sink.finding(NAME, f"{what} {slot.path!r} differs from the reference.",
                             argument=slot.path, mismatch=m)
            continue
        m = compare_leaf(actual, exp, rtol=0, atol=0, path=slot.path, exact=True)
        before = ex.impl_versions[j]
        if m is not None:
            sink.finding(
                NAME, f"argument {slot.path!r} was modified, but the contract does not declare "
                "it as mutated.", argument=slot.path, mismatch=m, exact=True,
                fix=f"declare the write with mutates={{{arg!r}: ...}}, or write into a copy.")
        elif after[j] != before:
            sink.finding(
                NAME, f"argument {slot.path!r} was written in place (version counter "
                f"{before} -> {after[j]}) though its values are unchanged and the contract does "
                "not declare it as mutated.", argument=slot.path,
                details="a write that leaves values equal (e.g. relu_ on positive inputs) "
                        "still invalidates tensors saved for backward and races with readers.",
                fix=f"declare it with mutates={{{arg!r}: ...}} or avoid the in-place op.")
    for w in outside_writes(template, side):
        _outside(template, w, sink)
    for name, before, now in template.changed_arguments(side, exempt=spec.mutates):
        _changed(template, name, before, now, sink)


def _outside(template: Template, w: OutsideWrite, sink: Sink) -> None:
    """A finding for a write into storage elements that belong to no argument."""
    names = list(dict.fromkeys(template.slots[j].path for j in w.group.slots))
    where = (f"{names[0]}'s storage (not part of {names[0]})" if len(names) == 1 else
             f"the storage shared by {', '.join(names)} (not part of any of them)")
    more = f" (and {w.count - 1} more such elements)" if w.count > 1 else ""
    sink.finding(
        NAME, f"the implementation wrote outside its arguments: storage element {w.index} of "
        f"{where} changed from {w.before!r} to {w.after!r}{more}.", argument=names[0],
        exact=True,
        details="an argument may be a view into a larger storage (a slice, an as_strided "
                "window); the elements around it belong to the caller and must keep their "
                "values whatever the contract declares.",
        fix="write through the argument tensors themselves, never through their "
            "untyped_storage(), data_ptr() or as_strided with an explicit storage offset.")


def _changed(template: Template, name: str, before: str, now: str, sink: Sink) -> None:
    """A finding for an argument whose containers or non-tensor values the call changed."""
    holds_tensors = any(s.path.split("[")[0] == name for s in template.slots)
    what = ("the containers or non-tensor values of argument" if holds_tensors else
            "the non-tensor argument")
    sink.finding(
        NAME, f"the implementation changed {what} {name!r}: {before} -> {now}.",
        argument=name, exact=True,
        details="the caller's list, dict or other value is changed in place (appended, a key "
                "set, an element replaced); the reference leaves it as it was.",
        fix=f"work on a copy ({name} = copy.deepcopy({name})), "
            + (f"or declare the write with mutates={{{name!r}: ...}}." if holds_tensors
               else "or return the new value."))


def _vmap(ex: Any, sink: Sink) -> None:
    spec = ex.spec
    names = list(spec.signature.parameters)
    for i, name in enumerate(names[:len(ex.impl_args)]):
        if name in ex.finals:
            ms = compare_trees(ex.impl_args[i], ex.finals[name], rtol=spec.rtol,
                               atol=spec.atol, root=name)
            what = "the final value of mutated argument"
        else:
            ms = compare_trees(ex.impl_args[i], ex.before[i], rtol=0, atol=0, root=name,
                               exact=True)
            what = "undeclared argument changed:"
        for m in ms:
            sink.finding(NAME, f"{what} {m.path!r} under vmap (batch dimension {ex.where}) "
                         "differs from the reference.", argument=m.path, mismatch=m,
                         details=f"{ex.detail}\n{m.message}")
