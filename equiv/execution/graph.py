"""Custom ``autograd.Function`` nodes in a graph, and autograd's errors about what a backward
returned (wrong number of gradients, a gradient for a non-tensor input, a wrong shape) turned
into headlines that name the Function, the forward input and the fix."""

from __future__ import annotations

import re
from typing import Any

import torch

from equiv._compat import custom_function_node_type, tree_flatten
from equiv._targets import forward_parameters
from equiv.errors import error_text

_MAX_NODES = 5000  # graph walk bound


def function_nodes(*trees: Any) -> list[Any]:
    """The custom Function nodes (``BackwardCFunction``) reachable from the tensors in ``trees``."""
    node_t = custom_function_node_type()
    stack = []
    for tree in trees:
        for leaf in tree_flatten(tree)[0]:
            if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None:
                stack.append(leaf.grad_fn)
    seen: set[int] = set()
    found = []
    while stack and len(seen) < _MAX_NODES:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, node_t):
            found.append(node)
        stack.extend(n for n, _ in getattr(node, "next_functions", ()))
    return found


def builtin_only(*trees: Any) -> bool:
    """Whether every autograd node reachable from the tensors in ``trees`` is one of torch's own
    derivative formulas, which never write the gradients they are handed: no custom Function,
    no C++ extension node (``CppNode<...>``); False when the graph exceeds the walk's bound."""
    node_t = custom_function_node_type()
    stack = [leaf.grad_fn for tree in trees for leaf in tree_flatten(tree)[0]
             if isinstance(leaf, torch.Tensor) and leaf.grad_fn is not None]
    seen: set[int] = set()
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        if len(seen) >= _MAX_NODES or isinstance(node, node_t) or \
                type(node).__module__ != "builtins" or type(node).__name__.startswith("CppNode"):
            return False
        seen.add(id(node))
        stack.extend(n for n, _ in getattr(node, "next_functions", ()))
    return True


def function_class(node: Any) -> type | None:
    return getattr(node, "_forward_cls", None)


def function_label(cls: type | None) -> str:
    if cls is None:
        return "a custom Function"
    name = cls.__name__
    if name.startswith("GeneratedBackwardFor_"):
        return f"the autograd formula of custom op {name[len('GeneratedBackwardFor_'):]}"
    return name


def _input_names(cls: type | None) -> list[str] | None:
    if cls is None or cls.__name__.startswith("GeneratedBackwardFor_"):
        return None
    try:
        return [p.name for p in forward_parameters(cls)]
    except (TypeError, ValueError):
        return None


def edge_matches(node: Any, t: torch.Tensor, grad_fn: Any) -> bool:
    for n, _ in getattr(node, "next_functions", ()):
        if n is None:
            continue
        if grad_fn is not None and n is grad_fn:
            return True
        if grad_fn is None and getattr(n, "variable", None) is t:
            return True
    return False


_NUMBER = re.compile(r"function (\w+) returned an incorrect number of gradients "
                     r"\(expected (\d+), got (\d+)\)")
_NON_TENSOR = re.compile(r"function (\w+) returned a gradient different than None at position "
                         r"(\d+), but the corresponding forward input was not a Variable")
_SHAPE = re.compile(r"Function (\w+) returned an invalid gradient at index (\d+) - got "
                    r"\[([^\]]*)\] but expected shape compatible with \[([^\]]*)\]")
_INVALID = re.compile(r"Function (\w+) returned an invalid gradient at index (\d+) - (.*)")


def slot_headline(details: str, classes: dict[str, type | None]) -> tuple[str, str] | None:
    def who(node_name: str) -> tuple[str, list[str] | None]:
        cls = classes.get(node_name)
        label = function_label(cls) if cls is not None else node_name.removesuffix("Backward")
        return label, _input_names(cls)

    m = _NUMBER.search(details)
    if m:
        label, names = who(m[1])
        inputs = f" ({', '.join(names)})" if names and len(names) == int(m[2]) else ""
        return (f"{label}.backward returned {m[3]} gradients, but {label}.forward takes {m[2]} "
                f"inputs{inputs}: backward must return exactly one gradient per forward input.",
                "return one value per forward input, in order: a gradient for each tensor input "
                "that needs one, None for the others (non-tensor arguments included).")
    m = _NON_TENSOR.search(details)
    if m:
        label, names = who(m[1])
        pos = int(m[2])  # 1-based in autograd's message
        arg = f"{names[pos - 1]!r} " if names and pos <= len(names) else ""
        return (f"{label}.backward returned a gradient for forward input {arg}(position {pos}), "
                "which is not a tensor: only tensor inputs can receive a gradient.",
                f"return None in slot {pos} of {label}.backward's result.")
    m = _SHAPE.search(details)
    if m:
        label, names = who(m[1])
        i = int(m[2])
        arg = f"{names[i]!r}" if names and i < len(names) else f"input {i}"
        return (f"{label}.backward returned a gradient of shape [{m[3]}] for forward input {arg}, "
                f"which has shape [{m[4]}].",
                f"return a gradient with the shape of {arg} (reduce broadcast dimensions with "
                ".sum_to_size(...)).")
    m = _INVALID.search(details)
    if m:
        label, names = who(m[1])
        i = int(m[2])
        arg = f"{names[i]!r}" if names and i < len(names) else f"input {i}"
        return (f"{label}.backward returned an invalid gradient for forward input {arg}: "
                f"{m[3].strip()}.",
                f"return a gradient with the shape, dtype and device of {arg}.")
    return None


def slot_explanation(err: BaseException | str, nodes: list[Any]) -> tuple[str, str] | None:
    """(headline, fix) for autograd's error about a Function's gradient slots, else None."""
    text = err if isinstance(err, str) else error_text(err)
    return slot_headline(text, {type(n).__name__: function_class(n) for n in nodes})


def graph_nodes(tensors: list[torch.Tensor]) -> list[Any]:
    stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
    seen: dict[int, Any] = {}
    while stack and len(seen) < _MAX_NODES:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen[id(node)] = node
        stack.extend(n for n, _ in getattr(node, "next_functions", ()))
    return list(seen.values())


def is_delayed_error(node: Any) -> bool:
    # torch.autograd.function.once_differentiable wraps its results in a DelayedError node
    return type(node).__name__ in ("Error", "DelayedError")


