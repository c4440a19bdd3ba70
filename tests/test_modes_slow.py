"""Slow mode tests (run with -m slow): inductor, and compilation counts over 100 examples."""

from __future__ import annotations

import hypothesis
import pytest
import torch
from hypothesis import strategies as st

import equiv
from equiv import check, equivalent_to
from equiv.strategies import shapes, tensors

pytestmark = pytest.mark.slow

SETTINGS = equiv.settings(max_examples=4, seed=7, derandomize=True, modes=("eager",),
                          hypothesis_settings=hypothesis.settings(database=None))


def silu_ref(x):
    return x * torch.sigmoid(x)


_M = st.tuples(tensors(shape=shapes(min_dims=2, max_dims=2, min_side=2, max_side=6),
                       dtype=torch.float32, requires_grad=True))


def affine_ref(x):
    return x * 2 + 1


def test_inductor_passes_a_correct_in_place_kernel_with_repeated_backward():
    @equivalent_to(affine_ref, mutates={"x": "out"}, inputs=_M)
    def affine_(x):
        return x.mul_(2).add_(1)

    report = check(affine_, settings=SETTINGS, modes=("compile[inductor]",))
    (run,) = report.runs
    assert run.status == "passed" and run.compilations >= 1


def test_inductor_catches_a_wrong_gradient():
    class BadSilu(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x * torch.sigmoid(x)

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * torch.sigmoid(x)  # missing the x * s * (1 - s) term

    @equivalent_to(silu_ref, inputs=_M)
    def silu(x):
        return BadSilu.apply(x)

    with pytest.raises(equiv.GradientMismatch) as info:
        check(silu, settings=SETTINGS, modes=("compile[inductor]",))
    f = info.value.report.findings[0]
    assert f.mode == "compile[inductor]" and f.argument == "x"
    assert "fails this check in eager mode too" in f.attribution


def test_at_most_three_compilations_over_100_compile_friendly_examples():
    @equivalent_to(silu_ref, inputs=_M)
    def silu(x):
        return x * torch.sigmoid(x)

    report = check(silu, settings=equiv.settings(SETTINGS, max_examples=100),
                   modes=("compile[aot_eager]",))
    (run,) = report.runs
    assert run.status == "passed" and run.examples >= 90
    assert 1 <= run.compilations <= 3, run
