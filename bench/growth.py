"""How equiv's cost grows: with tensor size (1e2 -> 1e7 elements) and with the number of
arguments, beside the function's own cost and finite-difference gradcheck.

equiv's gradient check is one vector-Jacobian product per cotangent, so its time should track
the function's own time; gradcheck's slow mode builds the Jacobian column by column.

    python bench/growth.py [--max-numel 10000000] [--examples 3] [--rounds 5]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from pathlib import Path

import hypothesis
import hypothesis.strategies as st
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import equiv  # noqa: E402
from equiv import equivalent_to  # noqa: E402
from equiv.strategies import tensors  # noqa: E402
from overhead import draw_examples  # noqa: E402

_NAMES = itertools.count()


def ref(x, w):
    return torch.tanh(x) * w


def impl(x, w):
    return torch.tanh(x).mul(w)


def _check(fn, n=3) -> float:
    """check() wall time per example run."""
    cfg = equiv.settings(max_examples=n, seed=0, modes=("eager",),
                         hypothesis_settings=hypothesis.settings(database=None))
    start = time.perf_counter()
    report = equiv.check(fn, settings=cfg)
    return (time.perf_counter() - start) / max(report.examples_run, 1)


def _raw(examples) -> float:
    """impl and ref forward + 2 backwards each, per example, on the given examples."""
    start = time.perf_counter()
    for ex in examples:
        x, w = (t.clone().requires_grad_() for t in ex)
        for f in (impl, ref):
            out = f(x, w)
            c = torch.randn_like(out)
            torch.autograd.grad(out, (x, w), c, retain_graph=True)
            torch.autograd.grad(out, (x, w), c)
    return (time.perf_counter() - start) / max(len(examples), 1)


def interleaved(fn, examples, rounds: int) -> tuple[float, float, float]:
    """Medians of check() and raw per-example times over alternating rounds, and the median
    per-round ratio."""
    _check(fn, n=1)  # warm-up
    _raw(examples[:1])
    checks, raws = [], []
    for r in range(rounds):
        pair = (lambda: checks.append(_check(fn, len(examples))),
                lambda: raws.append(_raw(examples)))
        for step in (pair if r % 2 == 0 else pair[::-1]):
            step()
    ratio = statistics.median(c / w for c, w in zip(checks, raws))
    return statistics.median(checks), statistics.median(raws), ratio


def _peak_bytes(fn) -> int:
    """Peak bytes of tensor storages allocated while ``fn`` runs (equiv's storage tracker)."""
    from equiv.memory import _StorageTracker

    tracker = _StorageTracker()
    with tracker:
        fn()
    tracker.close()
    return tracker.peak


def size_table(max_numel: int, examples: int = 3, rounds: int = 5) -> str:
    rows = ["| elements | check() per example ms | impl+ref fwd+2 bwd ms | ratio | check() peak MiB | raw peak MiB | gradcheck fast ms | gradcheck slow ms |",
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    numel = 100
    while numel <= max_numel:
        shape = (numel,)
        inputs = st.tuples(tensors(shape=shape, requires_grad=True),
                           tensors(shape=shape, requires_grad=True, salt=1))
        fn = equivalent_to(ref, inputs=inputs, name=f"growth.{numel}.{next(_NAMES)}")(
            type(impl)(impl.__code__, impl.__globals__, f"impl_{numel}"))
        drawn = draw_examples(inputs, examples)
        t_check, t_raw, ratio = interleaved(fn, drawn, rounds)
        mib = 1024 * 1024
        peak_check = _peak_bytes(lambda: _check(fn, n=1)) / mib
        peak_raw = _peak_bytes(lambda: _raw(drawn[:1])) / mib
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
                    f"{ratio:.1f}x | {peak_check:.1f} | {peak_raw:.1f} | "
                    f"{gc_fast} | {gc_slow} |")
        numel *= 10
    return "\n".join(rows)


def arity_table(max_args: int = 8) -> str:
    rows = ["| arguments | check() per example ms |", "| ---: | ---: |"]
    for k in sorted({k for k in (1, 2, 4) if k < max_args} | {max_args}):
        names = [f"a{i}" for i in range(k)]
        src = f"def f({', '.join(names)}):\n    return {' * '.join(names)}\n"
        ns: dict = {}
        exec(src, ns)
        exec(src.replace("def f", "def g"), ns)
        inputs = st.tuples(*[tensors(shape=(64, 64), requires_grad=True, salt=i)
                             for i in range(k)])
        fn = equivalent_to(ns["g"], inputs=inputs, name=f"arity.{k}.{next(_NAMES)}")(ns["f"])
        rows.append(f"| {k} | {_check(fn) * 1e3:.1f} |")
    return "\n".join(rows)


def bench(max_numel: int = 10_000_000, examples: int = 3, rounds: int = 5,
          max_args: int = 8) -> str:
    """The by-size and by-arity tables (markdown)."""
    _check(equivalent_to(ref, name=f"growth.warmup.{next(_NAMES)}")(
        type(impl)(impl.__code__, impl.__globals__, "impl_warm")))
    out = (f"### By size\n\n{examples} examples, {rounds} interleaved rounds; ratio = median "
           f"over rounds of check() / raw\n\n" + size_table(max_numel, examples, rounds)
           + "\n\n### By number of arguments\n\n" + arity_table(max_args))
    print(out)
    return out


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--max-numel", type=int, default=10_000_000)
    p.add_argument("--examples", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args(argv)
    return bench(args.max_numel, args.examples, args.rounds)


if __name__ == "__main__":
    main()
