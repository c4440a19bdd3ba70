"""What equiv calls for a registered target: a plain callable, an ``autograd.Function``
subclass (``Fn.apply``) or a ``torch.library`` custom op, each with a usable signature and a
readable name; and finding the spec registered for any spelling of a target."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Iterable

import torch

from equiv._compat import custom_op_overload, op_schema
from equiv.errors import InvalidArgument

def callable_for(impl: Any) -> Callable[..., Any]:
    """What equiv calls for ``impl``: ``Fn.apply`` for an ``autograd.Function`` subclass, the op
    for a custom op (``torch.library.custom_op`` object, ``torch.ops.ns.op[.overload]``), else
    ``impl`` itself. The wrapper carries a usable signature (``forward``'s, without ``ctx`` for
    old-style Functions; the op schema's) and a readable name (``Fn.apply``, ``torch.ops.ns.op``).
    """
    if isinstance(impl, type) and issubclass(impl, torch.autograd.Function):
        return _function_apply(impl)
    overload = custom_op_overload(impl)
    if overload is not None:
        return _op_call(overload)
    return impl


def own_spec(impl: Any, specs: Iterable[Any]) -> Any:
    """``impl``'s own ``__equiv_spec__``: a Function subclass does not inherit its parent's;
    ``Fn.apply`` and every spelling of a registered custom op (``torch.ops.ns.op``, its
    overload, the ``custom_op`` object) find the spec registered for them."""
    if isinstance(impl, type):
        return vars(impl).get("__equiv_spec__")
    spec = getattr(impl, "__equiv_spec__", None)
    if spec is not None:
        return spec
    owner = getattr(impl, "__self__", None)  # Fn.apply: a method bound to the class
    if isinstance(owner, type) and issubclass(owner, torch.autograd.Function):
        return vars(owner).get("__equiv_spec__")
    overload = custom_op_overload(impl)
    if overload is not None:
        for spec in specs:
            if getattr(spec.impl, "__equiv_wraps__", None) is overload:
                return spec
    return None


def _setup_context_defined(fn_cls: type) -> bool:
    return fn_cls.setup_context is not torch.autograd.Function.setup_context


def forward_parameters(fn_cls: type) -> list[inspect.Parameter]:
    """The parameters ``Fn.apply`` takes: ``forward``'s, minus ``ctx`` for old-style Functions."""
    params = list(inspect.signature(fn_cls.forward).parameters.values())
    if not _setup_context_defined(fn_cls) and params:
        params = params[1:]
    return params


def _function_apply(fn_cls: type) -> Callable[..., Any]:
    try:
        sig = inspect.Signature(forward_parameters(fn_cls))
    except (TypeError, ValueError) as e:
        raise InvalidArgument(
            f"cannot read the signature of {fn_cls.__qualname__}.forward ({e}); decorate a plain "
            f"Python function with named parameters that calls {fn_cls.__qualname__}.apply."
        ) from None

    def apply(*args: Any, **kwargs: Any) -> Any:
        return fn_cls.apply(*args, **kwargs)

    apply.__signature__ = sig  # type: ignore[attr-defined]
    apply.__name__ = f"{fn_cls.__name__}.apply"
    apply.__qualname__ = f"{fn_cls.__qualname__}.apply"
    apply.__module__ = fn_cls.__module__
    apply.__equiv_wraps__ = fn_cls  # type: ignore[attr-defined]
    return apply


_SCHEMA_ANNOTATIONS = {"Tensor": torch.Tensor, "float": float, "int": int, "SymInt": int,
                       "bool": bool}


def _op_call(overload: Any) -> Callable[..., Any]:
    schema = op_schema(overload)
    params = []
    for a in schema.arguments:
        kind = (inspect.Parameter.KEYWORD_ONLY if a.kwarg_only
                else inspect.Parameter.POSITIONAL_OR_KEYWORD)
        default = a.default_value if a.has_default_value() else inspect.Parameter.empty
        ann = _SCHEMA_ANNOTATIONS.get(str(a.type), str(a.type))
        params.append(inspect.Parameter(a.name, kind, default=default, annotation=ann))
    ns, _, name = schema.name.partition("::")
    overload_name = schema.overload_name

    def op(*args: Any, **kwargs: Any) -> Any:
        return overload(*args, **kwargs)

    op.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    op.__name__ = f"torch.ops.{ns}.{name}" + (f".{overload_name}" if overload_name else "")
    # the default overload's schema has overload_name "": torch.ops.ns.op(...) calls it
    op.__qualname__ = op.__name__
    op.__module__ = "builtins"  # so the report names it torch.ops.ns.op, not a module path
    op.__equiv_wraps__ = overload  # type: ignore[attr-defined]
    return op
