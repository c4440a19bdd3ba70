"""Every private torch import lives here, behind version guards."""

from __future__ import annotations

from typing import Any

from torch.utils import _pytree as pytree

tree_flatten = pytree.tree_flatten
tree_unflatten = pytree.tree_unflatten
tree_flatten_with_path = pytree.tree_flatten_with_path
keystr = pytree.keystr
TreeSpec = pytree.TreeSpec


# -- custom Functions and torch.library custom ops (equiv.checks.function) -------------------
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


def is_leaf_none(x: Any) -> bool:
    return x is None
