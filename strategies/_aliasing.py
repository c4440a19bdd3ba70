"""Argument tuples with a given alias pattern: tensors that share one storage."""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import strategies as st

from ._tensors import shapes, tensors

#: alias patterns, simplest first (``aliased_arguments`` shrinks toward the front)
ALIAS_PATTERNS: tuple[str, ...] = ("none", "same", "overlapping", "view-and-base", "disjoint")


@st.composite
def aliased_arguments(draw: Any, count: int = 2, *, pattern: Any = None, shape: Any = None,
                      dtype: Any = None, device: Any = None,
                      requires_grad: bool = False) -> tuple[torch.Tensor, ...]:
    """A tuple of ``count`` tensors with an alias ``pattern`` (a name from ``ALIAS_PATTERNS`` or
    a strategy of names; default: any):

    - ``none``: independent tensors.
    - ``same``: one tensor object in every slot.
    - ``overlapping``: views of one base, each starting ``shift`` elements after the previous
      (``0 < shift < numel``), so neighbours share elements.
    - ``view-and-base``: slot 0 is the base, later slots are views of it (a narrowed slice, then
      its transpose where possible).
    - ``disjoint``: views of one storage that share no element (a gap between them).

    Every slot of ``same``/``overlapping``/``disjoint`` has ``shape`` (default: drawn, with at
    least 2 elements for ``overlapping``). With ``requires_grad`` the base is a leaf and the
    other slots are autograd views of it (``t._base``).
    """
    if not isinstance(count, int) or count < 2:
        raise ValueError(f"aliased_arguments(count={count!r}): give an int >= 2")
    if pattern is None:
        pattern = st.sampled_from(ALIAS_PATTERNS)
    name = draw(pattern) if isinstance(pattern, st.SearchStrategy) else pattern
    if name not in ALIAS_PATTERNS:
        raise ValueError(f"aliased_arguments(pattern={name!r}): use one of {ALIAS_PATTERNS}")
    dt = draw(dtype) if isinstance(dtype, st.SearchStrategy) else (dtype or torch.float32)
    dev = draw(device) if isinstance(device, st.SearchStrategy) else (device or "cpu")
    need = 2 if name in ("overlapping", "view-and-base") else 1
    if isinstance(shape, st.SearchStrategy):
        shp = tuple(draw(shape))
    elif shape is not None:
        shp = tuple(shape)
    else:
        shp = tuple(draw(shapes(min_dims=1 if need > 1 else 0, min_side=1)))
        if need > 1 and _numel(shp) < need:
            shp = shp[:-1] + (shp[-1] + need - 1,)
    n = _numel(shp)
    if n < need:
        raise ValueError(f"aliased_arguments(pattern={name!r}, shape={shp}): this pattern needs "
                         f"at least {need} elements")

    def leaf(size: tuple[int, ...]) -> torch.Tensor:
        return draw(tensors(shape=size, dtype=dt, device=dev, requires_grad=requires_grad))

    if name == "none":
        return tuple(leaf(shp) for _ in range(count))
    if name == "same":
        t = leaf(shp)
        return (t,) * count
    if name == "view-and-base":
        base = leaf(shp)
        views = [base]
        d = next(i for i, side in enumerate(shp) if side > 1)
        for k in range(1, count):
            start = 1 + (k - 1) % (shp[d] - 1)
            v = base.narrow(d, start, shp[d] - start)
            if k % 2 == 0 and v.dim() >= 2:
                v = v.transpose(-1, -2)
            views.append(v)
        return tuple(views)
    if name == "overlapping":
        shift = draw(st.integers(1, n - 1))
        base = leaf((n + (count - 1) * shift,))
        return tuple(base[k * shift:k * shift + n].view(shp) for k in range(count))
    gap = draw(st.integers(0, 2))
    base = leaf((count * (n + gap),))
    return tuple(base[k * (n + gap):k * (n + gap) + n].view(shp) for k in range(count))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
