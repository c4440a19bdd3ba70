"""Every private torch import lives here, behind version guards."""

from __future__ import annotations

from typing import Any

from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode  # private path, stable since 1.13

tree_flatten = pytree.tree_flatten
tree_unflatten = pytree.tree_unflatten
tree_flatten_with_path = pytree.tree_flatten_with_path
keystr = pytree.keystr
TreeSpec = pytree.TreeSpec


def is_leaf_none(x: Any) -> bool:
    return x is None
