"""One example's arguments: ``Args(x, y, alpha=2.0)``, and normalising what a strategy drew."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class Args:
    """Positional and keyword arguments of one example: ``Args(x, y, alpha=2.0)``."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        object.__setattr__(self, "args", tuple(args))
        object.__setattr__(self, "kwargs", dict(kwargs))

    def __repr__(self) -> str:
        parts = [repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()]
        return f"Args({', '.join(parts)})"


def as_args(value: Any) -> Args:
    """Normalise what a strategy or ``examples=`` produced into :class:`Args`."""
    if isinstance(value, Args):
        return value
    if isinstance(value, tuple):
        return Args(*value)
    raise TypeError(
        f"an example must be a tuple of positional arguments or equiv.Args(...), got "
        f"{type(value).__name__}: {value!r:.80}"
    )
