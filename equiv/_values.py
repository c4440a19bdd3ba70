"""Python expressions that rebuild a tensor's exact values, for printed reproductions.

Up to :data:`LITERAL_MAX` elements a ``torch.tensor([...])`` literal, up to :data:`EXACT_INLINE`
the tensor's bytes (base64), beyond that a ``torch.load`` of a ``.pt`` file named by a hash of
its values: :class:`Stash` collects those files and writes them (:func:`write`) into
:func:`directory`, the report's folder (:func:`example_directory`) or else a temporary one.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import re
import tempfile
from typing import Iterator

import torch

#: tensors up to this many elements are printed as a literal
LITERAL_MAX = 64
#: tensors up to this many elements over LITERAL_MAX are printed as their exact bytes (base64)
EXACT_INLINE = 4096

_directory: list[str] = []


def directory() -> str:
    """Where ``.pt`` files of reproductions go: the folder set by :func:`example_directory`
    (the folder of the report being written), else ``<tempdir>/equiv-examples``."""
    return _directory[-1] if _directory else os.path.join(tempfile.gettempdir(), "equiv-examples")


@contextlib.contextmanager
def example_directory(path: str | None) -> Iterator[None]:
    """Within the block, reproductions' ``.pt`` files go to ``path`` (nothing changes for None)."""
    if path is None:
        yield
        return
    push_directory(path)
    try:
        yield
    finally:
        pop_directory()


def push_directory(path: str) -> None:
    """From now on reproductions' ``.pt`` files go to ``path`` (until :func:`pop_directory`)."""
    _directory.append(os.path.abspath(path))


def pop_directory() -> None:
    _directory.pop()


class Stash:
    """The tensors of one printed reproduction that are too big to print: ``{path: values}``."""

    def __init__(self) -> None:
        self.files: dict[str, torch.Tensor] = {}

    def expression(self, vals: torch.Tensor) -> str:
        """An expression rebuilding ``vals`` (a CPU tensor, its shape kept) bit for bit."""
        if vals.numel() == 0:  # torch.tensor([]) would lose the shape
            return f"torch.empty({tuple(vals.shape)}, dtype={vals.dtype})"
        if vals.numel() <= LITERAL_MAX:
            return f"torch.tensor({literal(repr(vals.tolist()))}, dtype={vals.dtype})"
        if vals.numel() <= EXACT_INLINE:
            return exact_bytes(vals)
        values = vals.detach().contiguous().clone()
        digest = hashlib.sha1(_raw(values).numpy().tobytes()).hexdigest()[:16]
        path = os.path.join(directory(), f"equiv-example-{digest}.pt")
        self.files[path] = values
        return f"torch.load({path!r})"


def write(files: dict[str, torch.Tensor]) -> None:
    """Write each ``{path: values}`` file that is not there yet (its name is its values' hash)."""
    for path, values in files.items():
        if os.path.exists(path):
            continue
        os.makedirs(os.path.dirname(path), exist_ok=True)
        part = f"{path}.{os.getpid()}.part"
        torch.save(values, part)
        os.replace(part, path)


def _raw(vals: torch.Tensor) -> torch.Tensor:
    flat = vals.contiguous().view(-1)
    return flat if vals.dtype == torch.bool else flat.view(torch.uint8)


def exact_bytes(vals: torch.Tensor) -> str:
    """An expression rebuilding ``vals`` (on the CPU) bit for bit from its bytes."""
    data = base64.b64encode(bytes(_raw(vals).contiguous().numpy().tobytes())).decode()
    return (f"torch.frombuffer(bytearray(base64.b64decode({data!r})), dtype={vals.dtype})"
            f".reshape({tuple(vals.shape)}).clone()")


def literal(data: str) -> str:
    """A value list's repr with nan/inf spelled as Python expressions."""
    data = re.sub(r"\bnan\b", "float('nan')", data)
    return re.sub(r"\binf\b", "float('inf')", data)
