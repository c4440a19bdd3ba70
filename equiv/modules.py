"""``nn.Module`` pairs as function specs: a fused module checked against a reference module.

``@equivalent_to(nn.LayerNorm, init=dict(normalized_shape=16))`` above ``class
FusedLayerNorm(nn.Module)`` registers an ordinary function spec whose arguments are

- the arguments of ``forward`` (drawn as for a function; ``input_shapes=`` fits them to the module),
- ``params``: the reference's parameters by their dotted names (``params['block.0.weight']``),
  drawn by Hypothesis; the optimizer schedules step them (``parameters=('params',)``),
- ``buffers``: the reference's buffers by dotted name, starting from the reference's initial
  values; declared mutated, so train-mode updates (running statistics, ``num_batches_tracked``)
  are compared with the reference's and any other write is a finding,
- ``training`` (drawn: train and eval mode) and ``calls`` (1 or 2 forwards in train mode),
- ``init`` when the construction arguments are drawn (a strategy of keyword dicts).

The implementation's wrapper maps that state through ``state_map`` (reference layout ->
implementation layout, differentiably) and calls ``torch.func.functional_call`` on the
implementation module: its in-place buffer updates land in the ``buffers`` argument. The
reference's wrapper is pure: it clones the buffers and returns ``(output, new buffers)``.
Both wrappers compile (``functional_call`` traces under ``torch.compile``).
"""

from __future__ import annotations

import copy
import inspect
import textwrap
from typing import Any, Callable, Mapping

import torch
from hypothesis import strategies as st
from torch import nn

from equiv import _values
from equiv import spec as _spec
from equiv.errors import InvalidArgument, error_text, user_error
from equiv._args import Args, as_args
from equiv.strategies import arguments_for, shapes, tensors
from equiv.strategies._compile import compiling

__all__ = ["is_module_side", "example_code"]

_RESERVED = ("params", "buffers", "training", "calls", "init")
_OPTIONS = ("init", "state_map", "input_shapes", "train", "eval", "repeat")
_PASSED = ("rtol", "atol", "settings", "name", "variants", "schedules", "max_memory_ratio",
           "max_retained_bytes")


def is_module_side(x: Any) -> bool:
    """An ``nn.Module`` subclass or instance."""
    return isinstance(x, nn.Module) or (isinstance(x, type) and issubclass(x, nn.Module))


def _label(x: Any) -> str:
    x = type(x) if isinstance(x, nn.Module) else x
    return getattr(x, "__qualname__", None) or getattr(x, "__name__", None) or repr(x)


def _build(side: Any, init: Mapping[str, Any], which: str) -> nn.Module:
    """A fresh module: an instance is copied, a class or factory is called with ``init``."""
    if isinstance(side, nn.Module):
        return copy.deepcopy(side)
    try:
        m = side(**init)
    except BaseException as e:  # the user's constructor raised (SystemExit too)
        if not user_error(e):
            raise
        raise InvalidArgument(
            f"equivalent_to(init={dict(init)!r}): building the {which} {_label(side)}(**init) "
            f"raised {type(e).__name__}: {error_text(e)[:200]}. Give init= the constructor's "
            "keyword arguments."
        ) from None
    if not isinstance(m, nn.Module):
        raise InvalidArgument(
            f"the {which} factory {_label(side)} returned {type(m).__name__}, not an nn.Module."
        )
    return m


class _Pair:
    """The two modules for one set of construction arguments, in train and eval mode."""

    def __init__(self, impl: Any, ref: Any, init: Mapping[str, Any], state_map: Any) -> None:
        self.init = dict(init)
        ref_m, impl_m = _build(ref, init, "reference"), _build(impl, init, "implementation")
        self.state_map = state_map
        self.param_names = [n for n, _ in ref_m.named_parameters()]
        self.buffers = {n: b.detach().clone() for n, b in ref_m.named_buffers()}
        self.params = {n: p.detach() for n, p in ref_m.named_parameters()}
        self.trainable = {n: p.requires_grad for n, p in ref_m.named_parameters()}
        self._validate_load(ref_m, impl_m)
        self.ref = {True: ref_m.train(), False: copy.deepcopy(ref_m).eval()}
        self.impl = {True: impl_m.train(), False: copy.deepcopy(impl_m).eval()}
        floating = [t for t in list(self.params.values()) + list(self.buffers.values())
                    if t.dtype.is_floating_point]
        self.dtype = floating[0].dtype if floating else torch.get_default_dtype()

    def mapped(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if self.state_map is None:
            return state
        out = self.state_map(dict(state))
        if not isinstance(out, Mapping):
            raise InvalidArgument(
                f"state_map returned {type(out).__name__}; it must return the implementation's "
                "state dict (a mapping of names to tensors)."
            )
        return dict(out)

    def _validate_load(self, ref_m: nn.Module, impl_m: nn.Module) -> None:
        """The mapped reference state must name exactly the implementation's parameters and
        buffers, with their shapes, and pass each buffer through as the same tensor."""
        state = {**self.params, **self.buffers}
        mapped = self.mapped(state)
        where = "state_map(reference state)" if self.state_map else "the reference's state"
        own = {**dict(impl_m.named_parameters()), **dict(impl_m.named_buffers())}
        missing, unexpected = sorted(set(own) - set(mapped)), sorted(set(mapped) - set(own))
        if missing or unexpected:
            raise InvalidArgument(
                f"{where} does not load into {type(impl_m).__qualname__}: missing keys "
                f"{missing}, unexpected keys {unexpected}. Give state_map= a callable (reference "
                "state dict -> implementation state dict) that renames or re-lays out the "
                "reference's keys."
            )
        shapes_ = [f"{k}: {tuple(v.shape)} given, {tuple(own[k].shape)} expected"
                   for k, v in mapped.items() if tuple(v.shape) != tuple(own[k].shape)]
        if shapes_:
            raise InvalidArgument(
                f"{where} does not load into {type(impl_m).__qualname__}: shape mismatch for "
                f"{'; '.join(shapes_)}. Fix state_map= so it produces the implementation's layout."
            )
        values = [id(v) for v in mapped.values()]
        for name, b in self.buffers.items():  # in-place buffer updates must reach the argument
            if id(b) not in values:
                raise InvalidArgument(
                    f"state_map does not pass buffer {name!r} through as the same tensor; "
                    "buffers may be renamed but not recomputed (the module updates them in place)."
                )


class _ModuleSpec:
    """Options of one module registration and the wrappers built from them."""

    def __init__(self, impl: Any, ref: Any, options: Mapping[str, Any],
                 passed: Mapping[str, Any]) -> None:
        self.impl_side, self.ref_side = impl, ref
        init = options.get("init")
        self.drawn_init = isinstance(init, st.SearchStrategy)
        if not (init is None or self.drawn_init or isinstance(init, Mapping)):
            raise InvalidArgument(
                f"equivalent_to(init={init!r:.60}) takes a dict of constructor keyword arguments "
                "or a Hypothesis strategy of such dicts, e.g. init=dict(normalized_shape=16)."
            )
        self.fixed_init = {} if (init is None or self.drawn_init) else dict(init)
        self.init_strategy = init if self.drawn_init else None
        self.state_map = options.get("state_map")
        if self.state_map is not None and not callable(self.state_map):
            raise InvalidArgument(
                "equivalent_to(state_map=...) takes a callable: reference state dict -> "
                "implementation state dict."
            )
        self.input_shapes = options.get("input_shapes")
        self.modes = tuple(m for m in (True, False) if options.get("train" if m else "eval", True))
        if not self.modes:
            raise InvalidArgument("equivalent_to(train=False, eval=False) leaves nothing to check.")
        self.repeat = bool(options.get("repeat", True))
        self.inputs = passed.get("inputs")
        self._pairs: dict[Any, _Pair] = {}
        self.forward_sig = _forward_signature(impl, ref)
        if not self.drawn_init:
            self.pair(self.fixed_init)  # registration-time errors: construction, state loading

    def pair(self, init: Mapping[str, Any]) -> _Pair:
        key = repr(sorted(init.items()))
        if key not in self._pairs:
            self._pairs[key] = _Pair(self.impl_side, self.ref_side, init, self.state_map)
        return self._pairs[key]

    @property
    def has_buffers(self) -> bool:
        return bool(self.pair(self.fixed_init).buffers) if not self.drawn_init else True

    # -- the two wrappers -----------------------------------------------------------------
    def wrappers(self) -> tuple[Callable[..., Any], Callable[..., Any]]:
        names = [p.name for p in self.forward_sig.parameters.values()]
        clash = sorted(set(names) & set(_RESERVED))
        if clash:
            raise InvalidArgument(
                f"{_label(self.impl_side)}.forward has parameter(s) {clash}, which equiv uses for "
                "the module's state; rename them in a wrapper module."
            )
        fixed, buffers = self.fixed_init, self.has_buffers

        def forward_args(args: tuple, kwargs: dict) -> tuple[tuple, dict, dict, bool, int, Any]:
            kw = dict(kwargs)
            params, bufs = kw.pop("params"), kw.pop("buffers", {})
            training, calls = kw.pop("training"), kw.pop("calls")
            init = kw.pop("init", fixed)
            return args, kw, {**params, **bufs}, training, calls, init

        def impl_fn(*args: Any, **kwargs: Any) -> Any:
            args, kw, state, training, calls, init = forward_args(args, kwargs)
            pair = self.pair(init)
            module = pair.impl[training]
            mapped = pair.mapped(state)
            outs = [torch.func.functional_call(module, mapped, args, kw) for _ in range(calls)]
            out = outs[0] if calls == 1 else tuple(outs)
            return (out, kwargs["buffers"]) if buffers else out

        def ref_fn(*args: Any, **kwargs: Any) -> Any:
            args, kw, state, training, calls, init = forward_args(args, kwargs)
            pair = self.pair(init)
            bufs = {n: b.clone() for n, b in kwargs.get("buffers", {}).items()}
            state = {**state, **bufs}
            module = pair.ref[training]
            outs = [torch.func.functional_call(module, state, args, kw) for _ in range(calls)]
            out = outs[0] if calls == 1 else tuple(outs)
            return (out, bufs) if buffers else out

        sig = self.wrapper_signature()
        for fn, side in ((impl_fn, self.impl_side), (ref_fn, self.ref_side)):
            cls = type(side) if isinstance(side, nn.Module) else side
            fn.__signature__ = sig  # type: ignore[attr-defined]
            fn.__name__ = getattr(cls, "__name__", fn.__name__)
            fn.__qualname__ = getattr(cls, "__qualname__", fn.__name__)
            fn.__module__ = getattr(cls, "__module__", fn.__module__)
            fn.__equiv_module__ = self  # type: ignore[attr-defined]
        impl_fn.__equiv_code__ = lambda example, stash=None: example_code(  # type: ignore
            self, example, stash)
        return impl_fn, ref_fn

    def wrapper_signature(self) -> inspect.Signature:
        params = list(self.forward_sig.parameters.values())
        kw = inspect.Parameter.KEYWORD_ONLY
        extra = [inspect.Parameter("params", kw, annotation=dict)]
        if self.has_buffers:
            extra.append(inspect.Parameter("buffers", kw, annotation=dict))
        extra += [inspect.Parameter("training", kw, annotation=bool),
                  inspect.Parameter("calls", kw, annotation=int)]
        if self.drawn_init:
            extra.append(inspect.Parameter("init", kw, annotation=dict))
        var_kw = [p for p in params if p.kind is p.VAR_KEYWORD]
        rest = [p for p in params if p.kind is not p.VAR_KEYWORD]
        return inspect.Signature(rest + extra + var_kw)

    # -- the drawn examples ---------------------------------------------------------------
    def strategy(self) -> st.SearchStrategy:
        @st.composite
        def build(draw: Any) -> Any:
            training = draw(st.sampled_from(self.modes))
            calls = draw(st.integers(1, 2)) if (training and self.repeat) else 1
            init = draw(self.init_strategy) if self.drawn_init else self.fixed_init
            pair = self.pair(init)
            fwd = as_args(draw(self.forward_inputs(pair, init)))
            params = {n: draw(tensors(shape=tuple(p.shape), dtype=p.dtype, salt=100 + i,
                                      requires_grad=pair.trainable[n]))
                      for i, (n, p) in enumerate(pair.params.items())}
            kw: dict[str, Any] = dict(params=params, training=training, calls=calls)
            if self.has_buffers:
                kw["buffers"] = {n: b.clone() for n, b in pair.buffers.items()}
            if self.drawn_init:
                kw["init"] = dict(init)
            return Args(*fwd.args, **fwd.kwargs, **kw)

        return build()

    def forward_inputs(self, pair: _Pair, init: Mapping[str, Any]) -> st.SearchStrategy:
        if self.inputs is not None:
            return self.inputs(init) if callable(self.inputs) and not isinstance(
                self.inputs, st.SearchStrategy) else self.inputs
        hint = self.input_shapes(init) if callable(self.input_shapes) else self.input_shapes
        if hint is None:
            return arguments_for(self.forward_sig, dtypes_=(pair.dtype,))
        tensor_args = _tensor_parameters(self.forward_sig, _label(self.impl_side))
        if not isinstance(hint, Mapping):
            hint = {n: hint for n in tensor_args}
        unknown = sorted(set(hint) - set(tensor_args))
        if unknown:
            raise InvalidArgument(
                f"equivalent_to(input_shapes=...) names {unknown}, which are not tensor "
                f"parameters of {_label(self.impl_side)}.forward {tensor_args}."
            )

        @st.composite
        def build(draw: Any) -> Any:
            shared = draw(shapes(min_dims=1, max_dims=2, min_side=1, max_side=4))
            args, kw = [], {}
            for i, (name, keyword) in enumerate(tensor_args.items()):
                shape = _fit(hint.get(name), shared, draw)
                t = draw(tensors(shape=shape, dtype=pair.dtype, requires_grad=True, salt=i))
                if keyword:
                    kw[name] = t
                else:
                    args.append(t)
            return Args(*args, **kw)

        return build()


def _fit(hint: Any, shared: tuple[int, ...], draw: Any) -> tuple[int, ...]:
    """A shape from a hint: ints kept, ``None`` a drawn side (1-4), a leading ``...`` 0-2
    drawn dims; no hint: the shared drawn shape."""
    if hint is None:
        return tuple(shared)
    hint = tuple(hint)
    lead: tuple[int, ...] = ()
    if hint and hint[0] is Ellipsis:
        # compile modes: one leading dim (each rank recompiles); eager: 0-2 of them, sides 1-3
        lead_dims = (1, 1, 2) if compiling() else (0, 2, 1)
        lead = tuple(draw(shapes(min_dims=lead_dims[0], max_dims=lead_dims[1],
                                 min_side=lead_dims[2], max_side=3)))
        hint = hint[1:]
    out = [draw(st.integers(1, 4)) if d is None else d for d in hint]
    if not all(isinstance(d, int) and d >= 0 for d in out):
        raise InvalidArgument(
            f"equivalent_to(input_shapes=...): {hint!r} must hold ints, None (a drawn side) and "
            "optionally a leading ... (drawn leading dims), e.g. input_shapes=(..., 16)."
        )
    return lead + tuple(out)


def _tensor_parameters(sig: inspect.Signature, label: str) -> dict[str, bool]:
    out = {}
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is not p.empty:
            continue
        if p.annotation not in (p.empty, torch.Tensor, "Tensor", "torch.Tensor"):
            raise InvalidArgument(
                f"{label}.forward's parameter {p.name!r} is annotated {p.annotation!r}; "
                "input_shapes= covers tensor parameters only: pass inputs= instead."
            )
        out[p.name] = p.kind is p.KEYWORD_ONLY
    return out


def _forward_signature(impl: Any, ref: Any) -> inspect.Signature:
    """``forward``'s signature without ``self``: the implementation's class when it is one,
    else the reference's (a factory's module type is only known once built)."""
    for side in (impl, ref):
        cls = type(side) if isinstance(side, nn.Module) else side
        if isinstance(cls, type) and issubclass(cls, nn.Module):
            sig = inspect.signature(cls.forward)
            return sig.replace(parameters=list(sig.parameters.values())[1:])
    raise InvalidArgument("equivalent_to: one side of a module pair must be an nn.Module class "
                          "or instance, to read forward's signature.")


def register(ref: Any, options: Mapping[str, Any], passed: Mapping[str, Any]
             ) -> Callable[[Any], Any] | None:
    """The hook ``equivalent_to`` calls: a decorator for module pairs, else ``None``."""
    if not (is_module_side(ref) or options):
        return None
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise InvalidArgument(
            f"equivalent_to() got unexpected keyword argument(s) {unknown}; the options of an "
            f"nn.Module pair are {list(_OPTIONS)} (see docs/modules.md)."
        )
    for key in ("mutates", "examples"):
        if passed.get(key):
            raise InvalidArgument(
                f"equivalent_to({key}=...) is not supported for nn.Module pairs: buffers are "
                "declared mutated automatically; draw forward inputs with inputs= or input_shapes=."
            )
    if passed.get("parameters"):
        raise InvalidArgument(
            "equivalent_to(parameters=...) is implied for nn.Module pairs: every parameter of "
            "the reference is stepped by the optimizer schedules."
        )

    def decorate(impl: Any) -> Any:
        if not callable(impl):
            raise InvalidArgument(f"@equivalent_to decorates a module class, got {impl!r:.60}.")
        ms = _ModuleSpec(impl, ref, options, passed)
        impl_fn, ref_fn = ms.wrappers()
        has_params = bool(ms.pair(ms.fixed_init).params) if not ms.drawn_init else True
        kwargs = {k: passed[k] for k in _PASSED if k in passed}
        _spec.equivalent_to(
            ref_fn, mutates={"buffers": 1} if ms.has_buffers else None, inputs=ms.strategy(),
            parameters=("params",) if has_params else (), **kwargs,
        )(impl_fn)
        spec = impl_fn.__equiv_spec__
        try:
            impl.__equiv_spec__ = spec
        except (AttributeError, TypeError):
            pass
        return impl

    return decorate


def example_code(ms: _ModuleSpec, example: Any, stash: _values.Stash | None = None) -> str:
    """Runnable code that rebuilds one example: both modules (constructor arguments and state)
    and the forward inputs, then runs every eager check on it (``equiv.assert_equivalent`` of
    the implementation, which raises the finding's failure). Tensors too big to print are
    loaded from ``.pt`` files: added to ``stash`` (the caller writes them), or written now."""
    own = stash is None
    stash = _values.Stash() if stash is None else stash
    a = as_args(example)
    kw = dict(a.kwargs)
    params, bufs = kw.pop("params", {}), kw.pop("buffers", {})
    training, calls = kw.pop("training", True), kw.pop("calls", 1)
    init = kw.pop("init", ms.fixed_init)
    lines = ["import torch", "import equiv"]
    names = {}
    for which, side in (("impl", ms.impl_side), ("ref", ms.ref_side)):
        cls = type(side) if isinstance(side, nn.Module) else side
        mod, qn = getattr(cls, "__module__", ""), getattr(cls, "__qualname__", repr(cls))
        names[which] = qn.split(".")[0]
        lines.append(f"from {mod} import {names[which]}")
    args = ", ".join(f"{k}={v!r}" for k, v in init.items())
    lines.append(f"ref = {_ctor(ms.ref_side, names['ref'], args)}")
    lines.append(f"impl = {_ctor(ms.impl_side, names['impl'], args)}")
    for var, state in (("params", params), ("buffers", bufs)):
        if var == "params" or ms.has_buffers:
            lines.append(f"{var} = {{")
            lines.extend(f"    {n!r}: {_value_code(t, stash)}," for n, t in state.items())
            lines.append("}")
    lines.append("state = {**params, **buffers}" if ms.has_buffers else "state = dict(params)")
    lines.append("ref.load_state_dict(state)")
    mapping = "state"
    if ms.state_map is not None:
        mapping = f"{_label(ms.state_map)}(state)"
        lines[2:2] = _definition(ms.state_map)
    lines.append(f"impl.load_state_dict({mapping})  # the state as equiv maps it")
    call = []
    sig_names = [p.name for p in ms.forward_sig.parameters.values()]
    for i, v in enumerate(a.args):
        var = sig_names[i] if i < len(sig_names) else f"arg{i}"
        lines.append(f"{var} = {_value_code(v, stash)}")
        call.append(var)
    for k, v in kw.items():
        lines.append(f"{k} = {_value_code(v, stash)}")
        call.append(f"{k}={k}")
    call.append("params=params")
    call += ["buffers=buffers"] if ms.has_buffers else []
    call += [f"training={training!r}", f"calls={calls!r}"]
    call += [f"init={dict(init)!r}"] if ms.drawn_init else []
    lines.append(f"# {names['impl']} against {names['ref']} on this state and input"
                 f" ({'train' if training else 'eval'} mode, {calls} forward(s)):")
    lines.append(f"equiv.assert_equivalent({names['impl']}, {', '.join(call)})")
    if "base64.b64decode" in "\n".join(lines):
        lines.insert(1, "import base64")
    if own:
        _values.write(stash.files)
    return "\n".join(lines)


def _definition(fn: Any) -> list[str]:
    """Lines that bring ``fn`` into the printed code: an import when it is a module-level
    function, else its source (a nested ``def``), else a comment saying it must be defined."""
    mod, qn = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if mod and qn and "<" not in qn and "." not in qn:
        return [f"from {mod} import {qn}"]
    if getattr(fn, "__name__", "") != "<lambda>":
        try:
            return textwrap.dedent(inspect.getsource(fn)).rstrip().splitlines()
        except (OSError, TypeError):
            pass
    return [f"# {_label(fn)}: the state_map= callable (not importable): define it here"]


def _ctor(side: Any, name: str, args: str) -> str:
    if isinstance(side, nn.Module):
        return f"{name}(...)  # the registered instance (its constructor arguments are not known)"
    return f"{name}({args})"


def _value_code(v: Any, stash: _values.Stash) -> str:
    """An expression rebuilding ``v``: a tensor with its exact values and requires_grad."""
    if isinstance(v, torch.Tensor):
        return stash.expression(v.detach().cpu()) + (".requires_grad_()" if v.requires_grad
                                                      else "")
    return repr(v)


_spec._MODULE_HOOK = register
