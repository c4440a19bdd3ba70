"""The hard cases of inputs derived from a signature: lengths that straddle tile sizes,
broadcastable shape tuples, independent lengths per argument, and exact zeros and ties planted
where the reference is smooth.

Each hard case is a drawn choice whose index 0 is "none", so a failure shrinks toward the plain
example. Zeros and ties are kinks of many references (``relu`` at 0, ``max`` of equal elements),
where the subgradient convention is free; :func:`smooth_at` keeps a plant only when the reference
is continuous, with a continuous gradient, across every planted position.
"""

from __future__ import annotations

import math

from typing import Any, Callable, Sequence

import numpy as np
import torch
from hypothesis import strategies as st
from hypothesis.extra.numpy import mutually_broadcastable_shapes

from equiv._compat import equal, numpy_view, tree_flatten
from equiv.errors import user_error

#: the most elements a derived tensor with a tile-straddling length has (time per example stays
#: bounded: the other dims shrink to fit)
TILE_MAX_NUMEL = 4096
#: lengths drawn along one dim when no ``block_sizes`` are given: 2^k - 1, 2^k + 1 and (half as
#: often) 2^k for k = 1..11 (1 ... 2049), those past a common tile of 16 twice as often,
#: smallest first: a failure that needs no long dim shrinks to a short one
TILE_LENGTHS: tuple[int, ...] = tuple(sorted(
    n for k in range(1, 12) for n in (2**k - 1, 2**k + 1, 2**k - 1, 2**k + 1, 2**k)
    for _ in range(1 if k < 5 else 2)))
# how many multiples of each block size are drawn (k*b - 1, k*b, k*b + 1 for k = 1..3)
_BLOCK_MULTIPLES = 3
# shape plans: index 0 (one shared small shape) is the shrink target; weights out of the table
# (a tile length in about one example in four: bench/detection_inputs.py measures the rates).
# The broadcast plan draws independent lengths where the reference refuses broadcast shapes:
# a plan of its own would reshuffle every multi-tensor spec's draws
_PLANS = {"shared": 12, "tile": 9, "broadcast": 5}
#: the other length one dim of some tensor arguments gets in the independent-lengths plan
#: (smallest first: a failure shrinks toward short, readable lengths; 1 is a query of one
#: token against a longer key sequence, the decoding step of attention)
OTHER_LENGTHS: tuple[int, ...] = (1, 2, 3, 4, 5, 7)
# the most (dim, argument subset) pairs the independent-lengths plan offers the reference
_LENGTH_TRIES = 16
# the probe's step and the jump (relative to the values' magnitude) that counts as a kink
_STEP = 1e-5
_JUMP = 1e-2


def tile_lengths(block_sizes: Sequence[int] = ()) -> tuple[int, ...]:
    """Lengths to draw along one dim: ``k*b - 1, k*b, k*b + 1`` for each block size ``b``
    (k = 1..3), else :data:`TILE_LENGTHS`."""
    if not block_sizes:
        return TILE_LENGTHS
    out = sorted({k * b + d for b in block_sizes for k in range(1, _BLOCK_MULTIPLES + 1)
                  for d in (-1, 1, 0) if 0 < k * b + d <= TILE_MAX_NUMEL})
    return tuple(out)


def draw_plan(draw: Any, tensors: int, *, tile: bool, broadcast: bool,
              steer: bool = False) -> str:
    """Which shape plan this example uses: shared, tile or broadcast (when allowed)."""
    weights = dict(_PLANS)
    if steer:  # block sizes were given: draw tile-straddling lengths more often
        weights["tile"] *= 4
    table = [p for p, w in weights.items() for _ in range(w)
             if p == "shared" or (p == "tile" and tile) or (p == "broadcast" and broadcast
                                                             and tensors >= 2)]
    return table[draw(st.integers(0, len(table) - 1))]


def tile_shape(draw: Any, base: tuple[int, ...], lengths: Sequence[int]) -> tuple[int, ...]:
    """``base`` (at least 1-D) with one dim (the last, five times as often as any other) set to
    a drawn tile-straddling length, the other dims shrunk so the total stays bounded. (Drawn for
    every example, used by the tile plan only: the choice sequence has the same length whatever
    the plan, so a failure shrinks from a tile length to the plain shape.)"""
    base = base or (1,)
    dims = [len(base) - 1] * 5 + list(range(len(base) - 1))
    dim = dims[draw(st.integers(0, len(dims) - 1))]
    length = lengths[draw(st.integers(0, len(lengths) - 1))]
    room = max(TILE_MAX_NUMEL // length, 1)
    out = []
    for i, d in enumerate(base):
        if i == dim:
            out.append(length)
            continue
        side = max(min(d, room), 1)
        room //= side
        out.append(side)
    return tuple(out)


def broadcast_shapes(draw: Any, count: int, mutated: Sequence[bool]) -> tuple[tuple[int, ...], ...]:
    """``count`` mutually broadcastable shapes; an argument written in place gets the result's
    shape (an in-place write cannot broadcast its destination)."""
    shapes, result = draw(mutually_broadcastable_shapes(
        num_shapes=count, min_dims=1, max_dims=3, min_side=1, max_side=4))
    return tuple(tuple(result) if m else tuple(s) for s, m in zip(shapes, mutated))


def independent_lengths(draw: Any, base: tuple[int, ...],
                        count: int) -> list[tuple[tuple[int, ...], ...]]:
    """Candidate shape tuples for ``count`` tensors of the shared shape ``base``: along one dim,
    the tensors of a non-empty proper subset get another length (q ``(B, Lq, D)`` against k, v
    ``(B, Lk, D)``; or v's feature dim against q's and k's), at most :data:`_LENGTH_TRIES` of
    them, every dim and subset in turn from a drawn start. The caller keeps the first the
    reference accepts. Three choices are drawn whatever the outcome; each shrinks to index 0
    (the first dim, the first subset, the shortest other length)."""
    dim0 = draw(st.integers(0, max(len(base) - 1, 0)))
    subsets = 2 ** count - 2
    start = draw(st.integers(0, max(subsets - 1, 0)))
    other = [n for n in OTHER_LENGTHS if not base or n != base[dim0]]
    length = other[draw(st.integers(0, len(other) - 1))]
    if not base or subsets < 1:
        return []
    out = []
    for d in range(len(base)):
        dim = (dim0 + d) % len(base)
        for s in range(subsets):
            mask = (start + s) % subsets + 1  # bit i: tensor i gets the other length
            if len(out) == _LENGTH_TRIES or base[dim] == length:
                break
            out.append(tuple(base[:dim] + (length,) + base[dim + 1:] if mask >> i & 1 else base
                             for i in range(count)))
    return out


def plant(draw: Any, t: torch.Tensor, apply: bool) -> list[tuple[int, str]]:
    """Exact zeros and ties (a copy of another element) at a few drawn positions of the floating
    or complex tensor ``t``, written in place (``t`` is freshly drawn) when ``apply``. The
    positions are drawn either way (a failure then shrinks from planted to plain values without
    shifting later choices). Returns the planted ``(flat index, "zero" | "tie")`` pairs."""
    n = t.numel()
    if n == 0 or not (t.dtype.is_floating_point or t.dtype.is_complex):
        return []
    flat = t.view(-1)
    out = []
    for _ in range(draw(st.integers(1, min(3, n)))):
        i = draw(st.integers(0, n - 1))
        if n >= 2 and draw(st.booleans()):
            j = draw(st.integers(0, n - 2))
            j += j >= i
            if apply:
                flat[i] = flat[j]
            out.append((i, "tie"))
        else:
            if apply:
                flat[i] = 0
            out.append((i, "zero"))
    return out if apply else []


def smooth_at(reference: Callable[..., Any] | None, args: Sequence[Any], kwargs: dict,
              planted: dict[int, list[int]]) -> bool:
    """True when ``reference`` is continuous, with a continuous gradient, across the planted
    positions: its outputs and the VJP of a fixed cotangent (in float64) agree at the example
    and at the example moved by +-step at those positions. A reference that raises is not
    smooth; without a reference there is nothing to probe."""
    if reference is None:
        return True
    cots: dict = {}  # every probe draws the same cotangents: drawn once
    try:
        at = _probe(reference, args, kwargs, planted, 0.0, cots)
        up = _probe(reference, args, kwargs, planted, _STEP, cots)
        down = _probe(reference, args, kwargs, planted, -_STEP, cots)
    except BaseException as e:  # the reference raised (SystemExit too): not smooth there
        if not user_error(e):
            raise
        return False
    return all(_close(at, other) for other in (up, down))


def jumps_at(reference: Callable[..., Any], args: Sequence[Any], kwargs: dict,
             planted: dict[int, list[int]]) -> bool:
    """True when the reference's outputs or VJP (:func:`smooth_at`'s probe) really jump across
    the planted positions: the gap from the example to the example moved by a step stays when
    the step shrinks tenfold (a kink or a discontinuity), where a smooth but steep function's
    gap (``b / c`` at a small ``c``) shrinks with the step. A reference that raises is no
    evidence: False."""
    cots: dict = {}
    try:
        at = _probe(reference, args, kwargs, planted, 0.0, cots)
        for sign in (1.0, -1.0):
            far = _gap(at, _probe(reference, args, kwargs, planted, sign * _STEP, cots))
            near = _gap(at, _probe(reference, args, kwargs, planted, sign * _STEP / 10, cots))
            if near > _JUMP and (near > 0.5 * far or math.isinf(near)):  # inf: NaN beside
                return True
    except BaseException as e:  # the reference raised (SystemExit too): nothing confirmed
        if not user_error(e):
            raise
    return False


def _gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """The largest relative gap ``|x - y| / (1 + |x|)`` between two probes (inf where their
    structure or finiteness differs)."""
    if len(a) != len(b):
        return math.inf
    worst = 0.0
    for x, y in zip(a, b):
        if x.shape != y.shape or not equal(torch.isfinite(x), torch.isfinite(y)):
            return math.inf
        if not (x.dtype.is_floating_point or x.dtype.is_complex):
            worst = worst if equal(x, y) else math.inf
            continue
        finite = torch.isfinite(x) & torch.isfinite(y)
        if finite.any():
            worst = max(worst, float(((x[finite] - y[finite]).abs()
                                      / (1 + x[finite].abs())).max()))
    return worst


def _wide(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.complex128 if t.dtype.is_complex else torch.float64)


def _probe(reference: Callable[..., Any], args: Sequence[Any], kwargs: dict,
           planted: dict[int, list[int]], step: float,
           cots: dict | None = None) -> list[torch.Tensor]:
    """The reference's float64 outputs and input gradients, with ``step`` added at the
    planted positions of the argument at each position of ``args + kwargs`` (the r-th argument
    with planted positions: ``(r + 1) * step``). ``cots``: the cotangents of earlier probes of
    the same call, by the outputs' shapes and dtypes (they are drawn from one seed, so equal
    outputs get equal cotangents: a probe reuses them rather than draw them again)."""
    values = list(args) + list(kwargs.values())
    leaves: list[torch.Tensor] = []
    # each argument moves by its own multiple of the step: a tie across arguments is broken
    rank = {k: r for r, k in enumerate(sorted(planted))}
    for k, v in enumerate(values):
        if isinstance(v, torch.Tensor) and (v.dtype.is_floating_point or v.dtype.is_complex):
            w = _wide(v.detach()).clone(memory_format=torch.contiguous_format)  # row-major
            for i in planted.get(k, ()):
                w.view(-1)[i] += step * (1 + rank[k])
            values[k] = w.requires_grad_(True)
            leaves.append(values[k])
    with torch.enable_grad():
        out = reference(*values[:len(args)], **dict(zip(kwargs, values[len(args):])))
        outs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        reals = [torch.view_as_real(o) if o.dtype.is_complex else o for o in outs
                 if o.requires_grad and (o.dtype.is_floating_point or o.dtype.is_complex)]
        key = tuple((r.shape, r.dtype) for r in reals)
        drawn = cots.get(key) if cots is not None else None
        if drawn is None:
            drawn = _probe_cotangents(reals)
            if cots is not None:
                cots[key] = drawn
        loss = 0
        for real, cot in zip(reals, drawn):
            loss = loss + (real * cot).sum()
        grads = []
        if isinstance(loss, torch.Tensor) and loss.requires_grad:
            found = torch.autograd.grad(loss, leaves, allow_unused=True)
            grads = [g for g in found if g is not None]
    return [_wide(o.detach()) if o.dtype.is_floating_point or o.dtype.is_complex
            else o.detach() for o in outs] + grads


def _probe_cotangents(reals: list[torch.Tensor]) -> list[torch.Tensor]:
    """One cotangent per output of a probe, from a fixed seed: a random sign times a magnitude
    in [1, 2) (a kink's jump in the gradient is never hidden by a tiny weight)."""
    gen = torch.Generator().manual_seed(1234)
    out = []
    for real in reals:
        sign = torch.randn(real.shape, generator=gen, dtype=real.dtype).sign()
        out.append(sign * (1 + torch.rand(real.shape, generator=gen, dtype=real.dtype)))
    return out


def _close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x.shape != y.shape:
            return False
        if not (x.dtype.is_floating_point or x.dtype.is_complex):
            if not equal(x, y):
                return False
            continue
        xs, ys = numpy_view(x), numpy_view(y)
        if xs is not None and ys is not None:  # the same test in NumPy, several times cheaper
            if not _close_numpy(xs, ys):
                return False
            continue
        if not equal(torch.isfinite(x), torch.isfinite(y)):
            return False
        # where both are non-finite the difference is NaN (or inf against an inf bound): never
        # a gap, so no mask is needed (a masked copy of each costs more than the test)
        if ((x - y).abs() > _JUMP * (1 + x.abs())).any():
            return False
    return True


def _close_numpy(x: np.ndarray, y: np.ndarray) -> bool:
    """:func:`_close` of two float64 or complex128 arrays: the same operations in the same
    order, so the same answer."""
    if not np.array_equal(np.isfinite(x), np.isfinite(y)):
        return False
    with np.errstate(all="ignore"):  # inf - inf: NaN, never a gap
        gap = np.abs(x - y)
        bound = np.abs(x)
        bound += 1
        bound *= _JUMP
        return not bool(np.greater(gap, bound).any())


def cross_ties(values: Sequence[Any]) -> dict[int, list[int]]:
    """Ties across arguments: for each floating tensor of ``values`` (by position), the flat
    (row-major) indices where it equals an earlier floating tensor of its dtype at the position
    broadcasting aligns with it (``clamp(x, lo, hi)`` at ``x == lo`` is a kink). Tensors whose
    shapes do not broadcast together are not aligned, so they never tie."""
    out: dict[int, list[int]] = {}
    seen: list[torch.Tensor] = []
    for k, t in enumerate(values):
        if not (isinstance(t, torch.Tensor) and t.dtype.is_floating_point and t.numel()):
            continue
        t = t.detach()
        hits = torch.zeros(t.shape, dtype=torch.bool, device=t.device)
        for u in seen:
            if u.dtype != t.dtype or u.device != t.device:
                continue
            try:
                shape = torch.broadcast_shapes(t.shape, u.shape)
            except RuntimeError:
                continue
            eq = (t.expand(shape) == u.expand(shape)).to(torch.int64)
            hits |= eq.sum_to_size(t.shape) > 0
        seen.append(t)
        found = hits.reshape(-1).nonzero().flatten().tolist()
        if found:
            out[k] = found
    return out


def break_ties(values: Sequence[Any], ties: dict[int, list[int]]) -> None:
    """Move the tied elements of each tensor in ``ties`` (from :func:`cross_ties`) off the tie,
    in place: the r-th tied tensor by ``r / 2**b`` (below 1/2, a different amount per tensor,
    exact in every floating dtype for simple half-integer values), so no two arguments tie
    there any more and simple values stay simple."""
    bits = max(3, (len(ties) + 1).bit_length() + 1)
    with torch.no_grad():
        for r, (k, found) in enumerate(sorted(ties.items()), start=1):
            flat = values[k].detach().view(-1)
            flat[torch.tensor(found, dtype=torch.long)] += r * 2.0 ** -bits
