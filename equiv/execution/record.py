"""The record of one example in one mode and device (:class:`Execution`), built by
:func:`execute`, and :class:`Sink`, where checks put their findings and notes as data."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import torch

from equiv._compat import tree_flatten
from equiv._explain import explaining
from equiv._settings import settings as Settings
from equiv.compare import Mismatch, align, compare_leaf, compare_trees
from equiv.errors import InvalidArgument, error_text
from equiv.examples import Args, Group, Side, Template
from equiv.execution.calls import brief, call, cast_like, cotangent, detached_clone, is_diff
from equiv.execution.calls import isolated, user_error
from equiv.execution.calls import leaves as leaves_of
from equiv.execution.calls import vjp
from equiv.execution.graph import builtin_only, function_nodes
from equiv.execution.runs import ImplRun, impl_run
from equiv.execution.rounding import rounding_spread
from equiv.execution.verdict import (
    FD_MAX_ELEMENTS,
    OracleVJP,
    fd_check,
    fd_plan,
    fd_reference,
    fd_impl_terms,
    fd_terms,
    judge_leaf,
    named_values,
    summed_terms,
)
from equiv.memory import measure, retained
from equiv.modes import normalise_error
from equiv.numerics import NumericMismatch, oracle_disagreement, oracle_dtype
from equiv.report import Finding
from equiv.spec import Spec
from equiv.strategies._derived import jumps_at, smooth_at
from equiv.variants import CONTIGUOUS, CotangentVariant


class ReferenceError_(InvalidArgument):
    """The reference broke its contract (it mutated its input, or its result does not fit)."""


@dataclasses.dataclass(frozen=True)
class Placement:
    """How one (mode, device) executes the sides: the callables and where the reference runs."""

    mode: str = "eager"
    kind: str = "eager"
    device: str = "cpu"
    impl_fn: Callable[..., Any] | None = None
    ref_fn: Callable[..., Any] | None = None
    ref_device: str | None = None
    ref_dtype: torch.dtype | None = None

    @property
    def cross(self) -> bool:
        return self.ref_device is not None or self.ref_dtype is not None


class Sink:
    """Findings and notes of one example: plain data, filtered by the selected checks."""

    def __init__(self, spec: Spec, cfg: Settings, mode: str, device: str) -> None:
        self.spec, self.cfg, self.mode, self.device = spec, cfg, mode, device
        self.findings: list[Finding] = []
        self.notes: list[str] = []
        self.dtype = "-"
        self.template: Template | None = None  # the example, once the core has built it
        #: the checks that ran on this example, those that compared something, and why the
        #: others could not compare (the runner's account of what was checked)
        self.ran: set[str] = set()
        self.compared: set[str] = set()
        self.uncompared: dict[str, str] = {}

    def finding(self, check: str, headline: str, *, argument: str | None = None,
                mismatch: Mismatch | None = None, details: str = "", tb: str | None = None,
                fix: str | None = None, likely_cause: str | None = None,
                exact: bool = False, timeline: tuple[dict[str, Any], ...] = ()) -> None:
        if check not in self.cfg.checks:
            return
        numbers = self._numbers(check, mismatch)
        self.findings.append(Finding(
            check=check, headline=headline, spec=self.spec.name,
            implementation=self.spec.implementation, reference=self.spec.reference,
            mode=self.mode, device=self.device, dtype=self.dtype, argument=argument,
            details=details or (mismatch.message if mismatch else ""),
            max_abs=mismatch.max_abs if mismatch else None,
            max_rel=mismatch.max_rel if mismatch else None,
            index=mismatch.index if mismatch else None,
            rtol=0.0 if exact else self.spec.rtol, atol=0.0 if exact else self.spec.atol,
            traceback=tb, fix=fix, likely_cause=likely_cause, timeline=timeline, **numbers,
        ))

    def _numbers(self, check: str, m: Mismatch | None) -> dict[str, Any]:
        """The numeric verdict's fields of a finding (and a note when it fell back)."""
        if not isinstance(m, NumericMismatch):
            return {}
        if m.rule == "dtype-default":
            self.note(f"{check}: no float64 oracle ({m.why}); compared with the per-dtype "
                      "default tolerance")
        return dict(rule=m.rule, impl_error=m.impl_error, baseline_error=m.baseline_error,
                    allowed=None if m.rule != "baseline" else m.allowed, k=m.k,
                    rounding_level=m.rounding_level)

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def mark_compared(self, check: str) -> None:
        """``check`` compared something on this example."""
        self.compared.add(check)

    def not_compared(self, check: str, why: str) -> None:
        """``check`` applied but could not compare on this example (a note too): when it
        compares on no example of a mode, the run is not a pass (:mod:`equiv.run`)."""
        self.uncompared.setdefault(check, why)
        self.note(why)


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
            raise ReferenceError_(
                f"equivalent_to(mutates={dict(locs)!r}) says the final value of {arg!r} is "
                f"at [{loc!r}] of the reference's result, but {spec.reference} returned "
                f"{type(ref_result).__name__} {brief(ref_result)}. Return a tuple (or dict) "
                "holding each mutated argument's final value."
            ) from None
    if isinstance(ref_result, (tuple, list)):
        consumed = set(locs.values()) == set(range(len(ref_result)))
    elif isinstance(ref_result, dict):
        consumed = set(locs.values()) == set(ref_result)
    else:
        consumed = False
    return ref_result, finals, consumed


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


@dataclasses.dataclass
class Rerun:
    """Both sides run once more on a fresh copy (another template, e.g. requires_grad pattern)."""

    impl_side: Side
    ref_side: Side
    impl_result: Any
    pairing: Pairing
    impl_exc: BaseException | None = None


@dataclasses.dataclass
class Backward:
    """One backward of the implementation through its retained graph."""

    grads: list[torch.Tensor]
    error: BaseException | None
    given: list[torch.Tensor | None]  # the cotangents handed to backward (checked untouched
    # after; None: undefined, that value not differentiated)
    cotangent: list[torch.Tensor | None]  # what they were before backward


class Execution:
    """One example executed on both sides in one mode and device: what every check reads.

    Built by :func:`execute`. Gradients are taken lazily and cached, always in the same order:
    the reference's VJP for the first cotangent, the implementation's backward #1 (first
    cotangent), the reference's VJP for a second cotangent, the implementation's backward #2
    (second cotangent, retained graph) and, only to explain a backward #2 that differs, #3
    (the first cotangent again).
    """

    kind = "recorded"

    def __init__(self, spec: Spec, cfg: Settings, cot_seed: int, place: Placement,
                 template: Template) -> None:
        self.spec, self.cfg, self.cot_seed, self.place = spec, cfg, cot_seed, place
        self.template = template
        self.impl_fn = place.impl_fn if place.impl_fn is not None else spec.impl
        self.ref_fn = place.ref_fn if place.ref_fn is not None else spec.ref
        self.ref_side: Side | None = None
        self.impl_side: Side | None = None
        self.ref_result: Any = None  # as the reference returned it (its own dtype/device)
        self.impl_result: Any = None
        self.ref_exc: BaseException | None = None
        self.impl_exc: BaseException | None = None
        self.expected: Any = None  # the reference's result at the implementation's dtype/device
        self.finals: dict[str, Any] = {}
        self.consumed = False
        self.impl_versions: list[int] = []
        #: each argument tensor's (grad_fn, version, requires_grad) just before and just after
        #: the implementation's call
        self.impl_history: tuple[list[tuple[Any, int, bool]], list[tuple[Any, int, bool]]] = (
            [], [])
        self.out_snapshot: Any = None
        self.snapshotted = False  # out_snapshot taken (on the examples the costly checks run)
        self.costly = True  # the costly checks run on this example
        self._pairing: Pairing | None = None
        self._cots: list[list[torch.Tensor]] | None = None
        self._laid: dict[int, list[torch.Tensor | None]] = {}
        self._ref_grads: dict[int, tuple[list[torch.Tensor], BaseException | None]] = {}
        self._ref_builtin: bool | None = None  # the reference's graph is torch's formulas only
        self._backwards: list[Backward] = []
        self._nodes: list[Any] | None = None
        self.cache: dict[str, Any] = {}  # derived evidence shared by checks (e.g. a replay)

    # -- identity ---------------------------------------------------------------------------
    @property
    def mode(self) -> str:
        return self.place.mode

    @property
    def mode_kind(self) -> str:
        return self.place.kind

    @property
    def device(self) -> str:
        return self.place.device

    @property
    def valid(self) -> bool:
        """Both sides returned normally."""
        return self.ref_exc is None and self.impl_exc is None and self.ref_side is not None

    def rejection(self) -> str | None:
        """Why the example is invalid input (both raised the same type of error), else None."""
        r, i = self.ref_exc, self.impl_exc
        if r is not None and i is not None and isinstance(i, type(r)):
            return f"the reference raised {type(r).__name__}: {error_text(r)[:200]}"
        return None

    # -- more runs, through the core ----------------------------------------------------------
    def side(self, template: Template | None = None, **options: Any) -> Side:
        """A fresh copy of the example (``template``'s, default this one's) on this device."""
        return (template or self.template).instantiate(device=self.device, **options)

    def call(self, which: str, side: Side) -> tuple[Any, BaseException | None]:
        """The implementation (``"impl"``) or reference (``"ref"``) in this mode, on ``side``."""
        return call(self.impl_fn if which == "impl" else self.ref_fn, side)

    def impl_run(self, template: Template | None = None,
                 cotangents: dict[str, torch.Tensor] | None = None) -> ImplRun:
        """The implementation alone once more, in this mode, on a fresh copy of ``template``
        (default this example's): its values and gradients for ``cotangents`` (default drawn
        from the example's seed, the same on every run), see :func:`~equiv.execution.runs.impl_run`."""
        return impl_run(self.impl_fn, list(self.spec.mutates), template or self.template,
                        self.device, self.cot_seed, cotangents)

    def rerun(self, template: Template) -> tuple[Rerun | None, BaseException | None]:
        """Both sides again on fresh copies of ``template``: (run, None); (None, None) when the
        reference raised; (None, error) when only the implementation raised."""
        ref_side = self.side(template)
        ref_result, ref_exc = self.call("ref", ref_side)
        if ref_exc is not None:
            return None, None
        impl_side = self.side(template)
        impl_result, impl_exc = self.call("impl", impl_side)
        if impl_exc is not None:
            return None, impl_exc
        _, finals, consumed = split(self.spec, ref_result)
        pairing = pair(template, impl_side, impl_result, ref_side, ref_result, finals, consumed)
        return Rerun(impl_side, ref_side, impl_result, pairing), None

    # -- the differentiated function ----------------------------------------------------------
    def pairing(self) -> Pairing:
        if self._pairing is None:
            assert self.impl_side is not None and self.ref_side is not None
            self._pairing = pair(self.template, self.impl_side, self.impl_result, self.ref_side,
                                 self.expected, self.finals, self.consumed)
        return self._pairing

    def function_nodes(self) -> list[Any]:
        """Custom Function nodes reachable from the implementation's differentiated values."""
        if self._nodes is None:
            assert self.impl_side is not None
            finals = [self.impl_side.argument(a) for a in self.finals]
            self._nodes = function_nodes(self.impl_result, finals)
        return self._nodes

    #: set by the runner's pipeline: the layout of the cotangents handed to every backward
    cot_variant: CotangentVariant = CONTIGUOUS

    def cotangents(self) -> list[list[torch.Tensor | None]]:
        """The first and second cotangent, one value per pair (``None``: undefined for that
        pair), from the example's seed and cotangent variant (its values; each backward gets
        fresh tensors in its layout, :meth:`laid_out`)."""
        if self._cots is None:
            gen = torch.Generator().manual_seed(self.cot_seed)
            pairs = self.pairing().pairs
            self._cots = [self.cot_variant.values([cotangent(r, gen) for _, _, r in pairs])
                          for _ in range(2)]
        return self._cots

    def laid_out(self, n: int) -> list[torch.Tensor | None]:
        """Fresh tensors holding cotangent ``n``'s (1 or 2) values in the variant's layout."""
        pristine = self._pristine(n) if self.cot_variant.copies_laid else None
        if pristine is not None:
            return [None if c is None else c.clone() for c in pristine]
        return self.cot_variant.lay_out(self.cotangents()[n - 1])

    def _pristine(self, n: int) -> list[torch.Tensor | None] | None:
        """Cotangent ``n`` in the variant's layout, never handed to the implementation, where
        it exists without extra work: the values themselves (contiguous, zero), or the one
        laid-out copy that :meth:`laid_out` clones (transposed); else None."""
        if self.cot_variant.holds_values:
            return self.cotangents()[n - 1]
        if not self.cot_variant.copies_laid:
            return None
        if n not in self._laid:
            self._laid[n] = self.cot_variant.lay_out(self.cotangents()[n - 1])
        return self._laid[n]

    def cotangent_line(self) -> str:
        """The findings' line naming a non-contiguous, zero or undefined cotangent (or "")."""
        if not self.cot_variant or not self.pairing().pairs:
            return ""
        return self.cot_variant.describe([n for n, _, _ in self.pairing().pairs],
                                         self.laid_out(1))

    def leaves(self, which: str, pairing: Pairing | None = None,
               side: Side | None = None) -> list[torch.Tensor]:
        """Gradient leaves of one side for ``pairing``'s groups (default: this record's)."""
        p = pairing or self.pairing()
        side = side or (self.impl_side if which == "impl" else self.ref_side)
        assert side is not None
        return [side.leaves[g.index] for g in p.groups]

    def ref_grads(self, n: int) -> tuple[list[torch.Tensor], BaseException | None]:
        """The reference's VJP for cotangent ``n`` (1 or 2), at the implementation's dtype.

        Both sides get the cotangent in the same layout (a reduction in backward then sums in
        the same order). A reference graph of torch's own formulas, which never write what
        they are handed, gets the :meth:`_pristine` tensors (no copy) where they exist; one
        with a custom Function or extension node gets a fresh laid-out copy, as the
        implementation does."""
        if n not in self._ref_grads:
            refs = [r for _, _, r in self.pairing().pairs]
            if self._ref_builtin is None:
                self._ref_builtin = builtin_only(refs)
            shared = self._pristine(n) if self._ref_builtin else None
            outs, cots = _defined(refs, self.laid_out(n) if shared is None else shared)
            versions = [c._version for c in cots]
            grads, err = vjp(outs, self.leaves("ref"), cots)
            if shared is not None and [c._version for c in cots] != versions:  # written after
                self._cots, self._laid, self._ref_builtin = None, {}, False  # all: draw again
                return self.ref_grads(n)
            if shared is not None:  # a gradient that IS the cotangent (an identity's
                ptrs = {c.data_ptr() for c in cots}  # backward passes it on) is copied
                grads = [g.clone() if g.data_ptr() in ptrs else g for g in grads]
            if err is None and self.place.cross:
                grads = [g.to(device=i.device, dtype=i.dtype)
                         for g, i in zip(grads, self.leaves("impl"))]
            self._ref_grads[n] = (grads, err)
        return self._ref_grads[n]

    @property
    def backwards_run(self) -> int:
        """How many of the implementation's backwards (:meth:`backward`) have run."""
        return len(self._backwards)

    def backward(self, k: int) -> Backward:
        """The implementation's backward #``k`` (1: first cotangent, 2: the second, 3: the first
        again), taking the earlier ones first; an earlier error is repeated."""
        while len(self._backwards) < k:
            if self._backwards and self._backwards[-1].error is not None:
                return self._backwards[-1]
            n = 2 if len(self._backwards) == 1 else 1  # the cotangent backward #k takes
            cot = self.cotangents()[n - 1]
            given = self.laid_out(n)
            outs, cots = _defined([i for _, i, _ in self.pairing().pairs], given)
            grads, err = vjp(outs, self.leaves("impl"), cots)
            self._backwards.append(Backward(grads, err, given, cot))
        return self._backwards[k - 1]

    # -- numerics: the oracle and the baseline (equiv.numerics, equiv.execution.verdict) -------
    def oracle(self) -> RefRun:
        """The reference once more on the same values in float64 (float32 where the device has
        none), on its own device; cached, run at most once, only when a value needs it. The
        reference run itself when it already ran in that dtype (``reference_dtype``)."""
        if "oracle" not in self.cache:
            device = self.place.ref_device or self.place.device
            dtype = oracle_dtype(torch.float32, device)
            if self.place.ref_dtype == dtype and self.ref_side is not None:
                run = reference_run(self.spec, self.ref_fn, self.ref_side, self.ref_result,
                                    self.ref_exc, called=True)
            else:
                side = self.template.instantiate(device=device, dtype=dtype)
                run = reference_run(self.spec, self.ref_fn, side)
            self.cache["oracle"] = run
        return self.cache["oracle"]

    def baseline(self) -> RefRun | None:
        """The reference at the implementation's dtype and device: None when that is the
        record's own reference run; with ``reference_dtype``/``reference_device``, one more
        call (cached)."""
        if not self.place.cross:
            return None
        if "baseline" not in self.cache:
            side = self.template.instantiate(device=self.place.device)
            self.cache["baseline"] = reference_run(self.spec, self.ref_fn, side)
        return self.cache["baseline"]

    def oracle_value(self, name: str) -> Any:
        """The oracle's value of the pairing name ``name`` (e.g. ``"output[0]"``), or None."""
        return self.oracle().values.get(name)

    def baseline_value(self, name: str) -> Any:
        run = self.baseline()
        return None if run is None else run.values.get(name)

    def _run_grads(self, run: RefRun | None, n: int) -> list[torch.Tensor] | None:
        if run is None or run.side is None or not run.values:
            return None
        p = self.pairing()
        outs = [run.values.get(name) for name, _, _ in p.pairs]
        leaves = [run.side.leaves[g.index] for g in p.groups]
        if not all(isinstance(o, torch.Tensor) and o.requires_grad for o in outs) or \
                any(leaf is None for leaf in leaves):
            return None
        outs, given = _defined(outs, self.cotangents()[n - 1])
        grads, err = vjp(outs, leaves, _cast(given, outs))
        return None if err is not None else grads

    def oracle_grads(self, n: int) -> list[torch.Tensor] | None:
        """The oracle's VJP for cotangent ``n`` (cast to float64), one per pairing group; None
        when the oracle cannot differentiate. Cached."""
        key = f"oracle-grads-{n}"
        if key not in self.cache:
            self.cache[key] = self._run_grads(self.oracle(), n)
        return self.cache[key]

    def baseline_grads(self, n: int) -> list[torch.Tensor] | None:
        """The baseline's VJP for cotangent ``n``: None when the baseline is the record's own
        reference run (:meth:`ref_grads`)."""
        key = f"baseline-grads-{n}"
        if key not in self.cache:
            self.cache[key] = self._run_grads(self.baseline(), n)
        return self.cache[key]

    def oracle_state(self, j: int) -> torch.Tensor | None:
        """What slot ``j`` must hold after the call, by the oracle (see :func:`expected_state`)."""
        return self._state("oracle-state", self.oracle(), j)

    def baseline_state(self, j: int) -> torch.Tensor | None:
        """The same by the baseline: None when that is the record's reference run."""
        run = self.baseline()
        return None if run is None else self._state("baseline-state", run, j)

    def _state(self, key: str, run: RefRun, j: int) -> torch.Tensor | None:
        if key not in self.cache:
            state = None
            if run.why is None and run.side is not None and run.side.tensors:
                t = run.side.tensors[0]
                dtype = oracle_dtype(torch.float32, t.device) if key == "oracle-state" else None
                try:
                    state = state_with(self.template, run.finals, t.device, dtype)
                except ReferenceError_:
                    state = None
            self.cache[key] = state
        state = self.cache[key]
        if state is None:
            return None
        side, unrepresentable = state
        return unrepresentable.get(j, side.tensors[j])

    def _oracle_run(self, template: Template, names: list[str],
                    shuffled: bool = False) -> tuple[Side, list[torch.Tensor]] | None:
        """The reference once more in float64 on a fresh copy of ``template`` (``shuffled``:
        every storage reversed): its side and its values ``names``; None when they are not all
        differentiable."""
        device = self.place.ref_device or self.place.device
        side = template.instantiate(device=device, dtype=oracle_dtype(torch.float32, device),
                                    shuffled=shuffled)
        run = reference_run(self.spec, self.ref_fn, side)
        outs = [run.values.get(n) for n in names]
        if run.why is not None or not all(isinstance(o, torch.Tensor) and o.requires_grad
                                          for o in outs):
            return None
        return side, outs

    def oracle_vjps(self, template: Template, names: list[str], groups: list[Any],
                    cots: list[list[torch.Tensor]], *,
                    shuffled: bool = False) -> list[list[torch.Tensor]] | None:
        """The reference once more in float64 on a fresh copy of ``template`` (e.g. another
        requires_grad pattern; ``shuffled``: every storage reversed, as a schedule's even
        forwards see it), its VJP w.r.t. ``groups``' leaves of the values ``names`` for
        each cotangent list in ``cots`` (cast to float64); None when it cannot. For a check's
        own rerun, called only when a value fails the per-dtype default."""
        found = self._oracle_run(template, names, shuffled)
        if found is None:
            return None
        side, outs = found
        result = []
        for c in cots:
            grads = OracleVJP(template, side, outs, _cast(c, outs), 0).grads(groups)
            if grads is None:
                return None
            result.append(grads)
        return result

    def rerun_oracle(self, template: Template, names: list[str],
                     cots: list[torch.Tensor]) -> OracleVJP | None:
        """The oracle of a rerun on ``template`` (another requires_grad pattern) with the
        cotangent ``cots`` for its values ``names`` (cast to float64): its gradients and the
        size of their terms, judged as the record's own (:meth:`judge`'s ``cotangent``); None
        when it cannot differentiate. For a check's own rerun, called only when a value fails
        the per-dtype default."""
        found = self._oracle_run(template, names)
        if found is None:
            return None
        side, outs = found
        return OracleVJP(template, side, outs, _cast(cots, outs), self.cot_seed + 104729 * 3)

    def judge(self, name: str, actual: Any, expected: Any, *, oracle: Any = None,
              baseline: Any = None, kind: str = "outputs", group: Any = None,
              cotangent: int | Callable[[], OracleVJP | None] | None = None,
              rounding: Any = None, precision: bool = False) -> Mismatch | None:
        """Compare one value with the reference's ``expected`` the way every check does: the
        spec's ``rtol``/``atol`` when set, else the per-dtype default and, where that rejects a
        floating value, the baseline-relative rule against ``oracle`` (a tensor or a callable;
        see :mod:`equiv.execution.verdict`). ``kind``: ``"outputs"``, ``"gradients"`` or
        ``"second-order"`` (the rule's ``k``); ``group``: the storage group of a gradient
        (an expanded argument's gradient sums many terms: a larger floor, taken at the size
        of the terms when ``cotangent`` names the cotangent the gradient was taken for: 1 or
        2, the record's, or a callable returning a rerun's oracle (:meth:`rerun_oracle`);
        under the record's expanded, constant cotangent also at the size the gradient has
        for a random one); ``rounding``: a lazy :meth:`rounding_spread` (an output) or
        :meth:`gradient_spread` (a gradient) for a value of the record's own example (the
        term-magnitude floor); ``precision``: the value is
        judged for precision (the forward check: float16/bfloat16 by the rule in ULPs)."""
        terms = 1.0 if group is None else summed_terms(self.template, group)
        magnitude = self._magnitude(cotangent, group, terms)
        m = judge_leaf(name, actual, expected, rtol=self.spec.rtol, atol=self.spec.atol,
                       oracle=oracle, baseline=baseline, kind=kind, why=self.oracle_why,
                       device=self.device, terms=terms, cross=self.place.cross,
                       magnitude=magnitude, example_size=lambda: self._example_size(kind),
                       rounding=rounding, precision=precision,
                       same_function=None if kind == "outputs" else self.oracle_agrees)
        overlapping = group is not None and not group.simple
        return self._precision_difference(name, actual, m, overlapping)

    def oracle_agrees(self) -> bool:
        """Whether the float64 oracle computes the reference's function on this example: every
        floating value of its forward (outputs, final values of mutated arguments) agrees with
        the reference's at its dtype within rounding (:func:`oracle_disagreement`). A gradient
        whose float64 and low-precision values differ far more then shows cancellation (a
        layer norm over two elements), not another function (a dropout mask drawn in float64
        is seen in the forward already). Cached."""
        if "oracle_agrees" not in self.cache:
            at_dtype = self.baseline()
            ours = (named_values(self.expected, self.finals, self.consumed) if at_dtype is None
                    else at_dtype.values)
            size = self._example_size("outputs")
            self.cache["oracle_agrees"] = all(
                oracle_disagreement(o, b, b.dtype, None, size) is None
                for name, o in self.oracle().values.items()
                for b in [ours.get(name)]
                if isinstance(o, torch.Tensor) and isinstance(b, torch.Tensor)
                and b.dtype.is_floating_point and o.shape == b.shape)
        return self.cache["oracle_agrees"]

    def _example_size(self, kind: str) -> float:
        """The largest finite ``|value|`` of the example's floating inputs and, for a gradient,
        of its cotangents: what the reference's rounding is measured against where its result
        cancels (a layer norm of a constant row is 0 in float64, and rounds at the inputs' size
        at its dtype)."""
        values = [g.values for g in self.template.groups if g.dtype.is_floating_point]
        if kind != "outputs":
            values += [c for cots in self.cotangents() for c in cots
                       if isinstance(c, torch.Tensor) and c.dtype.is_floating_point]
        sizes = [float(torch.nan_to_num(v.detach().abs().to(torch.float64), nan=0.0,
                                        posinf=0.0).max()) for v in values if v.numel()]
        return max(sizes, default=0.0)

    def _precision_difference(self, name: str, actual: Any, m: Mismatch | None,
                              overlapping: bool) -> Mismatch | None:
        """A value within rounding level of the reference's own error against float64
        (:attr:`~equiv.numerics.NumericMismatch.rounding_level`) passes with a note when it is
        float32 (another summation order, not a wrong value), or the gradient of an
        overlapping argument in any dtype (it sums one term per view, each carrying the
        rounding of intermediates the oracle's terms do not show: ``x * sigmoid(x)`` in
        bfloat16 rounds two parts of a derivative that nearly cancel). Other half values keep
        the finding: half accumulation bugs are rounding-level too."""
        if not (isinstance(m, NumericMismatch) and m.rounding_level
                and isinstance(actual, torch.Tensor)
                and (actual.dtype == torch.float32 or overlapping)):
            return m
        what = "float32" if actual.dtype == torch.float32 else "overlapping-argument gradient"
        self.cache.setdefault("precision-notes", []).append(
            f"{name}: {what} differences within rounding level of the reference's own error "
            "against float64 passed (a precision difference, not a wrong value)")
        return None

    def _magnitude(self, cot: int | Callable[[], OracleVJP | None] | None, group: Any,
                   terms: float) -> Any:
        """The lazy size of the terms a gradient for the cotangent ``cot`` sums, where the
        oracle's own value can understate it, else None: an overlapping argument's summed
        terms; the gradient for a random cotangent when the record's cotangent is one value
        expanded (a constant cotangent through softmax or a normalisation cancels to exactly
        0, which the implementation reaches only up to the rounding of terms of that size)."""
        if cot is None or group is None:
            return None
        run = (lambda: self.oracle_vjp(cot)) if isinstance(cot, int) else cot
        if terms > 1:
            return lambda: _sized(run(), lambda v: v.terms(group))
        if isinstance(cot, int) and self.cot_variant.kind == "expanded":
            return lambda: _sized(run(), lambda v: v.probe(group))
        return None

    def oracle_vjp(self, n: int) -> OracleVJP | None:
        """The oracle's run with cotangent ``n`` (1 or 2; random probes seeded from it), or
        None when the oracle has no differentiated values."""
        run = self.oracle()
        outs = [run.values.get(name) for name, _, _ in self.pairing().pairs]
        if run.side is None or not all(isinstance(o, torch.Tensor) and o.requires_grad
                                       for o in outs):
            return None
        outs, given = _defined(outs, self.cotangents()[n - 1])
        return OracleVJP(self.template, run.side, outs, _cast(given, outs),
                         self.cot_seed + 104729 * n)

    def probe_magnitude(self, n: int, group: Any) -> torch.Tensor | None:
        """The oracle's gradient w.r.t. ``group`` for random cotangents of cotangent ``n``'s
        mean size, root mean square over three (:meth:`OracleVJP.probe`). None if unknown."""
        return _sized(self.oracle_vjp(n), lambda v: v.probe(group))

    def oracle_terms(self, n: int, group: Any) -> torch.Tensor | None:
        """``sum |term|`` of the oracle's gradient for cotangent ``n`` per storage element of
        an overlapping ``group`` (:meth:`OracleVJP.terms`)."""
        return _sized(self.oracle_vjp(n), lambda v: v.terms(group))

    def rounding_spread(self, name: str) -> torch.Tensor | None:
        """How far rounding the reference's intermediates at float32's precision moves the
        value ``name`` (a pairing name), per element: :func:`~equiv.execution.rounding.
        rounding_spread` over fresh float64 copies of the example (four reference calls, cached,
        only for a value the rule rejects without it). None when unknown."""
        if "rounding" not in self.cache:
            run, device = self.oracle(), self.place.ref_device or self.place.device
            dtype = oracle_dtype(torch.float32, device)

            def again() -> dict[str, Any] | None:
                side = self.template.instantiate(grad=False, device=device, dtype=dtype)
                rerun = reference_run(self.spec, self.ref_fn, side)
                return None if rerun.why is not None else rerun.values

            self.cache["rounding"] = {} if run.why is not None or dtype != torch.float64 \
                else rounding_spread(again, run.values, self.cot_seed)
        return self.cache["rounding"].get(name)

    def gradient_spread(self, n: int, i: int) -> torch.Tensor | None:
        """How far rounding the reference's intermediates, forward and backward, at float32's
        precision moves its gradient w.r.t. pairing group ``i`` for cotangent ``n`` (1 or 2):
        :func:`~equiv.execution.rounding.rounding_spread` over the float64 VJP on fresh copies
        of the example (four reference calls and backwards per cotangent, cached, only for a
        gradient the rule rejects without it). None when unknown."""
        key = f"grad-rounding-{n}"
        if key not in self.cache:
            oracle, device = self.oracle_grads(n), self.place.ref_device or self.place.device
            dtype = oracle_dtype(torch.float32, device)

            def again() -> dict[str, Any] | None:
                rerun = reference_run(self.spec, self.ref_fn,
                                      self.template.instantiate(device=device, dtype=dtype))
                grads = None if rerun.why is not None else self._run_grads(rerun, n)
                return None if grads is None else {str(j): g for j, g in enumerate(grads)}

            self.cache[key] = {} if oracle is None or dtype != torch.float64 else \
                rounding_spread(again, {str(j): g for j, g in enumerate(oracle)},
                                self.cot_seed + n)
        return self.cache[key].get(str(i))

    def oracle_why(self) -> str | None:
        """Why the oracle cannot be used (the reference raised in float64), else None."""
        return self.oracle().why

    def finite_differences(self) -> tuple[Any, str | None]:
        """The implementation's VJP against central differences of the reference in float64
        (eight reference calls), for a reference that cannot differentiate: (FiniteDifference,
        None), or (None, why not) -- why None when nothing is differentiated. Cached."""
        if "finite-differences" not in self.cache:
            self.cache["finite-differences"] = self._finite_differences()
        return self.cache["finite-differences"]

    def _finite_differences(self) -> tuple[Any, str | None]:
        assert self.impl_side is not None
        impl_values = named_values(self.impl_result, {a: self.impl_side.argument(a)
                                                      for a in self.finals}, self.consumed)
        ref_values = named_values(self.expected, self.finals, self.consumed)
        plan = fd_plan(self.template, self.impl_side, impl_values, ref_values)
        if plan is None:
            big = fd_plan(self.template, self.impl_side, impl_values, ref_values, limit=None)
            return None, None if big is None else (
                f"the example has more than {FD_MAX_ELEMENTS} differentiable elements for "
                "finite differences")
        gen = torch.Generator().manual_seed(self.cot_seed)
        cots = [cotangent(v, gen) for v in plan.impl_values]
        grads, err = vjp(plan.impl_values, plan.impl_leaves, [c.clone() for c in cots])
        if err is not None:
            return None, f"the implementation's backward raised {type(err).__name__}"
        fn = fd_reference(self.template, plan, self.ref_fn, lambda r: split(self.spec, r),
                          self.device)
        terms = fd_terms(self.template, plan, self.impl_side, cots)
        try:
            with isolated():
                fd = fd_check(fn, plan, cots, grads, plan.impl_values[0].dtype,
                              self.cot_seed, terms)
                if not fd.ok and fd.nonfinite >= 0:  # judged again at the impl's own rounding
                    wider = fd_impl_terms(plan, terms, lambda: self._impl_vjp(plan, cots),
                                          self.cot_seed)
                    if wider is not None:
                        fd = fd_check(fn, plan, cots, grads, plan.impl_values[0].dtype,
                                      self.cot_seed, wider)
        except BaseException as e:  # the reference raised in float64: no finite differences
            if not user_error(e):
                raise
            return None, (f"finite differences failed (the reference raised "
                          f"{type(e).__name__} in float64: {error_text(e)[:120]})")
        if fd.nonfinite < 0 and _overflows(ref_values):
            return None, ("the implementation's gradient is inf/NaN where the reference's "
                          "float64 outputs are finite, but the reference's own outputs at the "
                          "implementation's dtype are inf/NaN too (they overflow there)")
        return fd, None

    def _impl_vjp(self, plan: Any, cots: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """The eager implementation's gradients per ``plan`` group for ``cots`` on a fresh
        copy of the example (None if it raised)."""
        side = self.template.instantiate(device=None if self.device == "cpu" else self.device)
        result, exc = call(self.spec.impl, side)
        if exc is not None:
            return None
        values = named_values(result, {a: side.argument(a) for a in self.finals},
                              self.consumed)
        outs = [values.get(n) for n in plan.names]
        leaves = [side.leaves[g.index] for g in plan.groups]
        if not all(isinstance(o, torch.Tensor) and o.requires_grad for o in outs) or \
                any(leaf is None for leaf in leaves):
            return None
        grads, err = vjp(outs, leaves, [c.clone() for c in cots])
        return None if err is not None else grads

    def measure(self, which: str) -> Any:
        """Peak and retained bytes of one side over forward + backward on a fresh copy
        (:func:`equiv.memory.measure`), or None when it raised."""
        fn = self.spec.impl if which == "impl" else self.spec.ref
        device = None if self.device == "cpu" else self.device
        return measure(fn, self.template.instantiate(device=device), self.cot_seed)

    # -- contract runs: errors, the no-grad path, state across calls --------------------------
    #: set by the runner's pipeline: this example was drawn from ``error_inputs=``
    error_input = False

    def expected_error(self) -> bool:
        """Both sides raised, on an ``error_inputs=`` example or with the declared ``raises=``
        error (then the example is a checked pass, not invalid input)."""
        r, i, spec = self.ref_exc, self.impl_exc, self.spec
        if r is None or i is None:
            return False
        if self.error_input:
            return True
        return spec.raises is not None and isinstance(r, spec.raises) and isinstance(
            i, spec.raises)

    def no_grad_run(self, how: str) -> "ContractRun":
        """The implementation on a fresh copy with no input requiring grad (``how="inputs"``),
        or under ``torch.no_grad()`` (``how="no_grad"``)."""
        side = self.side(grad=how != "inputs")
        before = side.versions()
        try:
            with isolated():
                if how == "no_grad":
                    with torch.no_grad():
                        result = side.call(self.impl_fn)
                else:
                    result = side.call(self.impl_fn)
            return ContractRun(side, result, None, before)
        except BaseException as e:  # the user's code raised: evidence, never a crash of equiv
            if not user_error(e):
                raise
            return ContractRun(side, None, normalise_error(e), before)

    def retained(self, which: str) -> Any:
        """Bytes one side's forward graph keeps alive on a fresh copy, without the peak tracker
        (:func:`equiv.memory.retained`), or None when it raised."""
        fn = self.spec.impl if which == "impl" else self.spec.ref
        return retained(fn, self.side())

    def shuffled_call(self) -> tuple[Side, Any, BaseException | None]:
        """The implementation on a fresh copy holding other values (every storage reversed),
        called while the record's outputs are alive: (side, result, error). Cached: one run
        serves every check that needs a second call on new values."""
        if "shuffled-call" not in self.cache:
            side = self.side(shuffled=True)
            self.cache["shuffled-call"] = (side, *self.call("impl", side))
        return self.cache["shuffled-call"]

    def calls_across_updates(self) -> Iterator["UpdatedCall"]:
        """Call the implementation, then on the same tensors write other values through each
        of :data:`UPDATE_PATHS` in turn (under ``torch.no_grad()``; the values alternate
        between every storage reversed and the example's own) and call it again. Yields one
        :class:`UpdatedCall` per path, lazily (a caller that stops early saves the calls);
        nothing more once a call raises or an update cannot be written."""
        fresh, fresh_result, fresh_exc = self.shuffled_call()  # what it gives on new tensors
        if fresh_exc is not None:
            return
        side = self.side()
        _, exc = self.call("impl", side)
        if exc is not None:
            return
        for k, how in enumerate(UPDATE_PATHS):
            shuffled = k % 2 == 0
            # the new values are only read, except by ``.data =``, which hands the side their
            # storage: the example's own values come as read-only views where they can
            copied = None if how == ".data =" else ()
            try:
                _update(side, self.side(shuffled=shuffled, grad=False, fresh=copied), how)
            except RuntimeError:  # an expanded (self-overlapping) argument cannot be written
                return
            before = side.versions()
            result, exc = self.call("impl", side)
            if exc is not None:
                return
            if shuffled:
                expected = fresh_result
                finals = {a: fresh.argument(a) for a in self.spec.mutates}
            else:
                expected, finals = self.expected, self.finals
            yield UpdatedCall(how, ContractRun(side, result, None, before), expected, finals,
                              shuffled)


#: how training loops write new weights into the tensors they pass, in the order tried:
#: an optimizer step (``p.copy_(new)``, version bumped), a write through ``.data`` (EMA swaps,
#: weight reloads: same storage, version not bumped), a new tensor assigned to ``.data`` (new
#: storage, same tensor object; a view into a larger storage gets its values through
#: ``.data.copy_`` instead)
UPDATE_PATHS = ("copy_", ".data.copy_", ".data =")


def _update(side: Side, new: Side, how: str) -> None:
    """Write ``new``'s values into ``side``'s tensors the way ``how`` (one of
    :data:`UPDATE_PATHS`) does."""
    template = side.template
    with torch.no_grad():
        for g in template.groups:
            if how == ".data =" and g.simple:  # every slot of a simple group is one tensor
                side.tensors[g.slots[0]].data = new.tensors[g.slots[0]].detach()
                continue
            for j in g.slots:
                t, v = side.tensors[j], new.tensors[j]
                (t.copy_ if how == "copy_" else t.data.copy_)(v)


@dataclasses.dataclass
class UpdatedCall:
    """A call of the implementation after its tensors were updated through ``how`` (one of
    :data:`UPDATE_PATHS`), and what it must give: ``expected`` outputs and ``finals`` of mutated
    arguments (``shuffled``: for the reversed values, from a call on fresh tensors; else the
    reference's for the example)."""

    how: str
    run: "ContractRun"
    expected: Any
    finals: dict[str, Any]
    shuffled: bool


@dataclasses.dataclass
class ContractRun:
    """One more call of the implementation: its side, result or error, and the versions of
    the side's tensors just before the call."""

    side: Side
    result: Any
    exc: BaseException | None
    versions: list[int]


def _cast(cots: list[torch.Tensor], outs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each cotangent detached, at its value's dtype and device (e.g. the oracle's float64)."""
    return [c.detach().to(device=o.device, dtype=o.dtype) for c, o in zip(cots, outs)]


def _sized(run: OracleVJP | None,
           size: Callable[[OracleVJP], torch.Tensor | None]) -> torch.Tensor | None:
    return None if run is None else size(run)


def _defined(outs: list[torch.Tensor], cots: list[torch.Tensor | None],
             ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The differentiated values with a defined cotangent, and those cotangents: an undefined
    one is left out of the VJP, so autograd hands that output's backward ``None`` (or zeros,
    where the graph materializes them) exactly as for an unused output."""
    kept = [(o, c) for o, c in zip(outs, cots) if c is not None]
    return [o for o, _ in kept], [c for _, c in kept]


def execute(spec: Spec, cfg: Settings, example: Args, cot_seed: int,
            place: Placement, costly: bool = True) -> Execution:
    """Run both sides once on ``example`` and build the record (see :class:`Execution`);
    ``costly``: the costly checks run on it.

    Raises :class:`ReferenceError_` when the reference breaks its contract (it modified an
    argument, or its result does not hold the declared mutated arguments' final values)."""
    template = Template(spec.signature, example, spec.mutates.keys())
    ex = Execution(spec, cfg, cot_seed, place, template)
    ex.costly = costly
    ref_place = dict(device=place.ref_device or place.device, dtype=place.ref_dtype)
    ref_side = template.instantiate(**ref_place)
    # the drawn values the reference must leave unchanged: views of the template's, no copy
    ref_before = template.instantiate(grad=False, fresh=(), **ref_place).tensors
    ref_versions = ref_side.versions()
    ex.ref_side = ref_side
    ex.ref_result, ex.ref_exc = call(ex.ref_fn, ref_side)
    if ex.ref_exc is None:
        _check_reference_pure(spec, template, ref_side, ref_before, ref_versions)
    impl_side = template.instantiate(device=place.device)
    ex.impl_side, ex.impl_versions = impl_side, impl_side.versions()
    before = [(t.grad_fn, t._version, t.requires_grad) for t in impl_side.tensors]
    ex.impl_result, ex.impl_exc = call(ex.impl_fn, impl_side)
    ex.impl_history = (before, [(t.grad_fn, t._version, t.requires_grad)
                                for t in impl_side.tensors])
    for who, result in (("reference", ex.ref_result), ("implementation", ex.impl_result)):
        _comparable_only(spec, who, result)
    if not ex.valid:
        return ex
    expected, finals, consumed = split(spec, ex.ref_result)
    ex.impl_result = align(ex.impl_result, expected)  # dicts compare by key, not order
    if place.cross:
        expected = cast_like(expected, ex.impl_result)
        finals = {a: cast_like(f, impl_side.argument(a)) for a, f in finals.items()}
    ex.expected, ex.finals, ex.consumed = expected, finals, consumed
    if costly:  # output-stability's evidence (a costly check)
        ex.out_snapshot, ex.snapshotted = detached_clone(ex.impl_result), True
    return ex


def _comparable_only(spec: Spec, who: str, result: Any) -> None:
    """Raise :class:`InvalidArgument` when ``who``'s result holds a tensor equiv cannot
    compare (:func:`_incomparable`), naming the side, the output and what to return."""
    for path, leaf in leaves_of(result):
        found = _incomparable(leaf) if isinstance(leaf, torch.Tensor) else None
        if found is not None:
            what, fix = found
            name = spec.reference if who == "reference" else spec.implementation
            raise InvalidArgument(
                f"the {who} {name} returned {what} at output{path}: equiv compares dense "
                f"tensors with values only (values, views, gradients). {fix}")


def _incomparable(t: torch.Tensor) -> tuple[str, str] | None:
    """(what ``t`` is, the fix) for a tensor equiv does not compare: a nested tensor, a tensor
    subclass with its own ``__torch_dispatch__`` (``MaskedTensor``...), a non-strided tensor, a
    meta tensor (no values); None for one it compares."""
    if t.is_nested:
        return ("a nested tensor", "Check a wrapper that returns .unbind() (a tuple of "
                "tensors) or .to_padded_tensor(0) on both sides.")
    kind = type(t)
    if getattr(kind, "__torch_dispatch__", None) is not torch.Tensor.__torch_dispatch__:
        return (f"a {kind.__name__} (a tensor subclass with its own __torch_dispatch__)",
                "Check a wrapper that returns the plain tensors it holds on both sides (for a "
                "MaskedTensor: .get_data() and .get_mask()).")
    if t.layout != torch.strided:
        return (f"a tensor with layout {t.layout}",
                "Check a wrapper that returns .to_dense() on both sides.")
    if t.is_meta:
        return ("a tensor on the meta device (it holds no values)",
                "Check on a real device, or, to check shapes only, a wrapper that returns "
                "(t.shape, t.dtype) on both sides.")
    return None


def _check_reference_pure(spec: Spec, template: Template, side: Side,
                          before: list[torch.Tensor], versions: list[int]) -> None:
    after = side.versions()
    for j, (slot, t, b) in enumerate(zip(template.slots, side.tensors, before)):
        changed = compare_leaf(t.detach(), b, rtol=0, atol=0, exact=True) is not None
        if changed or after[j] != versions[j]:
            raise ReferenceError_(
                f"the reference {spec.reference} modified its argument {slot.path!r} "
                "(a reference must be pure: it returns new tensors and leaves its inputs "
                "unchanged). Make it functional, e.g. use x.clamp(min=0) instead of "
                "x.clamp_(min=0), and declare the implementation's writes with mutates=."
            )
    changed = template.changed_arguments(side)
    if changed:
        name, old, new = changed[0]
        raise ReferenceError_(
            f"the reference {spec.reference} modified its argument {name!r} ({old} -> {new}; "
            "a reference must be pure: it leaves its inputs unchanged, lists and dicts "
            "included). Make it work on a copy of the argument.")


def expected_state(ex: Execution) -> tuple[Side, dict[int, torch.Tensor]]:
    """A copy of the example holding what every argument must hold after the call: the
    reference's final values for mutated arguments, the drawn values for the others. Final
    values an expanded (self-overlapping) argument cannot hold come back by slot index."""
    return state_with(ex.template, ex.finals, ex.device)


def state_with(template: Template, finals: dict[str, Any], device: Any,
               dtype: torch.dtype | None = None) -> tuple[Side, dict[int, torch.Tensor]]:
    """:func:`expected_state` for any final values (``dtype``: that of the floating slots)."""
    written = {template.slots[j].group for j, slot in enumerate(template.slots)
               if slot.path.split("[")[0] in finals}
    expected = template.instantiate(grad=False, device=device, dtype=dtype, fresh=written)
    unrepresentable: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for arg, final in finals.items():
            target = expected.argument(arg)
            t_leaves, f_leaves = tree_flatten(target)[0], tree_flatten(final)[0]
            if len(t_leaves) != len(f_leaves):
                raise ReferenceError_(
                    f"the reference's final value for mutated argument {arg!r} has "
                    f"{len(f_leaves)} leaves but the argument has {len(t_leaves)}."
                )
            for t, f in zip(t_leaves, f_leaves):
                if not isinstance(t, torch.Tensor):
                    continue
                if not isinstance(f, torch.Tensor) or f.shape != t.shape:
                    raise ReferenceError_(
                        f"the reference's final value for mutated argument {arg!r} is "
                        f"{brief(f)}, which does not fit the argument's shape "
                        f"{tuple(t.shape)}: check mutates= and the reference's result."
                    )
                try:
                    t.copy_(f.detach().to(t.dtype))
                except RuntimeError:  # t overlaps itself (stride 0): compare with f itself
                    j = next(j for j, e in enumerate(expected.tensors) if e is t)
                    unrepresentable[j] = f.detach().to(t.dtype)
    return expected, unrepresentable


@dataclasses.dataclass(frozen=True)
class OutsideWrite:
    """Elements of one storage group that no argument's view reaches, changed by a call:
    how many, and the first (its storage index, value before and after)."""

    group: Group
    count: int
    index: int
    before: Any
    after: Any


def outside_writes(template: Template, side: Side) -> list[OutsideWrite]:
    """The writes ``side``'s call made outside every argument's view, one per storage group
    (only groups that are views into larger storages have such elements)."""
    out = []
    for g in template.groups:
        if g.simple:
            continue
        now = side.storage(g)
        gaps = template.gaps(g, now.device)
        if gaps is None:
            continue
        before = g.values.to(now.device)
        changed = _differs_where(now, before, gaps)
        if changed is not None:
            k = int(changed[0])
            out.append(OutsideWrite(g, changed.numel(), k, before[k].item(), now[k].item()))
    return out


def _differs_where(a: torch.Tensor, b: torch.Tensor, where: torch.Tensor) -> torch.Tensor | None:
    """The flat indices where ``a`` differs from ``b`` (NaN equal to NaN) within the mask
    ``where``, or None when there are none. ``!=`` alone decides the common case (no such
    element): the NaN test runs only when some element differs."""
    changed = (a != b) & where
    if not bool(changed.any()):
        return None
    if a.dtype.is_floating_point or a.dtype.is_complex:
        changed &= ~(a.isnan() & b.isnan())
    changed = changed.nonzero().reshape(-1)
    return changed if changed.numel() else None


def cotangent_written(ex: Execution, b: Backward, n: int) -> list[tuple[str, str, Mismatch, str]]:
    """(name, headline, mismatch, fix) for each cotangent backward #``n`` wrote into."""
    out = []
    for (name, _, _), o, g in zip(ex.pairing().pairs, b.cotangent, b.given):
        if g is None:
            continue
        m = compare_leaf(g, o, rtol=0, atol=0, path=name, exact=True)
        if m is not None:
            out.append((name, f"backward #{n} modified the caller's cotangent (grad_output) for "
                        f"{name} in place.", m,
                        "do not write into grad_output in backward; use out-of-place ops "
                        "(grad_output * x, not grad_output.mul_(x))."))
    return out


def _overflows(values: dict[str, Any]) -> bool:
    """Some floating value holds inf or NaN."""
    return any(isinstance(v, torch.Tensor) and v.dtype.is_floating_point
               and not bool(torch.isfinite(v.detach()).all()) for v in values.values())


def _kink_site(ex: Execution, group: Any, m: Any) -> tuple[int, list[int], str] | None:
    """Where a mismatch's worst element is in the reference's arguments: (argument position,
    the row-major flat indices of the argument's elements that hold it -- several where the
    argument's storage overlaps, e.g. expanded --, ``"x[i, j] = v"``), or None where that
    cannot be said (a group of several arguments)."""
    index, side = getattr(m, "index", None), ex.ref_side
    if index is None or side is None or len(group.slots) != 1:
        return None
    tensor = side.tensors[group.slots[0]]
    if not tensor.dtype.is_floating_point:  # a kink is a real-valued notion
        return None
    values = list(side.bound.args) + list(side.bound.kwargs.values())
    k = next((i for i, v in enumerate(values) if v is tensor), None)
    slot = ex.template.slots[group.slots[0]]
    shape = tensor.shape if group.simple else group.values.shape
    if k is None or len(index) != len(shape):
        return None
    flat = sum(i * s for i, s in zip(index, torch.empty(shape).stride()))
    where = slot.path + (f"[{', '.join(map(str, index))}]" if index else "")
    if group.simple:
        return k, [flat], f"{where} = {float(tensor.detach().reshape(-1)[flat]):g}"
    positions = torch.arange(group.values.numel()).as_strided(slot.size, slot.stride,
                                                               slot.offset).reshape(-1)
    flats = [int(i) for i in (positions == flat).nonzero().reshape(-1)]
    if not flats:
        return None
    value = float(tensor.detach().reshape(-1)[flats[0]])
    return k, flats, f"{slot.path} (storage element {flat}) = {value:g}"


def kink_cause(ex: Execution, group: Any, m: Any) -> str | None:
    """When the worst element is an input where the reference is not differentiable (its
    output or gradient jumps there, e.g. ``clamp`` at its bounds), the line saying so: the two
    sides may legitimately pick different one-sided derivatives there. Only for a failure that
    is explained (:func:`equiv._explain.explaining`): it never changes a verdict."""
    if not explaining():
        return None
    site = _kink_site(ex, group, m)
    if site is None:
        return None
    k, flats, where = site
    side = ex.ref_side
    assert side is not None
    args, kwargs = side.bound.args, dict(side.bound.kwargs)
    if smooth_at(ex.spec.ref, args, kwargs, {k: flats}) or not jumps_at(ex.spec.ref, args,
                                                                         kwargs, {k: flats}):
        return None  # no jump seen within the probe's radius: no claim
    values = list(side.bound.args) + list(side.bound.kwargs.values())
    ties = _tied_with(ex, side, values, k, tuple(m.index)) if group.simple else []
    tie = (f" and ties {' and '.join(ties)} (equal values in two arguments; moving the tied "
           "value changes the reference's gradient)") if ties else ""
    return (f"{where}{tie} is a point where the reference is not differentiable (its "
            "output or gradient jumps there): the two sides pick different one-sided "
            "derivatives (subgradients). If either is acceptable, keep the inputs away from it "
            "(inputs=...) or use the reference's convention.")


def derivative_kink(ex: Execution, group: Any, m: Any) -> str | None:
    """``"x[i] = v"`` when a second-order mismatch's worst element is an input where the
    reference's derivative has a kink: the reference is not differentiable there
    (:func:`kink_cause`'s probe), or its autograd second derivative jumps there
    (``z.abs().pow(2)`` at 0: smooth, but ``sign(z)**2`` is 0 at 0 and 1 beside it). A smooth
    implementation's second derivative legitimately differs there. Else None."""
    site = _kink_site(ex, group, m)
    if site is None:
        return None
    k, flats, where = site
    side = ex.ref_side
    assert side is not None
    args, kwargs = side.bound.args, dict(side.bound.kwargs)
    if not smooth_at(ex.spec.ref, args, kwargs, {k: flats}):
        return where if jumps_at(ex.spec.ref, args, kwargs, {k: flats}) else None
    try:
        at, up, down, up_near, down_near = (
            _second_order(ex.spec.ref, args, kwargs, k, flats, step)
            for step in (0.0, _KINK_STEP, -_KINK_STEP, _KINK_STEP / 10, -_KINK_STEP / 10))
    except BaseException as e:  # the reference raised (SystemExit too): no claim
        if not user_error(e):
            raise
        return None

    def gap(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(((a - b).abs() / (1 + a.abs())).max()) if a.numel() else 0.0
    # a jump stays when the step shrinks; a steep smooth second derivative's gap shrinks too
    jump = [gap(at, near) > _KINK_JUMP and gap(at, near) > 0.5 * gap(at, far)
            for far, near in ((up, up_near), (down, down_near))
            if at.shape == far.shape == near.shape]
    return where if any(jump) else None


_KINK_STEP, _KINK_JUMP = 1e-5, 1e-2


def _second_order(ref: Callable[..., Any], args: Any, kwargs: dict, k: int, flats: list[int],
                  step: float) -> torch.Tensor:
    """The reference's float64 second-order gradient w.r.t. every floating argument (fixed
    cotangent and vector, magnitudes 1-2), ``step`` added at argument ``k``'s elements
    ``flats`` (row-major): all of them flattened into one tensor."""
    values = list(args) + list(kwargs.values())
    leaves: list[torch.Tensor] = []
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor) and v.dtype.is_floating_point:
            w = v.detach().to(torch.float64).clone(memory_format=torch.contiguous_format)
            if i == k:
                w.view(-1)[flats] += step
            values[i] = w.requires_grad_(True)
            leaves.append(values[i])
    gen = torch.Generator().manual_seed(1234)

    def weights(like: torch.Tensor) -> torch.Tensor:
        sign = torch.randn(like.shape, generator=gen, dtype=torch.float64).sign()
        return sign * (1 + torch.rand(like.shape, generator=gen, dtype=torch.float64))

    with torch.enable_grad():
        out = ref(*values[:len(args)], **dict(zip(kwargs, values[len(args):])))
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)
                and o.requires_grad and o.dtype.is_floating_point]
        if not outs:
            return torch.zeros(0, dtype=torch.float64)
        loss = sum((o.to(torch.float64) * weights(o)).sum() for o in outs)
        first = torch.autograd.grad(loss, leaves, create_graph=True, allow_unused=True)
        live = [(g, weights(g)) for g in first if g is not None and g.requires_grad]
        if not live:
            return torch.zeros(0, dtype=torch.float64)
        total = sum((g * w).sum() for g, w in live)
        second = torch.autograd.grad(total, leaves, allow_unused=True)
    return torch.cat([(torch.zeros_like(leaf) if g is None else g.detach()).reshape(-1)
                      for g, leaf in zip(second, leaves)])


def by_differences(ex: Execution) -> str | None:
    """Why the first backward is judged only by finite differences of the reference (it cannot
    differentiate: its backward raises, or its result has no autograd history), else None. A
    second backward (a new cotangent, or double backward) then has nothing to be compared
    with."""
    pairing = ex.pairing()
    if pairing.pairs:
        err = ex.ref_grads(1)[1] if pairing.ok else None
        return None if err is None else f"its backward raised {type(err).__name__}"
    fd, _ = ex.finite_differences()
    return None if fd is None else "its result has no autograd history"


def fd_only_note(check: str, what: str, why: str) -> str:
    """The note of a check of a second backward where only finite differences judge the first
    (:func:`by_differences`)."""
    return (f"{check} not compared: the reference cannot differentiate ({why}), and finite "
            f"differences judge the first backward only ({what} was not checked)")


def _tied_with(ex: Execution, side: Side, values: list[Any], k: int,
               index: tuple[int, ...]) -> list[str]:
    """The elements of other arguments (``lo[0]``) that broadcasting aligns with element
    ``index`` of the argument at position ``k`` of ``values``, hold the same value, and where
    the reference is not smooth (the probe moves that element alone)."""
    tensor = values[k]
    value = tensor.detach()[index]
    out = []
    for k2, u in enumerate(values):
        if (k2 == k or not isinstance(u, torch.Tensor) or u.dtype != tensor.dtype
                or u.dim() > tensor.dim()):
            continue
        off = tensor.dim() - u.dim()
        if any(d not in (1, tensor.shape[i + off]) for i, d in enumerate(u.shape)):
            continue
        at = tuple(0 if d == 1 else index[i + off] for i, d in enumerate(u.shape))
        if not bool(u.detach()[at] == value):
            continue
        flat = sum(i * st for i, st in zip(at, u.contiguous().stride()))
        if smooth_at(ex.spec.ref, side.bound.args, dict(side.bound.kwargs), {k2: [flat]}):
            continue
        j = next((i for i, t in enumerate(side.tensors) if t is u), None)
        name = ex.template.slots[j].path if j is not None else f"argument {k2}"
        out.append(name + (f"[{', '.join(map(str, at))}]" if at else ""))
    return out


def name_cotangent(ex: Execution, sink: Sink, first: int) -> None:
    """Add the line naming the cotangent layout (:meth:`Execution.cotangent_line`) to the
    details of ``sink.findings[first:]``."""
    line = ex.cotangent_line()
    if not line:
        return
    for i in range(first, len(sink.findings)):
        f = sink.findings[i]
        sink.findings[i] = dataclasses.replace(f, details=f"{f.details}\n{line}".lstrip())


def judge_run(ex: Execution, run: ContractRun, expected: Any, finals: dict[str, Any], *,
              shuffled: bool = False) -> list[tuple[str, Mismatch]]:
    """(what, mismatch) for each returned output of ``run`` that differs from ``expected`` and
    each argument that does not hold what it must after the call: ``finals`` for mutated
    arguments, the example's values (``shuffled``: the reversed ones) for the others."""
    spec, template = ex.spec, ex.template
    out: list[tuple[str, Mismatch]] = []
    if not (run.result is None and ex.consumed):
        out += [("output", m) for m in _judge_outputs(ex, run.result, expected, shuffled)]
    written = {slot.group for slot in template.slots if slot.path.split("[")[0] in finals}
    target = template.instantiate(grad=False, device=ex.device, shuffled=shuffled, fresh=written)
    with torch.no_grad():
        for arg, final in finals.items():
            for t, f in zip(tree_flatten(target.argument(arg))[0], tree_flatten(final)[0]):
                if isinstance(t, torch.Tensor) and isinstance(f, torch.Tensor):
                    try:
                        t.copy_(f.detach().to(device=t.device, dtype=t.dtype))
                    except RuntimeError:  # an expanded argument: not comparable here
                        pass
    after = run.side.versions()
    for j, slot in enumerate(template.slots):
        mutated = template.groups[slot.group].mutated
        actual, want = run.side.tensors[j].detach(), target.tensors[j]
        if mutated:  # the record's verdict (the float64 oracle holds the example's own values)
            m = ex.judge(slot.path, actual, want,
                         oracle=None if shuffled else (lambda j=j: ex.oracle_state(j)))
        else:
            m = compare_leaf(actual, want, rtol=0, atol=0, path=slot.path, exact=True)
        if m is not None:
            out.append(("final value of mutated argument" if mutated else
                        "undeclared write to argument", m))
        elif not mutated and after[j] != run.versions[j]:
            out.append(("undeclared write to argument", Mismatch(
                slot.path, f"version counter {run.versions[j]} -> {after[j]}")))
    return out


def _judge_outputs(ex: Execution, result: Any, expected: Any, shuffled: bool) -> list[Mismatch]:
    """Each returned leaf of another run judged like the forward check judges the record's (the
    oracle only where the run saw the example's own values)."""
    expected = cast_like(expected, result)
    actual, wanted = leaves_of(result), leaves_of(expected)
    if [p for p, _ in actual] != [p for p, _ in wanted]:
        return compare_trees(result, expected, rtol=ex.spec.rtol, atol=ex.spec.atol)
    out = []
    for (p, a), (_, e) in zip(actual, wanted):
        name = f"output{p}"
        if not (isinstance(a, torch.Tensor) and isinstance(e, torch.Tensor)):
            out += compare_trees(a, e, rtol=ex.spec.rtol, atol=ex.spec.atol, root=name)
            continue
        m = ex.judge(name, a, e, oracle=None if shuffled else (lambda n=name: ex.oracle_value(n)))
        if m is not None:
            out.append(m)
    return out
