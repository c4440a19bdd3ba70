"""Extra cost of the custom-Function checks (mark-dirty, needs-input-grad, double-backward,
opcheck): check() with them ÷ check() without them, on the same examples, and the extra time per
example.

    python bench/functions.py [--examples N] [--repeats R]
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import hypothesis
import hypothesis.strategies as st
import torch

import equiv
from equiv import equivalent_to
from equiv._settings import ALL_CHECKS
from equiv.strategies import tensors

FUNCTION_CHECKS = ("mark-dirty", "needs-input-grad", "double-backward", "opcheck")


class Mul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g * b, g * a


class Exp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


class ScaledTanh(torch.autograd.Function):
    """``2 * tanh(x)``, saving its output: the gradient is ``g * (2 - y * y / 2)``."""

    @staticmethod
    def forward(ctx, x):
        y = 2.0 * torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * (2.0 - 0.5 * y * y)


def scaled_tanh_ref(x):
    return 2.0 * torch.tanh(x)


@torch.library.custom_op("equiv_bench::softplus", mutates_args=())
def softplus_op(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.softplus(x)


@softplus_op.register_fake
def _(x):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _backward(ctx, g):
    (x,) = ctx.saved_tensors
    return g * torch.sigmoid(x)


softplus_op.register_autograd(_backward, setup_context=_setup)


def t(shape, salt=0):
    return tensors(shape=shape, dtype=torch.float32, requires_grad=True, salt=salt)


@functools.cache
def cases():
    """(label, decorated implementation) pairs, built once per process (spec names are unique)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    import seed_attention  # noqa: E402

    return [
        ("Mul (2 inputs)", equivalent_to(lambda a, b: a * b, name="bench.mul",
                                         inputs=st.tuples(t((64, 64)), t((64, 64), 1)))(Mul)),
        ("Exp (1 input)", equivalent_to(torch.exp, name="bench.exp",
                                        inputs=st.tuples(t((64, 64))))(Exp)),
        ("ScaledTanh (saved output)", equivalent_to(scaled_tanh_ref, name="bench.scaled_tanh",
                                                    inputs=st.tuples(t((64, 64))))(ScaledTanh)),
        ("seed QKV, k in two slots", seed_attention.attention),
        ("custom op softplus", equivalent_to(torch.nn.functional.softplus, name="bench.softplus",
                                             inputs=st.tuples(t((64, 64))))(softplus_op)),
        ("plain torch (no Function)", equivalent_to(lambda a, b: a * b, name="bench.plain",
                                                    inputs=st.tuples(t((64, 64)), t((64, 64), 1)))(
            lambda a, b: a * b)),
    ]


def timed(impl, checks, n):
    cfg = equiv.settings(max_examples=n, seed=1, checks=checks,
                         hypothesis_settings=hypothesis.settings(database=None))
    start = time.perf_counter()
    report = equiv.check(impl, settings=cfg)
    return time.perf_counter() - start, report.examples_run


def bench(examples: int = 20, repeats: int = 3) -> None:
    """Print the with/without table: best of ``repeats`` runs of ``examples`` examples each."""
    without = tuple(c for c in ALL_CHECKS if c not in FUNCTION_CHECKS)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{examples} examples, best of {repeats}")
    print(f"{'case':28} {'without':>9} {'with':>9} {'ratio':>6} {'extra/example':>14}")
    for label, impl in cases():
        timed(impl, ALL_CHECKS, 2)  # warm-up (opcheck's first call, caches)
        base = min(timed(impl, without, examples)[0] for _ in range(repeats))
        full, runs = min(timed(impl, ALL_CHECKS, examples) for _ in range(repeats))
        print(f"{label:28} {base:8.3f}s {full:8.3f}s {full / base:6.2f} "
              f"{1000 * (full - base) / max(runs, 1):11.1f} ms")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--examples", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    bench(args.examples, args.repeats)


if __name__ == "__main__":
    main()
