"""Overhead of equiv's check(): its wall time ÷ just executing impl and ref (forward + 2
backwards each) on the same number of examples, for small and medium tensors.

    python bench/overhead.py [--examples N] [--sizes 1000,1000000]
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


def relu_ref(x):
    return torch.relu(x)


def relu_(x):
    return x.clamp_(min=0)


def rms_ref(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def rms_fused(x, w):
    return torch.rms_norm(x, (x.shape[-1],), w, 1e-6)


CASES = [
    ("relu_ (in place)", relu_, relu_ref, {"x": "out"}, 1),
    ("rms_norm", rms_fused, rms_ref, None, 2),
]


def _shape(numel: int) -> tuple[int, int]:
    cols = 1000 if numel >= 10_000 else 10
    return (max(numel // cols, 1), cols)


def raw_time(impl, ref, mutated: bool, arity: int, shape, n: int) -> float:
    """impl and ref forward + 2 backwards each (retain_graph), on n fresh examples."""
    g = torch.Generator().manual_seed(0)
    examples = [[torch.randn(shape if i == 0 else shape[-1:], generator=g)
                 for i in range(arity)] for _ in range(n)]
    start = time.perf_counter()
    for ex in examples:
        for fn in (impl, ref):
            leaves = [t.clone().requires_grad_() for t in ex]
            args = [leaves[0].clone() if (mutated and fn is impl) else leaves[0], *leaves[1:]]
            out = fn(*args)
            cot = torch.randn_like(out)
            torch.autograd.grad(out, leaves, cot, retain_graph=True)
            torch.autograd.grad(out, leaves, cot)
    return time.perf_counter() - start


def check_time(impl, ref, mutates, arity: int, shape, n: int) -> tuple[float, int]:
    inputs = st.tuples(*[tensors(shape=shape if i == 0 else shape[-1:], dtype=torch.float32,
                                 requires_grad=True, salt=i) for i in range(arity)])
    fn = equivalent_to(ref, mutates=mutates, inputs=inputs, name=f"bench.{impl.__name__}")(impl)
    cfg = equiv.settings(max_examples=n, seed=0,
                         hypothesis_settings=hypothesis.settings(database=None))
    start = time.perf_counter()
    report = equiv.check(fn, settings=cfg)
    return time.perf_counter() - start, report.examples_run


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--examples", type=int, default=20)
    p.add_argument("--sizes", default="1000,1000000")
    args = p.parse_args(argv)
    check_time(relu_, relu_ref, {"x": "out"}, 1, (4, 4), 3)  # warm-up: imports, first calls
    rows = ["| case | elements | examples | check() s | raw s | overhead ratio |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for numel in [int(s) for s in args.sizes.split(",")]:
        shape = _shape(numel)
        for label, impl, ref, mutates, arity in CASES:
            n_examples = args.examples if numel < 100_000 else max(args.examples // 4, 3)
            t_check, ran = check_time(impl, ref, mutates, arity, shape, n_examples)
            t_raw = raw_time(impl, ref, bool(mutates), arity, shape, ran)
            rows.append(f"| {label} | {shape[0] * shape[1]:,} | {ran} | {t_check:.3f} | "
                        f"{t_raw:.3f} | {t_check / t_raw:.1f}x |")
    table = "\n".join(rows)
    print(table)
    return table


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
