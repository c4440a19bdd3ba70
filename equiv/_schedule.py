"""Schedules as part of a spec's contract: :class:`Schedule` (an ordered script of forward,
in-place writes, backward and optimizer steps, with its expected outcome) and the decoration-time
validation of ``equivalent_to``'s ``schedules=``, ``parameters=`` and memory options.

Running a schedule is the execution core's job (:mod:`equiv.execution.script`); judging it is the
``schedule`` check's (:mod:`equiv.checks.schedule`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

from equiv.errors import InvalidArgument

__all__ = ["Schedule"]

_EXPECT = ("match", "raises", "raises-or-match")
_STEP = re.compile(
    r"^(forward|backward( [1-9]\d*)?|step|write (out(\[\d+\])?|[A-Za-z_]\w*(\[[^\]]+\])*))$")
_LR = 0.5


@dataclasses.dataclass(frozen=True)
class Schedule:
    """An ordered script run identically on both sides, and its expected outcome.

    ``steps``: ``"forward"`` (the first on the example, each further one on a copy holding other
    values: every storage reversed); ``"write <arg>"`` / ``"write out"`` / ``"write out[i]"`` (an
    in-place write under ``torch.no_grad()`` to the latest forward's argument or output);
    ``"backward"`` (through the latest forward: a fresh random cotangent, retained graph),
    ``"backward <k>"`` (through forward #k, e.g. forward, forward, backward 1, backward 2);
    ``"step"`` (an SGD step on the spec's ``parameters=``, using the last backward's gradients). ``expect``: ``"match"`` (gradients equal the reference's at
    forward-time values), ``"raises"`` (an exception of type ``raises`` whose message matches
    the regex ``match``), or ``"raises-or-match"`` (either; the built-ins' rule).
    """

    steps: tuple[str, ...]
    name: str = ""
    expect: str = "raises-or-match"
    raises: type[BaseException] = RuntimeError
    match: str | None = None

    def __init__(self, steps: Sequence[str], *, name: str = "", expect: str = "raises-or-match",
                 raises: type[BaseException] = RuntimeError, match: str | None = None) -> None:
        if isinstance(steps, str) or not all(isinstance(s, str) for s in steps):
            raise InvalidArgument(
                f"Schedule(steps={steps!r}) takes a sequence of step strings, e.g. "
                "('forward', 'write x', 'backward')."
            )
        steps = tuple(" ".join(s.split()) for s in steps)
        bad = [s for s in steps if not _STEP.match(s)]
        if bad:
            raise InvalidArgument(
                f"Schedule step(s) {bad} not understood; use 'forward', 'write <argument>', "
                "'write out', 'write out[i]', 'backward', 'backward <k>' or 'step'."
            )
        if not steps or steps[0] != "forward":
            raise InvalidArgument(f"Schedule(steps={list(steps)}) must start with 'forward'.")
        forwards = 0
        for step in steps:
            forwards += step == "forward"
            if step.startswith("backward ") and int(step[9:]) > forwards:
                raise InvalidArgument(
                    f"Schedule(steps={list(steps)}): {step!r} comes before forward "
                    f"#{step[9:]}; 'backward <k>' goes through the k-th forward so far."
                )
        if expect not in _EXPECT:
            raise InvalidArgument(f"Schedule(expect={expect!r}): use one of {list(_EXPECT)}.")
        if not (isinstance(raises, type) and issubclass(raises, BaseException)):
            raise InvalidArgument(
                f"Schedule(raises={raises!r}) must be an exception type, e.g. RuntimeError."
            )
        if match is not None:
            try:
                re.compile(match)
            except (re.error, TypeError) as e:
                raise InvalidArgument(f"Schedule(match={match!r}) is not a regex: {e}.") from None
        object.__setattr__(self, "steps", steps)
        object.__setattr__(self, "name", name or " -> ".join(steps))
        object.__setattr__(self, "expect", expect)
        object.__setattr__(self, "raises", raises)
        object.__setattr__(self, "match", match)


def validate_options(sig: Any, impl_name: str, schedules: Any, parameters: Any,
                     max_memory_ratio: Any, max_retained_bytes: Any) -> tuple[tuple, tuple]:
    """Decoration-time validation of the schedule and memory options of ``equivalent_to``."""
    params = list(sig.parameters)
    if isinstance(parameters, str) or not isinstance(parameters, (list, tuple)):
        raise InvalidArgument(
            f"equivalent_to(parameters={parameters!r}) takes a tuple of argument names, e.g. "
            "parameters=('weight',)."
        )
    for p in parameters:
        if p not in params:
            raise InvalidArgument(
                f"equivalent_to(parameters=...) names {p!r}, which is not a parameter of "
                f"{impl_name}; use one of {params}."
            )
    if isinstance(schedules, Schedule) or not isinstance(schedules, (list, tuple)):
        raise InvalidArgument(
            "equivalent_to(schedules=...) takes a list of equiv.Schedule, e.g. "
            "schedules=[equiv.Schedule(('forward', 'write x', 'backward'), expect='raises')]."
        )
    for s in schedules:
        if not isinstance(s, Schedule):
            raise InvalidArgument(
                f"equivalent_to(schedules=...) holds {type(s).__name__} {s!r:.60}; wrap each "
                "script in equiv.Schedule(steps, expect=...)."
            )
        for step in s.steps:
            if step.startswith("write ") and not step.startswith("write out"):
                arg = step[6:].split("[")[0]
                if arg not in params:
                    raise InvalidArgument(
                        f"Schedule {s.name!r} writes {arg!r}, which is not a parameter of "
                        f"{impl_name}; use one of {params} or 'out'."
                    )
            if step == "step" and not parameters:
                raise InvalidArgument(
                    f"Schedule {s.name!r} has an optimizer 'step' but the spec declares no "
                    "parameters: pass equivalent_to(parameters=('weight', ...))."
                )
    if max_memory_ratio is not None and (isinstance(max_memory_ratio, bool) or not isinstance(
            max_memory_ratio, (int, float)) or max_memory_ratio <= 0):
        raise InvalidArgument(
            f"equivalent_to(max_memory_ratio={max_memory_ratio!r}): give a number > 0 "
            "(implementation peak bytes / reference peak bytes), e.g. 1.0."
        )
    if max_retained_bytes is not None and (isinstance(max_retained_bytes, bool) or not isinstance(
            max_retained_bytes, int) or max_retained_bytes < 0):
        raise InvalidArgument(
            f"equivalent_to(max_retained_bytes={max_retained_bytes!r}): give an int >= 0 (bytes "
            "the graph may keep alive after forward)."
        )
    return tuple(schedules), tuple(parameters)
