"""Whether a failure is explained or only judged.

While Hypothesis searches and shrinks, a failing example only needs its verdict (which checks
fail, which values mismatch): its messages are discarded. The explanation of a failure (the
numbers of a numeric mismatch beyond its verdict, why a gradient differs at a kink, the
timeline replay) is computed once, on the minimal example Hypothesis replays to report it.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

_EXPLAIN: contextvars.ContextVar[bool] = contextvars.ContextVar("equiv_explain", default=True)


def explaining() -> bool:
    """True (the default) when a failure found now is reported, so explained in full."""
    return _EXPLAIN.get()


@contextlib.contextmanager
def verdict_only(on: bool = True) -> Iterator[None]:
    """Within: failures are judged, not explained (when ``on``)."""
    token = _EXPLAIN.set(not on and _EXPLAIN.get())
    try:
        yield
    finally:
        _EXPLAIN.reset(token)
