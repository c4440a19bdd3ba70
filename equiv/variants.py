"""Automatic input variants: beside each drawn example, the runner draws a *variant* of it —
other memory layouts of its tensor arguments (same values) and alias patterns (the same tensor
in two slots, overlapping views of one base). Variants are drawn by Hypothesis, so a failure
shrinks toward no variant, and the report names the variant that failed.

Switched per spec with ``equivalent_to(..., variants=...)``:

- ``"layouts"``: every tensor argument may get another layout (transposed, permuted, sliced with
  a step and storage offset, as_strided window, channels_last; or expanded, stride 0, which
  repeats the first slice along one dim).
- ``"aliasing"``: two arguments the contract does not declare mutated, with the same dtype and
  device, may become one tensor in two slots (same shape only), two overlapping views of one
  base, or the row and the column of one base (``base[0]``, ``base[:, 0]``: different
  elements, one start address, so ``data_ptr()`` cannot tell them apart from one tensor;
  where that base would hold over ~4x the pair's elements, ``base[:n]`` and ``base[::2]``
  instead); views keep each argument's shape, so a matrix and its broadcast bias can overlap
  too. No variant builds a storage of more than ~4x the example's elements.
- ``"aliasing-mutated"``: the same, also for declared mutated arguments (and expanded layouts
  for them: a stride-0 argument overlaps itself).
- ``"half"``: every float32/float64 tensor argument rounded once to float16 or bfloat16
  (:func:`equiv.numerics.round_to`; both sides get the same values).
- ``"half-float32"``: the same for float32 arguments only (a float64 dtype, in
  ``settings(dtypes=...)`` or ``inputs=``, is deliberate). On by default for inputs derived
  from the signature: half results are judged by the baseline-relative rule
  (docs/numerics.md). A kernel that refuses a dtype with the same error as its reference
  rejects the example (it is not a finding).
- ``"extremes"`` (opt-in): large and non-finite values at a few positions of one floating
  argument, where the reference's results stay comparable
  (:mod:`equiv.strategies._extremes`).

For a mutated argument made expanded or aliased, the rule is "must raise or match": the
implementation may raise (torch refuses in-place writes into overlapping memory), otherwise its
results must match the reference's.

Derived inputs (``equiv.strategies.arguments_for``) may carry a note of their own (broadcast
shapes, planted zeros and ties); it is reported with the variant, and broadcast shapes are
"must raise or match" too: an implementation that refuses to broadcast may raise.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, Iterable

import torch
from hypothesis import strategies as st

from equiv._args import Args, as_args
from equiv._compat import tree_flatten
from equiv._options import DEFAULT_VARIANTS, VARIANT_KINDS, validate_variants
from equiv.numerics import round_to
from equiv.roles import Roles
from equiv.strategies import DERIVED_NOTE, layouts
from equiv.strategies._derived import cross_ties, smooth_at
from equiv.strategies._extremes import vary as _extremes_vary
from equiv.strategies._layouts import _gap_value

__all__ = ["DEFAULT_VARIANTS", "VARIANT_KINDS", "NO_VARIANT", "Variant", "excused",
           "validate_variants", "with_variants"]


# relative weights of the variants drawn for one example (index 0, "none", is the shrink target;
# Hypothesis already favours it, so its weight is small)
_CHOICE_WEIGHTS = {"float16": 16, "bfloat16": 9, "none": 1, "transposed": 24, "permuted": 6, "sliced": 8, "window": 4,
                   "channels_last": 3, "expanded": 20, "same": 20,
                   "overlapping": 50, "extremes": 40}
# the explicit "half" variant (opt-in) draws half casts more often than the default
# "half-float32" one, which every derived-input spec has
_HALF_OPT_IN = {"float16": 48, "bfloat16": 20}
_ALIAS_CHOICES = ("same", "overlapping")  # "overlapping" includes the row-column views
_LAYOUT_CHOICES = ("transposed", "sliced", "expanded", "permuted", "window", "channels_last")


@dataclasses.dataclass(frozen=True)
class Variant:
    """What was changed in a drawn example. ``may_raise``: a mutated argument now overlaps itself
    or another argument, so the implementation raising is accepted ("must raise or match")."""

    description: str = ""
    may_raise: bool = False
    overlaps: bool = False  # some argument now overlaps itself or another one

    def __bool__(self) -> bool:
        return bool(self.description)


NO_VARIANT = Variant()


def _tensor_arguments(signature: inspect.Signature, args: Any) -> tuple[Any, list[str]] | None:
    try:
        bound = signature.bind(*args.args, **args.kwargs)
    except TypeError:
        return None
    names = [n for n, v in bound.arguments.items()
             if isinstance(v, torch.Tensor) and v.layout == torch.strided]
    return bound, names


def with_variants(inputs: st.SearchStrategy, signature: inspect.Signature,
                  mutated: Iterable[str], kinds: tuple[str, ...],
                  roles: Roles | None = None,
                  reference: Callable[..., Any] | None = None) -> st.SearchStrategy:
    """Pairs (example, Variant): the drawn example, possibly re-laid out or aliased. ``roles``
    (:mod:`equiv.roles`): derived constants do not require grad, per-argument variant kinds,
    and constants are never aliased with an argument that requires grad. An alias variant that
    makes two arguments tie (equal values at aligned positions: the same tensor in two slots, a
    shared element) where ``reference`` is not smooth is not used."""
    mutated = frozenset(mutated)
    settle = roles.settle if roles is not None else (lambda ex: ex)
    if not kinds:
        return inputs.map(lambda ex: (settle(ex), _noted(ex, NO_VARIANT)))

    options = ["none"]
    if "layouts" in kinds:
        options += list(_LAYOUT_CHOICES)
    if "aliasing" in kinds or "aliasing-mutated" in kinds:
        options += list(_ALIAS_CHOICES)
    if "half" in kinds or "half-float32" in kinds:
        options += ["float16", "bfloat16"]
    if "extremes" in kinds:
        options += ["extremes"]
    # the variant is the first choice (Hypothesis varies a test case's first choices most), with
    # fixed weights; index 0 (no variant) is the shrink target
    weights = {**_CHOICE_WEIGHTS, **(_HALF_OPT_IN if "half" in kinds else {})}
    table = [o for o in options for _ in range(weights[o])]

    @st.composite
    def build(draw: Any) -> tuple[Any, Variant]:
        choice = table[draw(st.integers(0, len(table) - 1))]
        example = settle(draw(inputs))
        if choice == "extremes":
            changed, variant = _extremes(draw, example, signature, kinds, roles, reference)
        else:
            changed, variant = _vary(draw, example, choice, signature, mutated, kinds, roles)
        if variant.overlaps and not _ties_smooth(reference, changed):
            changed, variant = example, NO_VARIANT  # a tie at a kink of the reference
        return changed, _noted(example, variant)

    return build()


def _vary(draw: Any, example: Any, choice: str, signature: inspect.Signature,
          mutated: frozenset, kinds: tuple[str, ...],
          roles: Roles | None = None) -> tuple[Any, Variant]:
    """``example`` with the variant ``choice`` applied where it fits (or unchanged)."""
    try:
        args = as_args(example)
    except TypeError:
        return example, NO_VARIANT  # the runner reports the bad example
    found = _tensor_arguments(signature, args)
    if found is None or not found[1]:
        return example, NO_VARIANT
    bound, names = found
    values = dict(bound.arguments)
    own = (lambda n, k: k in roles.kinds_of(n, kinds)) if roles is not None else (
        lambda n, k: k in kinds)
    allowed = [n for n in names if own(n, "aliasing-mutated")
               or (n not in mutated and own(n, "aliasing"))]
    pairs = _alias_pairs(choice, values, allowed)
    if pairs and choice in _ALIAS_CHOICES:
        pairs = _apart(pairs, values, roles.constants(values) if roles is not None
                       else frozenset())
    if choice in _ALIAS_CHOICES and not pairs:
        if "layouts" not in kinds:
            return example, NO_VARIANT
        choice = "transposed" if choice == "same" else "expanded"
    if choice == "none":
        return example, NO_VARIANT
    if choice in ("float16", "bfloat16"):
        dtype = getattr(torch, choice)
        halved = (torch.float32, torch.float64) if "half" in kinds else (torch.float32,)
        cast = [n for n in names if values[n].dtype in halved
                and (own(n, "half") or own(n, "half-float32"))]
        if not cast:
            return example, NO_VARIANT
        for n in cast:  # rounded once (float64 -> half rounds twice through .to)
            t = values[n]
            values[n] = round_to(t.detach(), dtype).requires_grad_(t.requires_grad)
        variant = Variant(f"{', '.join(cast)} cast to {choice}")
    elif choice in _ALIAS_CHOICES:
        variant = _alias(draw, choice, values, pairs, mutated)
    else:
        variant = _layout(draw, choice, values, [n for n in names if own(n, "layouts")],
                          mutated, kinds)
        if variant is None:
            return example, NO_VARIANT
    bound.arguments.update(values)
    return Args(*bound.args, **bound.kwargs), variant


def _extremes(draw: Any, example: Any, signature: inspect.Signature, kinds: tuple[str, ...],
              roles: Roles | None, reference: Callable[..., Any] | None) -> tuple[Any, Variant]:
    """``example`` with large and non-finite values planted where the reference's result stays
    comparable (:func:`equiv.strategies._extremes.vary`)."""
    try:
        args = as_args(example)
    except TypeError:
        return example, NO_VARIANT  # the runner reports the bad example
    own = (lambda n: "extremes" in roles.kinds_of(n, kinds)) if roles is not None else (
        lambda n: True)
    changed, description = _extremes_vary(draw, args, signature, own, reference)
    return (changed, Variant(description)) if description else (example, NO_VARIANT)


def _ties_smooth(reference: Callable[..., Any] | None, example: Any) -> bool:
    """Whether ``reference`` is smooth at the ties across the arguments of ``example``
    (:func:`equiv.strategies._derived.cross_ties`); true without a reference or ties."""
    values = list(example.args) + list(example.kwargs.values())
    ties = cross_ties(values)
    return not ties or smooth_at(reference, example.args, example.kwargs, ties)


def _alias_pairs(choice: str, values: dict, allowed: list[str]) -> list[tuple[str, str]]:
    """The pairs of ``allowed`` arguments the alias ``choice`` can apply to: one tensor in two
    slots needs one shape; overlapping views take any two shapes, the first of at least two
    elements (a pair of single elements can only be one tensor in two slots)."""
    pairs = [(a, b) for i, a in enumerate(allowed) for b in allowed[i + 1:]
             if _compatible(values[a], values[b])]
    same = [(a, b) for a, b in pairs if values[a].shape == values[b].shape]
    if choice == "same":
        return same
    views = [(a, b) if values[a].numel() >= 2 else (b, a) for a, b in pairs
             if max(values[a].numel(), values[b].numel()) >= 2]
    return views or same


def _apart(pairs: list[tuple[str, str]], values: dict,
           constants: frozenset[str]) -> list[tuple[str, str]]:
    """``pairs`` without a constant, or an argument the example gives without requires_grad,
    paired with an argument that requires grad: one grad-requiring base would make it require
    grad, a call the example never makes (a kernel may refuse it: ATen's "This input cannot
    have requires_grad True" for a loss weight)."""
    def grad(n: str) -> bool:
        return bool(values[n].requires_grad)

    def fixed(n: str) -> bool:
        return n in constants or not grad(n)
    return [(a, b) for a, b in pairs
            if not ((fixed(a) and grad(b)) or (fixed(b) and grad(a)))]


def _alias(draw: Any, choice: str, values: dict, pairs: list, mutated: frozenset) -> Variant:
    """Make a drawn pair of ``values`` share memory (in place in ``values``)."""
    a, b = pairs[draw(st.integers(0, len(pairs) - 1))]
    x, y = values[a], values[b]
    if choice != "same" and x.numel() >= 2:
        # "overlapping" is drawn as the row and column of one base or as shifted views; both
        # draw a shift, so that one differs from the other by one choice of the same length.
        # Row-column is the simplest choice: Hypothesis's early examples take the simplest
        # value of every choice they do not vary, so they get the one-start-address views
        if draw(st.integers(0, 7)) < 7:  # row-column seven times as often as shifted views
            choice = "row-column"
        shift = draw(st.integers(1, x.numel() - 1))
        if choice == "row-column" and _row_column_fits(x.numel(), y.numel()):
            values[a], values[b] = _row_and_column(x, y)
            text = (f"{a} and {b} the row and the column of one base ({a} = base[0], "
                    f"{b} = base[:, 0]: one start address, 1 shared element)")
        elif choice == "row-column":  # an m x n base would dwarf the example: one start, stride 2
            values[a], values[b] = _every_other(x, y)
            shared = min((x.numel() + 1) // 2, y.numel())
            text = (f"{a} and {b} start at one address ({a} = base[:n], {b} = base[::2]: "
                    f"{b} holds every other element, {shared} shared)")
        else:
            values[a], values[b] = _overlapping(x, y, shift)
            text = (f"{a} and {b} overlapping views of one base ({b} starts {shift} "
                    f"element{'s' if shift > 1 else ''} after {a})")
    else:
        values[b] = x
        text = f"{b} is the same tensor as {a}"
    return Variant(text, bool({a, b} & mutated), True)


@functools.lru_cache(maxsize=None)
def _layouts_of(kind: str) -> st.SearchStrategy:
    """``layouts(kinds=(kind,))``, one strategy per kind: Hypothesis validates a new strategy
    on its first draw, so a fresh one per example costs that every time."""
    return layouts(kinds=(kind,))


def _layout(draw: Any, choice: str, values: dict, names: list[str], mutated: frozenset,
            kinds: tuple[str, ...]) -> Variant | None:
    """Re-lay out one drawn argument of ``values`` (in place in ``values``)."""
    lay = draw(_layouts_of(choice))
    # an expanded argument overlaps itself: for a mutated one that is aliasing
    usable = [n for n in names if lay.effective(values[n].shape).kind == choice
              and not (choice == "expanded" and n in mutated
                       and "aliasing-mutated" not in kinds)]
    if not usable:  # this shape cannot show the layout: fall back to one that can
        lay = draw(_layouts_of("sliced"))
        usable = [n for n in names if values[n].numel() > 0]
        if not usable:
            return None
    n = usable[draw(st.integers(0, len(usable) - 1))]
    t = values[n]
    values[n] = lay.apply(t)
    expanded = lay.kind == "expanded"
    return Variant(f"{n} {lay.describe(t.shape)}", expanded and n in mutated, expanded)


def _noted(example: Any, variant: Variant) -> Variant:
    """``variant`` joined with the note a derived example carries (broadcast shapes, planted
    zeros and ties): one description; broadcast shapes may raise ("must raise or match")."""
    note = getattr(example, DERIVED_NOTE, None)
    if not note:
        return variant
    text, may_raise = note
    description = "; ".join(d for d in (text, variant.description) if d)
    return Variant(description, variant.may_raise or may_raise, variant.overlaps)


def _compatible(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Whether ``x`` and ``y`` can be views of one base (their shapes may differ: overlapping
    views of differently shaped arguments, as broadcasting signatures take)."""
    return (x.dtype == y.dtype and x.device == y.device and x.numel() > 0
            and y.numel() > 0)


def _fresh_base(x: torch.Tensor, y: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.full(shape, _gap_value(x.dtype), dtype=x.dtype, device=x.device)


def _overlapping(x: torch.Tensor, y: torch.Tensor, shift: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two views of one fresh base: the first holds x's values, the second starts ``shift``
    elements later (its elements past the first's end are y's)."""
    n, m = x.numel(), y.numel()
    shared = max(0, min(n - shift, m))
    with torch.no_grad():
        base = _fresh_base(x, y, (max(n, shift + m),))
        base[:n] = x.detach().reshape(-1)
        base[shift + shared:shift + m] = y.detach().reshape(-1)[shared:]
    base.requires_grad_(x.requires_grad or y.requires_grad)
    return base[:n].view(x.shape), base[shift:shift + m].view(y.shape)


# the row/column variant's base is m x n (n, m: the two arguments' elements): only for
# arguments of up to this many elements each
_ROW_COLUMN_MAX = 1024
# ... and only where that base holds at most this many times the pair's elements (or at most
# _BASE_FLOOR elements, cheap whatever the pair): a variant costs about what the example costs
BASE_FACTOR = 4
_BASE_FLOOR = 1024


def _row_column_fits(n: int, m: int) -> bool:
    """Whether the m x n row/column base of arguments of ``n`` and ``m`` elements is small
    enough (a 1000-element row and column would need a 1M-element base: the shifted or
    every-other views show the overlap at the pair's own size)."""
    return (max(n, m) <= _ROW_COLUMN_MAX
            and n * m <= max(BASE_FACTOR * (n + m), _BASE_FLOOR))


def _row_and_column(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two views of one fresh m x n base (n, m: x's and y's elements): the first is ``base[0]``
    with x's values, the second ``base[:, 0]`` with y's values after its first element, which
    is shared with x. Both start at the base's first element."""
    n, m = x.numel(), y.numel()
    with torch.no_grad():
        base = _fresh_base(x, y, (m, n))
        base[0] = x.detach().reshape(-1)
        base[1:, 0] = y.detach().reshape(-1)[1:]
    base.requires_grad_(x.requires_grad or y.requires_grad)
    return base[0].view(x.shape), base[:, 0].view(y.shape)


def _every_other(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two views of one fresh base, both starting at its first element: the first is
    ``base[:n]`` with x's values, the second ``base[::2]`` (its elements past the first's end
    hold y's values)."""
    n, m = x.numel(), y.numel()
    shared = min((n + 1) // 2, m)
    with torch.no_grad():
        base = _fresh_base(x, y, (2 * max(n, m),))
        base[:n] = x.detach().reshape(-1)
        base[::2][shared:m] = y.detach().reshape(-1)[shared:]
    base.requires_grad_(x.requires_grad or y.requires_grad)
    return base[:n].view(x.shape), base[::2][:m].view(y.shape)


_OVERLAP_ERROR = "to a single memory location"  # torch refusing an in-place write


def excused(variant: Variant, findings: list[Any]) -> bool:
    """True when the variant allows what happened: the implementation raised where the
    reference returned ("must raise or match"), because the variant made a mutated argument
    overlap, or because torch refused an in-place write into memory the variant made overlap
    (an undeclared write is then reported by the mutation check on ordinary examples)."""
    if not (variant and findings):
        return False
    raised = all(f.check == "error-parity" and f.headline.startswith("the implementation")
                 and "where the reference returned" in f.headline for f in findings)
    refused = variant.overlaps and all(_OVERLAP_ERROR in f.details for f in findings)
    return raised and (variant.may_raise or refused)


# -- cotangent variants -----------------------------------------------------------------------
# relative weights of the cotangent layouts drawn for one example ("contiguous", index 0, is the
# shrink target: Hypothesis draws index 0 for about a third of examples already, so its weight
# is 1; "transposed" needs two dims of size > 1)
_COT_WEIGHTS = {"contiguous": 1, "strided": 4, "transposed": 10, "expanded": 5, "zero": 1}
COTANGENT_KINDS: tuple[str, ...] = tuple(_COT_WEIGHTS)
# undefined cotangents: bit i of the drawn mask leaves the (i+1)-th value from the end without
# one (0, all defined, is the shrink target; 1: the last value, the usual unused output)
_UNDEFINED_MASKS = 3


@dataclasses.dataclass(frozen=True)
class CotangentVariant:
    """How the cotangents handed to backward look (the same on both sides). ``kind``:
    ``"contiguous"`` (the shrink target); ``"strided"`` (every other element of a larger
    buffer, at a storage offset); ``"transposed"`` (the last two dims' strides swapped);
    ``"expanded"`` (one value expanded to the output's shape, every stride 0: what ``.sum()``
    and ``.mean()`` feed back); ``"zero"`` (all zeros). ``undefined``: a bit mask of the
    differentiated values, counted from the last, that get no cotangent (``None``, as autograd
    passes an unused output's gradient) when there are several; at least one stays defined."""

    kind: str = "contiguous"
    undefined: int = 0

    def __bool__(self) -> bool:
        return self.kind != "contiguous" or bool(self.undefined)

    def dropped(self, n: int) -> list[bool]:
        """Which of ``n`` differentiated values get no cotangent."""
        if n < 2:
            return [False] * n
        out = [bool(self.undefined >> (n - 1 - i) & 1) for i in range(n)]
        if all(out):
            out[0] = False
        return out

    def values(self, cots: list[torch.Tensor]) -> list[torch.Tensor | None]:
        """The drawn (contiguous) cotangents with this variant's values: zeros, the first
        element everywhere (expanded), ``None`` for undefined ones."""
        if self.kind == "zero":
            cots = [torch.zeros_like(c) for c in cots]
        elif self.kind == "expanded":  # one value everywhere, as .sum() feeds back
            cots = [c.reshape(-1)[0].expand(c.shape).clone() if c.numel() else c for c in cots]
        return [None if u else c for c, u in zip(cots, self.dropped(len(cots)))]

    @property
    def holds_values(self) -> bool:
        """Whether a laid-out cotangent is a plain copy of the values, in their own layout."""
        return self.kind in ("contiguous", "zero")

    @property
    def copies_laid(self) -> bool:
        """Whether a laid-out cotangent is cheaper to clone (``clone`` keeps its strides) than
        to lay out again: a transposing copy costs several clones."""
        return self.kind == "transposed"

    def lay_out(self, cots: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Fresh tensors holding ``cots``' values in this variant's layout."""
        return [None if c is None else _cot_layout(self.kind, c) for c in cots]

    def describe(self, names: list[str], laid: list[torch.Tensor | None]) -> str:
        """The finding's lines naming the cotangents, e.g. ``cotangent: transposed
        (output: strides (1, 3))``, ``cotangent: None for output[1] (undefined, ...)``; empty
        when every cotangent is as drawn."""
        lines = []
        shown = [(n, c) for n, c in zip(names, laid)
                 if c is not None and _cot_layout_applies(self.kind, c)]
        if self.kind == "zero" and shown:
            lines.append("cotangent: zero (all elements 0)")
        elif shown:
            lines.append(f"cotangent: {self.kind} (" + ", ".join(
                f"{n}: strides {tuple(c.stride())}"
                + (f", offset {c.storage_offset()}" if c.storage_offset() else "")
                for n, c in shown) + ")")
        none = [n for n, c in zip(names, laid) if c is None]
        if none:
            lines.append(f"cotangent: None for {', '.join(none)} (undefined, as autograd passes "
                         "the gradient of an unused output)")
        return "\n".join(lines)


CONTIGUOUS = CotangentVariant()


def cotangent_variants() -> st.SearchStrategy[CotangentVariant]:
    """The cotangent variant of one example: a weighted layout (index 0, contiguous, shrinks
    first) and a mask of undefined values (0, none, shrinks first)."""
    table = [k for k, w in _COT_WEIGHTS.items() for _ in range(w)]
    return st.builds(lambda i, mask: CotangentVariant(table[i], mask),
                     st.integers(0, len(table) - 1), st.integers(0, _UNDEFINED_MASKS))


def _cot_layout_applies(kind: str, c: torch.Tensor) -> bool:
    if kind == "zero":
        return True
    if kind == "transposed":
        return c.dim() >= 2 and c.shape[-1] > 1 and c.shape[-2] > 1
    if kind == "expanded":
        return c.numel() >= 2
    return kind == "strided" and c.numel() >= 1


def _cot_layout(kind: str, c: torch.Tensor) -> torch.Tensor:
    """A fresh tensor with ``c``'s values in the layout ``kind`` (``c`` itself when it cannot
    show the layout)."""
    if kind in ("contiguous", "zero") or not _cot_layout_applies(kind, c):
        return c.clone()
    if kind == "transposed":
        return c.transpose(-1, -2).contiguous().transpose(-1, -2)
    if kind == "expanded":
        return c.reshape(-1)[0].clone().expand(c.shape)
    # strided: every other element of a buffer twice as large, one element in
    base = torch.full((2 * c.numel() + 1,), _gap_value(c.dtype), dtype=c.dtype, device=c.device)
    view = base[1::2].view(c.shape) if c.dim() else base[1]
    view.copy_(c)
    return view


# -- write-only buffers -----------------------------------------------------------------------
def poison_value(dtype: torch.dtype) -> Any:
    """What a write-only argument is filled with before the implementation's call: NaN, or for
    integers their smallest value (bool: True)."""
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    if dtype == torch.bool:
        return True
    return torch.iinfo(dtype).min


def poisoning(signature: inspect.Signature, names: tuple[str, ...],
              fn: Any) -> Any:
    """``fn`` with the tensors of the write-only arguments ``names`` filled with
    :func:`poison_value` before each call (not where a tensor shares storage with another
    argument: that one would be poisoned too). The caller's tensors are the copies the core
    made for the implementation's side."""
    @functools.wraps(fn)
    def poisoned(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError:
            return fn(*args, **kwargs)
        others = {t.untyped_storage().data_ptr() for n, v in bound.arguments.items()
                  if n not in names for t in _tensors(v)}
        saved = []
        with torch.no_grad():
            for n in names:
                for t in _tensors(bound.arguments.get(n)):
                    if t.untyped_storage().data_ptr() in others or t.numel() == 0:
                        continue
                    try:
                        old = t.detach().clone()
                        t.detach().fill_(poison_value(t.dtype))
                        saved.append((t, old))
                    except RuntimeError:  # e.g. an expanded buffer cannot be written
                        pass
        try:
            return fn(*args, **kwargs)
        except BaseException:
            _unpoison(saved)
            raise

    return poisoned


def _unpoison(saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """After the implementation raised: a buffer it left untouched gets its contents back (the
    NaN was equiv's write, not the implementation's); a partly written one stays as it is."""
    with torch.no_grad():
        for t, old in saved:
            v, poison = t.detach(), poison_value(t.dtype)
            untouched = v.isnan().all() if isinstance(poison, float) else (v == poison).all()
            if bool(untouched):
                v.copy_(old)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
