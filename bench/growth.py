"""How equiv's cost grows: with tensor size (1e2 -> 1e7 elements) and with the number of
arguments, beside the function's own cost and finite-difference gradcheck.

equiv's gradient check is one vector-Jacobian product per cotangent, so its time should track
the function's own time; gradcheck's slow mode builds the Jacobian column by column.

    python bench/growth.py [--max-numel 10000000]
"""

from __future__ import annotations

import argparse
import time

import hypothesis
import hypothesis.strategies as st
import torch

import equiv
from equiv import equivalent_to
from equiv.strategies import tensors


def ref(x, w):
    return torch.tanh(x) * w


def impl(x, w):
    return torch.tanh(x).mul(w)


def _check(fn, inputs, n=3) -> float:
    cfg = equiv.settings(max_examples=n, seed=0,
                         hypothesis_settings=hypothesis.settings(database=None))
    start = time.perf_counter()
    report = equiv.check(fn, settings=cfg)
    return (time.perf_counter() - start) / max(report.examples_run, 1)


def _raw(shape) -> float:
    x = torch.randn(shape, requires_grad=True)
    w = torch.randn(shape, requires_grad=True)
    start = time.perf_counter()
    for f in (impl, ref):
        out = f(x, w)
        c = torch.randn_like(out)
        torch.autograd.grad(out, (x, w), c, retain_graph=True)
        torch.autograd.grad(out, (x, w), c)
    return time.perf_counter() - start


def _peak_bytes(fn) -> int:
    """Peak bytes of tensor storages allocated while ``fn`` runs (equiv's storage tracker)."""
    from equiv.memory import _StorageTracker

    tracker = _StorageTracker()
    with tracker:
        fn()
    tracker.close()
    return tracker.peak


def size_table(max_numel: int) -> str:
    rows = ["| elements | check() per example ms | impl+ref fwd+2 bwd ms | ratio | check() peak MiB | raw peak MiB | gradcheck fast ms | gradcheck slow ms |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    numel = 100
    while numel <= max_numel:
        shape = (numel,)
        inputs = st.tuples(tensors(shape=shape, requires_grad=True),
                           tensors(shape=shape, requires_grad=True, salt=1))
        fn = equivalent_to(ref, inputs=inputs, name=f"growth.{numel}")(
            type(impl)(impl.__code__, impl.__globals__, f"impl_{numel}"))
        t_check = _check(fn, inputs)
        t_raw = _raw(shape)
        mib = 1024 * 1024
        peak_check = _peak_bytes(lambda: _check(fn, inputs, n=1)) / mib
        peak_raw = _peak_bytes(lambda: _raw(shape)) / mib
        gc_fast = gc_slow = "-"
        if numel <= 10_000:
            x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
            w = torch.randn(shape, dtype=torch.float64, requires_grad=True)
            s = time.perf_counter()
            torch.autograd.gradcheck(impl, (x, w), fast_mode=True)
            gc_fast = f"{(time.perf_counter() - s) * 1e3:.1f}"
            if numel <= 1000:
                s = time.perf_counter()
                torch.autograd.gradcheck(impl, (x, w), fast_mode=False)
                gc_slow = f"{(time.perf_counter() - s) * 1e3:.1f}"
        rows.append(f"| {numel:,} | {t_check * 1e3:.1f} | {t_raw * 1e3:.1f} | "
                    f"{t_check / t_raw:.1f}x | {peak_check:.1f} | {peak_raw:.1f} | "
                    f"{gc_fast} | {gc_slow} |")
        numel *= 10
    return "\n".join(rows)


def arity_table(max_args: int = 8) -> str:
    rows = ["| arguments | check() per example ms |", "| ---: | ---: |"]
    for k in (1, 2, 4, max_args):
        names = [f"a{i}" for i in range(k)]
        src = f"def f({', '.join(names)}):\n    return {' * '.join(names)}\n"
        ns: dict = {}
        exec(src, ns)
        exec(src.replace("def f", "def g"), ns)
        inputs = st.tuples(*[tensors(shape=(64, 64), requires_grad=True, salt=i)
                             for i in range(k)])
        fn = equivalent_to(ns["g"], inputs=inputs, name=f"arity.{k}")(ns["f"])
        rows.append(f"| {k} | {_check(fn, inputs) * 1e3:.1f} |")
    return "\n".join(rows)


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--max-numel", type=int, default=10_000_000)
    args = p.parse_args(argv)
    _check(equivalent_to(ref, name="growth.warmup")(
        type(impl)(impl.__code__, impl.__globals__, "impl_warm")), None)
    out = "### By size\n\n" + size_table(args.max_numel) + "\n\n### By number of arguments\n\n" \
        + arity_table()
    print(out)
    return out


if __name__ == "__main__":
    main()
