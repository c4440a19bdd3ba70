"""The reference's runs that judge the record's values (:class:`Oracle`, ``ex.oracle``): the
float64 oracle and, for a reference placed elsewhere, the baseline (the reference at the
implementation's dtype and device), their VJPs and term magnitudes, the rounding spreads of the
reference's intermediates, whether the oracle computes the reference's function, the verdict of
one value (:meth:`Oracle.judge`) and, for a reference that cannot differentiate, finite
differences."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import torch

from equiv.compare import Mismatch
from equiv.errors import error_text
from equiv.examples import Side, Template
from equiv.execution.calls import call, cotangent, defined, isolated, user_error, vjp
from equiv.execution.pairing import RefRun, ReferenceError_, reference_run, split
from equiv.execution.rounding import rounding_spread
from equiv.execution.state import state_with
from equiv.execution.verdict import (
    FD_MAX_ELEMENTS,
    OracleVJP,
    fd_check,
    fd_plan,
    fd_impl_terms,
    fd_reference,
    fd_terms,
    judge_leaf,
    named_values,
    summed_terms,
)
from equiv.numerics import NumericMismatch, oracle_disagreement, oracle_dtype

if TYPE_CHECKING:
    from equiv.execution.record import Execution


class Oracle:
    """The reference's runs that judge one record's values: the float64 oracle (:meth:`run`)
    and, for a reference placed elsewhere, the baseline (:meth:`baseline`); their values,
    VJPs, final argument states and term sizes; the rounding spreads of the reference's
    intermediates; the verdict of one value (:meth:`judge`); finite differences.

    A view of one :class:`~equiv.execution.record.Execution`, built by each ``ex.oracle``
    (so no reference cycle keeps a record alive): it reads the record's example, pairing and
    cotangents, and caches every run on the record (``ex.cache``), taken at most once and only
    when a value needs it."""

    __slots__ = ("ex",)

    def __init__(self, ex: Execution) -> None:
        self.ex = ex

    def run(self) -> RefRun:
        """The reference once more on the same values in float64 (float32 where the device has
        none), on its own device; cached, run at most once, only when a value needs it. The
        reference run itself when it already ran in that dtype (``reference_dtype``)."""
        ex = self.ex
        if "oracle" not in ex.cache:
            device = ex.place.ref_device or ex.place.device
            dtype = oracle_dtype(torch.float32, device)
            if ex.place.ref_dtype == dtype and ex.ref_side is not None:
                run = reference_run(ex.spec, ex.ref_fn, ex.ref_side, ex.ref_result,
                                    ex.ref_exc, called=True)
            else:
                side = ex.template.instantiate(device=device, dtype=dtype)
                run = reference_run(ex.spec, ex.ref_fn, side)
            ex.cache["oracle"] = run
        return ex.cache["oracle"]

    def baseline(self) -> RefRun | None:
        """The reference at the implementation's dtype and device: None when that is the
        record's own reference run; with ``reference_dtype``/``reference_device``, one more
        call (cached)."""
        ex = self.ex
        if not ex.place.cross:
            return None
        if "baseline" not in ex.cache:
            side = ex.template.instantiate(device=ex.place.device)
            ex.cache["baseline"] = reference_run(ex.spec, ex.ref_fn, side)
        return ex.cache["baseline"]

    def value(self, name: str) -> Any:
        """The oracle's value of the pairing name ``name`` (e.g. ``"output[0]"``), or None."""
        return self.run().values.get(name)

    def baseline_value(self, name: str) -> Any:
        run = self.baseline()
        return None if run is None else run.values.get(name)

    def grads_of(self, run: RefRun | None, n: int) -> list[torch.Tensor] | None:
        """The VJP for cotangent ``n`` of a reference run ``run`` (one per pairing group), or
        None when it cannot be taken."""
        ex = self.ex
        if run is None or run.side is None or not run.values:
            return None
        p = ex.pairing()
        outs = [run.values.get(name) for name, _, _ in p.pairs]
        leaves = [run.side.leaves[g.index] for g in p.groups]
        if not all(isinstance(o, torch.Tensor) and o.requires_grad for o in outs) or \
                any(leaf is None for leaf in leaves):
            return None
        outs, given = defined(outs, ex.cotangents()[n - 1])
        grads, err = vjp(outs, leaves, _cast(given, outs))
        return None if err is not None else grads

    def grads(self, n: int) -> list[torch.Tensor] | None:
        """The oracle's VJP for cotangent ``n`` (cast to float64), one per pairing group; None
        when the oracle cannot differentiate. Cached."""
        ex = self.ex
        key = f"oracle-grads-{n}"
        if key not in ex.cache:
            ex.cache[key] = self.grads_of(self.run(), n)
        return ex.cache[key]

    def baseline_grads(self, n: int) -> list[torch.Tensor] | None:
        """The baseline's VJP for cotangent ``n``: None when the baseline is the record's own
        reference run (:meth:`~equiv.execution.record.Execution.ref_grads`)."""
        ex = self.ex
        key = f"baseline-grads-{n}"
        if key not in ex.cache:
            ex.cache[key] = self.grads_of(self.baseline(), n)
        return ex.cache[key]

    def state(self, j: int) -> torch.Tensor | None:
        """What slot ``j`` must hold after the call, by the oracle (see
        :func:`~equiv.execution.state.expected_state`)."""
        return self._state("oracle-state", self.run(), j)

    def baseline_state(self, j: int) -> torch.Tensor | None:
        """The same by the baseline: None when that is the record's reference run."""
        run = self.baseline()
        return None if run is None else self._state("baseline-state", run, j)

    def _state(self, key: str, run: RefRun, j: int) -> torch.Tensor | None:
        ex = self.ex
        if key not in ex.cache:
            state = None
            if run.why is None and run.side is not None and run.side.tensors:
                t = run.side.tensors[0]
                dtype = oracle_dtype(torch.float32, t.device) if key == "oracle-state" else None
                try:
                    state = state_with(ex.template, run.finals, t.device, dtype)
                except ReferenceError_:
                    state = None
            ex.cache[key] = state
        state = ex.cache[key]
        if state is None:
            return None
        side, unrepresentable = state
        return unrepresentable.get(j, side.tensors[j])

    def _fresh_run(self, template: Template, names: list[str],
                   shuffled: bool = False) -> tuple[Side, list[torch.Tensor]] | None:
        """The reference once more in float64 on a fresh copy of ``template`` (``shuffled``:
        every storage reversed): its side and its values ``names``; None when they are not all
        differentiable."""
        ex = self.ex
        device = ex.place.ref_device or ex.place.device
        side = template.instantiate(device=device, dtype=oracle_dtype(torch.float32, device),
                                    shuffled=shuffled)
        run = reference_run(ex.spec, ex.ref_fn, side)
        outs = [run.values.get(n) for n in names]
        if run.why is not None or not all(isinstance(o, torch.Tensor) and o.requires_grad
                                          for o in outs):
            return None
        return side, outs

    def vjps(self, template: Template, names: list[str], groups: list[Any],
             cots: list[list[torch.Tensor]], *,
             shuffled: bool = False) -> list[list[torch.Tensor]] | None:
        """The reference once more in float64 on a fresh copy of ``template`` (e.g. another
        requires_grad pattern; ``shuffled``: every storage reversed, as a schedule's even
        forwards see it), its VJP w.r.t. ``groups``' leaves of the values ``names`` for
        each cotangent list in ``cots`` (cast to float64); None when it cannot. For a check's
        own rerun, called only when a value fails the per-dtype default."""
        found = self._fresh_run(template, names, shuffled)
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

    def rerun_vjp(self, template: Template, names: list[str],
                  cots: list[torch.Tensor]) -> OracleVJP | None:
        """The oracle of a rerun on ``template`` (another requires_grad pattern) with the
        cotangent ``cots`` for its values ``names`` (cast to float64): its gradients and the
        size of their terms, judged as the record's own (:meth:`judge`'s ``cotangent``); None
        when it cannot differentiate. For a check's own rerun, called only when a value fails
        the per-dtype default."""
        found = self._fresh_run(template, names)
        if found is None:
            return None
        side, outs = found
        return OracleVJP(template, side, outs, _cast(cots, outs), self.ex.cot_seed + 104729 * 3)

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
        2, the record's, or a callable returning a rerun's oracle (:meth:`rerun_vjp`);
        under the record's expanded, constant cotangent also at the size the gradient has
        for a random one); ``rounding``: a lazy :meth:`rounding_spread` (an output) or
        :meth:`gradient_spread` (a gradient) for a value of the record's own example (the
        term-magnitude floor); ``precision``: the value is
        judged for precision (the forward check: float16/bfloat16 by the rule in ULPs)."""
        ex = self.ex
        terms = 1.0 if group is None else summed_terms(ex.template, group)
        magnitude = _magnitude(self, cotangent, group, terms)
        m = judge_leaf(name, actual, expected, rtol=ex.spec.rtol, atol=ex.spec.atol,
                       oracle=oracle, baseline=baseline, kind=kind, why=self.why,
                       device=ex.device, terms=terms, cross=ex.place.cross,
                       magnitude=magnitude, example_size=lambda: _example_size(ex, kind),
                       rounding=rounding, precision=precision,
                       same_function=None if kind == "outputs" else self.agrees)
        overlapping = group is not None and not group.simple
        return _precision_difference(ex, name, actual, m, overlapping)

    def agrees(self) -> bool:
        """Whether the float64 oracle computes the reference's function on this example: every
        floating value of its forward (outputs, final values of mutated arguments) agrees with
        the reference's at its dtype within rounding (:func:`oracle_disagreement`). A gradient
        whose float64 and low-precision values differ far more then shows cancellation (a
        layer norm over two elements), not another function (a dropout mask drawn in float64
        is seen in the forward already). Cached."""
        ex = self.ex
        if "oracle_agrees" not in ex.cache:
            at_dtype = self.baseline()
            ours = (named_values(ex.expected, ex.finals, ex.consumed) if at_dtype is None
                    else at_dtype.values)
            size = _example_size(ex, "outputs")
            ex.cache["oracle_agrees"] = all(
                oracle_disagreement(o, b, b.dtype, None, size) is None
                for name, o in self.run().values.items()
                for b in [ours.get(name)]
                if isinstance(o, torch.Tensor) and isinstance(b, torch.Tensor)
                and b.dtype.is_floating_point and o.shape == b.shape)
        return ex.cache["oracle_agrees"]

    def vjp(self, n: int) -> OracleVJP | None:
        """The oracle's run with cotangent ``n`` (1 or 2; random probes seeded from it), or
        None when the oracle has no differentiated values."""
        ex = self.ex
        run = self.run()
        outs = [run.values.get(name) for name, _, _ in ex.pairing().pairs]
        if run.side is None or not all(isinstance(o, torch.Tensor) and o.requires_grad
                                       for o in outs):
            return None
        outs, given = defined(outs, ex.cotangents()[n - 1])
        return OracleVJP(ex.template, run.side, outs, _cast(given, outs),
                         ex.cot_seed + 104729 * n)

    def probe_magnitude(self, n: int, group: Any) -> torch.Tensor | None:
        """The oracle's gradient w.r.t. ``group`` for random cotangents of cotangent ``n``'s
        mean size, root mean square over three (:meth:`OracleVJP.probe`). None if unknown."""
        return _sized(self.vjp(n), lambda v: v.probe(group))

    def rounding_spread(self, name: str) -> torch.Tensor | None:
        """How far rounding the reference's intermediates at float32's precision moves the
        value ``name`` (a pairing name), per element: :func:`~equiv.execution.rounding.
        rounding_spread` over the oracle's own float64 inputs, read through detached aliases (four
        reference calls, no copy; cached, only for a value the rule rejects without it). None
        when unknown."""
        ex = self.ex
        if "rounding" not in ex.cache:
            run, device = self.run(), ex.place.ref_device or ex.place.device
            dtype = oracle_dtype(torch.float32, device)

            def again() -> dict[str, Any] | None:  # the oracle's own inputs: the reference
                side = run.side.detached() if run.side is not None else \
                    ex.template.instantiate(grad=False, device=device, dtype=dtype)
                rerun = reference_run(ex.spec, ex.ref_fn, side)  # only reads them: no copy
                return None if rerun.why is not None else rerun.values

            inputs = () if run.side is None else run.side.tensors
            ex.cache["rounding"] = {} if run.why is not None or dtype != torch.float64 \
                else rounding_spread(again, run.values, ex.cot_seed, inputs=inputs)
        return ex.cache["rounding"].get(name)

    def gradient_spread(self, n: int, i: int) -> torch.Tensor | None:
        """How far rounding the reference's intermediates, forward and backward, at float32's
        precision moves its gradient w.r.t. pairing group ``i`` for cotangent ``n`` (1 or 2):
        :func:`~equiv.execution.rounding.rounding_spread` over the float64 VJP on fresh copies
        of the example (four reference calls and backwards per cotangent, cached, only for a
        gradient the rule rejects without it). None when unknown."""
        ex = self.ex
        key = f"grad-rounding-{n}"
        if key not in ex.cache:
            oracle, device = self.grads(n), ex.place.ref_device or ex.place.device
            dtype = oracle_dtype(torch.float32, device)

            def again() -> dict[str, Any] | None:
                rerun = reference_run(ex.spec, ex.ref_fn,
                                      ex.template.instantiate(device=device, dtype=dtype))
                grads = None if rerun.why is not None else self.grads_of(rerun, n)
                return None if grads is None else {str(j): g for j, g in enumerate(grads)}

            ex.cache[key] = {} if oracle is None or dtype != torch.float64 else \
                rounding_spread(again, {str(j): g for j, g in enumerate(oracle)},
                                ex.cot_seed + n)
        return ex.cache[key].get(str(i))

    def why(self) -> str | None:
        """Why the oracle cannot be used (the reference raised in float64), else None."""
        return self.run().why

    def finite_differences(self) -> tuple[Any, str | None]:
        """The implementation's VJP against central differences of the reference in float64
        (eight reference calls), for a reference that cannot differentiate: (FiniteDifference,
        None), or (None, why not) -- why None when nothing is differentiated. Cached."""
        ex = self.ex
        if "finite-differences" not in ex.cache:
            ex.cache["finite-differences"] = _finite_differences(ex)
        return ex.cache["finite-differences"]


def _magnitude(oracle: Oracle, cot: int | Callable[[], OracleVJP | None] | None, group: Any,
               terms: float) -> Any:
    """The lazy size of the terms a gradient for the cotangent ``cot`` sums, where the
    oracle's own value can understate it, else None: an overlapping argument's summed
    terms; the gradient for a random cotangent when the record's cotangent is one value
    expanded (a constant cotangent through softmax or a normalisation cancels to exactly
    0, which the implementation reaches only up to the rounding of terms of that size)."""
    if cot is None or group is None:
        return None
    run = (lambda: oracle.vjp(cot)) if isinstance(cot, int) else cot
    if terms > 1:
        return lambda: _sized(run(), lambda v: v.terms(group))
    if isinstance(cot, int) and oracle.ex.cot_variant.kind == "expanded":
        return lambda: _sized(run(), lambda v: v.probe(group))
    return None


def _example_size(ex: Execution, kind: str) -> float:
    """The largest finite ``|value|`` of the example's floating inputs and, for a gradient,
    of its cotangents: what the reference's rounding is measured against where its result
    cancels (a layer norm of a constant row is 0 in float64, and rounds at the inputs' size
    at its dtype)."""
    values = [g.values for g in ex.template.groups if g.dtype.is_floating_point]
    if kind != "outputs":
        values += [c for cots in ex.cotangents() for c in cots
                   if isinstance(c, torch.Tensor) and c.dtype.is_floating_point]
    return max((_largest_finite(v) for v in values if v.numel()), default=0.0)


def _largest_finite(v: torch.Tensor, chunk: int = 1 << 18) -> float:
    """The largest finite ``|v|`` (0 if none), read at ``v``'s dtype in chunks: no copy."""
    flat = v.detach().reshape(-1)
    return max(float(torch.nan_to_num(flat[i:i + chunk].abs(), nan=0.0, posinf=0.0).max())
               for i in range(0, flat.numel(), chunk))


def _precision_difference(ex: Execution, name: str, actual: Any, m: Mismatch | None,
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
    ex.cache.setdefault("precision-notes", []).append(
        f"{name}: {what} differences within rounding level of the reference's own error "
        "against float64 passed (a precision difference, not a wrong value)")
    return None


def _finite_differences(ex: Execution) -> tuple[Any, str | None]:
    """:meth:`Oracle.finite_differences`, uncached."""
    assert ex.impl_side is not None
    impl_values = named_values(ex.impl_result, {a: ex.impl_side.argument(a)
                                                for a in ex.finals}, ex.consumed)
    ref_values = named_values(ex.expected, ex.finals, ex.consumed)
    plan = fd_plan(ex.template, ex.impl_side, impl_values, ref_values)
    if plan is None:
        big = fd_plan(ex.template, ex.impl_side, impl_values, ref_values, limit=None)
        return None, None if big is None else (
            f"the example has more than {FD_MAX_ELEMENTS} differentiable elements for "
            "finite differences")
    gen = torch.Generator().manual_seed(ex.cot_seed)
    cots = [cotangent(v, gen) for v in plan.impl_values]
    grads, err = vjp(plan.impl_values, plan.impl_leaves, [c.clone() for c in cots])
    if err is not None:
        return None, f"the implementation's backward raised {type(err).__name__}"
    fn = fd_reference(ex.template, plan, ex.ref_fn, lambda r: split(ex.spec, r), ex.device)
    terms = fd_terms(ex.template, plan, ex.impl_side, cots)
    try:
        with isolated():
            fd = fd_check(fn, plan, cots, grads, plan.impl_values[0].dtype,
                          ex.cot_seed, terms)
            if not fd.ok and fd.nonfinite >= 0:  # judged again at the impl's own rounding
                wider = fd_impl_terms(plan, terms, lambda: _impl_vjp(ex, plan, cots),
                                      ex.cot_seed)
                if wider is not None:
                    fd = fd_check(fn, plan, cots, grads, plan.impl_values[0].dtype,
                                  ex.cot_seed, wider)
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


def _impl_vjp(ex: Execution, plan: Any, cots: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """The eager implementation's gradients per ``plan`` group for ``cots`` on a fresh
    copy of the example (None if it raised)."""
    side = ex.template.instantiate(device=None if ex.device == "cpu" else ex.device)
    result, exc = call(ex.spec.impl, side)
    if exc is not None:
        return None
    values = named_values(result, {a: side.argument(a) for a in ex.finals}, ex.consumed)
    outs = [values.get(n) for n in plan.names]
    leaves = [side.leaves[g.index] for g in plan.groups]
    if not all(isinstance(o, torch.Tensor) and o.requires_grad for o in outs) or \
            any(leaf is None for leaf in leaves):
        return None
    grads, err = vjp(outs, leaves, [c.clone() for c in cots])
    return None if err is not None else grads


def _cast(cots: list[torch.Tensor], outs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each cotangent detached, at its value's dtype and device (e.g. the oracle's float64)."""
    return [c.detach().to(device=o.device, dtype=o.dtype) for c, o in zip(cots, outs)]


def _sized(run: OracleVJP | None,
           size: Callable[[OracleVJP], torch.Tensor | None]) -> torch.Tensor | None:
    return None if run is None else size(run)


def _overflows(values: dict[str, Any]) -> bool:
    """Some floating value holds inf or NaN."""
    return any(isinstance(v, torch.Tensor) and v.dtype.is_floating_point
               and not bool(torch.isfinite(v.detach()).all()) for v in values.values())


def by_differences(ex: Execution) -> str | None:
    """Why the first backward is judged only by finite differences of the reference (it cannot
    differentiate: its backward raises, or its result has no autograd history), else None. A
    second backward (a new cotangent, or double backward) then has nothing to be compared
    with."""
    pairing = ex.pairing()
    if pairing.pairs:
        err = ex.ref_grad_error(1) if pairing.ok else None
        return None if err is None else f"its backward raised {type(err).__name__}"
    fd, _ = ex.oracle.finite_differences()
    return None if fd is None else "its result has no autograd history"


def fd_only_note(check: str, what: str, why: str) -> str:
    """The note of a check of a second backward where only finite differences judge the first
    (:func:`by_differences`)."""
    return (f"{check} not compared: the reference cannot differentiate ({why}), and finite "
            f"differences judge the first backward only ({what} was not checked)")

