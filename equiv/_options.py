"""Decoration-time validation of ``equivalent_to(variants=...)``: the input-variant kinds."""

from __future__ import annotations

from typing import Any

from equiv.errors import InvalidArgument

VARIANT_KINDS: tuple[str, ...] = ("layouts", "aliasing", "aliasing-mutated", "half",
                                  "half-float32")
DEFAULT_VARIANTS: tuple[str, ...] = ("layouts", "aliasing")
#: the default for inputs derived from the signature: float16/bfloat16 examples as well (judged
#: by the baseline-relative rule of equiv.numerics, so correct half kernels pass)
DERIVED_DEFAULT_VARIANTS: tuple[str, ...] = DEFAULT_VARIANTS + ("half-float32",)


def string_tuple(value: Any) -> tuple[str, ...] | None:
    """``value`` as a tuple of strings (one string counts as a one-tuple), or None when it is
    not a collection of strings."""
    names = (value,) if isinstance(value, str) else value
    try:
        names = tuple(names)
    except TypeError:
        return None
    return names if all(isinstance(n, str) for n in names) else None


def validate_variants(value: Any, impl: str, derived: bool = False) -> tuple[str, ...]:
    """``True``/``None`` -> the default (with ``"half-float32"`` for ``derived`` inputs), ``False`` ->
    none, or a collection of kind names."""
    if value is None or value is True:
        return DERIVED_DEFAULT_VARIANTS if derived else DEFAULT_VARIANTS
    if value is False:
        return ()
    kinds = string_tuple(value)
    if kinds is None:
        raise InvalidArgument(
            f"equivalent_to(variants={value!r:.60}) for {impl}: give True (the default: "
            f"{DEFAULT_VARIANTS}), False (only the drawn inputs), or a tuple of names from "
            f"{VARIANT_KINDS}."
        )
    unknown = [k for k in kinds if k not in VARIANT_KINDS]
    if unknown:
        raise InvalidArgument(
            f"equivalent_to(variants={value!r}) for {impl}: unknown variant kind(s) {unknown}; "
            f"use names from {VARIANT_KINDS}, e.g. variants=('layouts',), or variants=False."
        )
    return tuple(k for k in VARIANT_KINDS if k in kinds)
