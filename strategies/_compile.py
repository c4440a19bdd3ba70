"""What compile modes draw: Python scalars from a small fixed set, tensor sides >= 2 preferred.

Dynamo specialises a compiled graph on every distinct Python float passed to a custom op (and on
ints and sides equal to 0 or 1), so full-range scalars recompile once per value and exhaust the
recompile limit. While the runner checks a compile mode, :func:`compiling` is true and
:func:`scalars` draws one of at most two fixed values; eager modes draw the full range.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator

import hypothesis
import torch
from hypothesis import strategies as st
from torch.utils._pytree import tree_leaves

from equiv.errors import user_error

_COMPILING: contextvars.ContextVar[bool] = contextvars.ContextVar("equiv_compiling", default=False)

# compile values: a negative and a positive, non-integers (ints: never 0 or 1); two values,
# since the second value of a float passed to a custom op compiles twice under aot_eager
_FLOAT_PICKS = (-0.5, 1.5)
_INT_PICKS = (-2, 3)
_DEFAULTS = {float: (-2.0, 2.0), int: (-3, 3), bool: (False, True)}


def compiling() -> bool:
    """Whether the examples being drawn are for a compile mode."""
    return _COMPILING.get()


@contextlib.contextmanager
def compile_draws(on: bool) -> Iterator[None]:
    """Draw compile-mode values (``on``) or full-range ones inside the block."""
    token = _COMPILING.set(bool(on))
    try:
        yield
    finally:
        _COMPILING.reset(token)


def compile_values(kind: type, lo: Any, hi: Any) -> tuple[Any, ...]:
    """The at most two values compile modes draw for ``kind`` in ``[lo, hi]``: the preferred
    picks inside the bounds, then points spread over them (ints avoid 0 and 1 when they can)."""
    if kind is bool:
        return (False, True)
    if kind is float:
        fill = [lo + (hi - lo) * f for f in (0.25, 0.875)] + [lo]
        picks = _FLOAT_PICKS
    else:
        ends = [lo, hi, lo + 1, hi - 1]
        fill = [v for v in ends if v not in (0, 1)] + [v for v in ends if v in (0, 1)]
        picks = _INT_PICKS
    values: list[Any] = []
    for v in [p for p in picks if lo <= p <= hi] + fill:
        if lo <= v <= hi and kind(v) not in values:
            values.append(kind(v))
    return tuple(sorted(values[:2]))


def scalars(kind: type = float, min_value: Any = None, max_value: Any = None) -> Any:
    """Python ``float``/``int``/``bool`` scalars in ``[min_value, max_value]`` (default
    ``[-2, 2]`` for floats, ``[-3, 3]`` for ints): the full range in eager modes, one of the at
    most two values of ``.compile_values`` in compile modes (a negative and a positive
    non-integer where the bounds allow), so a scalar argument adds at most two or three
    compilations. Outside equiv's runner (plain ``@given``) the full range."""
    if kind not in _DEFAULTS:
        raise ValueError(f"scalars(kind={kind!r}): give float, int or bool")
    lo = _DEFAULTS[kind][0] if min_value is None else kind(min_value)
    hi = _DEFAULTS[kind][1] if max_value is None else kind(max_value)
    if lo > hi:
        raise ValueError(f"scalars(min_value={min_value!r}, max_value={max_value!r}): need "
                         "min_value <= max_value")
    if kind is bool:
        full: st.SearchStrategy = st.booleans()
    elif kind is float:
        full = st.floats(lo, hi, allow_nan=False, allow_infinity=False)
    else:
        full = st.integers(lo, hi)
    values = compile_values(kind, lo, hi)
    small = st.sampled_from(values)

    @st.composite
    def draw_scalar(draw: Any) -> Any:
        return draw(small if compiling() else full)

    strategy = draw_scalar()
    strategy.compile_values = values
    return strategy


def prefer_sides_of_two(strategy: st.SearchStrategy) -> st.SearchStrategy:
    """``strategy`` without the examples that have a tensor side of 0 or 1 (Dynamo specialises
    those), when a short derandomized probe finds that it can draw others; else ``strategy``
    as it is (a strategy that only has sides of 1 still runs)."""
    probe = hypothesis.settings(max_examples=50, database=None, derandomize=True,
                                phases=[hypothesis.Phase.generate], deadline=None,
                                suppress_health_check=list(hypothesis.HealthCheck))
    try:
        hypothesis.find(strategy, lambda ex: not _has_unit_side(ex), settings=probe)
    except BaseException as e:  # NoSuchExample, or an error the run itself will report
        if not user_error(e):
            raise
        return strategy
    return strategy.filter(lambda ex: not _has_unit_side(ex))


def _has_unit_side(example: Any) -> bool:
    if hasattr(example, "args") and hasattr(example, "kwargs"):
        example = (tuple(example.args), dict(example.kwargs))
    return any(isinstance(t, torch.Tensor) and any(s < 2 for s in t.shape)
               for t in tree_leaves(example))
