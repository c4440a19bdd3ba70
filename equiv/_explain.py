"""Whether a failure is explained or only judged.

While Hypothesis searches and shrinks, a failing example only needs its verdict (which checks
fail, which values mismatch): its messages are discarded. The explanation of a failure (the
numbers of a numeric mismatch beyond its verdict, why a gradient differs at a kink, the
timeline replay) is computed once, on the minimal example Hypothesis replays to report it.

While it searches, Hypothesis tells bugs apart by the check of an example's first finding
alone, so there the checks after the first one that fails need not run (:func:`searching`);
a replay that asks which checks fail (attribution) runs them all.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

_EXPLAIN: contextvars.ContextVar[bool] = contextvars.ContextVar("equiv_explain", default=True)
_SEARCH: contextvars.ContextVar[bool] = contextvars.ContextVar("equiv_search", default=False)


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


def first_finding_decides() -> bool:
    """True while Hypothesis searches or shrinks: only an example's first finding is read."""
    return _SEARCH.get()


@contextlib.contextmanager
def searching(on: bool = True) -> Iterator[None]:
    """Within (when ``on``): failures are judged, not explained, and the checks after an
    example's first finding are skipped."""
    token = _SEARCH.set(on)
    try:
        with verdict_only(on):
            yield
    finally:
        _SEARCH.reset(token)
