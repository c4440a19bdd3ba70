"""Every private torch import lives here, behind version guards."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode  # private path, stable since 1.13

from equiv.errors import InvalidArgument

tree_flatten = pytree.tree_flatten
tree_unflatten = pytree.tree_unflatten
tree_flatten_with_path = pytree.tree_flatten_with_path
keystr = pytree.keystr
tree_map = pytree.tree_map


# -- custom Functions and torch.library custom ops (equiv.checks.function) -------------------
def decompositions() -> dict[Any, Any]:
    """torch's table of aten decompositions (op overload -> Python function), or {}."""
    try:
        from torch._decomp import decomposition_table
    except ImportError:  # pragma: no cover - torch without the decomposition table
        return {}
    return decomposition_table


def custom_function_node_type() -> type:
    """The base class of the autograd nodes of Python ``autograd.Function``s (and of custom ops
    with ``register_autograd``, which torch implements with a generated Function)."""
    from torch.autograd.function import BackwardCFunction

    return BackwardCFunction


def op_types() -> tuple[type, type]:
    """``(OpOverload, OpOverloadPacket)``: what ``torch.ops.ns.op[.overload]`` evaluates to."""
    from torch._ops import OpOverload, OpOverloadPacket

    return OpOverload, OpOverloadPacket


def custom_op_overload(obj: Any) -> Any:
    """The ``OpOverload`` behind a ``torch.library.custom_op`` object, an ``OpOverload`` or an
    ``OpOverloadPacket`` with a ``default`` overload; ``None`` for anything else."""
    overload_t, packet_t = op_types()
    if isinstance(obj, overload_t):
        return obj
    if isinstance(obj, packet_t):
        return getattr(obj, "default", None)
    try:
        from torch._library.custom_ops import CustomOpDef
    except ImportError:  # pragma: no cover - torch without torch.library.custom_op
        return None
    if isinstance(obj, CustomOpDef):
        return obj._opoverload
    return None


def op_schema(overload: Any) -> Any:
    return overload._schema


# -- torch.compile internals (imported lazily: ``import equiv`` must not load Dynamo) -----------
def dynamo() -> Any:
    """``torch._dynamo``, imported on first use by a compile mode."""
    import torch._dynamo

    return torch._dynamo


def lookup_backend(name: str) -> Any:
    d = dynamo()
    try:
        return d.lookup_backend(name)
    except d.exc.InvalidBackend:
        raise InvalidArgument(
            f"compile[{name}]: {name!r} is not a torch.compile backend; available here: "
            f"{sorted(d.list_backends())} (or pass a callable: equiv.compiled(my_backend))."
        ) from None


def mark_sides_dynamic(values: Any) -> None:
    """``maybe_mark_dynamic`` every side >= 2 of the tensors in ``values`` (a pytree): the first
    compilation is then the dynamic-shape graph automatic dynamic shapes compile on the second
    shape (sides 0 and 1 stay specialised; a side the program specialises raises nothing)."""
    d = dynamo()
    for t in pytree.tree_leaves(values):
        if isinstance(t, torch.Tensor):
            for dim, side in enumerate(t.shape):
                if side >= 2:
                    d.maybe_mark_dynamic(t, dim)


def graph_break_counter() -> dict[str, int]:
    """Dynamo's running count of graph breaks by reason (not cleared by ``reset``)."""
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])


def dynamo_config_patch(recompile_limit: int) -> Any:
    """Raise the recompile limit and make hitting it an exception instead of a silent eager
    fallback (``fail_on_recompile_limit_hit`` exists from torch 2.6; older versions fall back
    to the warning only, and the runner detects the fallback by counting compilations)."""
    config = dynamo().config
    changes: dict[str, Any] = {}
    if hasattr(config, "recompile_limit"):
        changes["recompile_limit"] = recompile_limit
    else:  # torch < 2.6
        changes["cache_size_limit"] = recompile_limit
    if hasattr(config, "accumulated_recompile_limit"):
        changes["accumulated_recompile_limit"] = max(256, 4 * recompile_limit)
    elif hasattr(config, "accumulated_cache_size_limit"):
        changes["accumulated_cache_size_limit"] = max(256, 4 * recompile_limit)
    if hasattr(config, "fail_on_recompile_limit_hit"):
        changes["fail_on_recompile_limit_hit"] = True
    return config.patch(**changes)


def functorch_config_patch() -> Any:
    """Switch off donated buffers so that ``retain_graph=True`` through a compiled backward is
    tested rather than refused (``torch._functorch.config.donated_buffer``, torch >= 2.6)."""
    import contextlib

    import torch._functorch.config as fconfig

    if hasattr(fconfig, "donated_buffer"):
        return fconfig.patch(donated_buffer=False)
    return contextlib.nullcontext()


def recompile_limit_error() -> tuple[type[BaseException], ...]:
    exc = getattr(dynamo().exc, "FailOnRecompileLimitHit", None)
    return (exc,) if exc is not None else ()


def compile_wrapper_errors() -> tuple[type[BaseException], ...]:
    """Dynamo exceptions that wrap a user-level error (unwrapped for error parity)."""
    import sys

    mod = sys.modules.get("torch._dynamo.exc")
    if mod is None:  # Dynamo never ran: nothing can be wrapped
        return ()
    names = ("TorchRuntimeError", "BackendCompilerFailed", "InternalTorchDynamoError")
    return tuple(getattr(mod, n) for n in names if hasattr(mod, n))


try:  # private helper of torch.testing since 1.12
    from torch.testing._comparison import default_tolerances as _default_tolerances
except ImportError:  # moved: callers take assert_close's own path
    _default_tolerances = None


def default_tolerances(dtype: torch.dtype) -> tuple[float, float] | None:
    """``torch.testing.assert_close``'s default (rtol, atol) for ``dtype``, or None where this
    torch does not expose them."""
    if _default_tolerances is None:
        return None
    try:
        rtol, atol = _default_tolerances(dtype)
    except Exception:  # its signature changed: the caller takes assert_close's own path
        return None
    return rtol, atol
