"""equiv versus torch.autograd.gradcheck and torch.library.opcheck on a suite of known bugs:
which tool catches which bug, and the time per verdict.

    python bench/versus.py
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable

import hypothesis
import hypothesis.strategies as st
import torch

import equiv
from equiv import equivalent_to
from equiv.strategies import tensors

torch.library.define("equiv_bench::sin_wrong", "(Tensor x) -> Tensor")
torch.library.define("equiv_bench::relu_pos", "(Tensor(a!) x) -> Tensor")
torch.library.define("equiv_bench::relu_pos_undeclared", "(Tensor x) -> Tensor")


@torch.library.impl("equiv_bench::sin_wrong", "cpu")
def _sin_wrong(x):
    return x.sin()


@torch.library.register_fake("equiv_bench::sin_wrong")
def _sin_wrong_fake(x):
    return torch.empty_like(x)


def _sin_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _sin_backward(ctx, g):
    (x,) = ctx.saved_tensors
    return g * x.sin()  # should be cos


torch.library.register_autograd("equiv_bench::sin_wrong", _sin_backward, setup_context=_sin_setup)


@torch.library.impl("equiv_bench::relu_pos_undeclared", "cpu")
def _relu_pos(x):
    x.relu_()  # undeclared in the schema: a no-op on positive input
    return x * 1.0


@torch.library.register_fake("equiv_bench::relu_pos_undeclared")
def _relu_pos_fake(x):
    return torch.empty_like(x)


class _SinWrong(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.sin()


class _GradOutWriter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 3

    @staticmethod
    def backward(ctx, g):
        return g.mul_(3)


_WORKSPACE: dict = {}


def bug_wrong_backward(x):
    return _SinWrong.apply(x)


def bug_undeclared_write(x):
    x.detach().relu_()
    return x * 1.0


def bug_stale_data(x):
    w = x * 1
    y = w * w
    w.data.add_(0.5)
    return y


def bug_alias_fast_path(x):
    return x if bool((x > 0).all()) else x.clamp(min=0)


def bug_grad_output_write(x):
    return _GradOutWriter.apply(x)


def bug_workspace(x):
    buf = _WORKSPACE.setdefault(tuple(x.shape), torch.empty_like(x))
    with torch.no_grad():
        torch.mul(x, 2, out=buf)
    return buf


BUGS: list[tuple[str, Callable, Callable, Any]] = [
    ("wrong backward formula", bug_wrong_backward, torch.sin, "equiv_bench::sin_wrong"),
    ("undeclared in-place write (values unchanged)", bug_undeclared_write,
     lambda x: x * 1.0, "equiv_bench::relu_pos_undeclared"),
    ("stale saved value (.data write)", bug_stale_data, lambda x: x * x, None),
    ("output aliases input (fast path)", bug_alias_fast_path, lambda x: x.clamp(min=0), None),
    ("backward writes grad_output", bug_grad_output_write, lambda x: x * 3, None),
    ("reused output workspace", bug_workspace, lambda x: x * 2, None),
]


def _positive(shape):
    return tensors(shape=shape, dtype=torch.float64, requires_grad=True).map(
        lambda t: (t.detach().abs() + 0.1).requires_grad_())


def run_equiv(impl, ref, shape) -> tuple[bool, float]:
    equivalent_to(ref, inputs=st.tuples(_positive(shape)), name=f"versus.{impl.__name__}")(impl)
    cfg = equiv.settings(max_examples=30, seed=0,
                         hypothesis_settings=hypothesis.settings(database=None))
    start = time.perf_counter()
    report = equiv.check(impl, settings=cfg, raise_on_failure=False)
    return (not report.ok), time.perf_counter() - start


def run_gradcheck(impl, shape, fast: bool) -> tuple[bool, float]:
    x = (torch.rand(shape, dtype=torch.float64) + 0.1).requires_grad_()
    start = time.perf_counter()
    try:
        ok = torch.autograd.gradcheck(impl, (x,), fast_mode=fast, raise_exception=False)
    except Exception:  # a crash counts as a catch
        ok = False
    return (not ok), time.perf_counter() - start


def run_opcheck(opname, shape) -> tuple[bool, float] | None:
    if opname is None:
        return None
    op = getattr(torch.ops.equiv_bench, opname.split("::")[1]).default
    x = (torch.rand(shape, dtype=torch.float64) + 0.1).requires_grad_(opname.endswith("wrong"))
    start = time.perf_counter()
    try:
        result = torch.library.opcheck(op, (x,), raise_exception=False)
        caught = any(v != "SUCCESS" for v in result.values())
    except Exception:
        caught = True
    return caught, time.perf_counter() - start


def bench(bugs: int | None = None) -> str:
    """The equiv / gradcheck / opcheck detection table (markdown), on the first ``bugs`` bugs
    (all by default)."""
    shape = (4, 4)
    rows = ["| bug | equiv | gradcheck (slow) | gradcheck (fast) | opcheck |",
            "| --- | --- | --- | --- | --- |"]
    fmt = lambda r: "n/a" if r is None else f"{'caught' if r[0] else 'missed'} ({r[1] * 1e3:.0f} ms)"
    run_equiv(bug_wrong_backward, torch.sin, (2,))  # warm-up
    for label, impl, ref, opname in BUGS[:bugs]:
        _WORKSPACE.clear()
        e = run_equiv(impl, ref, shape)
        _WORKSPACE.clear()
        gs = run_gradcheck(impl, shape, fast=False)
        _WORKSPACE.clear()
        gf = run_gradcheck(impl, shape, fast=True)
        oc = run_opcheck(opname, shape)
        rows.append(f"| {label} | {fmt(e)} | {fmt(gs)} | {fmt(gf)} | {fmt(oc)} |")
    table = "\n".join(rows)
    print(table)
    return table


def main(argv=None) -> str:
    argparse.ArgumentParser(description=__doc__).parse_args(argv)
    return bench()


if __name__ == "__main__":
    main()
