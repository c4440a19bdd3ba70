"""Scripted runs through the core: a schedule's steps (forward, in-place writes, backward,
optimizer steps) on a fresh copy of the example, with or without the timeline recorder, and the
replay of the core's gradient run that explains a diverging backward.

Decisions are made on runs WITHOUT recording hooks (they would switch autograd's version check
off); a diverging run is then replayed under the :class:`~equiv.timeline.Recorder`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from equiv._explain import explaining
from equiv._schedule import Schedule
from equiv.errors import InvalidArgument
from equiv.examples import Side, Template
from equiv.execution.calls import call, cotangent, isolated, user_error, vjp
from equiv.execution.calls import leaves as leaves_of
from equiv.execution.pairing import pair, split
from equiv.execution.record import Execution, Sink
from equiv.timeline import Recorder, likely_cause

_LR = 0.5


@dataclasses.dataclass
class ScriptResult:
    grads: list[list[torch.Tensor]]  # one list per backward, one tensor per gradient leaf
    error: BaseException | None = None
    failed_step: str | None = None
    forward_error: BaseException | None = None


class Script:
    """Scripted runs of one example (a :class:`~equiv.Schedule`'s steps), eagerly, on fresh
    copies: the reference's differentiated pairs, its leaves and gradients, cotangents."""

    def __init__(self, ex: Execution) -> None:
        self.ex = ex
        template = ex.template
        self.template: Template = template
        spec = self.spec = ex.spec
        self.device = None if ex.device == "cpu" else ex.device
        # the reference runs where the mode places it (e.g. float64 on CPU)
        self.ref_place = dict(device=ex.place.ref_device or self.device, dtype=ex.place.ref_dtype)
        self._ref_cache: dict[str, Any] = {}
        if ex.place.kind == "eager" and ex.ref_exc is None and ex.ref_side is not None:
            # the core's reference run: same placement, its graph retained by every VJP
            self.ref_side, ref_out, err = ex.ref_side, ex.ref_result, None
        else:
            self.ref_side = template.instantiate(**self.ref_place)
            ref_out, err = call(spec.ref, self.ref_side)
        self.ok = err is None
        if not self.ok:
            return
        self.ref_out = ref_out
        _, self.finals, self.consumed = split(spec, ref_out)
        self.pairs = pair(template, self.ref_side, ref_out, self.ref_side, ref_out, self.finals,
                          self.consumed).pairs
        if self.consumed:  # the result IS the mutated arguments' final values: use those only
            self.pairs = [p for p in self.pairs if not p[0].startswith("output")]
        self.groups = [g for g in template.groups if self.ref_side.leaves[g.index] is not None]
        self.names = [template.group_name(g) for g in self.groups]
        self.ok = bool(self.pairs and self.groups)

    def cotangents(self, count: int) -> list[list[torch.Tensor]]:
        """The first ``count`` cotangents of this example's schedules (one seeded sequence:
        every schedule's backward #j gets the same values)."""
        cots = self._ref_cache.setdefault("cotangents", [])
        if len(cots) < count:
            gen = self._ref_cache.setdefault(
                "generator", torch.Generator().manual_seed(self.ex.cot_seed + 7919))
            cots += [[cotangent(r, gen) for _, _, r in self.pairs]
                     for _ in range(count - len(cots))]
        return cots[:count]

    def reference_grads(self, cots: list[list[torch.Tensor]],
                        schedule: Schedule | None = None) -> list[list[torch.Tensor]] | None:
        """The reference's gradients for each backward (through the forward it names); the
        VJP of one cotangent through one forward is taken once per example."""
        through = backward_forwards(schedule) if schedule is not None else [1] * len(cots)
        grads_of = self._ref_cache.setdefault("vjps", {})
        result = []
        for c, k in zip(cots, through):
            key = (k, id(c))
            if key not in grads_of:
                ref = self._ref_forward(k)
                grads, err = (None, None) if ref is None else vjp(ref[0], ref[1], c)
                grads_of[key] = None if ref is None or err is not None else (grads, c)
            if grads_of[key] is None:
                return None
            result.append(grads_of[key][0])
        self._ref_cache.pop("even", None)  # its VJPs are taken: the run is made again if asked
        return result

    def _ref_forward(self, k: int) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """The reference's differentiated outputs and leaves for forward #``k`` (odd: the
        example's values, even: every storage reversed)."""
        if k % 2:
            return ([r for _, _, r in self.pairs],
                    [self.ref_side.leaves[g.index] for g in self.groups])
        if "even" not in self._ref_cache:
            side = self.template.instantiate(shuffled=True, **self.ref_place)
            out, err = call(self.spec.ref, side)
            outs = None if err is not None else self._outputs(side, out, is_ref=True)
            self._ref_cache["even"] = None if outs is None else (
                outs, [side.leaves[g.index] for g in self.groups])
        return self._ref_cache["even"]

    def execute(self, schedule: Schedule, fn: Any, cots: list[list[torch.Tensor]],
                recorder: Recorder | None = None) -> ScriptResult:
        """Run ``schedule`` on a fresh copy of the example; never raises the user's errors.

        Under a ``recorder`` the run ends with a ``release`` phase: the graph, the outputs and
        then the arguments are dropped, so the timeline shows when each storage is freed."""
        # an optimizer step writes the leaves: they must not view the example's values
        def fresh() -> Side:
            return self.template.instantiate(device=self.device,
                                             leaves_written="step" in schedule.steps)

        result = ScriptResult([])
        if recorder is None:  # the steps make and hold the side: released after its last read
            with isolated():  # global torch state the user's code sets is restored
                self._steps(schedule, fn, fresh, cots, result, None)
            return result
        side = fresh()
        leaves = [side.leaves[g.index] for g in self.groups]
        self._name_arguments(recorder, side, leaves)
        with recorder:
            with isolated():
                self._steps(schedule, fn, lambda: side, cots, result, recorder)
            # the steps' frame is gone, so the graph and outputs are freed; now the arguments
            # (no gc.collect(): a full collection costs ~0.3 s; storages kept only by reference
            # cycles, e.g. a ctx attribute holding an output, are simply not shown released)
            del side, leaves
        return result

    def _name_arguments(self, recorder: Recorder, side: Side,
                        leaves: list[torch.Tensor]) -> None:
        for slot, t in zip(self.template.slots, side.tensors):
            recorder.name(t, slot.path)
        for name, leaf in zip(self.names, leaves):
            recorder.name(leaf, name)

    def _steps(self, schedule: Schedule, fn: Any, first: Callable[[], Side],
               cots: list[list[torch.Tensor]], result: ScriptResult,
               recorder: Recorder | None) -> None:
        """``schedule``'s steps from its first forward on the side ``first()`` makes; without a
        recorder, each forward's side and graph are released after the last step that reads
        them (the side is made here, not passed: an argument stays referenced by the caller
        while a call runs when an eval-frame hook such as Dynamo's is installed)."""
        try:
            forwards: list[Any] = []
            side = first()
            leaves = [side.leaves[g.index] for g in self.groups]
            if not self._forward(fn, side, leaves, forwards, result, recorder):
                return
            del side, leaves  # held by ``forwards`` until the last step that reads them
            n_back = 0
            last = {} if recorder is not None else last_reads(schedule)
            for i, step in enumerate(schedule.steps[1:], 1):
                side, leaves, outs = forwards[-1]
                try:
                    if step == "forward":
                        new = self.template.instantiate(device=self.device,
                                                        shuffled=len(forwards) % 2 == 1,
                                                        leaves_written="step" in schedule.steps)
                        new_leaves = [new.leaves[g.index] for g in self.groups]
                        if not self._forward(fn, new, new_leaves, forwards, result, recorder):
                            return
                    elif step.startswith("write"):
                        if recorder is not None:
                            recorder.phase("after forward")
                        self._write(step[6:], side, outs)
                    elif step.startswith("backward"):
                        if step != "backward":
                            _, leaves, outs = forwards[int(step[9:]) - 1]
                        if recorder is not None:
                            recorder.phase(f"backward #{n_back + 1}")
                        given = [c.to(dtype=o.dtype, device=o.device, copy=True)
                                 for c, o in zip(cots[n_back], outs)]
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
                except BaseException as e:  # the user's code raised: that is the outcome
                    if not user_error(e):
                        raise
                    result.error, result.failed_step = e, step
                    return
                for j, at in last.items():  # a forward no later step reads: its side and
                    if at == i and j < len(forwards):  # graph are released
                        forwards[j - 1] = (None, None, None)
        finally:
            if recorder is not None:
                recorder.phase("release")

    def _forward(self, fn: Any, side: Side, leaves: list[torch.Tensor],
                 forwards: list[Any], result: ScriptResult, recorder: Recorder | None) -> bool:
        """One forward of a schedule, appended to ``forwards``; False when it raised."""
        out, err = call(fn, side)
        if err is not None:
            result.forward_error = err
            return False
        outs = self._outputs(side, out, is_ref=fn is self.spec.ref)
        if outs is None:
            result.forward_error = RuntimeError("outputs do not match the reference's")
            return False
        if recorder is not None:
            n = f" (forward #{len(forwards) + 1})" if forwards else ""
            for (name, _, _), o in zip(self.pairs, outs):
                recorder.name(o, name + n)
            recorder.after_forward(outs)
        forwards.append((side, leaves, outs))
        return True

    def _outputs(self, side: Side, out: Any, *, is_ref: bool
                 ) -> list[torch.Tensor] | None:
        """The differentiated tensors, in the order of ``self.pairs``: returned outputs and
        final values of mutated arguments (for the pure reference: where its result holds them)."""
        if self.consumed:
            tree: list[tuple[str, Any]] = []
        else:
            tree = [(f"output{p}", v) for p, v in leaves_of(out)]
        finals = split(self.spec, out)[1] if is_ref else {a: side.argument(a) for a in self.finals}
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

    def _write(self, target: str, side: Side, outs: list[torch.Tensor]) -> None:
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
        params = set(self.spec.parameters)
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


def last_reads(schedule: Schedule) -> dict[int, int]:
    """For each (1-based) forward of ``schedule``, the index of the last step that reads it
    (its own step, a write, a step or a backward while it is the latest forward, a numbered
    backward through it)."""
    out: dict[int, int] = {}
    forwards = 0
    for i, step in enumerate(schedule.steps):
        if step == "forward":
            forwards += 1
            out[forwards] = i
        elif step.startswith("backward "):
            out[int(step[9:])] = i
        elif forwards:
            out[forwards] = i
    return out


def backward_forwards(schedule: Schedule) -> list[int]:
    """For each backward step of ``schedule``, the (1-based) forward it goes through."""
    out, forwards = [], 0
    for step in schedule.steps:
        forwards += step == "forward"
        if step == "backward":
            out.append(forwards)
        elif step.startswith("backward "):
            out.append(int(step[9:]))
    return out


def replay(ex: Execution, schedule: Schedule, fn: Any, cots: list[list[torch.Tensor]],
           sink: Sink, script: Script | None = None) -> tuple[str | None, tuple[dict, ...]]:
    """Replay ``schedule`` on ``fn`` under the recorder: (likely cause, timeline events)."""
    script = script or Script(ex)
    rec = Recorder()
    try:
        script.execute(schedule, fn, cots, recorder=rec)
    except RuntimeError as e:  # e.g. saved-tensor hooks disabled by an enclosing context
        sink.note(f"timeline recorder unavailable: {str(e)[:160]}")
        return None, ()
    return likely_cause(rec.events), tuple(rec.events)


def explain_backwards(ex: Execution, sink: Sink, first: int) -> None:
    """Replay the core's gradient run as far as it went (forward, backward #1, #2 with a second
    cotangent, #3 with the first again) on the implementation under the recorder, once per
    example and number of backwards, and attach the timeline and likely cause to
    ``sink.findings[first:]``. Only for a failure that is explained
    (:func:`equiv._explain.explaining`)."""
    if not explaining():
        return
    count = max(1, min(ex.backwards_run, 3))
    key = f"backward-replay-{count}"
    if key not in ex.cache:
        ex.cache[key] = _replay_backwards(ex, sink, count)
    explained = ex.cache[key]
    if explained is None:
        return
    cause, events = explained
    for i in range(first, len(sink.findings)):
        f = sink.findings[i]
        sink.findings[i] = dataclasses.replace(f, timeline=events,
                                               likely_cause=cause or f.likely_cause)


def _replay_backwards(ex: Execution, sink: Sink,
                      count: int) -> tuple[str | None, tuple[dict, ...]] | None:
    script = Script(ex)
    if not script.ok:
        return None
    gen = torch.Generator().manual_seed(ex.cot_seed)
    cot1 = [cotangent(r, gen) for _, _, r in script.pairs]
    cot2 = [cotangent(r, gen) for _, _, r in script.pairs]
    steps = ("forward",) + ("backward",) * count
    cause, events = replay(ex, Schedule(steps), ex.spec.impl, [cot1, cot2, cot1][:count], sink,
                           script)
    if not events and cause is None:
        return None
    return cause, events
