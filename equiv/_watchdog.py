"""A per-example time limit (``settings(timeout=seconds)``) that stops a hanging example.

On POSIX, in the main thread, a ``SIGALRM`` interval timer ticks every quarter of the limit; the
handler finds the Hypothesis frame running the current example and raises
:class:`ExampleTimeout` once the same example has been running for the limit. A hang inside C
code that never returns to Python cannot be interrupted this way. Elsewhere (a worker thread,
Windows) the limit is not enforced and :func:`per_example` says so.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from types import FrameType
from typing import Any, Iterator

_EXAMPLE_FRAME = "execute_once"  # Hypothesis runs each example in this method


class ExampleTimeout(BaseException):
    """One example ran past ``settings(timeout=...)``. A BaseException, like KeyboardInterrupt,
    so that the guards around the user's code (which catch ``Exception``) let it through."""

    def __init__(self, seconds: float, message: str = "") -> None:
        super().__init__(message or f"an example ran longer than timeout={seconds:g}s")
        self.seconds = seconds


def deadline_timeout(error: BaseException) -> ExampleTimeout:
    """The timeout a Hypothesis ``DeadlineExceeded`` (the user's ``deadline=``) stands for."""
    runtime, deadline = getattr(error, "runtime", None), getattr(error, "deadline", None)
    seconds = deadline.total_seconds() if deadline is not None else 0.0
    took = f" (it took {runtime.total_seconds():.3g}s)" if runtime is not None else ""
    return ExampleTimeout(seconds, f"an example ran longer than the Hypothesis deadline="
                                   f"{seconds * 1000:g}ms set in hypothesis_settings{took}")


def _example_frame(frame: FrameType | None) -> FrameType | None:
    while frame is not None:
        code = frame.f_code
        if code.co_name == _EXAMPLE_FRAME and "hypothesis" in code.co_filename:
            return frame
        frame = frame.f_back
    return None


def unenforced_reason() -> str | None:
    """Why a timeout cannot be enforced here, or None when it can."""
    if not hasattr(signal, "setitimer"):
        return "this platform has no signal.setitimer (SIGALRM)"
    if threading.current_thread() is not threading.main_thread():
        return "equiv is not running in the main thread (signals reach only the main thread)"
    return None


@contextlib.contextmanager
def per_example(seconds: float | None) -> Iterator[str | None]:
    """Enforce ``seconds`` per example inside the block; yields None when enforced, else the
    reason it is not (the caller shows it)."""
    why = None if seconds is None else unenforced_reason()
    if seconds is None or why is not None:
        yield why
        return
    seen: dict[str, Any] = {"frame": None, "since": 0.0}

    def tick(signum: int, frame: FrameType | None) -> None:
        current, now = _example_frame(frame), time.monotonic()
        if current is None or current is not seen["frame"]:
            seen.update(frame=current, since=now)
            return
        if now - seen["since"] >= seconds:
            seen["frame"] = None
            raise ExampleTimeout(seconds)

    interval = max(seconds / 4, 0.005)
    previous = signal.signal(signal.SIGALRM, tick)
    signal.setitimer(signal.ITIMER_REAL, interval, interval)
    try:
        yield None
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        seen.clear()
