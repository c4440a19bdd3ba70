"""Hazardous schedules: forward, in-place writes, backward, optimizer steps, run on the
implementation and judged against the reference's gradients at forward-time values.

Built-in schedules (check ``schedule``), where they apply:

- ``mutate-after-forward[x]``: forward, write in place (under ``torch.no_grad()``) to input ``x``,
  backward. One per differentiable input not declared mutated.
- ``mutate-output-after-forward``: forward, write in place to each output, backward.
- ``step-between-losses``: forward, backward of a first loss, an SGD step on the spec's
  ``parameters=``, backward of a second loss through the same graph.

Acceptable outcomes: autograd raises (its in-place/version error), or every gradient equals the
reference's at the values the forward saw. Silent divergence is a finding. A user's
:class:`Schedule` can demand one outcome (``expect="raises"`` / ``expect="match"``).
Decisions are made on runs WITHOUT recording hooks (they would switch autograd's version check
off); a diverging run is then replayed under the :class:`~equiv.timeline.Recorder` to explain it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any, Sequence

import torch

from equiv.compare import compare_leaf
from equiv.errors import InvalidArgument

if TYPE_CHECKING:  # pragma: no cover
    from equiv.checks.core import _Run
    from equiv.examples import Side, Template
    from equiv.timeline import Recorder

__all__ = ["Schedule"]

_EXPECT = ("match", "raises", "raises-or-match")
_STEP = re.compile(r"^(forward|backward|step|write (out(\[\d+\])?|[A-Za-z_]\w*(\[[^\]]+\])*))$")
_LR = 0.5


@dataclasses.dataclass(frozen=True)
class Schedule:
    """An ordered script run identically on both sides, and its expected outcome.

    ``steps``: ``"forward"``; ``"write <arg>"`` / ``"write out"`` / ``"write out[i]"`` (an
    in-place write under ``torch.no_grad()`` after forward); ``"backward"`` (a fresh random
    cotangent, retained graph); ``"step"`` (an SGD step on the spec's ``parameters=``, using the
    last backward's gradients). ``expect``: ``"match"`` (gradients equal the reference's at
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
                "'write out', 'write out[i]', 'backward' or 'step'."
            )
        if not steps or steps[0] != "forward" or steps.count("forward") != 1:
            raise InvalidArgument(
                f"Schedule(steps={list(steps)}) must start with 'forward', exactly once."
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


# -- running one schedule -------------------------------------------------------------------------
@dataclasses.dataclass
class _Result:
    grads: list[list[torch.Tensor]]  # one list per backward, one tensor per gradient leaf
    error: BaseException | None = None
    failed_step: str | None = None
    forward_error: BaseException | None = None


class _Plan:
    """What one example offers a schedule: differentiable pairs, leaves, cotangents."""

    def __init__(self, run: "_Run") -> None:
        from equiv.checks.core import _call

        self.run = run
        template = run.template
        assert template is not None
        self.template: Template = template
        spec = run.spec
        self.device = None if run.device == "cpu" else run.device
        self.ref_side = template.instantiate(device=self.device)
        ref_out, err = _call(spec.ref, self.ref_side)
        self.ok = err is None
        if not self.ok:
            return
        self.ref_out = ref_out
        _, self.finals, self.consumed = run._split(ref_out)
        n = len(run.findings)
        self.pairs = run._diff_pairs(self.ref_side, ref_out, ref_out, self.finals, self.consumed)
        del run.findings[n:]
        if self.consumed:  # the result IS the mutated arguments' final values: use those only
            self.pairs = [p for p in self.pairs if not p[0].startswith("output")]
        self.groups = [g for g in template.groups if self.ref_side.leaves[g.index] is not None]
        self.names = [template.group_name(g) for g in self.groups]
        self.ok = bool(self.pairs and self.groups)

    def cotangents(self, count: int) -> list[list[torch.Tensor]]:
        from equiv.checks.core import _cotangent

        gen = torch.Generator().manual_seed(self.run.cot_seed + 7919)
        return [[_cotangent(r, gen) for _, _, r in self.pairs] for _ in range(count)]

    def reference_grads(self, cots: list[list[torch.Tensor]]) -> list[list[torch.Tensor]] | None:
        from equiv.checks.core import _vjp

        outs = [r for _, _, r in self.pairs]
        leaves = [self.ref_side.leaves[g.index] for g in self.groups]
        result = []
        for c in cots:
            grads, err = _vjp(outs, leaves, c)
            if err is not None:
                return None
            result.append(grads)
        return result

    def execute(self, schedule: Schedule, fn: Any, cots: list[list[torch.Tensor]],
                recorder: "Recorder | None" = None) -> _Result:
        """Run ``schedule`` on a fresh copy of the example; never raises the user's errors.

        Under a ``recorder`` the run ends with a ``release`` phase: the graph, the outputs and
        then the arguments are dropped, so the timeline shows when each storage is freed."""
        side: Side = self.template.instantiate(device=self.device)
        leaves = [side.leaves[g.index] for g in self.groups]
        result = _Result([])
        if recorder is None:
            self._steps(schedule, fn, side, leaves, cots, result, None)
            return result
        self._name_arguments(recorder, side, leaves)
        with recorder:
            self._steps(schedule, fn, side, leaves, cots, result, recorder)
            # the steps' frame is gone, so the graph and outputs are freed; now the arguments
            # (no gc.collect(): a full collection costs ~0.3 s; storages kept only by reference
            # cycles, e.g. a ctx attribute holding an output, are simply not shown released)
            del side, leaves
        return result

    def _name_arguments(self, recorder: "Recorder", side: "Side",
                        leaves: list[torch.Tensor]) -> None:
        for slot, t in zip(self.template.slots, side.tensors):
            recorder.name(t, slot.path)
        for name, leaf in zip(self.names, leaves):
            recorder.name(leaf, name)

    def _steps(self, schedule: Schedule, fn: Any, side: "Side", leaves: list[torch.Tensor],
               cots: list[list[torch.Tensor]], result: _Result,
               recorder: "Recorder | None") -> None:
        from equiv.checks.core import _call, _leaves

        try:
            out, err = _call(fn, side)
            if err is not None:
                result.forward_error = err
                return
            outs = self._outputs(side, out, _leaves, is_ref=fn is self.run.spec.ref)
            if outs is None:
                result.forward_error = RuntimeError("outputs do not match the reference's")
                return
            if recorder is not None:
                for (name, _, _), o in zip(self.pairs, outs):
                    recorder.name(o, name)
                recorder.after_forward(outs)
            n_back = 0
            for step in schedule.steps[1:]:
                try:
                    if step.startswith("write"):
                        if recorder is not None:
                            recorder.phase("after forward")
                        self._write(step[6:], side, outs)
                    elif step == "backward":
                        if recorder is not None:
                            recorder.phase(f"backward #{n_back + 1}")
                        given = [c.clone() for c in cots[n_back]]
                        if recorder is not None:
                            for (name, _, _), c in zip(self.pairs, given):
                                recorder.name(c, f"grad_output for {name}")
                        n_back += 1
                        grads = torch.autograd.grad(outs, leaves, given, retain_graph=True,
                                                    allow_unused=True)
                        result.grads.append([torch.zeros_like(l) if g is None else g.detach()
                                             for g, l in zip(grads, leaves)])
                    elif step == "step":
                        if recorder is not None:
                            recorder.phase("step")
                            recorder.step("SGD")
                        self._step(leaves, result.grads[-1] if result.grads else None)
                except Exception as e:  # the user's code raised: that is the outcome
                    result.error, result.failed_step = e, step
                    return
        finally:
            if recorder is not None:
                recorder.phase("release")

    def _outputs(self, side: "Side", out: Any, leaves_of: Any, *, is_ref: bool
                 ) -> list[torch.Tensor] | None:
        """The differentiated tensors, in the order of ``self.pairs``: returned outputs and
        final values of mutated arguments (for the pure reference: where its result holds them)."""
        if self.consumed:
            tree: list[tuple[str, Any]] = []
        else:
            tree = [(f"output{p}", v) for p, v in leaves_of(out)]
        finals = self.run._split(out)[1] if is_ref else {a: side.argument(a) for a in self.finals}
        for arg, final in finals.items():
            tree += [(f"final value of {arg}{p}", v) for p, v in leaves_of(final)]
        by_name = dict(tree)
        outs = []
        for name, _, _ in self.pairs:
            t = by_name.get(name)
            if not isinstance(t, torch.Tensor) or not t.requires_grad:
                return None
            outs.append(t)
        return outs

    def _write(self, target: str, side: "Side", outs: list[torch.Tensor]) -> None:
        if target.startswith("out"):
            index = int(target[4:-1]) if target != "out" else None
            chosen = outs if index is None else [outs[index]]
        else:
            def hit(path: str) -> bool:
                return path == target or path.split("[")[0] == target

            chosen = []
            for g in self.template.groups:  # write the gradient leaf the argument lives in
                if not any(hit(self.template.slots[j].path) for j in g.slots):
                    continue
                leaf = side.leaves[g.index]
                if leaf is not None and not g.mutated:
                    chosen.append(leaf)
                else:
                    chosen += [side.tensors[j] for j in g.slots
                               if hit(self.template.slots[j].path)]
        with torch.no_grad():
            for t in chosen:
                if t.dtype.is_floating_point or t.dtype.is_complex:
                    t.add_(1.0)

    def _step(self, leaves: list[torch.Tensor], grads: list[torch.Tensor] | None) -> None:
        if grads is None:
            raise InvalidArgument("Schedule: 'step' needs a 'backward' before it.")
        params = set(self.run.spec.parameters)
        chosen = [(leaf, g) for leaf, g, grp in zip(leaves, grads, self.groups)
                  if any(self.template.slots[j].path.split("[")[0] in params for j in grp.slots)]
        if not chosen:
            return
        for leaf, g in chosen:
            leaf.grad = g.clone()
        # foreach=False: under a Python dispatch mode (the recorder) _foreach_add_ does not bump
        # version counters on torch 2.13, so the replay would disagree with the real run
        opt = torch.optim.SGD([leaf for leaf, _ in chosen], lr=_LR, foreach=False)
        opt.step()
        for leaf, _ in chosen:
            leaf.grad = None


def builtin_schedules(plan: _Plan) -> list[Schedule]:
    """The built-in schedules that apply to this example."""
    out = []
    for g, name in zip(plan.groups, plan.names):
        if not g.mutated:
            path = plan.template.slots[g.slots[0]].path
            out.append(Schedule(("forward", f"write {path}", "backward"),
                                name=f"mutate-after-forward[{name}]"))
    out.append(Schedule(("forward", "write out", "backward"), name="mutate-output-after-forward"))
    if plan.run.spec.parameters:
        out.append(Schedule(("forward", "backward", "step", "backward"),
                            name="step-between-losses"))
    return out


def _describe(result: _Result) -> str:
    if result.error is not None:
        text = str(result.error).splitlines()[0] if str(result.error) else ""
        if len(text) > 200:
            text = text[:200].rsplit(" ", 1)[0] + " ..."
        return f"raised {type(result.error).__name__} at step {result.failed_step!r}: {text}"
    return "completed without error"


def run_schedules(run: "_Run") -> None:
    """The hook ``_Run.run`` calls after the core checks: schedules, then memory."""
    if "schedule" in run.cfg.checks and not run.findings and run.mode == "eager":
        plan = _Plan(run)
        if plan.ok:
            user = list(run.spec.schedules)
            for schedule in builtin_schedules(plan) + user:
                _run_one(run, plan, schedule, user=schedule in user)
    if "memory" in run.cfg.checks and run.mode == "eager":
        from equiv.memory import check_memory

        check_memory(run)


def _run_one(run: "_Run", plan: _Plan, schedule: Schedule, *, user: bool) -> None:
    count = schedule.steps.count("backward")
    cots = plan.cotangents(count)
    expected = plan.reference_grads(cots)
    if expected is None:
        return
    result = plan.execute(schedule, run.spec.impl, cots)
    if result.forward_error is not None:
        return  # the core checks own forward errors

    def context() -> str:  # only built for a finding: it runs the reference's schedule too
        ref_result = plan.execute(schedule, run.spec.ref, cots)
        return (f"schedule: {' -> '.join(schedule.steps)}\n"
                f"implementation: {_describe(result)}\n"
                f"reference under the same schedule: {_describe(ref_result)}")

    if result.error is not None:
        if schedule.expect == "match":
            run.finding("schedule", f"schedule {schedule.name!r} was expected to match the "
                        f"reference but the implementation raised {type(result.error).__name__}.",
                        details=context(), tb=_tb(result.error))
            return
        if not user:
            return  # built-ins accept autograd's error (any error raised is not silent)
        ok_type = isinstance(result.error, schedule.raises)
        ok_msg = schedule.match is None or re.search(schedule.match, str(result.error))
        if not (ok_type and ok_msg):
            run.finding("schedule", f"schedule {schedule.name!r} raised "
                        f"{type(result.error).__name__}, expected {schedule.raises.__name__}"
                        + (f" matching {schedule.match!r}" if schedule.match else "") + ".",
                        details=context(), tb=_tb(result.error))
        return
    if schedule.expect == "raises":
        run.finding("schedule", f"schedule {schedule.name!r} was expected to raise "
                    f"{schedule.raises.__name__}"
                    + (f" matching {schedule.match!r}" if schedule.match else "")
                    + " but completed without error.", details=context(),
                    fix="if the implementation is meant to support this schedule, declare "
                        "expect='match'.")
        return
    for k, (got, exp) in enumerate(zip(result.grads, expected), 1):
        for name, a, e in zip(plan.names, got, exp):
            m = compare_leaf(a, e, rtol=run.spec.rtol, atol=run.spec.atol, path=name)
            if m is None:
                continue
            cause, events = _explain(plan, schedule, cots)
            n = len(run.findings)
            run.finding(
                "schedule",
                f"schedule {schedule.name!r}: gradient w.r.t. {name!r} on backward #{k} differs "
                "from the reference's at forward-time values, and autograd raised no error.",
                argument=name, mismatch=m, likely_cause=cause,
                fix=None if cause else "save what backward needs with ctx.save_for_backward "
                                       "(autograd then raises) or save a clone.",
            )
            if len(run.findings) > n:  # the numbers, after what was run
                run.findings[-1] = dataclasses.replace(
                    run.findings[-1], details=context() + "\n" + m.message, timeline=events)
            return


def _explain(plan: _Plan, schedule: Schedule, cots: list[list[torch.Tensor]]
             ) -> tuple[str | None, tuple[dict[str, Any], ...]]:
    """Replay the schedule on the implementation under the recorder."""
    from equiv.timeline import Recorder, likely_cause

    rec = Recorder()
    try:
        plan.execute(schedule, plan.run.spec.impl, cots, recorder=rec)
    except RuntimeError as e:  # e.g. saved-tensor hooks disabled by an enclosing context
        plan.run.notes.append(f"timeline recorder unavailable: {str(e)[:160]}")
        return None, ()
    return likely_cause(rec.events), tuple(rec.events)


def _tb(exc: BaseException) -> str:
    from equiv.checks.core import _format_tb

    return _format_tb(exc)
