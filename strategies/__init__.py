"""Hypothesis strategies for tensors and argument tuples (importable as ``equiv.strategies``).

Values are dense: every element is drawn or derived from a drawn seed (never one repeated
background fill) and tie-free by default, so kinks (``relu`` at exactly 0, ``max`` of equal
elements), where subgradient conventions legitimately differ, are avoided unless asked for with
``elements=`` or ``special=``. A failing example shrinks toward fewer dimensions, smaller sides,
contiguous layout, no aliasing, float64 and simple values (distinct small half-integers:
``-0.5, 0.5, 1.5, ...``).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import hypothesis
from hypothesis import strategies as st

from equiv._args import Args
from equiv.errors import user_error

from . import _derived
from ._aliasing import ALIAS_PATTERNS, aliased_arguments
from ._compile import scalars
from ._derived import TILE_LENGTHS, tile_lengths
from ._layouts import LAYOUT_KINDS, Layout, layouts
from ._tensors import (
    COMPLEX,
    DERIVED_DTYPES,
    FLOATING,
    HALF,
    INTEGER,
    SPECIAL_VALUES,
    _numel,
    devices,
    dtypes,
    shapes,
    tensors,
)

__all__ = [
    "ALIAS_PATTERNS", "LAYOUT_KINDS", "SPECIAL_VALUES", "TILE_LENGTHS", "Layout",
    "aliased_arguments", "arguments_for", "devices", "dtypes", "layouts", "scalars", "shapes",
    "tensors", "tile_lengths",
]

_TENSOR_ANNOTATIONS = {inspect.Parameter.empty, torch.Tensor, "Tensor", "torch.Tensor"}
_SCALARS = {  # scalars(): full range in eager modes, a small fixed set in compile modes
    float: scalars(float), "float": None, int: scalars(int), "int": None, bool: st.booleans(),
    "bool": None,
}


def arguments_for(signature: inspect.Signature, *,
                  dtypes_: Sequence[torch.dtype] = DERIVED_DTYPES,
                  shape_strategy: st.SearchStrategy | None = None,
                  reference: Callable[..., Any] | None = None,
                  mutated: Iterable[str] = (),
                  block_sizes: Sequence[int] = (),
                  hard_cases: bool = True,
                  broadcast: bool = True) -> st.SearchStrategy:
    """Argument tuples for a signature: every required tensor parameter gets a tensor of one
    shared drawn shape (``shapes()``: 0-d to 3-D, sides 0-4) and dtype (from ``dtypes_``:
    float32, float64; complex when listed), requiring grad; annotated ``float``/``int``/``bool``
    parameters get small scalars (``scalars()``: from a small fixed set in compile modes);
    parameters with defaults keep them. Raises ``ValueError``
    naming the parameter when a required parameter cannot be derived.

    With ``hard_cases`` (the default), some examples reach the cases kernels break on (each a
    drawn choice that shrinks away): one dim with a length that straddles a tile size
    (``tile_lengths(block_sizes)``, at most 4096 elements in all); mutually broadcastable
    shapes when there are several tensor parameters and ``broadcast`` (parameters in
    ``mutated`` keep the full shape); and exact zeros and ties, kept only where ``reference``
    (when given) is smooth there. A given ``shape_strategy`` (compile-friendly shapes) turns the
    shape cases off; zeros and ties stay. Examples with broadcast shapes or planted values carry
    a description the runner reports as their input variant."""
    kinds = _parameter_kinds(signature)
    locations = dict(mutated) if isinstance(mutated, Mapping) else {}
    mutated = frozenset(mutated)
    lengths = _derived.tile_lengths(tuple(block_sizes))
    n_tensors = sum(kind == "tensor" for _, kind, _ in kinds)
    shaped = hard_cases and shape_strategy is None

    @st.composite
    def build(draw: Any) -> Any:
        # the dtype is the first choice: Hypothesis varies a test case's first choices most
        # the first dtype is the shrink target; the others twice as likely as listed once
        dt = draw(st.sampled_from(tuple(dtypes_[:1]) + tuple(dtypes_[1:]) * 2))
        # the shape plan before the shape: an early choice, varied most by Hypothesis
        plan = (_derived.draw_plan(draw, n_tensors, tile=True, broadcast=broadcast,
                                   steer=bool(block_sizes)) if shaped else "shared")
        shp = draw(shape_strategy if shape_strategy is not None else shapes())
        per_arg = _shapes_for(draw, plan, shp, kinds, mutated, lengths, shaped, broadcast)
        plant = hard_cases and draw(st.integers(0, 3)) >= 1  # about one example in two
        args: list[Any] = []
        kw: dict[str, Any] = {}
        planted: dict[int, list[int]] = {}
        plain: dict[int, torch.Tensor] = {}
        words: list[str] = []
        for k, (name, kind, keyword) in enumerate(kinds):
            if kind == "tensor":
                value = draw(tensors(shape=per_arg[k], dtype=dt)).detach()
                before = value.clone() if plant else value
                spots = _derived.plant(draw, value, plant) if hard_cases else []
                if spots:
                    planted[k], plain[k] = [i for i, _ in spots], before
                    words.append(_plant_words(name, spots))
                value.requires_grad_(dt.is_floating_point or dt.is_complex)
            else:
                value = draw(kind)
            if keyword:
                kw[name] = value
            else:
                args.append(value)
        keep, broken = _smooth_planted(reference, args, kw, planted) if hard_cases else (1, 0)
        if not keep:
            _unplant(args, kw, kinds, plain)  # a kink of the reference: keep the plain values
            words = []
            if broken:  # the plain values tie across arguments where the planted ones did
                values = list(args) + list(kw.values())
                _derived.break_ties(values, _derived.cross_ties(values))
        out = Args(*args, **kw)
        if plan == "broadcast":
            if reference is not None and not _accepts(reference, out, signature, locations):
                return _lengths_or_shared(draw, out, kinds, dt, shp, reference, signature,
                                          locations)
            words.insert(0, f"broadcast shapes: {_shown(kinds, per_arg)}")
        if words:
            object.__setattr__(out, DERIVED_NOTE, ("; ".join(words), plan == "broadcast"))
        return out

    return build()


def compile_arguments_for(signature: inspect.Signature, *, dtype: torch.dtype,
                          reference: Callable[..., Any] | None = None,
                          mutated: Iterable[str] = ()) -> st.SearchStrategy:
    """Derived arguments for a compile mode: one dtype and compile-friendly shapes of one rank,
    2-D when a short probe finds a 2-D example the reference accepts, else 1-D (else both).
    Dynamo guards on every tensor's rank, so each rank is another graph of every frame; the
    ranks, sides of 0/1 and the other dtypes are eager mode's to explore."""
    def of_rank(lo: int, hi: int) -> st.SearchStrategy:
        return arguments_for(signature, dtypes_=(dtype,), reference=reference, mutated=mutated,
                             shape_strategy=shapes(compile_friendly=True, min_dims=lo,
                                                   max_dims=hi))

    if reference is None:
        return of_rank(2, 2)
    locations = dict(mutated) if isinstance(mutated, Mapping) else {}
    for ndim in (2, 1):
        strategy = of_rank(ndim, ndim)
        if _draws_accepted(strategy, reference, signature, locations):
            return strategy
    return of_rank(1, 2)


def _draws_accepted(strategy: st.SearchStrategy, reference: Callable[..., Any],
                    signature: inspect.Signature, locations: Mapping[str, Any]) -> bool:
    """Whether a short derandomized probe of ``strategy`` draws an example ``reference``
    returns on."""
    probe = hypothesis.settings(max_examples=10, database=None, derandomize=True,
                                phases=[hypothesis.Phase.generate], deadline=None,
                                suppress_health_check=list(hypothesis.HealthCheck))
    try:
        hypothesis.find(strategy, lambda ex: _accepts(reference, ex, signature, locations),
                        settings=probe)
    except BaseException as e:  # NoSuchExample, or an error the run itself will report
        if not user_error(e):
            raise
        return False
    return True


def _build_shared(draw: Any, kinds: list, dt: torch.dtype, shp: tuple[int, ...]) -> Any:
    """The plain example: one shared shape (the reference refused broadcast shapes)."""
    args: list[Any] = []
    kw: dict[str, Any] = {}
    for name, kind, keyword in kinds:
        value = (draw(tensors(shape=shp, dtype=dt, requires_grad=True)) if kind == "tensor"
                 else draw(kind))
        (kw.__setitem__(name, value) if keyword else args.append(value))
    return Args(*args, **kw)


def _untied(reference: Callable[..., Any], example: Args) -> Args:
    """``example`` with its equal simple values across arguments moved off the tie where the
    reference has a kink there (``x == lo`` in ``clamp``), as in a plain example (in place)."""
    _smooth_planted(reference, list(example.args), dict(example.kwargs), {})
    return example


def _lengths_or_shared(draw: Any, refused: Args, kinds: list, dt: torch.dtype,
                       shp: tuple[int, ...], reference: Callable[..., Any],
                       signature: inspect.Signature, locations: Mapping[str, Any]) -> Any:
    """Where the reference refused broadcast shapes (``refused``): independent lengths (some
    tensor arguments get another length along one dim), the first candidate of
    :func:`_derived.independent_lengths` the reference accepts, with the other arguments of
    ``refused`` (the example drawn so far); else the plain example of one shared shape."""
    slots = [k for k, (_, kind, _) in enumerate(kinds) if kind == "tensor"]
    for shapes_ in _derived.independent_lengths(draw, tuple(shp), len(slots)):
        per_arg = dict(zip(slots, shapes_))
        if _accepts(reference, _with_tensors(refused, kinds, per_arg, _probe_tensor, dt),
                    signature, locations):
            break
    else:
        return _untied(reference, _build_shared(draw, kinds, dt, shp))
    out = _with_tensors(refused, kinds, per_arg, lambda s, d: draw(
        tensors(shape=s, dtype=d, requires_grad=True)), dt)
    if not _accepts(reference, _untied(reference, out), signature, locations):
        return _untied(reference, _build_shared(draw, kinds, dt, shp))  # refused: these values
    object.__setattr__(out, DERIVED_NOTE,
                       (f"independent lengths: {_shown(kinds, per_arg)}", True))
    return out


def _shown(kinds: list, per_arg: dict[int, tuple[int, ...]]) -> str:
    """``"x (2, 1), y (3,)"``: each tensor parameter's shape."""
    return ", ".join(f"{kinds[k][0]} {tuple(per_arg[k])}" for k in sorted(per_arg))


def _probe_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Distinct simple values of ``shape``: enough to ask the reference whether it accepts
    the shapes."""
    n = _numel(shape)
    return (torch.arange(n, dtype=torch.float64).remainder(7) - 2.5).to(dtype).reshape(shape)


def _with_tensors(example: Args, kinds: list, per_arg: dict[int, tuple[int, ...]],
                  make: Callable[[tuple[int, ...], torch.dtype], torch.Tensor],
                  dt: torch.dtype) -> Args:
    """``example`` with the tensor argument at each position of ``per_arg`` replaced by
    ``make(shape, dt)``; the other arguments are kept."""
    args, kw = list(example.args), dict(example.kwargs)
    pos = 0
    for k, (name, _, keyword) in enumerate(kinds):
        if k in per_arg:
            value = make(per_arg[k], dt)
            if keyword:
                kw[name] = value
            else:
                args[pos] = value
        pos += not keyword
    return Args(*args, **kw)


#: the attribute of a derived example naming what was drawn beyond a plain example:
#: ``(description, may_raise)``; ``may_raise`` (broadcast shapes) means "must raise or match"
DERIVED_NOTE = "_equiv_derived_note"


def _parameter_kinds(signature: inspect.Signature) -> list[tuple[str, Any, bool]]:
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
    return kinds


def _shapes_for(draw: Any, plan: str, shp: tuple[int, ...], kinds: list, mutated: frozenset,
                lengths: Sequence[int], hard: bool, spread_ok: bool) -> dict[int, tuple[int, ...]]:
    """The shape of each tensor parameter (by position in ``kinds``) under ``plan``. With
    ``hard``, the tile and broadcast shapes are drawn whatever the plan (same choice sequence
    length: a failure shrinks from either plan to the shared shape)."""
    slots = [k for k, (_, kind, _) in enumerate(kinds) if kind == "tensor"]
    if not hard:
        return {k: tuple(shp) for k in slots}
    tiled = _derived.tile_shape(draw, tuple(shp), lengths)
    spread = (_derived.broadcast_shapes(draw, len(slots), [kinds[k][0] in mutated for k in slots])
              if spread_ok and len(slots) >= 2 else ())
    if plan == "broadcast":
        return dict(zip(slots, spread))
    return {k: tuple(tiled if plan == "tile" else shp) for k in slots}


def _smooth_planted(reference: Callable[..., Any] | None, args: list, kw: dict,
                    planted: dict[int, list[int]]) -> tuple[bool, bool]:
    """(whether the planted values, ``planted``: flat indices by argument position, may stay;
    whether ties across arguments were broken). Ties across arguments (``x == lo`` in
    ``clamp(x, lo, hi)``: equal simple values in two arguments) are probed with the plants;
    where the reference is not smooth there they are broken (:func:`_derived.break_ties`) and
    the plants are probed alone."""
    values = list(args) + list(kw.values())
    ties = _derived.cross_ties(values)
    if not ties:
        return not planted or _derived.smooth_at(reference, args, kw, planted), False
    both = {k: sorted(set(planted.get(k, ())) | set(ties.get(k, ()))) for k in {*planted, *ties}}
    if _derived.smooth_at(reference, args, kw, both):
        return True, False
    _derived.break_ties(values, ties)
    return not planted or _derived.smooth_at(reference, args, kw, planted), True


def _plant_words(name: str, spots: list[tuple[int, str]]) -> str:
    zeros = [i for i, w in spots if w == "zero"]
    ties = [i for i, w in spots if w == "tie"]
    parts = ([f"exact zeros in {name} (flat index {', '.join(map(str, zeros))})"] if zeros
             else []) + ([f"ties in {name} (flat index {', '.join(map(str, ties))})"] if ties
                         else [])
    return "; ".join(parts)


def _unplant(args: list, kw: dict, kinds: list, plain: dict[int, torch.Tensor]) -> None:
    """Put back the values drawn before planting (in place, keeping the tensors)."""
    pos = 0
    for k, (name, _, keyword) in enumerate(kinds):
        if k in plain:
            t = kw[name] if keyword else args[pos]
            with torch.no_grad():
                t.copy_(plain[k])
        pos += not keyword


def _accepts(reference: Callable[..., Any], example: Any, signature: inspect.Signature,
             locations: Mapping[str, Any]) -> bool:
    """Whether ``reference`` returns (does not raise) on ``example``, without gradients, with
    the final value of each mutated argument (``locations``: as in ``mutates=``) of that
    argument's shape (an ``out=`` buffer drawn larger than the other arguments' broadcast
    result does not fit)."""
    try:
        with torch.no_grad():
            result = reference(
                *[a.detach() if isinstance(a, torch.Tensor) else a for a in example.args],
                **{k: v.detach() if isinstance(v, torch.Tensor) else v
                   for k, v in example.kwargs.items()})
        bound = signature.bind(*example.args, **example.kwargs).arguments
        for name, loc in locations.items():
            final = result if loc == "out" else result[loc]
            arg = bound.get(name)
            if isinstance(arg, torch.Tensor) and getattr(final, "shape", None) != arg.shape:
                return False
    except BaseException as e:  # the reference raised (SystemExit too): not accepted
        if not user_error(e):
            raise
        return False
    return True
