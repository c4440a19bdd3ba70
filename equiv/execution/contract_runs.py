"""More runs of the implementation for its contracts beyond the record's one call, through the
core (:class:`~equiv.execution.record.Execution`'s ``side()`` and ``call()``): the no-grad path
(:func:`no_grad_run`), a second call on other values (:func:`shuffled_call`), calls after its
arguments were updated in place (:func:`calls_across_updates`), each judged like the record
(:func:`judge_run`); memory (:func:`measure`, :func:`retained`); and whether both sides' errors
were expected (:func:`expected_error`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

import torch

from equiv import memory
from equiv._compat import tree_flatten
from equiv.compare import Mismatch, compare_leaf, compare_trees
from equiv.examples import Side
from equiv.execution.calls import cast_like, isolated, user_error
from equiv.execution.calls import leaves as leaves_of
from equiv.execution.record import Execution
from equiv.modes import normalise_error


@dataclasses.dataclass
class ContractRun:
    """One more call of the implementation: its side, result or error, and the versions of
    the side's tensors just before the call."""

    side: Side
    result: Any
    exc: BaseException | None
    versions: list[int]


def no_grad_run(ex: Execution, how: str) -> ContractRun:
    """The implementation on a fresh copy with no input requiring grad (``how="inputs"``),
    or under ``torch.no_grad()`` (``how="no_grad"``)."""
    side = ex.side(grad=how != "inputs")
    before = side.versions()
    try:
        with isolated():
            if how == "no_grad":
                with torch.no_grad():
                    result = side.call(ex.impl_fn)
            else:
                result = side.call(ex.impl_fn)
        return ContractRun(side, result, None, before)
    except BaseException as e:  # the user's code raised: evidence, never a crash of equiv
        if not user_error(e):
            raise
        return ContractRun(side, None, normalise_error(e), before)


def shuffled_call(ex: Execution) -> tuple[Side, Any, BaseException | None]:
    """The implementation on a fresh copy holding other values (every storage reversed),
    called while the record's outputs are alive: (side, result, error). Cached: one run
    serves every check that needs a second call on new values."""
    if "shuffled-call" not in ex.cache:
        side = ex.side(shuffled=True)
        ex.cache["shuffled-call"] = (side, *ex.call("impl", side))
    return ex.cache["shuffled-call"]


#: how training loops write new weights into the tensors they pass, in the order tried:
#: an optimizer step (``p.copy_(new)``, version bumped), a write through ``.data`` (EMA swaps,
#: weight reloads: same storage, version not bumped), a new tensor assigned to ``.data`` (new
#: storage, same tensor object; a view into a larger storage gets its values through
#: ``.data.copy_`` instead)
UPDATE_PATHS = ("copy_", ".data.copy_", ".data =")


@dataclasses.dataclass
class UpdatedCall:
    """A call of the implementation after its tensors were updated through ``how`` (one of
    :data:`UPDATE_PATHS`), and what it must give: ``expected`` outputs and ``finals`` of mutated
    arguments (``shuffled``: for the reversed values, from a call on fresh tensors; else the
    reference's for the example)."""

    how: str
    run: "ContractRun"
    expected: Any
    finals: dict[str, Any]
    shuffled: bool


def calls_across_updates(ex: Execution) -> Iterator[UpdatedCall]:
    """Call the implementation, then on the same tensors write other values through each
    of :data:`UPDATE_PATHS` in turn (under ``torch.no_grad()``; the values alternate
    between every storage reversed and the example's own) and call it again. Yields one
    :class:`UpdatedCall` per path, lazily (a caller that stops early saves the calls);
    nothing more once a call raises or an update cannot be written."""
    fresh, fresh_result, fresh_exc = shuffled_call(ex)  # what it gives on new tensors
    if fresh_exc is not None:
        return
    side = ex.side()
    _, exc = ex.call("impl", side)
    if exc is not None:
        return
    for k, how in enumerate(UPDATE_PATHS):
        shuffled = k % 2 == 0
        # the new values are only read, except by ``.data =``, which hands the side their
        # storage: the example's own values come as read-only views where they can
        copied = None if how == ".data =" else ()
        try:
            _update(side, ex.side(shuffled=shuffled, grad=False, fresh=copied), how)
        except RuntimeError:  # an expanded (self-overlapping) argument cannot be written
            return
        before = side.versions()
        result, exc = ex.call("impl", side)
        if exc is not None:
            return
        if shuffled:
            expected = fresh_result
            finals = {a: fresh.argument(a) for a in ex.spec.mutates}
        else:
            expected, finals = ex.expected, ex.finals
        yield UpdatedCall(how, ContractRun(side, result, None, before), expected, finals,
                          shuffled)


def _update(side: Side, new: Side, how: str) -> None:
    """Write ``new``'s values into ``side``'s tensors the way ``how`` (one of
    :data:`UPDATE_PATHS`) does."""
    template = side.template
    with torch.no_grad():
        for g in template.groups:
            if how == ".data =" and g.simple:  # every slot of a simple group is one tensor
                side.tensors[g.slots[0]].data = new.tensors[g.slots[0]].detach()
                continue
            for j in g.slots:
                t, v = side.tensors[j], new.tensors[j]
                (t.copy_ if how == "copy_" else t.data.copy_)(v)


def judge_run(ex: Execution, run: ContractRun, expected: Any, finals: dict[str, Any], *,
              shuffled: bool = False) -> list[tuple[str, Mismatch]]:
    """(what, mismatch) for each returned output of ``run`` that differs from ``expected`` and
    each argument that does not hold what it must after the call: ``finals`` for mutated
    arguments, the example's values (``shuffled``: the reversed ones) for the others."""
    template = ex.template
    out: list[tuple[str, Mismatch]] = []
    if not (run.result is None and ex.consumed):
        out += [("output", m) for m in _judge_outputs(ex, run.result, expected, shuffled)]
    written = {slot.group for slot in template.slots if slot.path.split("[")[0] in finals}
    target = template.instantiate(grad=False, device=ex.device, shuffled=shuffled, fresh=written)
    with torch.no_grad():
        for arg, final in finals.items():
            for t, f in zip(tree_flatten(target.argument(arg))[0], tree_flatten(final)[0]):
                if isinstance(t, torch.Tensor) and isinstance(f, torch.Tensor):
                    try:
                        t.copy_(f.detach().to(device=t.device, dtype=t.dtype))
                    except RuntimeError:  # an expanded argument: not comparable here
                        pass
    after = run.side.versions()
    for j, slot in enumerate(template.slots):
        mutated = template.groups[slot.group].mutated
        actual, want = run.side.tensors[j].detach(), target.tensors[j]
        if mutated:  # the record's verdict (the float64 oracle holds the example's own values)
            m = ex.oracle.judge(slot.path, actual, want,
                                oracle=None if shuffled else (lambda j=j: ex.oracle.state(j)))
        else:
            m = compare_leaf(actual, want, rtol=0, atol=0, path=slot.path, exact=True)
        if m is not None:
            out.append(("final value of mutated argument" if mutated else
                        "undeclared write to argument", m))
        elif not mutated and after[j] != run.versions[j]:
            out.append(("undeclared write to argument", Mismatch(
                slot.path, f"version counter {run.versions[j]} -> {after[j]}")))
    return out


def _judge_outputs(ex: Execution, result: Any, expected: Any, shuffled: bool) -> list[Mismatch]:
    """Each returned leaf of another run judged like the forward check judges the record's (the
    oracle only where the run saw the example's own values)."""
    expected = cast_like(expected, result)
    actual, wanted = leaves_of(result), leaves_of(expected)
    if [p for p, _ in actual] != [p for p, _ in wanted]:
        return compare_trees(result, expected, rtol=ex.spec.rtol, atol=ex.spec.atol)
    out = []
    for (p, a), (_, e) in zip(actual, wanted):
        name = f"output{p}"
        if not (isinstance(a, torch.Tensor) and isinstance(e, torch.Tensor)):
            out += compare_trees(a, e, rtol=ex.spec.rtol, atol=ex.spec.atol, root=name)
            continue
        m = ex.oracle.judge(name, a, e, oracle=None if shuffled else (lambda n=name: ex.oracle.value(n)))
        if m is not None:
            out.append(m)
    return out


def measure(ex: Execution, which: str) -> Any:
    """Peak and retained bytes of one side over forward + backward on a fresh copy
    (:func:`equiv.memory.measure`), or None when it raised."""
    fn = ex.spec.impl if which == "impl" else ex.spec.ref
    device = None if ex.device == "cpu" else ex.device
    return memory.measure(fn, ex.template.instantiate(device=device), ex.cot_seed)


def retained(ex: Execution, which: str) -> Any:
    """Bytes one side's forward graph keeps alive on a fresh copy, without the peak tracker
    (:func:`equiv.memory.retained`), or None when it raised."""
    fn = ex.spec.impl if which == "impl" else ex.spec.ref
    return memory.retained(fn, ex.side())


def expected_error(ex: Execution) -> bool:
    """Both sides raised, on an ``error_inputs=`` example or with the declared ``raises=``
    error (then the example is a checked pass, not invalid input)."""
    r, i, spec = ex.ref_exc, ex.impl_exc, ex.spec
    if r is None or i is None:
        return False
    if ex.error_input:
        return True
    return spec.raises is not None and isinstance(r, spec.raises) and isinstance(
        i, spec.raises)
