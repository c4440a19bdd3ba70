"""One-sided derivatives of the reference where a gradient mismatches: at a point where the
reference is not differentiable (``hardtanh`` at its bound, ``clamp`` with ``lo == hi``), or
where its autograd value is not its derivative (``log1p(exp(-|x|)) + relu(-x)`` at 0 is smooth
while autograd takes ``abs``'s and ``relu``'s subgradient 0; ``std`` of an expanded constant),
an implementation returning the reference's own derivative from one side is correct.

For the worst mismatched element, the reference's scalar ``sum(value * cotangent)`` is computed
in float64 with that storage element moved by ``+-h`` and ``+-h/4``. The element is a kink of the
reference's autograd when a one-sided difference stays away from the autograd value as the
step shrinks (at a smooth point it closes in as the step does). The implementation's value is
accepted there when it equals that one-sided difference; the element is then taken out of the
comparison (set equal on both sides) and the gradient judged again, for up to
:data:`_ELEMENTS` elements. Anything else keeps the finding.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from equiv.errors import user_error
from equiv.execution.pairing import reference_run

_ELEMENTS = 4  # mismatched elements probed per gradient
_STEP = 1e-5  # relative to max(1, |value|)
_CLOSES = 0.5  # at a smooth point the difference shrinks with the step (to ~1/4)


def subgradient_choice(ex: Any, name: str, i: int, actual: torch.Tensor, expected: torch.Tensor,
                       m: Any, n: int) -> str | None:
    """A note when every mismatch of gradient ``i`` (``name``, for cotangent ``n``) is at a
    point where the implementation takes one of the reference's one-sided derivatives (and the
    rest then passes); else None (the finding stands)."""
    group = ex.pairing().groups[i]
    oracle = (ex.oracle_grads(n) or [None] * (i + 1))[i]
    if oracle is None or len(group.slots) != 1 or not group.dtype.is_floating_point:
        return None
    baseline = (ex.baseline_grads(n) or [None] * (i + 1))[i]
    values = [t.detach().clone() for t in (expected, oracle, baseline) if t is not None]
    seen = []
    for _ in range(_ELEMENTS):
        index = getattr(m, "index", None)
        if index is None or len(index) != actual.dim():
            return None
        side = _one_sided(ex, group, _storage_index(ex, group, index), n, float(oracle[index]),
                          float(actual.detach()[index]), actual.dtype)
        if side is None:
            return None
        seen.append(f"{name}[{', '.join(map(str, index))}] ({side})")
        for v in values:  # the element leaves the comparison: both sides equal there
            v[index] = actual.detach()[index].to(v.dtype)
        e, o, b = values[0], values[1], values[2] if len(values) > 2 else None
        m = ex.judge(name, actual, e, kind="gradients", group=group, cotangent=n,
                     oracle=o, baseline=b, rounding=lambda: ex.gradient_spread(n, i))
        if m is None:
            return (f"gradient w.r.t. {name!r}: at {', '.join(seen)} the reference is not "
                    "differentiable (or its autograd value there is not its derivative) and "
                    "the implementation returns the reference's own one-sided derivative; "
                    "accepted there, the rest compared")
    return None


def _storage_index(ex: Any, group: Any, index: tuple[int, ...]) -> int:
    """The storage element of ``group`` a gradient element ``index`` belongs to (a simple
    group's gradient has the argument's shape and strides; another's is its flat storage)."""
    if not group.simple:
        return int(index[0])
    stride = ex.template.slots[group.slots[0]].stride
    return sum(k * s for k, s in zip(index, stride))


def _one_sided(ex: Any, group: Any, element: int, n: int, auto: float, impl: float,
               dtype: torch.dtype) -> str | None:
    """Which of the reference's derivatives along ``element`` the implementation's ``impl``
    takes where the reference's autograd value ``auto`` is not its derivative: ``"from
    above"``/``"from below"`` (a one-sided difference away from ``auto`` as the step shrinks),
    or ``"between the one-sided derivatives"`` at a kink (the two sides differ; any value
    between them is a subgradient: ``abs`` at 0 takes 0); else None."""
    try:
        at = _loss(ex, group, element, n, 0.0)
        value = float(group.values.reshape(-1)[element])
        h = _STEP * max(1.0, abs(value))
        sides = {}
        for sign, label in ((1.0, "from above"), (-1.0, "from below")):
            far = (_loss(ex, group, element, n, sign * h) - at) / (sign * h)
            near = (_loss(ex, group, element, n, sign * h / 4) - at) / (sign * h / 4)
            sides[label] = (far, near)
            if _kink(far, near, auto) and _matches(impl, near, far, dtype):
                return label
    except _NoClaim:
        return None
    except BaseException as e:  # the reference raised (SystemExit too): no claim
        if not user_error(e):
            raise
        return None
    return "between the one-sided derivatives" if _between(impl, *sides.values(), dtype) \
        else None


def _between(impl: float, above: tuple[float, float], below: tuple[float, float],
             dtype: torch.dtype) -> bool:
    """``impl`` lies between the two one-sided derivatives, which differ beyond both
    estimates' errors (a kink)."""
    (fa, na), (fb, nb) = above, below
    if not all(math.isfinite(v) for v in (fa, na, fb, nb, impl)):
        return False
    error = 2 * (abs(fa - na) + abs(fb - nb))
    slack = error + max(1e-3, 8 * torch.finfo(dtype).eps) * (1 + max(abs(na), abs(nb)))
    if abs(na - nb) <= 10 * slack:
        return False
    return min(na, nb) - slack <= impl <= max(na, nb) + slack


class _NoClaim(Exception):
    """The reference's values could not be taken apart on a probed example."""


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
    rel = max(1e-3, 8 * torch.finfo(dtype).eps)
    return abs(impl - near) <= 2 * abs(far - near) + rel * (1 + abs(near))


def _loss(ex: Any, group: Any, element: int, n: int, step: float) -> float:
    """``sum(value * cotangent n)`` over the differentiated values of the reference, in float64,
    with storage ``element`` of ``group`` moved by ``step``."""
    device = ex.place.ref_device or ex.place.device
    side = ex.template.instantiate(grad=False, device=device, dtype=torch.float64)
    if step:
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
