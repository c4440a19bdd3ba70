"""The record of one example in one mode and device (:class:`Execution`), built by
:func:`execute`, and :class:`Sink`, where checks put their findings and notes as data.

The reference's runs that judge the record's values are its :class:`~equiv.execution.oracle.
Oracle` (``ex.oracle``); the implementation's calls for its contracts are functions of the
record in :mod:`equiv.execution.contract_runs`."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from equiv._settings import settings as Settings
from equiv.compare import Mismatch, align, compare_leaf
from equiv.errors import InvalidArgument, error_text
from equiv.examples import Args, Side, Template
from equiv.execution.calls import call, cast_like, cotangent, defined, detached_clone, vjp
from equiv.execution.calls import leaves as leaves_of
from equiv.execution.graph import builtin_only, function_nodes
from equiv.execution.oracle import Oracle
from equiv.execution.pairing import Pairing, ReferenceError_, pair, split
from equiv.execution.runs import ImplRun, impl_run
from equiv.numerics import NumericMismatch
from equiv.report import Finding
from equiv.spec import Spec
from equiv.variants import CONTIGUOUS, CotangentVariant


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
    # after, then released by cotangent_written; None: undefined, that value not differentiated)
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
    #: set by the runner's pipeline: this example was drawn from ``error_inputs=``
    error_input = False

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
        #: the gradient tensors were released (:meth:`release_gradients`); the errors kept
        self._released: dict[int, BaseException | None] | None = None
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
        """Why the example is invalid input, else None: both raised the same type of error,
        or the implementation raised where the reference's result holds a final value no
        write in place can leave (:meth:`unwritable_final`)."""
        r, i = self.ref_exc, self.impl_exc
        if r is not None and i is not None and isinstance(i, type(r)):
            return f"the reference raised {type(r).__name__}: {error_text(r)[:200]}"
        if r is None and i is not None:
            return self.unwritable_final()
        return None

    def unwritable_final(self) -> str | None:
        """Why the reference's result on this example cannot be the final values of the
        arguments written in place (a final value of another shape or dtype than its argument:
        ``x + b[:, None]`` for a 1-d ``x``), else None. The example is then outside the
        contract: an implementation writing in place cannot match it, so its raising there is
        no evidence against it."""
        if self.ref_exc is not None or self.ref_side is None or not self.spec.mutates:
            return None
        try:
            _, finals, _ = split(self.spec, self.ref_result)
        except ReferenceError_:
            return None
        for name, final in finals.items():
            arg = self.ref_side.bound.arguments.get(name)
            if isinstance(final, torch.Tensor) and isinstance(arg, torch.Tensor) and (
                    final.shape != arg.shape or final.dtype != arg.dtype):
                return (f"the reference's final value of {name!r} is "
                        f"{_brief_tensor(final)} but the argument is {_brief_tensor(arg)}: "
                        "no write in place leaves that, so the example is outside the "
                        "contract (the implementation raised on it)")
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

    # -- the reference's other runs -----------------------------------------------------------
    @property
    def oracle(self) -> Oracle:
        """The float64 oracle and the baseline of this example, which judge its values
        (:class:`~equiv.execution.oracle.Oracle`; its runs are cached on the record)."""
        return Oracle(self)

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
        if n not in self._ref_grads:  # again after a release: the reference is pure
            refs = [r for _, _, r in self.pairing().pairs]
            if self._ref_builtin is None:
                self._ref_builtin = builtin_only(refs)
            shared = self._pristine(n) if self._ref_builtin else None
            outs, cots = defined(refs, self.laid_out(n) if shared is None else shared)
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

    def ref_grad_error(self, n: int) -> BaseException | None:
        """What the reference's VJP for cotangent ``n`` raised (None: it returned), without
        holding its gradients again once they were released."""
        if n not in self._ref_grads and self._released is not None and n in self._released:
            return self._released[n]
        return self.ref_grads(n)[1]

    def release_gradients(self, reference: bool = True) -> None:
        """Drop the gradient tensors once no later check reads them (the costly checks then
        run without them): the implementation's backwards may not run again (a backward can be
        stateful), so asking for one after this is a bug in equiv; with ``reference``, the
        reference's VJPs too (taken again if asked for; keep them where a finding may still
        need them as evidence: a reference returning other gradients on a second call)."""
        self._released = {n: err for n, (_, err) in self._ref_grads.items()}
        if reference:
            self._ref_grads = {}
        for b in self._backwards:
            b.grads = None  # type: ignore[assignment]

    @property
    def reference_grads_released(self) -> bool:
        """The reference's VJPs were released: one asked for now is a new call's."""
        return self._released is not None and not self._ref_grads

    @property
    def backwards_run(self) -> int:
        """How many of the implementation's backwards (:meth:`backward`) have run."""
        return len(self._backwards)

    def backward(self, k: int) -> Backward:
        """The implementation's backward #``k`` (1: first cotangent, 2: the second, 3: the first
        again), taking the earlier ones first; an earlier error is repeated."""
        if self._released is not None:
            raise RuntimeError("the implementation's gradients were released: a check that "
                               "reads them runs before release_gradients()")
        while len(self._backwards) < k:
            if self._backwards and self._backwards[-1].error is not None:
                return self._backwards[-1]
            n = 2 if len(self._backwards) == 1 else 1  # the cotangent backward #k takes
            cot = self.cotangents()[n - 1]
            given = self.laid_out(n)
            outs, cots = defined([i for _, i, _ in self.pairing().pairs], given)
            grads, err = vjp(outs, self.leaves("impl"), cots)
            self._backwards.append(Backward(grads, err, given, cot))
        return self._backwards[k - 1]


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


def _brief_tensor(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


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


def cotangent_written(ex: Execution, b: Backward, n: int) -> list[tuple[str, str, Mismatch, str]]:
    """(name, headline, mismatch, fix) for each cotangent backward #``n`` wrote into. Its only
    reader: the cotangents ``b`` was handed are released after (no later check holds them)."""
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
    b.given[:] = [None] * len(b.given)
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


