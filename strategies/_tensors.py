"""Shapes, dtypes, devices and dense tensors: the building blocks of every other strategy."""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
from hypothesis import strategies as st

from equiv.errors import InvalidArgument

from ._layouts import LAYOUT_KINDS, Layout

FLOATING = (torch.float64, torch.float32)
HALF = (torch.float16, torch.bfloat16)
COMPLEX = (torch.complex128, torch.complex64)
INTEGER = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
#: the dtypes derived inputs draw from (float32 first: failures shrink toward it). Half dtypes
#: come from the runner's opt-in "half" variant: default tolerances (torch.testing) are 1e-3
#: relative for float16, which a correct kernel computing in another order can exceed by an ULP.
DERIVED_DTYPES = (torch.float32, torch.float64)
#: names accepted by ``tensors(special=...)``
SPECIAL_VALUES = ("nan", "inf", "-inf", "-0.0", "subnormal", "large")
# half-integers are exact in every floating dtype up to this many elements (bfloat16: 8 bits)
_SIMPLE_MAX = 256


# -- shapes --------------------------------------------------------------------------------------
@st.composite
def shapes(draw: Any, *, min_dims: int = 0, max_dims: int = 3, min_side: int = 0,
           max_side: int = 4, compile_friendly: bool = False) -> tuple[int, ...]:
    """Tensor shapes, including 0-d and size-1 dims (and size-0 dims, rarely, when
    ``min_side == 0``). Shrinks toward 1-D (0-d and size 0 are edge cases, not the target), then
    smaller sides.

    ``compile_friendly=True`` keeps ``torch.compile`` recompilations bounded: at most two distinct
    ndims (``max_dims`` and ``max_dims - 1``, both >= ``max(min_dims, 1)``), and sides >= 2 from
    the buckets 2, 4, 8, 16 (capped by ``max_side``), so no side is specialised as 0 or 1.
    """
    if not 0 <= min_dims <= max_dims:
        raise ValueError(f"shapes(min_dims={min_dims}, max_dims={max_dims}): need "
                         "0 <= min_dims <= max_dims")
    if not 0 <= min_side <= max_side:
        raise ValueError(f"shapes(min_side={min_side}, max_side={max_side}): need "
                         "0 <= min_side <= max_side")
    if compile_friendly:
        hi = max(max_dims, 1)
        lo = max(min_dims, 1, hi - 1)
        ndim = draw(st.integers(lo, hi))
        buckets = [b for b in (2, 4, 8, 16) if max(min_side, 2) <= b <= max(max_side, 2)] or [2]
        return tuple(draw(st.sampled_from(buckets)) for _ in range(ndim))
    # ndim weighted toward 2 (layout bugs need 2 dims); 0-d is a regular guest but, like size 0,
    # an edge case: failures shrink toward 1-D (or min_dims), then fewer dims only if needed
    weight = {1: 2, 2: 4}
    table = [d for d in range(max(min_dims, 1), max_dims + 1) for _ in range(weight.get(d, 3))]
    if min_dims == 0 and (not table or draw(st.integers(0, 9)) == 9):
        ndim = 0  # 1 in 10, behind its own flag so that shrinking stays monotone in ndim
    else:
        ndim = table[draw(st.integers(0, len(table) - 1))]
    # sides: the smallest is the shrink target (index 0) but the others are three times as
    # likely, since Hypothesis already favours index 0; size 0 is rare (1 in 16 per dim)
    lo, hi = max(min_side, 1), max(max_side, 1)
    side_table = [lo] + list(range(lo + 1, hi + 1)) * 3
    # the leading (batch) dim of a 2-D+ shape is 1 more often: bugs for a batch of one
    batch_table = [lo, lo] + list(range(lo, hi + 1))
    sides = []
    for i in range(ndim):
        table = batch_table if i == 0 and ndim >= 2 else side_table
        if min_side == 0 and draw(st.integers(0, 15)) == 15:
            sides.append(0)
        else:
            sides.append(table[draw(st.integers(0, len(table) - 1))])
    return tuple(sides)


# -- dtypes and devices --------------------------------------------------------------------------
def dtypes(*, floating: bool = True, half: bool = True, complex: bool = False,
           integer: bool = False, boolean: bool = False) -> st.SearchStrategy[torch.dtype]:
    """dtypes by family; float64 first, so a failure shrinks to float64 unless the bug needs
    another dtype (then to that one). ``half`` covers float16 and bfloat16."""
    options = ((FLOATING if floating else ()) + (HALF if half else ()) +
               (COMPLEX if complex else ()) + (INTEGER if integer else ()) +
               ((torch.bool,) if boolean else ()))
    if not options:
        raise ValueError("dtypes(): every family is switched off; enable at least one")
    return st.sampled_from(options)


def devices() -> st.SearchStrategy[torch.device]:
    """Devices that exist here: ``cpu``, and ``cuda`` when available."""
    options = [torch.device("cpu")]
    if torch.cuda.is_available():
        options.append(torch.device("cuda"))
    return st.sampled_from(options)


# -- values --------------------------------------------------------------------------------------
def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _values(kind: int, seed: int, shape: tuple[int, ...], dtype: torch.dtype,
            scale: float) -> torch.Tensor:
    """kind 0: simple (distinct half-integers, permuted by ``seed``; ascending at seed 0);
    kind 1: seeded continuous ``randn * scale``. Both dense and tie-free for floating dtypes."""
    g = torch.Generator().manual_seed(seed)
    n = _numel(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if not (dtype.is_floating_point or dtype.is_complex):
        lo = 0 if dtype == torch.uint8 else -8
        if kind == 0 and seed == 0:
            return (torch.arange(n) % (9 - lo) + lo).reshape(shape).to(dtype)
        return torch.randint(lo, 9, shape, generator=g).to(dtype)
    if kind == 0 and n <= _SIMPLE_MAX:
        order = torch.arange(n) if seed == 0 else torch.randperm(n, generator=g)
        real = (order - n // 2).to(torch.float64) + 0.5
        if dtype.is_complex:
            imag = (torch.flip(order, (0,)) - n // 2).to(torch.float64) + 0.5
            return torch.complex(real, imag).reshape(shape).to(dtype)
        return real.reshape(shape).to(dtype)
    real = torch.float64 if dtype in (torch.float64, torch.complex128) else torch.float32
    base = _normal(shape, g, real) * scale
    if dtype.is_complex:
        imag = _normal(shape, g, real) * scale
        return torch.complex(base, imag).to(dtype)
    return base.to(dtype)


#: above this many elements continuous values are drawn cheaply (:func:`_normal`)
CHEAP_VALUES_ABOVE = 1 << 16
_BLOCK = 1021  # prime: the tiled block's period does not line up with a row length


def _normal(shape: tuple[int, ...], g: torch.Generator, dtype: torch.dtype) -> torch.Tensor:
    """Standard normal values; above :data:`CHEAP_VALUES_ABOVE` elements :func:`tiled_normal`
    (a CPU ``randn`` of 1e6 elements costs ~4 ms, more than a relu's forward and backward)."""
    if _numel(shape) <= CHEAP_VALUES_ABOVE:
        return torch.randn(shape, generator=g, dtype=dtype)
    return tiled_normal(shape, g, dtype)


def tiled_normal(shape: tuple[int, ...], g: torch.Generator, dtype: torch.dtype,
                 device: Any = None) -> torch.Tensor:
    """Standard normal values in one element-wise pass: a drawn row of ``_BLOCK`` normal
    values plus a drawn normal offset per row, scaled back to unit variance. Every element
    differs, and so do two tensors drawn one after the other from ``g``."""
    n = _numel(shape)
    block = torch.randn(_BLOCK, generator=g, dtype=dtype).to(device)
    offsets = torch.randn(-(-n // _BLOCK), 1, generator=g, dtype=dtype).to(device)
    values = torch.add(block, offsets, alpha=0.5).mul_(1.25 ** -0.5)
    return values.reshape(-1)[:n].reshape(shape)


def _special(name: str, dtype: torch.dtype) -> float:
    info = torch.finfo(dtype)
    return {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "-0.0": -0.0,
            "subnormal": info.smallest_normal / 4, "large": info.max / 4}[name]


def _resolve(draw: Any, value: Any, default: Any) -> Any:
    if isinstance(value, st.SearchStrategy):
        return draw(value)
    return default if value is None else value


def _shape(draw: Any, shape: Any) -> tuple[int, ...]:
    """The drawn shape: ``shape`` itself, drawn from when a strategy, each dimension drawn
    from when a strategy (``(st.integers(1, 4), n)``), default ``shapes()``."""
    got = draw(shapes()) if shape is None else (
        draw(shape) if isinstance(shape, st.SearchStrategy) else shape)
    if isinstance(got, int) or not isinstance(got, (tuple, list, torch.Size)):
        raise InvalidArgument(f"tensors(shape={got!r}): give a tuple of ints (e.g. (2, 3)), a "
                              "tuple whose dimensions are ints or strategies of ints, or a "
                              "strategy of tuples")
    dims = tuple(draw(d) if isinstance(d, st.SearchStrategy) else d for d in got)
    try:
        sizes = tuple(operator.index(d) for d in dims if not isinstance(d, bool))
    except TypeError:
        sizes = ()
    if len(sizes) != len(dims) or any(d < 0 for d in sizes):
        raise InvalidArgument(f"tensors(shape={got!r}) drew the shape {dims!r}: each dimension "
                              "must be an int >= 0 (or a strategy drawing one)")
    return sizes


@st.composite
def tensors(draw: Any, *, shape: Any = None, dtype: Any = None, device: Any = None,
            requires_grad: bool = False, elements: st.SearchStrategy | None = None,
            layout: Any = None, special: Sequence[str] | bool = (),
            scale: float = 2.0, salt: int = 0) -> torch.Tensor:
    """Dense strided tensors. ``shape``, ``dtype``, ``device`` and ``layout`` take a value or a
    strategy (defaults: ``shapes()``, float32, cpu, contiguous); each dimension of a ``shape``
    tuple may be a strategy too (``shape=(st.integers(1, 4), n)``).

    Values: without ``elements``, a drawn choice between simple values (distinct small
    half-integers; the shrink target) and seeded continuous values (``randn * scale``); both
    are dense and tie-free; a non-default ``scale`` (the continuous values' standard deviation)
    draws continuous values only. With ``elements`` each element is drawn from that strategy.
    ``special`` (names from ``SPECIAL_VALUES``, or ``True`` for all) plants nan, +-inf, -0.0,
    subnormals or large magnitudes at drawn positions of floating tensors.
    ``requires_grad`` applies to floating and complex dtypes; the result is a leaf.
    ``layout`` (a ``Layout`` or a kind name such as ``"transposed"``) never changes the values:
    an ``expanded`` tensor's values are drawn for its stride-0 dim once. ``salt`` is added to
    the drawn seed (distinct values for tensors drawn from one choice).
    """
    shp = _shape(draw, shape)
    dt = _resolve(draw, dtype, torch.float32)
    if not isinstance(dt, torch.dtype):
        raise TypeError(f"tensors(dtype={dt!r}): give a torch.dtype or a strategy of them")
    dev = torch.device(_resolve(draw, device, "cpu"))
    lay = _resolve(draw, layout, Layout())
    if isinstance(lay, str):
        lay = Layout(lay)
    if not isinstance(lay, Layout):
        raise TypeError(f"tensors(layout={lay!r}): give an equiv.strategies.Layout, a kind name "
                        f"from {LAYOUT_KINDS}, or layouts()")
    lay = lay.effective(shp)
    value_shape = shp
    expand_dim = None
    if lay.kind == "expanded":
        big = [i for i, d in enumerate(shp) if d > 1]
        expand_dim = big[lay.dim % len(big)]
        value_shape = shp[:expand_dim] + (1,) + shp[expand_dim + 1:]
    if elements is not None:
        flat = draw(st.lists(elements, min_size=_numel(value_shape),
                             max_size=_numel(value_shape)))
        t = torch.tensor(flat, dtype=dt).reshape(value_shape)
    else:
        kind = draw(st.integers(0, 1)) if scale == 2.0 else 1  # a chosen scale: continuous only
        t = _values(kind, draw(st.integers(0, 2**32 - 1)) + 7919 * salt, value_shape, dt, scale)
    if special and dt.is_floating_point and t.numel():
        names = SPECIAL_VALUES if special is True else tuple(special)
        bad = [s for s in names if s not in SPECIAL_VALUES]
        if bad:
            raise ValueError(f"tensors(special={special!r}): unknown {bad}; use names from "
                             f"{SPECIAL_VALUES} or True")
        planted = draw(st.lists(st.tuples(st.integers(0, t.numel() - 1), st.sampled_from(names)),
                                max_size=min(t.numel(), 4)))
        flat_t = t.reshape(-1)
        for i, name in planted:
            flat_t[i] = _special(name, dt)
    t = t.to(dev)
    if expand_dim is not None:
        t = t.expand(shp)
    elif lay.kind != "contiguous":
        t = lay.apply(t)
    if requires_grad and (dt.is_floating_point or dt.is_complex):
        t = t.detach().requires_grad_(True)
    return t


# -- arguments derived from a signature ----------------------------------------------------------
