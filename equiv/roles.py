"""Argument roles: which arguments are *constants* (docs/strategies.md, "Argument roles").

A constant is an argument the reference does not differentiate: a RoPE ``cos``/``sin`` table,
BCE's ``pos_weight``, batch norm's running stats. The user names them
(``equivalent_to(constants=...)``), or the reference tells: its VJP does not reach the argument
(it detaches it, uses it only through integer or non-differentiable ops, or its backward returns
None for it), or it raises when the argument requires grad and returns when it does not (ATen's
"This input cannot have requires_grad True"). Derived inputs do not make a constant require
grad, and the aliasing variant never merges a constant with an argument that requires grad; a
user's own ``inputs=`` and ``examples=`` are run as drawn.

The reference is probed once per argument signature (names, dims, dtypes) of a spec, at the
example's own dtype, and each shape keeps its first answer (a replayed example gets the roles it
had).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Mapping

import torch

from equiv._compat import tree_flatten, tree_unflatten
from equiv.errors import user_error

__all__ = ["Roles", "roles_of"]

#: argument signatures whose roles one spec keeps
_CACHED = 4096


def _differentiable(v: Any) -> bool:
    return (isinstance(v, torch.Tensor) and v.layout == torch.strided
            and (v.dtype.is_floating_point or v.dtype.is_complex))


@dataclasses.dataclass
class Roles:
    """The roles of one spec's arguments: declared constants, per-argument variant kinds, and
    the constants derived from the reference (cached by argument signature)."""

    ref: Any
    signature: Any
    declared: frozenset[str] = frozenset()
    mutated: frozenset[str] = frozenset()
    kinds: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    derived_inputs: bool = False
    _cache: dict[Any, frozenset[str]] = dataclasses.field(default_factory=dict)
    _by_dims: dict[Any, frozenset[str]] = dataclasses.field(default_factory=dict)

    def kinds_of(self, name: str, default: tuple[str, ...]) -> tuple[str, ...]:
        """The variant kinds argument ``name`` may get (``default``: the spec's)."""
        return self.kinds.get(name, default)

    def constants(self, values: Mapping[str, Any]) -> frozenset[str]:
        """The constants among the bound arguments ``values`` of one example."""
        candidates = [n for n, v in values.items() if _differentiable(v)
                      and n not in self.mutated and n not in self.declared]
        if not candidates:
            return self.declared
        shapes = tuple((n, tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor)
                       else (n, type(v)) for n, v in values.items())
        found = self._cache.get(shapes)
        if found is None:
            if len(self._cache) > _CACHED:
                self._cache.clear()
            # one probe per signature of dims and dtypes; an example the reference raises on
            # whatever requires grad tells nothing (only the declared constants), and the next
            # example of that signature is probed. Each shape keeps its first answer, so a
            # replayed example gets the roles it had.
            dims = tuple(k[:1] + (len(k[1]),) + k[2:] if len(k) == 3 else k for k in shapes)
            found = self._by_dims.get(dims)
            if found is None:
                found = _probe(self.ref, self.signature, values, candidates)
                if found is not None:
                    self._by_dims[dims] = found
            self._cache[shapes] = found = found or frozenset()
        return self.declared | found

    def settle(self, example: Any) -> Any:
        """A derived example with its constants no longer requiring grad (in place: derived
        tensors are equiv's own leaves); any other example unchanged."""
        if not self.derived_inputs:
            return example
        try:
            bound = self.signature.bind(*example.args, **example.kwargs).arguments
        except (TypeError, AttributeError):
            return example
        for name in self.constants(bound):
            v = bound.get(name)
            if isinstance(v, torch.Tensor) and v.is_leaf and v.requires_grad:
                v.requires_grad_(False)
        return example


#: id(spec) -> (spec, its roles): one cache per spec across modes and devices
_ROLES: dict[int, tuple[Any, Roles]] = {}


def roles_of(spec: Any) -> Roles:
    """The :class:`Roles` of ``spec`` (made once per spec object)."""
    entry = _ROLES.get(id(spec))
    if entry is not None and entry[0] is spec:
        return entry[1]
    if len(_ROLES) > 512:
        _ROLES.clear()
    roles = Roles(spec.ref, spec.signature, frozenset(spec.constants), frozenset(spec.mutates),
                  dict(spec.argument_variants), spec.derived_inputs)
    _ROLES[id(spec)] = (spec, roles)
    return roles


def _call(ref: Any, signature: inspect.Signature, values: dict[str, Any]) -> Any:
    """``ref`` on the bound arguments ``values``, or the exception it raised."""
    bound = inspect.BoundArguments(signature, values)  # type: ignore[arg-type]
    try:  # the probe leaves the random state as it found it
        with torch.random.fork_rng(devices=[]), torch.enable_grad():
            return ref(*bound.args, **bound.kwargs)
    except BaseException as e:  # the reference raised (SystemExit too): no information
        if not user_error(e):
            raise
        return e


def _probe(ref: Any, signature: inspect.Signature, values: Mapping[str, Any],
           candidates: list[str]) -> frozenset[str] | None:
    """The candidates the reference does not differentiate: those whose requiring grad makes
    it raise, and those its VJP does not reach. None when the example tells nothing (the
    reference raised anyway, or no output is differentiable)."""
    def run(grad: frozenset[str]) -> tuple[Any, list[torch.Tensor]]:
        args, leaves = {}, []
        for n, v in values.items():
            if isinstance(v, torch.Tensor) and v.layout == torch.strided:
                v = v.detach().clone().requires_grad_(n in grad)
                if n in grad:
                    leaves.append(v)
            elif not isinstance(v, torch.Tensor):  # containers: copies, never the example's
                flat, spec = tree_flatten(v)
                v = tree_unflatten([t.detach().clone() if isinstance(t, torch.Tensor) else t
                                    for t in flat], spec)
            args[n] = v
        return _call(ref, signature, args), leaves

    everything = frozenset(candidates)
    out, leaves = run(everything)
    refused: frozenset[str] = frozenset()
    if isinstance(out, BaseException):
        if isinstance(run(frozenset())[0], BaseException):
            return None
        refused = frozenset(n for n in candidates
                            if isinstance(run(frozenset((n,)))[0], BaseException))
        if not refused or refused == everything:
            return refused or None
        out, leaves = run(everything - refused)
        if isinstance(out, BaseException):
            return None
    reached = _reached(out, leaves)
    if reached is None:
        return refused or None
    rest = [n for n in candidates if n not in refused]
    return refused | frozenset(n for n, hit in zip(rest, reached) if not hit)


def _reached(out: Any, leaves: list[torch.Tensor]) -> list[bool] | None:
    """Which ``leaves`` the VJP of ``out`` reaches (a gradient, not None); None when no output
    is differentiable or the backward raised."""
    outs = [o for o in tree_flatten(out)[0]
            if isinstance(o, torch.Tensor) and o.requires_grad and _differentiable(o)]
    if not outs or not leaves:
        return None
    try:
        grads = torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs],
                                    allow_unused=True)
    except BaseException as e:  # the reference's backward raised: no information
        if not user_error(e):
            raise
        return None
    hits = [g is not None for g in grads]
    return hits if any(hits) else None
