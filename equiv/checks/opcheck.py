"""``opcheck``: once per spec, on the first valid example (any mode), ``torch.library.opcheck``
on every custom (non-aten) op the implementation calls, with the arguments it called it with
(recorded with a ``TorchFunctionMode``). opcheck compares an op only with itself; equiv compares
it with the reference."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from equiv._compat import op_schema, op_types
from equiv.errors import error_text
from equiv.examples import tensor_summary
from equiv.execution.calls import call
from equiv.execution.record import Execution, Sink

NAME = "opcheck"

#: id(spec) -> (weak reference to the spec, [(op name, result dict or exception)])
_OPCHECKED: dict[int, tuple[Any, list[tuple[str, Any, str]]]] = {}

_ALLOWED_NAMESPACES = {"aten", "prim", "prims", "debugprims", "_refs"}


class _OpRecorder(TorchFunctionMode):
    """Records the first call of each custom (non-aten) op with copies of its arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[Any, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        overload_t, packet_t = op_types()
        op = func.default if isinstance(func, packet_t) and hasattr(func, "default") else func
        if (isinstance(op, overload_t) and op.namespace not in _ALLOWED_NAMESPACES
                and op not in self.calls):
            self.calls[op] = _copy_args(args, kwargs)
        return func(*args, **kwargs)


def _copy_args(args: Any, kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Leaf copies of the tensors (requires_grad kept; one object stays one object)."""
    made: dict[int, torch.Tensor] = {}

    def cp(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if id(x) not in made:
                with torch.no_grad():
                    c = x.detach().clone()
                made[id(x)] = c.requires_grad_(x.requires_grad and c.is_floating_point())
            return made[id(x)]
        if isinstance(x, (list, tuple)):
            return type(x)(cp(v) for v in x)
        return x

    return tuple(cp(a) for a in args), {k: cp(v) for k, v in kwargs.items()}


def run(ex: Execution, sink: Sink) -> None:
    spec = ex.spec
    entry = _OPCHECKED.get(id(spec))
    if entry is None or entry[0]() is not spec:
        results = _run_opcheck(ex)
        if results is None:
            return
        _OPCHECKED[id(spec)] = (weakref.ref(spec), results)
        entry = _OPCHECKED[id(spec)]
    if entry[1]:
        sink.mark_compared(NAME)  # no custom op: nothing for opcheck to compare
    for op_name, outcome, example in entry[1]:
        _report_opcheck(sink, op_name, outcome, example)


def _run_opcheck(ex: Execution) -> list[tuple[str, Any, str]] | None:
    recorder = _OpRecorder()
    with recorder:  # as written (eager), whatever the mode
        _, exc = call(ex.spec.impl, ex.side())
    if exc is not None:  # the core checks report a failing call; retry on the next example
        return None
    results = []
    for op, (args, kwargs) in list(recorder.calls.items())[:8]:
        name = str(op_schema(op).name)
        example = _describe_call(name, args, kwargs)
        try:
            outcome: Any = torch.library.opcheck(op, args, kwargs, raise_exception=False)
        except Exception as e:  # opcheck itself could not run this op
            outcome = e
        results.append((name, outcome, example))
    return results


def _describe_call(name: str, args: Any, kwargs: Any) -> str:
    def show(x: Any) -> str:
        if isinstance(x, torch.Tensor):
            return tensor_summary(x)
        if isinstance(x, (list, tuple)):
            return "[" + ", ".join(show(v) for v in x) + "]"
        return repr(x)

    parts = [show(a) for a in args] + [f"{k}={show(v)}" for k, v in kwargs.items()]
    return f"{name}({', '.join(parts)})"


def _report_opcheck(sink: Sink, op_name: str, outcome: Any, example: str) -> None:
    if isinstance(outcome, BaseException):
        note = (f"opcheck could not run on custom op {op_name}: {type(outcome).__name__}: "
                f"{str(outcome)[:160]}")
        sink.note(note)
        return
    failed = {k: v for k, v in outcome.items() if isinstance(v, BaseException)}
    if not failed:
        passed = ", ".join(k for k, v in outcome.items() if v == "SUCCESS")
        note = (f"opcheck passed for custom op {op_name} ({passed}); it compares the op only with "
                "itself: equiv compared it with the reference")
        sink.note(note)
        return
    first_name, first = next(iter(failed.items()))
    lines = [f"{k}: {type(v).__name__}: {_first_line(v)}" for k, v in failed.items()]
    sink.finding(
        NAME,
        f"torch.library.opcheck failed for custom op {op_name}: {', '.join(failed)}.",
        argument=op_name,
        details="opcheck ran on the call " + example + "\n" + "\n".join(lines),
        fix=_opcheck_fix(first_name),
    )


def _first_line(e: BaseException) -> str:
    text = error_text(e).strip().splitlines()
    return text[0][:300] if text else ""


def _opcheck_fix(test: str) -> str:
    return {
        "test_schema": "declare every argument the op writes in mutates_args (and make the "
                       "schema's aliasing match what the kernel returns).",
        "test_autograd_registration": "register a backward with torch.library.register_autograd "
                                      "(or op.register_autograd).",
        "test_faketensor": "register a fake (meta) kernel with op.register_fake that returns "
                           "tensors of the right shape and dtype.",
    }.get(test, "see the opcheck message above; torch.compile relies on this test (register a "
                "fake kernel, keep the schema honest).")
