"""Benchmark of equiv.strategies: generation cost per example, and torch.compile recompilations
over 100 examples with compile-friendly shapes versus the default ones.

Run: python bench/strategies_bench.py [--examples 100]
"""

from __future__ import annotations

import argparse
import inspect
import time

import logging

import hypothesis
import torch
from hypothesis import given
from hypothesis import strategies as st

import equiv.strategies as es
from equiv.variants import DEFAULT_VARIANTS, with_variants

N = 100


def _settings(n: int) -> hypothesis.settings:
    return hypothesis.settings(max_examples=n, database=None, deadline=None, derandomize=True,
                               suppress_health_check=list(hypothesis.HealthCheck))


def per_example_ms(strategy: st.SearchStrategy, n: int = N) -> float:
    """Mean wall time per example of drawing from ``strategy`` (test body does nothing)."""
    calls = [0]

    @_settings(n)
    @given(strategy)
    def run(_):
        calls[0] += 1

    t = time.perf_counter()
    run()
    return (time.perf_counter() - t) * 1000 / max(calls[0], 1)


def generation(n: int = N) -> None:
    def f(x, y):
        pass

    sig = inspect.signature(f)
    cases = {
        "tensors(shape=(4,)) f32": es.tensors(shape=(4,)),
        "tensors(shape=(16,16)) f32": es.tensors(shape=(16, 16)),
        "tensors(shape=(64,64)) f32": es.tensors(shape=(64, 64)),
        "tensors(shape=(256,256)) f32": es.tensors(shape=(256, 256)),
        "tensors(shapes(), layouts(), dtypes())": es.tensors(layout=es.layouts(),
                                                             dtype=es.dtypes()),
        "tensors((16,16), special=True)": es.tensors(shape=(16, 16), special=True),
        "aliased_arguments(2)": es.aliased_arguments(2),
        "arguments_for(f(x, y))": es.arguments_for(sig),
        "arguments_for + runner variants": with_variants(es.arguments_for(sig), sig, (),
                                                         DEFAULT_VARIANTS),
    }
    print(f"Generation cost per example ({n} examples each, derandomized):")
    for name, strategy in cases.items():
        print(f"  {name:42s} {per_example_ms(strategy, n):7.2f} ms")


def compile_counts(n: int = N) -> None:
    from torch._dynamo.testing import CompileCounter, CompileCounterWithBackend

    def fn(x, y):
        return (x * y).sin() + x

    def count(backend_name: str, shape_strategy: st.SearchStrategy, dtype: torch.dtype,
              layout: object = None) -> int:
        torch._dynamo.reset()
        counter = (CompileCounter() if backend_name == "eager"
                   else CompileCounterWithBackend(backend_name))
        compiled = torch.compile(fn, backend=counter)

        @_settings(n)
        @given(shape_strategy.flatmap(lambda s: st.tuples(
            es.tensors(shape=s, dtype=dtype, requires_grad=backend_name == "aot_eager",
                       layout=layout),
            es.tensors(shape=s, dtype=dtype))))
        def run(xy):
            out = compiled(*xy)
            if out.requires_grad:
                out.sum().backward()

        run()
        return counter.frame_count

    print(f"\ntorch.compile frames compiled over {n} examples of fn(x, y) = (x*y).sin() + x "
          f"(torch {torch.__version__}; recompile_limit "
          f"{torch._dynamo.config.recompile_limit}):")
    cases = {
        "shapes(compile_friendly=True) [2-D, sides 2/4]":
            es.shapes(compile_friendly=True, max_dims=2),
        "shapes(compile_friendly=True, max_dims=3, max_side=16)":
            es.shapes(compile_friendly=True, max_dims=3, max_side=16),
        "shapes() default [0-3-D, sides 0-4]": es.shapes(),
    }
    for backend in ("eager", "aot_eager"):
        for name, strategy in cases.items():
            print(f"  {backend:9s} {name:55s} {count(backend, strategy, torch.float32):3d}")
        friendly = es.shapes(compile_friendly=True, max_dims=2)
        print(f"  {backend:9s} {'compile-friendly 2-D + layouts() on x':55s} "
              f"{count(backend, friendly, torch.float32, es.layouts()):3d}")


def bench(examples: int = N) -> None:
    """Print both tables, ``examples`` examples per row."""
    logging.getLogger("torch._dynamo").setLevel(logging.ERROR)  # the recompile-limit warning
    generation(examples)
    compile_counts(examples)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--examples", type=int, default=N)
    bench(p.parse_args(argv).examples)


if __name__ == "__main__":
    main()
