"""Hypothesis strategies for tensors and argument tuples (importable as ``equiv.strategies``).

Values are dense: every element comes from a seeded generator (no single background fill), and
continuous, so ties and kinks (``relu`` at exactly 0, ``max`` of equal elements) where
subgradient conventions legitimately differ are avoided unless asked for with ``elements=``.
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch
from hypothesis import strategies as st

__all__ = ["tensors", "shapes", "dtypes", "devices", "arguments_for"]

FLOAT_DTYPES = (torch.float32, torch.float64)


@st.composite
def shapes(draw: Any, *, min_dims: int = 1, max_dims: int = 3, min_side: int = 1,
           max_side: int = 4) -> tuple[int, ...]:
    """Tensor shapes; shrinks toward fewer dimensions and smaller sides."""
    ndim = draw(st.integers(min_dims, max_dims))
    return tuple(draw(st.integers(min_side, max_side)) for _ in range(ndim))


def dtypes(*, floating: bool = True) -> st.SearchStrategy[torch.dtype]:
    """Floating dtypes that run on CPU (float64 first, so failures shrink to it)."""
    return st.sampled_from((torch.float64, torch.float32))


def devices() -> st.SearchStrategy[torch.device]:
    """Devices that exist here: ``cpu``, and ``cuda`` when available."""
    options = [torch.device("cpu")]
    if torch.cuda.is_available():
        options.append(torch.device("cuda"))
    return st.sampled_from(options)


def _values(seed: int, shape: tuple[int, ...], dtype: torch.dtype, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if not (dtype.is_floating_point or dtype.is_complex):
        return torch.randint(-8, 9, shape, generator=g).to(dtype)
    real = torch.float64 if dtype in (torch.float64, torch.complex128) else torch.float32
    base = torch.randn(shape, generator=g, dtype=real) * scale
    if dtype.is_complex:
        imag = torch.randn(shape, generator=g, dtype=real) * scale
        return torch.complex(base, imag).to(dtype)
    return base.to(dtype)


@st.composite
def tensors(draw: Any, *, shape: Any = None, dtype: Any = None, device: Any = "cpu",
            requires_grad: bool = False, elements: st.SearchStrategy | None = None,
            scale: float = 2.0, salt: int = 0) -> torch.Tensor:
    """Dense tensors. ``shape``/``dtype`` may be values or strategies.

    Without ``elements`` the values come from a drawn seed (dense, tie-free); with ``elements``
    each element is drawn from that strategy (use it for special values: nan, inf, -0.0).
    """
    shp = draw(shape) if isinstance(shape, st.SearchStrategy) else (
        tuple(shape) if shape is not None else draw(shapes()))
    dt = draw(dtype) if isinstance(dtype, st.SearchStrategy) else (dtype or torch.float32)
    dev = draw(device) if isinstance(device, st.SearchStrategy) else torch.device(device)
    if elements is not None:
        n = 1
        for d in shp:
            n *= d
        flat = draw(st.lists(elements, min_size=n, max_size=n))
        t = torch.tensor(flat, dtype=dt).reshape(shp)
    else:
        t = _values(draw(st.integers(0, 2**32 - 1)) + 7919 * salt, shp, dt, scale)
    t = t.to(dev)
    if requires_grad and (dt.is_floating_point or dt.is_complex):
        t.requires_grad_(True)
    return t


_TENSOR_ANNOTATIONS = {inspect.Parameter.empty, torch.Tensor, "Tensor", "torch.Tensor"}
_SCALARS = {
    float: st.floats(-2.0, 2.0, allow_nan=False, allow_infinity=False),
    "float": None, int: st.integers(-3, 3), "int": None, bool: st.booleans(), "bool": None,
}


def arguments_for(signature: inspect.Signature, *,
                  dtypes_: Sequence[torch.dtype] = FLOAT_DTYPES) -> st.SearchStrategy:
    """Argument tuples for a signature: every required tensor parameter gets a tensor of one
    shared drawn shape and dtype (requiring grad); annotated ``float``/``int``/``bool`` parameters
    get small scalars; parameters with defaults keep them. Raises ``ValueError`` naming the
    parameter when a required parameter cannot be derived."""
    kinds: list[tuple[str, Any, bool]] = []
    for p in signature.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is not p.empty:
            continue
        ann = p.annotation
        if ann in _TENSOR_ANNOTATIONS:
            kinds.append((p.name, "tensor", p.kind is p.KEYWORD_ONLY))
        elif ann in _SCALARS:
            key = {"float": float, "int": int, "bool": bool}.get(ann, ann)
            kinds.append((p.name, _SCALARS[key], p.kind is p.KEYWORD_ONLY))
        else:
            raise ValueError(
                f"parameter {p.name!r} is annotated {ann!r} and has no default, so equiv cannot "
                "draw it"
            )
    if not kinds:
        raise ValueError("it has no required parameters to draw")

    @st.composite
    def build(draw: Any) -> tuple[Any, ...]:
        from equiv.examples import Args

        shp = draw(shapes())
        dt = draw(st.sampled_from(tuple(dtypes_)))
        args: list[Any] = []
        kw: dict[str, Any] = {}
        for i, (name, kind, keyword) in enumerate(kinds):
            if kind == "tensor":
                value = draw(tensors(shape=shp, dtype=dt, requires_grad=True, salt=i))
            else:
                value = draw(kind)
            if keyword:
                kw[name] = value
            else:
                args.append(value)
        return Args(*args, **kw)

    return build()
