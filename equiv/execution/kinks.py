"""The reference's kinks where a value mismatches: points where it is not differentiable, or
where its autograd value is not its derivative.

:func:`kink_cause` names the worst element of a gradient mismatch when the reference's output
or gradient jumps there (the line of an explained failure, never a verdict);
:func:`derivative_kink` does the same for a second-order mismatch (there the reference's
autograd second derivative may jump too), so that double-backward sets the element aside.

:func:`subgradient_choice` accepts a mismatching gradient there: at a point where the reference
is not differentiable (``hardtanh`` at its bound, ``clamp`` with ``lo == hi``), or where its
autograd value is not its derivative (``log1p(exp(-|x|)) + relu(-x)`` at 0 is smooth while
autograd takes ``abs``'s and ``relu``'s subgradient 0; ``std`` of an expanded constant), an
implementation returning the reference's own derivative from one side is correct.

For the worst mismatched element, the reference's scalar ``sum(value * cotangent)`` is computed
in float64 with that storage element moved by ``+-h`` and ``+-h/4``. The element is a kink of the
reference's autograd when a one-sided difference stays away from the autograd value as the
step shrinks (at a smooth point it closes in as the step does). The implementation's value is
accepted there when it equals that one-sided difference (or lies between the two sides where
they differ); the element is then taken out of the comparison (set equal on both sides) and
the gradient judged again. Where the two sides agree (the reference is differentiable, its
autograd value is not its derivative) up to :data:`_ELEMENTS` elements are accepted (a few
such points, not a reference whose backward is wrong everywhere); where they differ (a true
kink) :data:`_PROBED` are probed one at a time (all of them in a small gradient:
:data:`_BUDGET`) and the rest together (:func:`_together`);
elements where the reference's float64 autograd is NaN (an expanded constant at ``std``'s
kink; the reference overflowing in float64 too) are probed one at a time, up to
:data:`_UNDEFINED` in all (more in a small gradient: :data:`_BUDGET`). Anything else keeps the
finding.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from equiv._compat import tree_flatten
from equiv.compare import dtype_tolerance
from equiv._explain import explaining
from equiv.errors import user_error
from equiv.examples import Side
from equiv.execution.pairing import reference_run
from equiv.strategies._derived import jumps_at, smooth_at

if TYPE_CHECKING:
    from equiv.execution.record import Execution

_ELEMENTS = 4  # mismatched elements accepted per gradient where the reference is smooth
#: elements probed one at a time in all, counting kinks and those where its float64 autograd
#: value is NaN (0 * inf: std of a constant row); each probe is five reference calls
_UNDEFINED = 32
#: ... and, for kinks too, more where the gradient is small: up to this many elements times its
#: size (each probe runs the reference on the whole example)
_BUDGET = 2 ** 16
#: kinks probed one at a time before the rest of the mismatched elements are probed together
_PROBED = 8
_STEP = 1e-5  # relative to max(1, |value|)
_CLOSES = 0.5  # at a smooth point the difference shrinks with the step (to ~1/4)


def subgradient_choice(ex: Any, name: str, i: int, actual: torch.Tensor, expected: torch.Tensor,
                       m: Any, n: int) -> str | None:
    """A note when every mismatch of gradient ``i`` (``name``, for cotangent ``n``) is at a
    point where the implementation takes one of the reference's one-sided derivatives (and the
    rest then passes); else None (the finding stands)."""
    group = ex.pairing().groups[i]
    oracle = (ex.oracle.grads(n) or [None] * (i + 1))[i]
    if oracle is None or len(group.slots) != 1 or not group.dtype.is_floating_point:
        return None
    baseline = (ex.oracle.baseline_grads(n) or [None] * (i + 1))[i]
    values = [t.detach().clone() for t in (expected, oracle, baseline) if t is not None]
    seen: list[str] = []
    moved: list[tuple[int, float, float]] = []  # (storage element, side, implementation's)
    smooth = kinks = 0  # accepted where the reference is differentiable / is not
    small = _BUDGET // max(actual.numel(), 1)  # a small gradient is probed element by element
    most, alone = max(_UNDEFINED, small), max(_PROBED, small)
    while m is not None and len(seen) < most and kinks < alone:
        index = getattr(m, "index", None)
        if index is None or len(index) != actual.dim():
            return None
        element, value = _storage_index(ex, group, index), float(actual.detach()[index])
        probed = _one_sided(ex, group, element, n, float(oracle[index]), value, actual.dtype)
        if probed is None:
            return None
        side, kink = probed
        valued = not math.isnan(float(oracle[index]))
        kinks += kink and valued
        smooth += not kink and valued
        if smooth > _ELEMENTS:
            return None
        if valued and side in _SIGN:
            moved.append((element, _SIGN[side], value))
        seen.append(f"{_at(name, index)} ({side})")
        m = _rejudge(ex, name, i, n, actual, values, [index])
    if m is not None and kinks >= alone and smooth == 0:  # many kinks: the rest together
        rest = _together(ex, group, i, n, actual, values[0])
        if rest is None:
            return None
        seen += [f"{_at(name, index)} ({side})" for index, side, _ in rest]
        moved += [(element, _SIGN[side], float(actual.detach()[index]))
                  for index, side, element in rest if side in _SIGN]
        m = _rejudge(ex, name, i, n, actual, values, [index for index, _, _ in rest])
    if m is not None or not _jointly(ex, group, n, moved, actual.dtype):
        return None
    return (f"gradient w.r.t. {name!r}: at {_listed(seen)} the reference is not "
            "differentiable (or its autograd value there is not its derivative) and "
            "the implementation takes the reference's own one-sided derivative (or, at a "
            "kink, a value between the two); "
            "accepted there, the rest compared")


#: the direction a one-sided derivative is taken in
_SIGN = {"from above": 1.0, "from below": -1.0}


def _jointly(ex: Any, group: Any, n: int, moved: list[tuple[int, float, float]],
             dtype: torch.dtype) -> bool:
    """The implementation's values at the elements accepted one-sidedly, taken together, are
    the reference's derivative along those sides: a finite difference of the reference with
    all of them moved at once (each by its own random share of the step, toward its side)
    agrees with them. Each alone can be a one-sided derivative while together they are not:
    a backward giving the whole cotangent to each of several ties of a max."""
    if len(moved) < 2:
        return True
    elements = torch.tensor([e for e, _, _ in moved])
    picked = torch.tensor([v for _, _, v in moved], dtype=torch.float64)
    sign = torch.tensor([s for _, s, _ in moved], dtype=torch.float64)
    weights = torch.rand(len(moved), generator=torch.Generator().manual_seed(1234),
                         dtype=torch.float64) + 0.5
    step = sign * weights * _steps(group, elements)
    losses = _claimed(lambda: [_loss(ex, group, elements, n, d) for d in (0.0, step, step / 4)])
    if losses is None:
        return False
    far, near = losses[1] - losses[0], (losses[2] - losses[0]) * 4
    rel = _rel(dtype)
    predicted = float((step * picked).sum())
    scale = float((step.abs() * (1 + picked.abs())).sum())
    return abs(predicted - near) <= 2 * abs(far - near) + rel * scale


def _rejudge(ex: Any, name: str, i: int, n: int, actual: torch.Tensor,
             values: list[torch.Tensor], indices: list[tuple[int, ...]]) -> Any:
    """The gradient judged again with ``indices`` out of the comparison (the expected, oracle
    and baseline values set to the implementation's there): its mismatch, or None."""
    for index in indices:
        for v in values:
            v[index] = actual.detach()[index].to(v.dtype)
    e, o, b = values[0], values[1], values[2] if len(values) > 2 else None
    group = ex.pairing().groups[i]
    return ex.oracle.judge(name, actual, e, kind="gradients", group=group, cotangent=n,
                           oracle=o, baseline=b, rounding=lambda: ex.oracle.gradient_spread(n, i))


def _together(ex: Any, group: Any, i: int, n: int, actual: torch.Tensor, expected: torch.Tensor
              ) -> list[tuple[tuple[int, ...], str, int]] | None:
    """Every element where ``actual`` and ``expected`` still differ, probed at once: the
    reference's float64 autograd with all of them moved a little up (and down) gives each
    one's derivative from above (below); the implementation must take one of the two, or a
    value between them, at each, at a kink (they differ); where that fails, each is moved
    toward the implementation's choice (:func:`_directed`). ``(index, side, storage element)``
    per element, or None. (:func:`_jointly` then tests the chosen sides together.)"""
    a, e = (t.detach().to("cpu", torch.float64) for t in (actual, expected))  # any device
    rtol, atol = dtype_tolerance(actual.dtype)
    where = (~torch.isclose(a, e, rtol=rtol, atol=atol, equal_nan=True)).nonzero()
    if not len(where):
        return None
    if group.simple:  # the gradient has the argument's strides; else it is the flat storage
        stride = torch.tensor(ex.template.slots[group.slots[0]].stride, dtype=torch.long)
        elements = (where * stride).sum(-1)
    else:
        elements = where[:, 0]
    h, picked = _steps(group, elements), a[tuple(where.T)]
    shifted = _claimed(lambda: [_shifted_grads(ex, group, i, n, elements, sign * h / 4)
                                for sign in (1.0, -1.0)])
    if shifted is None or shifted[0] is None or shifted[1] is None:
        return None
    above, below = (g[tuple(where.T)] for g in shifted)
    rel = _rel(actual.dtype)
    up, down, between = _sides(picked, above, below, rel)
    if not bool(between.all()):  # ties moved together stay tied: move them apart instead
        up, down = _directed(ex, group, i, n, (where, elements, h), picked, above, below, rel)
        if up is None:
            return None
    side = {(True, False): "from above", (False, True): "from below"}
    return [(tuple(int(k) for k in index),
             side.get((bool(u), bool(d)), "between the one-sided derivatives"), int(element))
            for index, u, d, element in zip(where, up, down, elements)]


def _sides(picked: torch.Tensor, above: torch.Tensor, below: torch.Tensor, rel: float
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per element: the implementation's value is the derivative from above, from below, or
    lies between the two where they differ (a kink; at a smooth point they differ only by the
    curvature over the step): ``between`` is False where it is none of these."""
    largest = torch.maximum(above.abs(), below.abs())
    slack = rel * (1 + largest)
    up, down = (picked - above).abs() <= slack, (picked - below).abs() <= slack
    gap = (above - below).abs()
    apart = (gap > 10 * rel * largest) & (gap > 1e-12)
    between = apart & (picked >= torch.minimum(above, below) - slack) & (
        picked <= torch.maximum(above, below) + slack)
    return up, down, between


def _directed(ex: Any, group: Any, i: int, n: int, at: tuple[torch.Tensor, ...],
              picked: torch.Tensor, above: torch.Tensor, below: torch.Tensor, rel: float
              ) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
    """Where moving every element up (or down) together kept ties tied (``max`` of a window):
    move each toward the implementation's choice instead, up where it takes more than the
    reference's share (``(picked - share) * share > 0``) and down elsewhere, and require the
    reference's float64 autograd there to be the implementation's value at every element.
    ``(up, down)`` masks, or ``(None, None)``."""
    where, elements, h = at
    share = (above + below) / 2
    toward = torch.where((picked - share) * share > 0, 1.0, -1.0).to(torch.float64)
    moved = _claimed(lambda: _shifted_grads(ex, group, i, n, elements, toward * h / 4))
    if moved is None:
        return None, None
    got = moved[tuple(where.T)]
    if not bool(((picked - got).abs() <= rel * (1 + got.abs())).all()):
        return None, None
    return toward > 0, toward < 0


def _shifted_grads(ex: Any, group: Any, i: int, n: int, elements: torch.Tensor,
                   shift: torch.Tensor) -> torch.Tensor | None:
    """The reference's float64 gradient ``i`` for cotangent ``n`` with the storage
    ``elements`` of ``group`` moved by ``shift``, or None."""
    device = ex.place.ref_device or ex.place.device
    side = ex.template.instantiate(device=device, dtype=torch.float64)
    side.storage(group)[elements.to(device)] += shift.to(device)
    run = reference_run(ex.spec, ex.ref_fn, side)
    if run.exc is not None:
        raise run.exc
    if run.why is not None:
        raise _NoClaim(run.why)
    grads = ex.oracle.grads_of(run, n)
    return None if grads is None else grads[i].detach().to("cpu", torch.float64)


def _rel(dtype: torch.dtype) -> float:
    """The relative agreement a probe asks of two derivatives: the implementation dtype's
    rounding (8 ulps), no finer than 1e-3 (the finite differences' own error)."""
    return max(1e-3, 8 * torch.finfo(dtype).eps)


def _at(name: str, index: Sequence[int]) -> str:
    """``"x[0, 1]"``."""
    return f"{name}[{', '.join(map(str, index))}]"


def _listed(elements: list[str], shown: int = 4) -> str:
    """``elements`` joined, the first ``shown`` of them and how many more."""
    more = len(elements) - shown
    return ", ".join(elements[:shown]) + (f" and {more} more elements" if more > 0 else "")


def _storage_index(ex: Any, group: Any, index: tuple[int, ...]) -> int:
    """The storage element of ``group`` a gradient element ``index`` belongs to (a simple
    group's gradient has the argument's shape and strides; another's is its flat storage)."""
    if not group.simple:
        return int(index[0])
    stride = ex.template.slots[group.slots[0]].stride
    return sum(k * s for k, s in zip(index, stride))


def _one_sided(ex: Any, group: Any, element: int, n: int, auto: float, impl: float,
               dtype: torch.dtype) -> tuple[str, bool] | None:
    """Which of the reference's derivatives along ``element`` the implementation's ``impl``
    takes where the reference's autograd value ``auto`` is not its derivative: ``"from
    above"``/``"from below"`` (a one-sided difference away from ``auto`` as the step shrinks),
    or ``"between the one-sided derivatives"`` at a kink (the two sides differ; any value
    between them is a subgradient: ``abs`` at 0 takes 0); with whether the element is a kink
    (the two one-sided derivatives differ: the reference is not differentiable there). Else
    None."""
    h = float(_steps(group, torch.tensor([element]))[0])

    def differences() -> dict[str, tuple[float, float]]:
        at, sides = _loss(ex, group, element, n, 0.0), {}
        for sign, label in ((1.0, "from above"), (-1.0, "from below")):
            far = (_loss(ex, group, element, n, sign * h) - at) / (sign * h)
            near = (_loss(ex, group, element, n, sign * h / 4) - at) / (sign * h / 4)
            sides[label] = (far, near)
        return sides

    sides = _claimed(differences)
    if sides is None:
        return None
    kink = _apart(*sides.values(), dtype)
    for label, (far, near) in sides.items():
        if _kink(far, near, auto) and _matches(impl, near, far, dtype):
            return label, kink
    return ("between the one-sided derivatives", True) if kink and _between(
        impl, *sides.values(), dtype) else None


def _steps(group: Any, elements: torch.Tensor) -> torch.Tensor:
    """The probe's step for each storage element: :data:`_STEP` relative to max(1, |value|)."""
    values = group.values.reshape(-1)[elements].detach().to("cpu", torch.float64)
    return _STEP * values.abs().clamp(min=1)


def _claimed(probe: Callable[[], Any]) -> Any:
    """``probe()``, or None where the reference raised or gave no values (no claim)."""
    try:
        return probe()
    except _NoClaim:
        return None
    except BaseException as e:  # the reference raised (SystemExit too): no claim
        if not user_error(e):
            raise
        return None


def _apart(above: tuple[float, float], below: tuple[float, float], dtype: torch.dtype) -> bool:
    """The two one-sided derivatives differ beyond both estimates' errors (a kink)."""
    return _slack(above, below, dtype) is not None


def _slack(above: tuple[float, float], below: tuple[float, float],
           dtype: torch.dtype) -> float | None:
    """The error of the one-sided estimates where the two sides differ beyond ten times it;
    else None (no kink seen)."""
    (fa, na), (fb, nb) = above, below
    if not all(math.isfinite(v) for v in (fa, na, fb, nb)):
        return None
    error = 2 * (abs(fa - na) + abs(fb - nb))
    slack = error + _rel(dtype) * (1 + max(abs(na), abs(nb)))
    return slack if abs(na - nb) > 10 * slack else None


def _between(impl: float, above: tuple[float, float], below: tuple[float, float],
             dtype: torch.dtype) -> bool:
    """``impl`` lies between the two one-sided derivatives, which differ beyond both
    estimates' errors (a kink)."""
    slack = _slack(above, below, dtype)
    if slack is None or not math.isfinite(impl):
        return False
    (_, na), (_, nb) = above, below
    return min(na, nb) - slack <= impl <= max(na, nb) + slack


def _kink(far: float, near: float, auto: float) -> bool:
    """The one-sided difference stays away from autograd's value as the step shrinks."""
    if not math.isfinite(near):
        return False
    if not math.isfinite(auto):
        return True
    gap = abs(near - auto)
    return gap > 1e-4 * (1 + abs(auto)) and gap > _CLOSES * abs(far - auto)


def _matches(impl: float, near: float, far: float, dtype: torch.dtype) -> bool:
    """``impl`` equals the one-sided derivative within its estimate's error and the
    implementation dtype's rounding."""
    rel = _rel(dtype)
    return abs(impl - near) <= 2 * abs(far - near) + rel * (1 + abs(near))


def _loss(ex: Any, group: Any, element: int | torch.Tensor, n: int,
          step: float | torch.Tensor) -> float:
    """``sum(value * cotangent n)`` over the differentiated values of the reference, in float64,
    with storage ``element`` of ``group`` moved by ``step`` (or several elements, each by its
    own step)."""
    device = ex.place.ref_device or ex.place.device
    side = ex.template.instantiate(grad=False, device=device, dtype=torch.float64)
    if isinstance(step, torch.Tensor):  # several elements, each moved by its own step
        side.storage(group)[element.to(device)] += step.to(device)
    elif step:
        side.storage(group)[element] += step
    run = reference_run(ex.spec, ex.ref_fn, side)
    if run.exc is not None:
        raise run.exc
    if run.why is not None:
        raise _NoClaim(run.why)
    values = run.values
    total = 0.0
    for (pair, _, _), cot in zip(ex.pairing().pairs, ex.cotangents()[n - 1]):
        v = values.get(pair)
        if cot is None or not isinstance(v, torch.Tensor) or not v.dtype.is_floating_point:
            continue
        total += float((v.detach().to(torch.float64) * cot.to(v.device, torch.float64)).sum())
    return total


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


def _probe_site(ex: Execution, group: Any, m: Any) -> tuple[Any, ...] | None:
    """:func:`_kink_site` with the reference's bound side and its args and kwargs."""
    site = _kink_site(ex, group, m)
    if site is None:
        return None
    side = ex.ref_side
    assert side is not None
    return (*site, side, side.bound.args, dict(side.bound.kwargs))


def kink_cause(ex: Execution, group: Any, m: Any) -> str | None:
    """When the worst element is an input where the reference is not differentiable (its
    output or gradient jumps there, e.g. ``clamp`` at its bounds), the line saying so: the two
    sides may legitimately pick different one-sided derivatives there. Only for a failure that
    is explained (:func:`equiv._explain.explaining`): it never changes a verdict."""
    if not explaining():
        return None
    site = _probe_site(ex, group, m)
    if site is None:
        return None
    k, flats, where, side, args, kwargs = site
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


def undefined_cause(ex: Any, i: int, n: int, m: Any) -> str | None:
    """When the reference's own float64 gradient ``i`` (cotangent ``n``) is NaN at the worst
    element of a mismatch where the implementation's is a number: the line saying the
    reference has no value to judge it by there. Else None."""
    index = getattr(m, "index", None)
    oracle = (ex.oracle.grads(n) or [None] * (i + 1))[i]
    if index is None or oracle is None or len(index) != oracle.dim() or \
            not oracle.dtype.is_floating_point:
        return None
    if not math.isnan(float(oracle[index])):
        return None
    where = _at(ex.template.group_name(ex.pairing().groups[i]), index)
    return (f"the reference's own gradient at {where} is NaN in float64 too (an overflow, "
            "inf/inf or 0*inf inside its backward): it has no value there to judge the "
            "implementation's by. If the implementation is right, give the reference a formula "
            "that stays finite there, or keep the inputs away from such values (inputs=...).")


def derivative_kink(ex: Execution, group: Any, m: Any) -> str | None:
    """``"x[i] = v"`` when a second-order mismatch's worst element is an input where the
    reference's derivative has a kink: the reference is not differentiable there
    (:func:`kink_cause`'s probe), or its autograd second derivative jumps there
    (``z.abs().pow(2)`` at 0: smooth, but ``sign(z)**2`` is 0 at 0 and 1 beside it). A smooth
    implementation's second derivative legitimately differs there. Else None."""
    site = _probe_site(ex, group, m)
    if site is None:
        return None
    k, flats, where, _side, args, kwargs = site
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

