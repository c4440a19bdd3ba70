"""Spec (impl + ref + contract), its registry, and validation at decoration time."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable, Mapping, Sequence, TypeVar

from hypothesis.strategies import SearchStrategy

from equiv._args import as_args
from equiv._contracts import validate_contracts
from equiv._options import validate_variants
from equiv._schedule import validate_options
from equiv._settings import settings as Settings
from equiv._targets import callable_for, own_spec
from equiv.errors import InvalidArgument
from equiv.strategies import arguments_for

F = TypeVar("F", bound=Callable[..., Any])

Location = Any  # "out", an int index, or a str key into the reference's result

_REGISTRY: dict[str, "Spec"] = {}

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
    #: mutated arguments the implementation overwrites entirely (filled with NaN before its call)
    write_only: tuple[str, ...] = ()

    @property
    def implementation(self) -> str:
        return _qualname(self.impl)

    @property
    def reference(self) -> str:
        return _qualname(self.ref)


def _qualname(fn: Any) -> str:
    mod = getattr(fn, "__module__", None) or ""
    qn = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    mod = "" if mod in ("__main__", "builtins") else mod + "."
    return mod + qn


def registry() -> dict[str, Spec]:
    """Every registered spec by name (a copy)."""
    return dict(_REGISTRY)


def get_spec(impl: Any) -> Spec:
    spec = own_spec(impl, _REGISTRY.values())
    if isinstance(spec, Spec):
        return spec
    if isinstance(impl, Spec):
        return impl
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
    write_only: Sequence[str] = (),
    **module_options: Any,
) -> Callable[[F], F]:
    """Register the decorated implementation as equivalent to the pure function ``ref``.

    ``mutates`` maps each argument the implementation writes in place to where its final value
    is in ``ref``'s result: ``"out"`` (the whole result), an index or a key. Every other argument
    must stay bitwise unchanged. ``inputs`` is a Hypothesis strategy of argument tuples (or
    ``equiv.Args``); when omitted, inputs are derived from the signature. ``examples`` always run
    first. ``rtol``/``atol`` override the dtype's default tolerance (give both or neither).
    ``variants`` (default ``True``: other layouts and aliasing of unmutated arguments) says which
    automatic input variants the runner explores; see :mod:`equiv.variants`.
    ``schedules`` adds :class:`equiv.Schedule` scripts (with their expected outcome) to the
    built-in hazardous schedules; ``parameters`` names the arguments an optimizer steps.
    ``max_memory_ratio`` (implementation peak / reference peak) and ``max_retained_bytes`` (bytes
    the graph keeps alive after forward) make a memory contract.
    ``aliases`` maps output locations to the argument they must be a view of, or to None (a new
    tensor); without an entry the reference decides. ``error_inputs`` is a strategy of examples on
    which both sides must raise; ``raises``/``match`` are the error type and message regex both
    sides' errors must have (then an example on which both raise it counts as a pass).
    ``ref`` may be an ``nn.Module`` class or instance, and then ``module_options`` (``init``,
    ``state_map``, ``input_shapes``, ``train``, ``eval``, ``repeat``) describe the pair: see
    :mod:`equiv.modules`.
    ``block_sizes`` (e.g. ``(64,)``) steers derived inputs toward lengths ``k*b - 1, k*b,
    k*b + 1`` along one dim, for kernels that tile by ``b``.
    ``write_only`` names mutated arguments the implementation overwrites entirely (an ``out=``
    buffer, a workspace): before each call of the implementation they are filled with NaN
    (integers: a sentinel), so a kernel that reads their stale contents is caught.
    Returns the implementation unchanged, with ``__equiv_spec__`` attached.
    """
    module_pair = _MODULE_HOOK and _MODULE_HOOK(ref, module_options, dict(
        mutates=mutates, inputs=inputs, examples=examples, rtol=rtol, atol=atol,
        settings=settings, name=name, variants=variants, schedules=schedules,
        parameters=parameters, max_memory_ratio=max_memory_ratio,
        max_retained_bytes=max_retained_bytes, aliases=aliases, error_inputs=error_inputs,
        raises=raises, match=match, block_sizes=block_sizes))
    if module_pair is not None:
        return module_pair
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
    for label, tol in (("rtol", rtol), ("atol", atol)):
        if tol is not None and (not isinstance(tol, (int, float)) or tol < 0):
            raise InvalidArgument(f"equivalent_to({label}={tol!r}): give a number >= 0.")
    if settings is not None and not isinstance(settings, Settings):
        raise InvalidArgument(
            f"equivalent_to(settings=...) takes an equiv.settings object, got "
            f"{type(settings).__name__}."
        )

    blocks = _validate_block_sizes(block_sizes)
    written = _validate_write_only(write_only, mutates)

    def decorate(impl: F) -> F:
        if not callable(impl):
            raise InvalidArgument(f"@equivalent_to decorates a callable, got {impl!r:.60}.")
        target = _callable_target(impl)
        try:
            sig = inspect.signature(target)
        except (TypeError, ValueError) as e:
            raise InvalidArgument(
                f"cannot read the signature of {_qualname(impl)} ({e}); wrap it in a plain "
                "Python function with named parameters."
            ) from None
        contract = _validate_mutates(mutates, sig, impl)
        _validate_ref_signature(ref, sig, impl)
        strategy, derived = _resolve_inputs(inputs, sig, impl)
        exs = _validate_examples(examples, sig, impl)
        kinds = validate_variants(variants, _qualname(impl))
        scheds, params = validate_options(sig, _qualname(impl), schedules, parameters,
                                          max_memory_ratio, max_retained_bytes)
        alias_map, err_inputs, err_type, err_match = validate_contracts(
            sig, _qualname(impl), aliases, error_inputs, raises, match)
        spec = Spec(
            impl=target, ref=ref, name=name or _qualname(target), mutates=contract,
            inputs=strategy, examples=exs, rtol=None if rtol is None else float(rtol),
            atol=None if atol is None else float(atol), settings=settings, signature=sig,
            derived_inputs=derived, variants=kinds,
            schedules=scheds, parameters=params,
            max_memory_ratio=None if max_memory_ratio is None else float(max_memory_ratio),
            max_retained_bytes=max_retained_bytes, aliases=alias_map,
            error_inputs=err_inputs, raises=err_type, match=err_match,
            block_sizes=blocks, write_only=written,
        )
        try:
            impl.__equiv_spec__ = spec  # type: ignore[attr-defined]
        except (AttributeError, TypeError):
            raise InvalidArgument(
                f"cannot attach a spec to {_qualname(impl)}; decorate a Python function that "
                "calls it instead."
            ) from None
        _REGISTRY[spec.name] = spec
        return impl

    return decorate


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


def _validate_write_only(value: Any, mutates: Any) -> tuple[str, ...]:
    names = (value,) if isinstance(value, str) else value
    try:
        names = tuple(names)
    except TypeError:
        names = None
    if names is None or not all(isinstance(n, str) for n in names):
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
        out[arg] = loc
    if "out" in out.values() and len(out) > 1:
        raise InvalidArgument(
            f"equivalent_to(mutates={dict(mutates)!r}): 'out' says the reference's whole result is "
            "one argument's final value, so it cannot be combined with other mutated arguments; "
            "have the reference return a tuple and use indices, e.g. {'m': 0, 'v': 1}."
        )
    return out


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
        return inputs, False
    try:
        return arguments_for(sig), True
    except ValueError as e:
        raise InvalidArgument(
            f"cannot derive inputs for {_qualname(impl)}{sig}: {e}. Pass "
            "inputs=<a Hypothesis strategy of argument tuples>."
        ) from None


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
