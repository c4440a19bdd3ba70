"""Memory layouts: the same values laid out differently in memory (strides, offsets, gaps)."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Sequence

import torch
from hypothesis import strategies as st

#: every layout kind, simplest first (failures shrink toward the front of this tuple)
LAYOUT_KINDS: tuple[str, ...] = (
    "contiguous", "transposed", "sliced", "expanded", "permuted", "window", "channels_last",
)
# weights when drawing a kind. Hypothesis already favours the simplest choice (contiguous, index
# 0: about half of all draws with equal weights), so contiguous gets a small weight here.
_WEIGHTS = {"contiguous": 4, "transposed": 26, "sliced": 14, "expanded": 22, "permuted": 14,
            "window": 10, "channels_last": 10}


def contiguous_strides(size: Sequence[int]) -> tuple[int, ...]:
    strides, acc = [], 1
    for d in reversed(tuple(size)):
        strides.append(acc)
        acc *= max(d, 1)
    return tuple(reversed(strides))


@dataclasses.dataclass(frozen=True)
class Layout:
    """How a tensor's elements sit in memory. ``apply`` keeps the values (see ``expanded``).

    - ``contiguous``: row-major.
    - ``transposed``: the last two dims swapped in memory (column-major for 2-D).
    - ``permuted``: the dims stored in another order (``key`` picks the permutation).
    - ``sliced``: every ``step``-th element along ``dim`` of a larger storage, from ``offset``.
    - ``window``: an ``as_strided`` window with gaps between rows (row pitch + ``step``) and a
      storage offset; strides are never negative.
    - ``channels_last``: ``torch.channels_last`` for 4-D (channels stored last for 3-D+).
    - ``expanded``: stride 0 along ``dim`` (``torch.expand``). A stride-0 dim repeats one slice,
      so ``apply`` keeps the values only when they are constant along it; otherwise the result
      repeats the first slice. ``tensors(layout=...)`` draws values that fit.
    """

    kind: str = "contiguous"
    dim: int = 0
    step: int = 2
    offset: int = 0
    key: int = 0

    def __post_init__(self) -> None:
        if self.kind not in LAYOUT_KINDS:
            raise ValueError(f"unknown layout kind {self.kind!r}; use one of {LAYOUT_KINDS}")

    # -- geometry ------------------------------------------------------------------------------
    def effective(self, size: Sequence[int]) -> "Layout":
        """This layout, or ``contiguous`` when it cannot differ from contiguous for ``size``."""
        size = tuple(size)
        big = [i for i, d in enumerate(size) if d > 1]
        if self.kind in ("transposed", "permuted") and len(big) < 2:
            return Layout()
        if self.kind == "transposed" and not (len(size) >= 2 and size[-1] > 1 and size[-2] > 1):
            return Layout("permuted", key=self.key)
        if self.kind == "channels_last" and (len(size) < 3 or size[1] <= 1 or
                                             all(d <= 1 for d in size[2:])):
            return Layout()
        if self.kind == "expanded" and not big:
            return Layout()
        if self.kind in ("sliced", "window") and not size:
            return Layout("sliced", offset=max(self.offset, 1)) if self.kind == "window" else self
        return self

    def _perm(self, ndim: int, size: tuple[int, ...]) -> tuple[int, ...]:
        if self.kind == "transposed":
            return tuple(range(ndim - 2)) + (ndim - 1, ndim - 2)
        if self.kind == "channels_last":
            return (0,) + tuple(range(2, ndim)) + (1,)
        # a permutation of the dims that changes strides: one that moves a dim of size > 1
        perms = [p for p in itertools.permutations(range(ndim))
                 if [i for i in p if size[i] > 1] != [i for i in range(ndim) if size[i] > 1]]
        return perms[self.key % len(perms)]

    def apply(self, t: torch.Tensor) -> torch.Tensor:
        """A new tensor (a leaf when ``t`` requires grad) with ``t``'s values in this layout.

        The storage is fresh; ``t`` is only read."""
        size = tuple(t.shape)
        lay = self.effective(size)
        rg = t.requires_grad
        with torch.no_grad():
            src = t.detach()
            if lay.kind == "contiguous":
                out = src.clone(memory_format=torch.contiguous_format)
            elif lay.kind in ("transposed", "permuted", "channels_last"):
                perm = lay._perm(len(size), size)
                if lay.kind == "channels_last" and len(size) == 4:
                    out = src.clone(memory_format=torch.channels_last)
                else:
                    inv = [perm.index(i) for i in range(len(size))]
                    out = src.permute(perm).contiguous().permute(inv)
            elif lay.kind == "expanded":
                dims = [i for i, d in enumerate(size) if d > 1]
                d = dims[lay.dim % len(dims)]
                out = src.narrow(d, 0, 1).clone().expand(size)
            else:
                out = _strided_copy(src, lay)
        return out.detach().requires_grad_(rg) if rg else out

    def describe(self, size: Sequence[int] | None = None) -> str:
        lay = self if size is None else self.effective(size)
        if lay.kind == "sliced":
            return f"sliced (step {lay.step} along dim {lay.dim}, storage offset {lay.offset})"
        if lay.kind == "window":
            return f"as_strided window (row gap {lay.step}, storage offset {lay.offset})"
        if lay.kind == "expanded":
            if size is not None:
                dims = [i for i, d in enumerate(size) if d > 1]
                return f"expanded (stride 0 along dim {dims[lay.dim % len(dims)]})"
            return "expanded (stride 0)"
        if lay.kind == "permuted" and size is not None:
            return f"permuted (dims stored in order {lay._perm(len(size), tuple(size))})"
        return lay.kind


def _strided_copy(src: torch.Tensor, lay: Layout) -> torch.Tensor:
    size = tuple(src.shape)
    if lay.kind == "sliced" and size:
        d = lay.dim % len(size)
        padded = list(size)
        padded[d] = max(size[d], 1) * lay.step
        strides = list(contiguous_strides(padded))
        strides[d] *= lay.step
    elif lay.kind == "window" and size:
        padded = list(size)
        padded[-1] = size[-1] + lay.step
        strides = list(contiguous_strides(padded))
    else:  # 0-d: an offset into a larger storage
        padded, strides = [1], []
    n = lay.offset + max(1, _numel(padded)) + lay.step
    # the gaps hold a value that is never one of the tensor's (a kernel reading them is caught)
    base = torch.full((n,), _gap_value(src.dtype), dtype=src.dtype, device=src.device)
    out = base.as_strided(size, tuple(strides), lay.offset)
    out.copy_(src)
    return out


def _gap_value(dtype: torch.dtype) -> Any:
    if dtype == torch.bool:
        return True
    if dtype.is_floating_point or dtype.is_complex:
        return 77.0
    return 77 if dtype != torch.int8 else -77


def _numel(size: Sequence[int]) -> int:
    n = 1
    for d in size:
        n *= d
    return n


@st.composite
def layouts(draw: Any, *, kinds: Sequence[str] = LAYOUT_KINDS) -> Layout:
    """Memory layouts (``Layout.apply(t)`` re-lays ``t`` out); shrinks toward ``contiguous``.

    ``kinds`` restricts the choice, e.g. ``layouts(kinds=("transposed", "sliced"))``.
    """
    chosen = tuple(k for k in LAYOUT_KINDS if k in kinds)
    unknown = set(kinds) - set(LAYOUT_KINDS)
    if unknown or not chosen:
        raise ValueError(f"layouts(kinds={tuple(kinds)!r}): use kinds from {LAYOUT_KINDS}")
    table = [k for k in chosen for _ in range(_WEIGHTS[k])]
    kind = table[draw(st.integers(0, len(table) - 1))]
    if kind == "contiguous":
        return Layout()
    if kind in ("transposed", "channels_last"):
        return Layout(kind)
    if kind == "permuted":
        return Layout(kind, key=draw(st.integers(0, 23)))
    if kind == "expanded":
        return Layout(kind, dim=draw(st.integers(0, 3)))
    return Layout(kind, dim=draw(st.integers(0, 3)), step=draw(st.integers(2, 3)),
                  offset=draw(st.integers(1, 3)))
