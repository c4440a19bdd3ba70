"""Spec (impl + ref + contract), its registry, and validation at decoration time."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import sys
from typing import Any, Callable, Mapping, Sequence, TypeVar

import torch
from hypothesis.strategies import SearchStrategy

from equiv._args import as_args
from equiv._contracts import validate_contracts
from equiv._options import string_tuple, validate_argument_variants, validate_constants
from equiv._schedule import validate_options
from equiv._settings import settings as Settings
from equiv._settings import skippable
from equiv._targets import callable_for, own_spec
from equiv.errors import InvalidArgument
from equiv.strategies import arguments_for

F = TypeVar("F", bound=Callable[..., Any])

Location = Any  # "out", an int index, or a str key into the reference's result

_REGISTRY: dict[str, "Spec"] = {}
#: id(spec) -> (spec, the namespace (module globals) that registered it): a module executed
#: again (re-imported) replaces its specs; two specs of one execution with one name are two
_ORIGINS: dict[int, tuple["Spec", dict[str, Any]]] = {}


def _origin(spec: "Spec") -> dict[str, Any] | None:
    entry = _ORIGINS.get(id(spec))
    return entry[1] if entry is not None and entry[0] is spec else None

# registers nn.Module pairs (installed by equiv.modules on import): (ref, module options, the
# other options) -> a decorator, or None when ``ref`` and the options are not a module pair
_MODULE_HOOK: Callable[..., Any] | None = None


@dataclasses.dataclass(frozen=True)
class Spec:
    """An implementation, its reference and the contract between them."""

    impl: Callable[..., Any]
    ref: Callable[..., Any]
    name: str
    mutates: Mapping[str, Location]
    inputs: Any  # a Hypothesis strategy of tuples / equiv.Args
    examples: tuple[Any, ...]
    rtol: float | None
    atol: float | None
    settings: Settings | None
    signature: inspect.Signature
    derived_inputs: bool
    variants: tuple[str, ...] = ("layouts", "aliasing")  # see equiv.variants
    # hazardous schedules and memory (equiv.checks.schedules, equiv.memory)
    schedules: tuple[Any, ...] = ()
    parameters: tuple[str, ...] = ()
    max_memory_ratio: float | None = None
    max_retained_bytes: int | None = None
    # views and errors as contract (equiv._contracts)
    aliases: Mapping[Any, str | None] = dataclasses.field(default_factory=dict)
    error_inputs: Any = None
    raises: type[BaseException] | None = None
    match: str | None = None
    #: block sizes that derived inputs straddle (lengths k*b-1, k*b, k*b+1 along one dim)
    block_sizes: tuple[int, ...] = ()
    # where the reference runs (equiv.numerics): a floating dtype and/or a device, or None
    reference_dtype: Any = None
    reference_device: str | None = None
    #: False: gradients are not part of the contract (the gradient checks do not run)
    grads: bool = True
    #: transforms whose "unsupported by torch" skip is accepted (equiv._settings.SKIPPABLE)
    allow_skip: tuple[str, ...] = ()
    #: the module the spec belongs to (collected by ``equiv check``, ``tests_for(module)``)
    module: str = ""
    #: the modules whose import registered it (their top-level code was running), innermost
    #: first: a spec also belongs to each of them
    sites: tuple[str, ...] = ()
    #: mutated arguments the implementation overwrites entirely (filled with NaN before its call)
    write_only: tuple[str, ...] = ()
    #: arguments declared constant (equiv.roles: never made to require grad by equiv, never
    #: aliased with a differentiated argument)
    constants: tuple[str, ...] = ()
    #: per-argument variant kinds of ``variants={"x": (...), "cos": ()}`` (others: ``variants``)
    argument_variants: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    #: opt-in properties of the implementation alone (checks ``determinism``, ``batch-invariance``)
    deterministic: bool = False
    batch_invariant: int | None = None

    @property
    def implementation(self) -> str:
        return _qualname(self.impl)

    @property
    def reference(self) -> str:
        return _qualname(self.ref)


def _qualname(fn: Any) -> str:
    """A deterministic dotted name: no memory address, so every process (xdist workers) agrees."""
    if isinstance(fn, functools.partial):
        return f"functools.partial({_qualname(fn.func)})"
    qn = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    mod = getattr(fn, "__module__", None) or ""
    if not isinstance(qn, str):  # a callable object: named by its class
        cls = type(fn)
        qn, mod = f"{cls.__qualname__}()", cls.__module__
    mod = "" if mod in ("__main__", "builtins") else mod + "."
    return mod + qn


def _owner_module(target: Any, caller: str) -> str:
    """The module a spec belongs to: a function's or class's own ``__module__``; for a partial,
    a callable object or an op, the module that applied the decorator."""
    if inspect.isfunction(target) or inspect.isclass(target) or inspect.ismethod(target):
        mod = getattr(target, "__module__", None)
        if isinstance(mod, str) and mod not in ("builtins", "functools"):
            return mod
    return caller


def _register(spec: "Spec", origin: dict[str, Any], explicit: bool) -> "Spec":
    """Add ``spec`` to the registry under a unique name and return it (renamed if needed).

    A spec of a module executed again replaces that module's earlier specs. Within one
    execution, automatic names that collide (factory-made functions with one qualname, two
    lambdas) get ``#2``, ``#3``... in definition order; a duplicate explicit ``name=`` is an
    :class:`InvalidArgument` naming both implementations.
    """
    name = spec.name
    old = _REGISTRY.get(name)
    stale = None if old is None else _origin(old)
    if old is not None and stale is not origin and old.module == spec.module:
        # the module was executed again: forget the specs of its earlier execution
        for n, s in list(_REGISTRY.items()):
            if s.module == spec.module and (s is old or (stale is not None
                                                          and _origin(s) is stale)):
                del _REGISTRY[n]
        old = None
    if old is not None and old.impl is not spec.impl:
        if explicit:
            raise InvalidArgument(
                f"equivalent_to(name={name!r}) is already the name of the spec of "
                f"{old.implementation}; {spec.implementation} needs another name (spec names "
                "must be unique: equiv check, equiv list and pytest ids use them).")
        n = 2
        while f"{name}#{n}" in _REGISTRY and _REGISTRY[f"{name}#{n}"].impl is not spec.impl:
            n += 1
        spec = dataclasses.replace(spec, name=f"{name}#{n}")
    _REGISTRY[spec.name] = spec
    _ORIGINS[id(spec)] = (spec, origin)
    return spec


def _number(where: str, label: str, value: Any, *, positive: bool = False) -> None:
    """Reject booleans, NaN, infinities and negative (or zero, when ``positive``) values."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (
        math.isfinite(value) and (value > 0 if positive else value >= 0))
    if not ok:
        raise InvalidArgument(
            f"{where}({label}={value!r}): give a number {'> 0' if positive else '>= 0'} "
            f"(finite; not a bool or NaN).")


def registry() -> dict[str, Spec]:
    """Every registered spec by name (a copy)."""
    return dict(_REGISTRY)


def get_spec(impl: Any) -> Spec:
    """The spec of ``impl``: a decorated implementation (any spelling of a custom op), a
    ``Spec``, or a spec's own ``impl`` (the callable equiv runs, e.g. a custom op's wrapper)."""
    spec = own_spec(impl, _REGISTRY.values())
    if isinstance(spec, Spec):
        return spec
    if isinstance(impl, Spec):
        return impl
    for spec in _REGISTRY.values():
        if spec.impl is impl:
            return spec
    raise InvalidArgument(
        f"{_qualname(impl)} has no equiv spec: decorate it with @equivalent_to(reference) "
        "before calling check()."
    )


def equivalent_to(
    ref: Callable[..., Any],
    *,
    mutates: Mapping[str, Location] | None = None,
    inputs: Any = None,
    examples: Sequence[Any] = (),
    rtol: float | None = None,
    atol: float | None = None,
    settings: Settings | None = None,
    name: str | None = None,
    variants: Any = True,
    schedules: Sequence[Any] = (),
    parameters: Sequence[str] = (),
    max_memory_ratio: float | None = None,
    max_retained_bytes: int | None = None,
    aliases: Mapping[Any, str | None] | None = None,
    error_inputs: Any = None,
    raises: type[BaseException] | None = None,
    match: str | None = None,
    block_sizes: Sequence[int] = (),
    reference_dtype: Any = None,
    reference_device: str | None = None,
    write_only: Sequence[str] = (),
    constants: Sequence[str] = (),
    grads: bool = True,
    allow_skip: Sequence[str] = (),
    deterministic: bool = False,
    batch_invariant: int | None = None,
    **module_options: Any,
) -> Callable[[F], F]:
    """Register the decorated implementation as equivalent to the pure function ``ref``.

    ``mutates`` maps each argument the implementation writes in place to where its final value
    is in ``ref``'s result: ``"out"`` (the whole result), an index or a key. Every other argument
    must stay bitwise unchanged. ``inputs`` is a Hypothesis strategy of argument tuples (or
    ``equiv.Args``); when omitted, inputs are derived from the signature. ``examples`` always run
    first. ``rtol``/``atol`` override the dtype's default tolerance (give both or neither).
    ``variants`` (default ``True``) says which input variants the runner explores, or per argument
    (``{"cos": ()}``); ``constants``: arguments never made to require grad (:mod:`equiv.roles`).
    ``schedules`` adds :class:`equiv.Schedule` scripts (with their expected outcome) to the
    built-in hazardous schedules; ``parameters`` names the arguments an optimizer steps.
    ``max_memory_ratio`` (implementation peak / reference peak) and ``max_retained_bytes`` (bytes
    the graph keeps alive after forward) make a memory contract.
    ``aliases`` maps output locations to the argument they must be a view of, or to None (a new
    tensor); without an entry the reference decides. ``error_inputs`` is a strategy of examples on
    which both sides must raise; ``raises``/``match`` are the error type and message regex both
    sides' errors must have (then an example on which both raise it counts as a pass).
    ``reference_dtype``/``reference_device`` run the reference in another floating dtype or on
    another device (e.g. ``torch.float64``) and compare at the implementation's.
    ``grads=False``: gradients are not part of the contract; ``allow_skip=("vmap",)``: a skip
    of that transform as unsupported by torch is accepted (docs/reference.md, Verdicts).
    ``block_sizes`` (e.g. ``(64,)``) steers derived inputs toward lengths ``k*b - 1, k*b,
    k*b + 1`` along one dim; ``deterministic=True`` and ``batch_invariant=DIM`` are opt-in
    checks. ``ref`` may be an ``nn.Module`` (``module_options``: :mod:`equiv.modules`). Returns the
    implementation with ``__equiv_spec__`` attached (docs/reference.md lists every option).
    """
    options = dict(mutates=mutates, inputs=inputs, examples=examples, rtol=rtol, atol=atol,
                   settings=settings, name=name, variants=variants, schedules=schedules,
                   parameters=parameters, max_memory_ratio=max_memory_ratio,
                   max_retained_bytes=max_retained_bytes, aliases=aliases,
                   error_inputs=error_inputs, raises=raises, match=match, block_sizes=block_sizes)
    module_pair = _MODULE_HOOK and _MODULE_HOOK(ref, module_options, dict(options))
    placement = validate_reference(reference_dtype, reference_device, "equivalent_to")
    if module_pair is not None:
        return _module_pair(module_pair, placement != (None, None) or grads is not True
                            or any((allow_skip, write_only, constants, deterministic))
                            or batch_invariant is not None)
    _validate_plain_options(ref, options)
    options.update(block_sizes=_validate_block_sizes(block_sizes),
                   write_only=_validate_write_only(write_only, mutates), constants=constants,
                   **_validate_verdict_options(grads, allow_skip),
                   **_validate_properties(deterministic, batch_invariant))

    def decorate(impl: F) -> F:
        frame = sys._getframe(1)  # the frame applying the decorator
        spec = _build_spec(impl, ref, options, placement, frame.f_globals,
                           _registering_modules(frame))
        return _attach(impl, _register(spec, frame.f_globals, explicit=name is not None))

    return decorate


def _registering_modules(frame: Any) -> tuple[str, ...]:
    """The names of the modules whose top-level code is on the stack from ``frame`` out (the
    imports that are registering a spec), innermost first."""
    names: list[str] = []
    while frame is not None:
        name = frame.f_globals.get("__name__")
        if frame.f_code.co_name == "<module>" and isinstance(name, str) and name not in names:
            names.append(name)
        frame = frame.f_back
    return tuple(names)


def _attach(impl: F, spec: Spec) -> F:
    try:
        impl.__equiv_spec__ = spec  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        _REGISTRY.pop(spec.name, None)
        raise InvalidArgument(
            f"cannot attach a spec to {_qualname(impl)}; decorate a Python function that "
            "calls it instead."
        ) from None
    return impl


def _validate_plain_options(ref: Any, o: dict[str, Any]) -> None:
    """The options that need no signature, validated when ``equivalent_to`` is called."""
    rtol, atol, name, settings = o["rtol"], o["atol"], o["name"], o["settings"]
    if not callable(ref):
        raise InvalidArgument(
            f"equivalent_to(ref=...) must be the pure reference function, got "
            f"{type(ref).__name__} {ref!r:.60}."
        )
    if (rtol is None) != (atol is None):
        raise InvalidArgument(
            f"equivalent_to(rtol={rtol!r}, atol={atol!r}): give both rtol and atol, or neither "
            "to use torch.testing.assert_close's default for each dtype."
        )
    for label, value in (("rtol", rtol), ("atol", atol)):
        if value is not None:
            _number("equivalent_to", label, value)
    if o["max_memory_ratio"] is not None:
        _number("equivalent_to", "max_memory_ratio", o["max_memory_ratio"], positive=True)
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise InvalidArgument(
            f"equivalent_to(name={name!r}): give a non-empty string, e.g. name='relu_inplace'.")
    if settings is not None and not isinstance(settings, Settings):
        raise InvalidArgument(
            f"equivalent_to(settings=...) takes an equiv.settings object, got "
            f"{type(settings).__name__}."
        )


def _build_spec(impl: Any, ref: Any, o: dict[str, Any], placement: tuple[Any, str | None],
                caller: dict[str, Any], sites: tuple[str, ...] = ()) -> Spec:
    """The spec of ``impl``: its signature read and every signature-bound option validated."""
    if not callable(impl):
        raise InvalidArgument(f"@equivalent_to decorates a callable, got {impl!r:.60}.")
    target = _callable_target(impl)
    for role, fn in (("implementation", target), ("reference", ref)):
        _synchronous(role, fn)
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError) as e:
        raise InvalidArgument(
            f"cannot read the signature of {_qualname(impl)} ({e}); wrap it in a plain "
            "Python function with named parameters."
        ) from None
    who = _qualname(impl)
    contract = _validate_mutates(o["mutates"], sig, impl)
    _validate_ref_signature(ref, sig, impl)
    strategy, derived = _resolve_inputs(o["inputs"], sig, impl)
    scheds, params = validate_options(sig, who, o["schedules"], o["parameters"],
                                      o["max_memory_ratio"], o["max_retained_bytes"])
    alias_map, err_inputs, err_type, err_match = validate_contracts(
        sig, who, o["aliases"], o["error_inputs"], o["raises"], o["match"])
    rtol, atol, ratio = o["rtol"], o["atol"], o["max_memory_ratio"]
    kinds, per_argument = validate_argument_variants(o["variants"], who, derived, sig.parameters)
    return Spec(
        impl=target, ref=ref, name=o["name"] or _qualname(target), mutates=contract,
        inputs=strategy, examples=_validate_examples(o["examples"], sig, impl),
        rtol=None if rtol is None else float(rtol), atol=None if atol is None else float(atol),
        settings=o["settings"], signature=sig, derived_inputs=derived,
        variants=kinds, argument_variants=per_argument,
        constants=validate_constants(o["constants"], who, sig.parameters),
        schedules=scheds, parameters=params,
        max_memory_ratio=None if ratio is None else float(ratio),
        max_retained_bytes=o["max_retained_bytes"], aliases=alias_map,
        error_inputs=err_inputs, raises=err_type, match=err_match,
        block_sizes=o["block_sizes"], reference_dtype=placement[0],
        reference_device=placement[1], grads=o["grads"], allow_skip=o["allow_skip"],
        write_only=o["write_only"], deterministic=o["deterministic"],
        batch_invariant=o["batch_invariant"],
        module=_owner_module(target, str(caller.get("__name__", ""))), sites=sites,
    )


def _module_pair(decorate: Any, unsupported: bool) -> Any:
    if unsupported:
        raise InvalidArgument(
        "equivalent_to(reference_dtype=, reference_device=, grads=, allow_skip=, write_only=, "
        "constants=, deterministic=, batch_invariant=) are not supported for nn.Module pairs; "
        "pass the first four to check() or settings(), deterministic= to settings().")
    return decorate


def _validate_properties(deterministic: Any, batch_invariant: Any) -> dict[str, Any]:
    """``deterministic=`` and ``batch_invariant=`` (opt-in properties), validated."""
    if not isinstance(deterministic, bool):
        raise InvalidArgument(
            f"equivalent_to(deterministic={deterministic!r}): give True (two calls on equal "
            "inputs must give bitwise-equal results) or False.")
    if batch_invariant is not None and (isinstance(batch_invariant, bool) or not isinstance(
            batch_invariant, int) or batch_invariant < 0):
        raise InvalidArgument(
            f"equivalent_to(batch_invariant={batch_invariant!r}): give the batch dimension, "
            "an int >= 0 (e.g. batch_invariant=0), or None.")
    return dict(deterministic=deterministic, batch_invariant=batch_invariant)


def _validate_verdict_options(grads: Any, allow_skip: Any) -> dict[str, Any]:
    """``grads=`` and ``allow_skip=`` (what a pass may leave unchecked), validated."""
    if not isinstance(grads, bool):
        raise InvalidArgument(f"equivalent_to(grads={grads!r}): give True (compare gradients) "
                              "or False (gradients are not part of the contract).")
    return {"grads": grads, "allow_skip": skippable(allow_skip, "equivalent_to")}


def _synchronous(role: str, fn: Any) -> None:
    """An ``async def`` or generator function returns a coroutine or generator, not a value."""
    inner = fn.func if isinstance(fn, functools.partial) else fn
    kind = ("an async function (async def)" if inspect.iscoroutinefunction(inner)
            or inspect.isasyncgenfunction(inner) else
            "a generator function" if inspect.isgeneratorfunction(inner) else None)
    if kind is not None:
        raise InvalidArgument(
            f"equivalent_to: the {role} {_qualname(fn)} is {kind}; equiv calls both sides "
            "synchronously and compares the values they return. Decorate a plain function "
            "that returns the value, e.g. def f(x): return asyncio.run(g(x)).")


def _validate_block_sizes(value: Any) -> tuple[int, ...]:
    try:
        blocks = tuple(value)
    except TypeError:
        blocks = None
    if blocks is None or not all(isinstance(b, int) and not isinstance(b, bool)
                                 and 2 <= b <= 2048 for b in blocks):
        raise InvalidArgument(
            f"equivalent_to(block_sizes={value!r:.60}): give a tuple of ints from 2 to 2048, the "
            "sizes your kernel tiles by, e.g. block_sizes=(64,) or block_sizes=(16, 128)."
        )
    return tuple(sorted(set(blocks)))


def validate_reference(dtype: Any, device: Any, where: str) -> tuple[Any, str | None]:
    """A floating ``torch.dtype`` (or its name, ``"float64"``) and a device name, or None."""
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, dtype)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise InvalidArgument(f"{where}(reference_dtype={dtype!r}): give a floating torch.dtype, "
                              "e.g. torch.float64.")
    if device is not None:
        try:
            device = str(torch.device(device))
        except (RuntimeError, TypeError) as e:
            raise InvalidArgument(f"{where}(reference_device={device!r}): {e}; give a torch "
                                  "device name such as 'cpu' or 'cuda'.") from None
    return dtype, device


def _validate_write_only(value: Any, mutates: Any) -> tuple[str, ...]:
    """``write_only=``: argument names, each declared in ``mutates=``."""
    names = string_tuple(value)
    if names is None:
        raise InvalidArgument(
            f"equivalent_to(write_only={value!r:.60}): give a tuple of argument names, e.g. "
            "write_only=('out',).")
    declared = set(mutates) if isinstance(mutates, Mapping) else set()
    undeclared = [n for n in names if n not in declared]
    if undeclared:
        raise InvalidArgument(
            f"equivalent_to(write_only={names!r}): {undeclared} not declared in mutates= "
            f"({sorted(declared)}); a write-only argument is a mutated one the implementation "
            "overwrites entirely: declare it in mutates= too, e.g. mutates={'out': 'out'}, "
            "write_only=('out',).")
    return tuple(dict.fromkeys(names))


def _callable_target(impl: Any) -> Any:
    """What equiv calls: ``Fn.apply`` for an autograd.Function subclass, the op for a custom op
    (each with a usable signature), else ``impl`` itself."""
    return callable_for(impl)


def _validate_mutates(mutates: Any, sig: inspect.Signature, impl: Any) -> dict[str, Location]:
    if mutates is None:
        return {}
    if not isinstance(mutates, Mapping):
        raise InvalidArgument(
            f"equivalent_to(mutates={mutates!r:.60}) must map argument names to where their "
            "final value is in the reference's result, e.g. mutates={'x': 'out'} or "
            "mutates={'m': 0, 'v': 1}."
        )
    params = sig.parameters
    out: dict[str, Location] = {}
    for arg, loc in mutates.items():
        if arg not in params:
            raise InvalidArgument(
                f"equivalent_to(mutates=...) names {arg!r}, which is not a parameter of "
                f"{_qualname(impl)}{sig}; use one of {list(params)}."
            )
        if not (loc == "out" or isinstance(loc, (int, str))) or isinstance(loc, bool):
            raise InvalidArgument(
                f"equivalent_to(mutates={{{arg!r}: {loc!r}}}): the location must be 'out' (the "
                "reference's whole result), an int index or a str key into its result."
            )
        kind = _non_tensor_annotation(params[arg].annotation)
        if kind is not None:
            raise InvalidArgument(
                f"equivalent_to(mutates=...) names {arg!r}, annotated {kind} in "
                f"{_qualname(impl)}{sig}: a {kind} cannot be written in place, so nothing "
                "would be compared. Name only tensor arguments the implementation writes.")
        out[arg] = loc
    if "out" in out.values() and len(out) > 1:
        raise InvalidArgument(
            f"equivalent_to(mutates={dict(mutates)!r}): 'out' says the reference's whole result is "
            "one argument's final value, so it cannot be combined with other mutated arguments; "
            "have the reference return a tuple and use indices, e.g. {'m': 0, 'v': 1}."
        )
    return out


_SCALARS = {"float": float, "int": int, "bool": bool, "str": str, "complex": complex,
            "bytes": bytes}


def _non_tensor_annotation(annotation: Any) -> str | None:
    """The name of a scalar annotation (``float``, ``"int"``...), else None (a tensor or
    anything equiv cannot tell)."""
    if isinstance(annotation, str):
        return annotation if annotation in _SCALARS else None
    for name, t in _SCALARS.items():
        if annotation is t:
            return name
    return None


def _validate_ref_signature(ref: Any, sig: inspect.Signature, impl: Any) -> None:
    try:
        ref_sig = inspect.signature(ref)
    except (TypeError, ValueError):
        return  # builtins without a signature: found at run time
    args, kwargs = [], {}
    for p in sig.parameters.values():
        if p.default is not inspect.Parameter.empty:
            continue
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            args.append(None)
        elif p.kind is p.KEYWORD_ONLY:
            kwargs[p.name] = None
    try:
        ref_sig.bind(*args, **kwargs)
    except TypeError as e:
        raise InvalidArgument(
            f"the reference {_qualname(ref)}{ref_sig} cannot take the arguments of "
            f"{_qualname(impl)}{sig}: {e}. equiv calls both with the same arguments; give the "
            "reference the same parameters."
        ) from None


def _resolve_inputs(inputs: Any, sig: inspect.Signature, impl: Any) -> tuple[Any, bool]:
    if inputs is not None:
        if not isinstance(inputs, SearchStrategy):
            raise InvalidArgument(
                f"equivalent_to(inputs=...) must be a Hypothesis strategy producing argument "
                f"tuples or equiv.Args, got {type(inputs).__name__}; e.g. "
                "inputs=st.tuples(equiv.strategies.tensors(shape=(3,)))."
            )
        return inputs.map(_fits(sig, impl)), False
    try:
        return arguments_for(sig), True
    except ValueError as e:
        raise InvalidArgument(
            f"cannot derive inputs for {_qualname(impl)}{sig}: {e}. Pass "
            "inputs=<a Hypothesis strategy of argument tuples>."
        ) from None


def _fits(sig: inspect.Signature, impl: Any) -> Callable[[Any], Any]:
    """A check applied to every example an ``inputs=`` strategy draws: one that does not fit
    the signature is an :class:`InvalidArgument` naming ``inputs=`` and the expected arity."""
    required = [p.name for p in sig.parameters.values() if p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    name = _qualname(impl)

    def fits(example: Any) -> Any:
        try:
            a = as_args(example)
            sig.bind(*a.args, **a.kwargs)
        except TypeError as e:
            got = (f"a tuple of {len(example)}" if isinstance(example, tuple)
                   else f"a {type(example).__name__}")
            raise InvalidArgument(
                f"equivalent_to(inputs=...) produced a bad example for {name}{sig}: it drew "
                f"{got} ({e}); the strategy must "
                f"produce tuples of {len(required)} argument(s), one per parameter "
                f"({', '.join(required)}), or equiv.Args(...) that bind to the signature."
            ) from None
        return example

    return fits


def _validate_examples(examples: Any, sig: inspect.Signature, impl: Any) -> tuple[Any, ...]:
    if not isinstance(examples, (list, tuple)):
        raise InvalidArgument(
            "equivalent_to(examples=...) takes a list of argument tuples or equiv.Args."
        )
    out = []
    for i, ex in enumerate(examples):
        try:
            a = as_args(ex)
            sig.bind(*a.args, **a.kwargs)
        except TypeError as e:
            raise InvalidArgument(
                f"equivalent_to(examples=...)[{i}] does not fit {_qualname(impl)}{sig}: {e}."
            ) from None
        out.append(a)
    return tuple(out)
