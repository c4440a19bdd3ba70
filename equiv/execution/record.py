"""The record of one example in one mode and device (:class:`Execution`), built by
:func:`execute`, and :class:`Sink`, where checks put their findings and notes as data."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterator

import torch

from equiv._compat import tree_flatten
from equiv._settings import settings as Settings
from equiv.compare import Mismatch, align, compare_leaf, compare_trees
from equiv.errors import InvalidArgument, error_text
from equiv.examples import Args, Side, Template
from equiv.execution.calls import call, cast_like, cotangent, detached_clone
from equiv.execution.calls import isolated, user_error
from equiv.execution.calls import leaves as leaves_of
from equiv.execution.calls import defined, vjp
from equiv.execution.graph import builtin_only, function_nodes
from equiv.execution.oracle import Oracle
from equiv.execution.pairing import Pairing, ReferenceError_, pair, split
from equiv.execution.runs import ImplRun, impl_run
from equiv.memory import measure, retained
from equiv.modes import normalise_error
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
        if n not in self._ref_grads:
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
            outs, cots = defined([i for _, i, _ in self.pairing().pairs], given)
            grads, err = vjp(outs, self.leaves("impl"), cots)
            self._backwards.append(Backward(grads, err, given, cot))
        return self._backwards[k - 1]

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
            m = ex.oracle.judge(slot.path, actual, want,
                                oracle=None if shuffled else (lambda j=j: ex.oracle.state(j)))
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
        m = ex.oracle.judge(name, a, e, oracle=None if shuffled else (lambda n=name: ex.oracle.value(n)))
        if m is not None:
            out.append(m)
    return out
