"""Each side's result split and paired: the reference's result split into returned outputs and
final values of mutated arguments (:func:`split`), the differentiated values of both sides paired
by name (:func:`pair`, :class:`Pairing`), and the reference run once more on other values, split
(:func:`reference_run`, :class:`RefRun`: the float64 oracle, the baseline, a probe)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from equiv._compat import tree_flatten
from equiv.errors import InvalidArgument, error_text
from equiv.examples import Args, Side, Template
from equiv.execution.calls import brief, call, is_diff
from equiv.execution.calls import leaves as leaves_of
from equiv.execution.verdict import named_values
from equiv.spec import Spec


class ReferenceError_(InvalidArgument):
    """The reference broke its contract (it mutated its input, or its result does not fit)."""


@dataclasses.dataclass
class Pairing:
    """The differentiated function's values on both sides: (name, impl tensor, ref tensor) for
    each returned output and final value of a mutated argument that the reference
    differentiates, the names whose gradient flow the implementation cut, and the storage groups
    whose gradient leaves exist on both sides; ``undifferentiated``: the names the reference
    returns without gradient (detached) where the implementation's requires grad."""

    pairs: list[tuple[str, torch.Tensor, torch.Tensor]]
    cut: list[str]
    groups: list[Any]
    undifferentiated: list[str] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.pairs and self.groups)


def split(spec: Spec, ref_result: Any) -> tuple[Any, dict[str, Any], bool]:
    """(expected return value, {mutated arg: final value}, whole result consumed?)."""
    finals: dict[str, Any] = {}
    locs = spec.mutates
    if not locs:
        return ref_result, finals, False
    if "out" in locs.values():
        (arg,) = locs
        return ref_result, {arg: ref_result}, True
    if isinstance(ref_result, (tuple, list)):  # -1 is the last element, as in Python
        n = len(ref_result)
        locs = {a: l % n if isinstance(l, int) and not isinstance(l, bool) and -n <= l < 0
                else l for a, l in locs.items()}
    for arg, loc in locs.items():
        try:
            finals[arg] = ref_result[loc]
        except (TypeError, IndexError, KeyError):
            raise ReferenceError_(_misplaced(spec, dict(locs), arg, ref_result)) from None
    if isinstance(ref_result, (tuple, list)):
        consumed = set(locs.values()) == set(range(len(ref_result)))
    elif isinstance(ref_result, dict):
        consumed = set(locs.values()) == set(ref_result)
    else:
        consumed = False
    return ref_result, finals, consumed


def _misplaced(spec: Spec, locs: dict[str, Any], arg: str, result: Any) -> str:
    """Why ``mutates=``'s place for ``arg`` is not in the reference's ``result``, and the fix."""
    head = (f"equivalent_to(mutates={locs!r}) says the final value of {arg!r} is at "
            f"[{locs[arg]!r}] of the reference's result, but {spec.reference} returned ")
    if isinstance(result, (tuple, list)):
        what = f"a {type(result).__name__} of {len(result)}"
        if not isinstance(locs[arg], int) or isinstance(locs[arg], bool):
            fix = {a: i for i, a in enumerate(locs)}
            return (f"{head}{what}, whose elements are found by int index: mutates={fix!r} "
                    "if they are in that order.")
        return f"{head}{what}: index {locs[arg]} is out of range."
    if isinstance(result, dict):
        return f"{head}a dict with keys {sorted(map(repr, result))}."
    return (f"{head}{type(result).__name__} {brief(result)}. Return a tuple (or dict) holding "
            "each mutated argument's final value.")


def check_mutated(spec: Spec, example: Args) -> None:
    """Raise :class:`InvalidArgument` when an argument named in ``mutates=`` was drawn as a
    value holding no tensor (nothing could be written in place, so nothing would be compared)."""
    if not spec.mutates:
        return
    try:
        bound = spec.signature.bind(*example.args, **example.kwargs)
    except TypeError:
        return  # the example does not fit: the core reports that
    for arg in spec.mutates:
        if arg not in bound.arguments:
            continue
        value = bound.arguments[arg]
        if not any(isinstance(v, torch.Tensor) for v in tree_flatten(value)[0]):
            raise InvalidArgument(
                f"equivalent_to(mutates={dict(spec.mutates)!r}) names {arg!r}, but its drawn "
                f"value is not a tensor ({type(value).__name__} {brief(value)}): only tensors "
                f"are written in place, so nothing about {arg!r} would be compared. Remove "
                f"{arg!r} from mutates=, or make inputs= draw a tensor for it.")


def pair(template: Template, impl_side: Side, impl_out: Any, ref_side: Side, ref_out: Any,
         finals: dict[str, Any], consumed: bool) -> Pairing:
    """Pair the differentiated values of both sides (see :class:`Pairing`)."""
    named: list[tuple[str, Any, Any]] = []
    if not (impl_out is None and consumed):
        i_leaves, r_leaves = leaves_of(impl_out), leaves_of(ref_out)
        if [p for p, _ in i_leaves] == [p for p, _ in r_leaves]:
            named += [(f"output{p}", i, r) for (p, i), (_, r) in zip(i_leaves, r_leaves)]
    for arg, final in finals.items():
        i_leaves, r_leaves = leaves_of(impl_side.argument(arg)), leaves_of(final)
        if len(i_leaves) == len(r_leaves):
            named += [(f"final value of {arg}{p}", i, r)
                      for (p, i), (_, r) in zip(i_leaves, r_leaves)]
    kept, cut, extra = [], [], []
    for name, i, r in named:
        if is_diff(r) and not r.requires_grad and isinstance(i, torch.Tensor) and \
                i.requires_grad:
            extra.append(name)
        if not (is_diff(r) and r.requires_grad and isinstance(i, torch.Tensor)):
            continue
        (kept if i.requires_grad else cut).append((name, i, r))
    groups = [g for g in template.groups
              if impl_side.leaves[g.index] is not None and ref_side.leaves[g.index] is not None]
    return Pairing(kept, [n for n, _, _ in cut], groups, extra)


@dataclasses.dataclass
class RefRun:
    """The reference run once more on the example's values at another dtype or device: the
    oracle (float64) or, for a reference placed elsewhere, the baseline (the implementation's
    dtype and device). ``values``: its differentiated values by pairing name."""

    side: Side | None
    result: Any = None
    exc: BaseException | None = None
    finals: dict[str, Any] = dataclasses.field(default_factory=dict)
    values: dict[str, Any] = dataclasses.field(default_factory=dict)
    why: str | None = None  # why it cannot serve (the reference raised)


def reference_run(spec: Spec, fn: Callable[..., Any], side: Side,
                  result: Any = None, exc: BaseException | None = None,
                  called: bool = False) -> RefRun:
    """``fn`` (the reference) on ``side`` (unless ``called``: its ``result``/``exc``), split."""
    if not called:
        result, exc = call(fn, side)
    run = RefRun(side, result, exc)
    if exc is not None:
        dtype = next((t.dtype for t in side.tensors if t.dtype.is_floating_point), None)
        run.why = (f"the reference raised {type(exc).__name__} in "
                   f"{str(dtype).replace('torch.', '')}: {error_text(exc)[:120]}")
        return run
    try:
        expected, run.finals, consumed = split(spec, result)
    except ReferenceError_ as e:
        run.why = error_text(e)[:160]
        return run
    run.values = named_values(expected, run.finals, consumed)
    return run

