"""``schedule``: hazardous schedules — forward, in-place writes, backward, optimizer steps —
run on the implementation and judged against the reference's gradients at forward-time values.

Built-in schedules, where they apply:

- ``mutate-after-forward[x]``: forward, write in place (under ``torch.no_grad()``) to input ``x``,
  backward. One per differentiable input not declared mutated.
- ``mutate-output-after-forward``: forward, write in place to each output, backward.
- ``step-between-losses``: forward, backward of a first loss, an SGD step on the spec's
  ``parameters=``, backward of a second loss through the same graph.
- ``interleaved-forwards``: forward A (the example), forward B (other values: every storage
  reversed), backward A, backward B; each must match the reference at its own forward's values
  and must not raise (state stashed on the Function class or module instead of ``ctx`` fails).

Acceptable outcomes: autograd raises (its in-place/version error), or every gradient equals the
reference's at the values the forward saw. Silent divergence is a finding. A user's
:class:`~equiv.Schedule` can demand one outcome (``expect="raises"`` / ``expect="match"``).
The runs are the core's (:mod:`equiv.execution.script`); a diverging one is replayed there under
the timeline recorder to explain it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from equiv._schedule import Schedule
from equiv.execution.calls import format_tb
from equiv.execution.record import Execution, Sink
from equiv.execution.script import Script, ScriptResult, backward_forwards, replay
from equiv.execution.verdict import rounding_only

NAME = "schedule"


_SAVE_FIX = ("save what backward needs with ctx.save_for_backward (autograd then raises) or "
             "save a clone.")
_SHARED_STATE = ("state shared between calls: the second forward overwrote what the first "
                 "forward's backward reads (an attribute of the Function class or of a module, a "
                 "global or a cache), so backward #1 saw forward #2's values.")
_SHARED_STATE_FIX = ("keep each call's state on its own ctx (ctx.save_for_backward, or ctx "
                     "attributes for non-tensors), never on the class, the module or a global.")


def builtin_schedules(plan: Script) -> list[Schedule]:
    """The built-in schedules that apply to this example."""
    out = []
    for g, name in zip(plan.groups, plan.names):
        if not g.mutated:
            path = plan.template.slots[g.slots[0]].path
            out.append(Schedule(("forward", f"write {path}", "backward"),
                                name=f"mutate-after-forward[{name}]"))
    out.append(Schedule(("forward", "write out", "backward"), name="mutate-output-after-forward"))
    if plan.spec.parameters:
        out.append(Schedule(("forward", "backward", "step", "backward"),
                            name="step-between-losses"))
    out.append(Schedule(("forward", "forward", "backward 1", "backward 2"),
                        name="interleaved-forwards", expect="match"))
    return out


def plain_twin(schedule: Schedule) -> Schedule | None:
    """``schedule`` without its hazards: no writes or steps, each backward right after the
    forward it goes through, backwards in their original order (None when that order cannot
    be kept)."""
    through = backward_forwards(schedule)
    if through != sorted(through):
        return None
    forwards = sum(step == "forward" for step in schedule.steps)
    steps: list[str] = []
    for j in range(1, forwards + 1):
        steps.append("forward")
        steps += [f"backward {j}"] * through.count(j)
    return Schedule(tuple(steps), name=f"{schedule.name} (plain)", expect="match")


def _plain_differs(ex: Execution, plan: Script, schedule: Schedule, cots: Any,
                   at: tuple[int, int], expected: Any, oracle: Any) -> bool:
    """Whether the implementation's gradient ``i`` on backward ``k`` also differs from
    ``expected`` in :func:`plain_twin`'s run (the same cotangents, no hazard)."""
    (k, i), twin = at, plain_twin(schedule)
    if twin is None or twin.steps == schedule.steps:
        return False
    plain = plan.execute(twin, ex.spec.impl, cots)
    if plain.error is not None or len(plain.grads) < k:
        return False
    got = plain.grads[k - 1][i]
    m = ex.oracle.judge(plan.names[i], got, expected.to(dtype=got.dtype, device=got.device),
                        kind="gradients", group=plan.groups[i], oracle=oracle)
    return m is not None and not rounding_only([m])


def _describe(result: ScriptResult) -> str:
    if result.error is not None:
        text = str(result.error).splitlines()[0] if str(result.error) else ""
        if len(text) > 200:
            text = text[:200].rsplit(" ", 1)[0] + " ..."
        return f"raised {type(result.error).__name__} at step {result.failed_step!r}: {text}"
    return "completed without error"


def run(ex: Execution, sink: Sink) -> None:
    script = Script(ex)
    if script.ok:
        user = list(ex.spec.schedules)
        for schedule in builtin_schedules(script) + user:
            _run_one(ex, sink, script, schedule, user=schedule in user)


def _run_one(ex: Execution, sink: Sink, plan: Script, schedule: Schedule, *,
             user: bool) -> None:
    count = sum(step.startswith("backward") for step in schedule.steps)
    cots = plan.cotangents(count)
    expected = plan.reference_grads(cots, schedule)
    if expected is None:
        return
    result = plan.execute(schedule, ex.spec.impl, cots)
    if result.forward_error is not None:
        return  # the core checks own forward errors
    sink.mark_compared(NAME)  # raising is an outcome too: the schedule was judged

    def context() -> str:  # only built for a finding: it runs the reference's schedule too
        ref_result = plan.execute(schedule, ex.spec.ref, cots)
        return (f"schedule: {' -> '.join(schedule.steps)}\n"
                f"implementation: {_describe(result)}\n"
                f"reference under the same schedule: {_describe(ref_result)}")

    if result.error is not None:
        if schedule.expect == "match":
            sink.finding(NAME, f"schedule {schedule.name!r} was expected to match the "
                        f"reference but the implementation raised {type(result.error).__name__}.",
                        details=context(), tb=format_tb(result.error))
            return
        if not user:
            return  # built-ins accept autograd's error (any error raised is not silent)
        ok_type = isinstance(result.error, schedule.raises)
        ok_msg = schedule.match is None or re.search(schedule.match, str(result.error))
        if not (ok_type and ok_msg):
            sink.finding(NAME, f"schedule {schedule.name!r} raised "
                        f"{type(result.error).__name__}, expected {schedule.raises.__name__}"
                        + (f" matching {schedule.match!r}" if schedule.match else "") + ".",
                        details=context(), tb=format_tb(result.error))
        return
    if schedule.expect == "raises":
        sink.finding(NAME, f"schedule {schedule.name!r} was expected to raise "
                    f"{schedule.raises.__name__}"
                    + (f" matching {schedule.match!r}" if schedule.match else "")
                    + " but completed without error.", details=context(),
                    fix="if the implementation is meant to support this schedule, declare "
                        "expect='match'.")
        return
    _compare(ex, sink, plan, schedule, cots, result, expected, context)


def _compare(ex: Execution, sink: Sink, plan: Script, schedule: Schedule, cots: Any,
             result: ScriptResult, expected: Any, context: Any) -> None:
    """The schedule's gradients against the reference's at forward-time values: the first
    divergence that the plain twin does not share is a finding."""
    memo: dict[bool, Any] = {}

    def oracle(k: int, i: int, even: bool) -> Any:  # the float64 reference's, on first use
        if even not in memo:
            memo[even] = ex.oracle.vjps(ex.template, [n for n, _, _ in plan.pairs],
                                        plan.groups, cots, shuffled=even)
        return None if memo[even] is None else memo[even][k][i]

    through = backward_forwards(schedule)
    for k, (got, exp) in enumerate(zip(result.grads, expected), 1):
        for i, (name, a, e) in enumerate(zip(plan.names, got, exp)):
            e = e.to(dtype=a.dtype, device=a.device)  # the reference may run elsewhere
            even = through[k - 1] % 2 == 0  # even forwards see every storage reversed
            m = ex.oracle.judge(name, a, e, kind="gradients", group=plan.groups[i],
                                oracle=lambda k=k, i=i, even=even: oracle(k - 1, i, even))
            if m is None:
                continue
            if rounding_only([m]):  # a precision difference, not a schedule problem
                sink.note(f"schedule {schedule.name!r}: gradient w.r.t. {name!r} differs at "
                          "rounding level only (a precision difference, judged by the "
                          "gradients check, not a schedule problem)")
                continue
            if _plain_differs(ex, plan, schedule, cots, (k, i), e,
                              lambda k=k, i=i, even=even: oracle(k - 1, i, even)):
                sink.note(f"schedule {schedule.name!r}: gradient w.r.t. {name!r} differs on "
                          "the same cotangent without the schedule's hazard too (a gradients "
                          "bug, not a schedule one)")
                return
            cause, events = replay(ex, schedule, ex.spec.impl, cots, sink, plan)
            fix = None if cause else _SAVE_FIX
            if cause is None and schedule.name == "interleaved-forwards":
                cause, fix = _SHARED_STATE, _SHARED_STATE_FIX
            n = len(sink.findings)
            sink.finding(
                NAME,
                f"schedule {schedule.name!r}: gradient w.r.t. {name!r} on backward #{k} differs "
                "from the reference's at forward-time values, and autograd raised no error.",
                argument=name, mismatch=m, likely_cause=cause, fix=fix,
            )
            if len(sink.findings) > n:  # the numbers, after what was run
                sink.findings[-1] = dataclasses.replace(
                    sink.findings[-1], details=context() + "\n" + m.message, timeline=events)
            return
