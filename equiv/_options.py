"""Decoration-time validation of ``equivalent_to(variants=..., constants=...)``: the input-variant
kinds, spec-wide or per argument, and the arguments declared constant."""

from __future__ import annotations

from typing import Any, Mapping

from equiv.errors import InvalidArgument

VARIANT_KINDS: tuple[str, ...] = ("layouts", "aliasing", "aliasing-mutated", "half",
                                  "half-float32", "extremes")
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


def validate_argument_variants(value: Any, impl: str, derived: bool,
                               params: Any) -> tuple[tuple[str, ...], dict[str, tuple[str, ...]]]:
    """``variants=`` in either form: the spec's kinds (for a mapping, every kind some argument
    may get) and the per-argument kinds of a mapping ``{"x": ("layouts",), "cos": ()}`` (each
    value in the spec-wide form; arguments it does not name get the default)."""
    if not isinstance(value, Mapping):
        return validate_variants(value, impl, derived), {}
    default = validate_variants(True, impl, derived)
    per: dict[str, tuple[str, ...]] = {}
    for name, kinds in value.items():
        if name not in params:
            raise InvalidArgument(
                f"equivalent_to(variants={{{name!r}: ...}}) for {impl}: {name!r} is not a "
                f"parameter; name one of {list(params)}, e.g. variants={{'cos': ()}}.")
        plain = kinds is True or kinds is False or kinds is None
        names = () if plain else string_tuple(kinds)
        if names is not None and not all(k in VARIANT_KINDS for k in names):
            names = None
        if names is None:
            raise InvalidArgument(
                f"equivalent_to(variants={{{name!r}: {kinds!r:.60}}}) for {impl}: give True "
                f"(the default), False or () (no variant for {name!r}), or a tuple of names "
                f"from {VARIANT_KINDS}, e.g. variants={{{name!r}: ('layouts',)}}.")
        per[name] = validate_variants(kinds, impl, derived)
    union = tuple(k for k in VARIANT_KINDS
                  if k in default or any(k in v for v in per.values()))
    return union, per


def validate_constants(value: Any, impl: str, params: Any) -> tuple[str, ...]:
    """``constants=``: names of parameters the reference does not differentiate."""
    names = string_tuple(value)
    if names is None:
        raise InvalidArgument(
            f"equivalent_to(constants={value!r:.60}) for {impl}: give a tuple of argument "
            "names, e.g. constants=('cos', 'sin').")
    unknown = [n for n in names if n not in params]
    if unknown:
        raise InvalidArgument(
            f"equivalent_to(constants={names!r}) for {impl}: {unknown} is not a parameter; "
            f"name arguments from {list(params)}, e.g. constants=({list(params)[-1]!r},).")
    return tuple(dict.fromkeys(names))
