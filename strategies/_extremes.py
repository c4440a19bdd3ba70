"""Extreme values planted in an example: magnitudes past the overflow thresholds of ``exp``
(float16's and the tensor's own dtype's), near the dtype's largest finite value, and inf, -inf,
NaN, at a few drawn positions of one floating tensor argument. A plant is kept only where the
reference's result there stays comparable: :func:`comparable` runs the reference at the
example's dtype and in float64 and asks for the same non-finite pattern in both (a kernel's
inf or NaN is then judged against values that mean the same at either precision).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
from hypothesis import strategies as st

from equiv._args import Args
from equiv._compat import tree_flatten
from equiv.errors import user_error

# float16's largest finite value: exp overflows in float16 past log(65504) ~ 11.09
_HALF_EXP = 11.5
# the most positions planted in one example
_MOST = 3


def extreme_values(dtype: torch.dtype) -> tuple[float, ...]:
    """The values planted in a tensor of ``dtype``, each exact in it, smallest magnitude
    first (a failure shrinks toward the mildest): just past float16's and ``dtype``'s ``exp``
    overflow (and the same negated: ``exp`` underflows to 0), twice ``sqrt(max)`` (a square
    overflows), ``max`` and ``-max``, inf, -inf, NaN."""
    big = torch.finfo(dtype).max
    past = math.floor(math.log(big)) + 1.0
    raw = [_HALF_EXP, -_HALF_EXP, past, -past, 2 * math.sqrt(big), big, -big]
    out: list[float] = []
    for v in raw:
        exact = float(torch.tensor(v, dtype=torch.float64).to(dtype))
        if math.isfinite(exact) and exact not in out:
            out.append(exact)
    return tuple(out) + (math.inf, -math.inf, math.nan)


def plant_extremes(draw: Any, t: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, float]]]:
    """A contiguous copy of the floating tensor ``t`` (same ``requires_grad``) with extreme
    values at 1 to 3 drawn flat positions, and the ``(flat index, value)`` pairs planted."""
    values = extreme_values(t.dtype)
    n = t.numel()
    out = t.detach().clone(memory_format=torch.contiguous_format)
    flat = out.view(-1)
    spots: list[tuple[int, float]] = []
    for _ in range(draw(st.integers(1, min(_MOST, n)))):
        i = draw(st.integers(0, n - 1))
        v = values[draw(st.integers(0, len(values) - 1))]
        flat[i] = v
        spots.append((i, v))
    return out.requires_grad_(t.requires_grad), spots


def describe(name: str, spots: Sequence[tuple[int, float]]) -> str:
    """``"extremes in x: inf at flat index 3, -65504 at flat index 0"``."""
    return f"extremes in {name}: " + ", ".join(f"{v:g} at flat index {i}" for i, v in spots)


def comparable(reference: Callable[..., Any] | None, args: Sequence[Any], kwargs: dict) -> bool:
    """Whether the reference's results at this example can be compared with a kernel's: its
    outputs, final argument values and input gradients (the VJP of a fixed cotangent) have the
    same NaN and +-inf positions at the example's dtype and in float64, or it raises the same
    exception type at both. Without a reference, nothing says so: False."""
    if reference is None:
        return False
    found = []
    for wide in (False, True):
        try:
            found.append(_results(reference, args, kwargs, wide))
        except BaseException as e:  # the reference raised (SystemExit too)
            if not user_error(e):
                raise
            found.append(type(e))
    at, high = found
    if isinstance(at, type) or isinstance(high, type):
        return at is high
    return len(at) == len(high) and all(
        x.shape == y.shape and all(torch.equal(f(x), f(y)) for f in _PATTERN)
        for x, y in zip(at, high))


_PATTERN = (torch.isnan, torch.isposinf, torch.isneginf)


def _results(reference: Callable[..., Any], args: Sequence[Any], kwargs: dict,
             wide: bool) -> list[torch.Tensor]:
    """The reference's floating outputs, its floating arguments' final values and their
    gradients for a fixed cotangent (signs random, magnitudes 1-2), on copies of the
    arguments (upcast to float64 when ``wide``)."""
    values = list(args) + list(kwargs.values())
    leaves: list[torch.Tensor] = []
    for k, v in enumerate(values):
        if isinstance(v, torch.Tensor) and v.dtype.is_floating_point:
            w = v.detach().to(torch.float64) if wide else v.detach()
            values[k] = w.clone().requires_grad_(v.requires_grad)
            leaves.append(values[k])
    grads: list[torch.Tensor] = []
    with torch.enable_grad():
        copies = [v.clone() if v.requires_grad else v for v in leaves]
        moved = {id(a): c for a, c in zip(leaves, copies)}
        values = [moved.get(id(v), v) for v in values]
        out = reference(*values[:len(args)], **dict(zip(kwargs, values[len(args):])))
        outs = [o for o in tree_flatten(out)[0]
                if isinstance(o, torch.Tensor) and o.dtype.is_floating_point]
        gen = torch.Generator().manual_seed(1234)
        loss = 0
        for o in outs:
            if o.requires_grad:
                sign = torch.randn(o.shape, generator=gen, dtype=torch.float64).sign()
                cot = sign * (1 + torch.rand(o.shape, generator=gen, dtype=torch.float64))
                loss = loss + (o * cot.to(o.dtype)).sum()
        need = [v for v in leaves if v.requires_grad]
        if isinstance(loss, torch.Tensor) and loss.requires_grad and need:
            grads = [g for g in torch.autograd.grad(loss, need, allow_unused=True)
                     if g is not None]
    finals = [c.detach() for c in copies]
    return [o.detach() for o in outs] + finals + grads


def vary(draw: Any, example: Any, signature: Any, allowed: Callable[[str], bool],
         reference: Callable[..., Any] | None) -> tuple[Any, str]:
    """``example`` (an :class:`equiv._args.Args`) with extremes planted in one drawn floating
    argument that ``allowed`` names, and its description; ``(example, "")`` where no argument
    fits or the reference's result there is not :func:`comparable`. (The argument and the
    positions are drawn either way, so the choice sequence does not depend on the verdict.)"""
    try:
        bound = signature.bind(*example.args, **example.kwargs)
    except (TypeError, AttributeError):
        return example, ""
    names = [n for n, v in bound.arguments.items() if allowed(n)
             and isinstance(v, torch.Tensor) and v.layout == torch.strided
             and v.dtype.is_floating_point and v.numel() > 0]
    if not names:
        return example, ""
    name = names[draw(st.integers(0, len(names) - 1))]
    bound.arguments[name], spots = plant_extremes(draw, bound.arguments[name])
    changed = Args(*bound.args, **bound.kwargs)
    if not comparable(reference, changed.args, dict(changed.kwargs)):
        return example, ""
    return changed, describe(name, spots)
