"""Automatic input variants: beside each drawn example, the runner draws a *variant* of it —
other memory layouts of its tensor arguments (same values) and alias patterns (the same tensor
in two slots, overlapping views of one base). Variants are drawn by Hypothesis, so a failure
shrinks toward no variant, and the report names the variant that failed.

Switched per spec with ``equivalent_to(..., variants=...)``:

- ``"layouts"``: every tensor argument may get another layout (transposed, permuted, sliced with
  a step and storage offset, as_strided window, channels_last; or expanded, stride 0, which
  repeats the first slice along one dim).
- ``"aliasing"``: two arguments the contract does not declare mutated, with the same shape, dtype
  and device, may become one tensor in two slots or two overlapping views of one base.
- ``"aliasing-mutated"``: the same, also for declared mutated arguments (and expanded layouts
  for them: a stride-0 argument overlaps itself).
- ``"half"``: every float32/float64 tensor argument rounded once to float16 or bfloat16
  (:func:`equiv.numerics.round_to`; both sides get the same values).
- ``"half-float32"``: the same for float32 arguments only (a float64 dtype, in
  ``settings(dtypes=...)`` or ``inputs=``, is deliberate). On by default for inputs derived
  from the signature: half results are judged by the baseline-relative rule
  (docs/numerics.md). A kernel that refuses a dtype with the same error as its reference
  rejects the example (it is not a finding).

For a mutated argument made expanded or aliased, the rule is "must raise or match": the
implementation may raise (torch refuses in-place writes into overlapping memory), otherwise its
results must match the reference's.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Iterable

import torch
from hypothesis import strategies as st

from equiv._args import Args, as_args
from equiv._options import DEFAULT_VARIANTS, VARIANT_KINDS, validate_variants
from equiv.numerics import round_to
from equiv.strategies import layouts

__all__ = ["DEFAULT_VARIANTS", "VARIANT_KINDS", "NO_VARIANT", "Variant", "excused",
           "validate_variants", "with_variants"]


# relative weights of the variants drawn for one example (index 0, "none", is the shrink target;
# Hypothesis already favours it, so its weight is small)
_CHOICE_WEIGHTS = {"float16": 14, "bfloat16": 8, "none": 1, "transposed": 18, "permuted": 6, "sliced": 8, "window": 4,
                   "channels_last": 3, "expanded": 16, "same": 20, "overlapping": 20}
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
                  mutated: Iterable[str], kinds: tuple[str, ...]) -> st.SearchStrategy:
    """Pairs (example, Variant): the drawn example, possibly re-laid out or aliased."""

    mutated = frozenset(mutated)
    if not kinds:
        return inputs.map(lambda ex: (ex, NO_VARIANT))

    options = ["none"]
    if "layouts" in kinds:
        options += list(_LAYOUT_CHOICES)
    if "aliasing" in kinds or "aliasing-mutated" in kinds:
        options += ["same", "overlapping"]
    if "half" in kinds or "half-float32" in kinds:
        options += ["float16", "bfloat16"]
    halved = (torch.float32, torch.float64) if "half" in kinds else (torch.float32,)
    # the variant is the first choice (Hypothesis varies a test case's first choices most), with
    # fixed weights; index 0 (no variant) is the shrink target
    table = [o for o in options for _ in range(_CHOICE_WEIGHTS[o])]

    @st.composite
    def build(draw: Any) -> tuple[Any, Variant]:
        choice = table[draw(st.integers(0, len(table) - 1))]
        example = draw(inputs)
        try:
            args = as_args(example)
        except TypeError:
            return example, NO_VARIANT  # the runner reports the bad example
        found = _tensor_arguments(signature, args)
        if found is None or not found[1]:
            return example, NO_VARIANT
        bound, names = found
        values = dict(bound.arguments)
        allowed = [n for n in names if n not in mutated or "aliasing-mutated" in kinds]
        pairs = [(a, b) for i, a in enumerate(allowed) for b in allowed[i + 1:]
                 if _compatible(values[a], values[b])]
        if choice in ("same", "overlapping") and not pairs:
            if "layouts" not in kinds:
                return example, NO_VARIANT
            choice = "transposed" if choice == "same" else "expanded"
        if choice == "none":
            return example, NO_VARIANT
        if choice in ("float16", "bfloat16"):
            dtype = getattr(torch, choice)
            cast = [n for n in names if values[n].dtype in halved]
            if not cast:
                return example, NO_VARIANT
            for n in cast:
                t = values[n]
                values[n] = round_to(t.detach(), dtype).requires_grad_(t.requires_grad)
            text = f"{', '.join(cast)} cast to {choice}"
            raising = overlaps = False
        elif choice in ("same", "overlapping"):
            a, b = pairs[draw(st.integers(0, len(pairs) - 1))]
            x, y = values[a], values[b]
            if choice == "overlapping" and x.numel() >= 2:
                shift = draw(st.integers(1, x.numel() - 1))
                values[a], values[b] = _overlapping(x, y, shift)
                text = (f"{a} and {b} overlapping views of one base ({b} starts {shift} "
                        f"element{'s' if shift > 1 else ''} after {a})")
            else:
                values[b] = x
                text = f"{b} is the same tensor as {a}"
            raising = bool({a, b} & mutated)
            overlaps = True
        else:
            lay = draw(layouts(kinds=(choice,)))
            # an expanded argument overlaps itself: for a mutated one that is aliasing
            usable = [n for n in names if lay.effective(values[n].shape).kind == choice
                      and not (choice == "expanded" and n in mutated
                               and "aliasing-mutated" not in kinds)]
            if not usable:  # this shape cannot show the layout: fall back to one that can
                lay = draw(layouts(kinds=("sliced",)))
                usable = [n for n in names if values[n].numel() > 0]
                if not usable:
                    return example, NO_VARIANT
            n = usable[draw(st.integers(0, len(usable) - 1))]
            t = values[n]
            values[n] = lay.apply(t)
            text = f"{n} {lay.describe(t.shape)}"
            raising = lay.kind == "expanded" and n in mutated
            overlaps = lay.kind == "expanded"
        bound.arguments.update(values)
        return Args(*bound.args, **bound.kwargs), Variant(text, raising, overlaps)

    return build()


def _compatible(x: torch.Tensor, y: torch.Tensor) -> bool:
    return (x.shape == y.shape and x.dtype == y.dtype and x.device == y.device
            and x.numel() > 0)


def _overlapping(x: torch.Tensor, y: torch.Tensor, shift: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two views of one fresh base: the first holds x's values, the second starts ``shift``
    elements later (its last ``shift`` elements are y's last ones)."""
    n = x.numel()
    rg = x.requires_grad or y.requires_grad
    with torch.no_grad():
        base = torch.empty(n + shift, dtype=x.dtype, device=x.device)
        base[:n] = x.detach().reshape(-1)
        base[n:] = y.detach().reshape(-1)[n - shift:]
    base.requires_grad_(rg)
    return base[:n].view(x.shape), base[shift:].view(y.shape)


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
