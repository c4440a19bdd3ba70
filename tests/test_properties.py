"""Opt-in properties of the implementation alone: run-to-run determinism
(``deterministic=True``) and batch invariance (``batch_invariant=DIM``), each with a buggy
implementation it must catch and a correct twin it must pass."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch

import equiv
from equiv import equivalent_to
from equiv.strategies import tensors
from tests.conftest import FAST

BLOCKS = 8


def rows(shape=(4, 64), dtype=torch.float32):
    return st.tuples(tensors(shape=shape, dtype=dtype, requires_grad=True))


def row_sum_ref(x):
    return x.sum(-1)


def _blocks_in_order(x, order):
    parts = x.reshape(x.shape[0], BLOCKS, -1).sum(-1) * 1000  # large partial sums
    acc = torch.zeros(x.shape[0], dtype=x.dtype)
    for k in order:
        acc = acc + parts[:, k]
    return acc / 1000


def random_block_sum(x):
    """Sums the blocks' partial sums in a random order: float32 rounding differs per call."""
    return _blocks_in_order(x, torch.randperm(BLOCKS).tolist())


def fixed_block_sum(x):
    return _blocks_in_order(x, range(BLOCKS))


def test_a_random_block_order_is_caught_by_deterministic():
    impl = equivalent_to(row_sum_ref, inputs=rows(), deterministic=True)(random_block_sum)
    with pytest.raises(equiv.EquivalenceFailure) as info:
        equiv.check(impl, settings=FAST)
    found = [f for f in info.value.report.findings if f.check == "determinism"]
    assert found, info.value.report.findings
    f = found[0]
    assert "two calls on equal inputs gave different output" in f.headline
    assert f.max_abs is not None and f.max_abs > 0
    assert "not deterministic" in f.details and "order" in f.likely_cause


def counting(fn):
    calls = []

    def counted(x):
        calls.append(1)
        return fn(x)

    return counted, calls


def test_the_fixed_order_twin_passes_and_the_settings_switch_works():
    impl = equivalent_to(row_sum_ref, inputs=rows(), deterministic=True)(fixed_block_sum)
    assert equiv.check(impl, settings=FAST).ok
    # the same random kernel is caught through settings(deterministic=True)
    other = equivalent_to(row_sum_ref, inputs=rows(), name="via_settings")(random_block_sum)
    with pytest.raises(equiv.EquivalenceFailure) as info:
        equiv.check(other, settings=equiv.settings(FAST, deterministic=True))
    assert {f.check for f in info.value.report.findings} == {"determinism"}


def test_determinism_costs_nothing_unless_enabled(monkeypatch):
    from equiv.checks import determinism

    ran = []
    real = determinism.run
    monkeypatch.setattr(determinism, "run", lambda ex, sink: (ran.append(1), real(ex, sink)))
    fn, calls = counting(fixed_block_sum)
    impl = equivalent_to(row_sum_ref, inputs=rows())(fn)
    few = equiv.settings(FAST, max_examples=3)
    assert equiv.check(impl, settings=few).ok
    plain, calls[:] = len(calls), []
    assert not ran  # never called: no extra run of the implementation
    assert equiv.check(impl, settings=equiv.settings(few, deterministic=True)).ok
    assert ran and len(calls) > plain, (plain, len(calls), len(ran))


class RandomOrderBackward(torch.autograd.Function):
    """A correct forward; backward scales by a sum of blocks taken in a random order."""

    @staticmethod
    def forward(ctx, x):
        ctx.n = x.shape[1]
        return x.sum(-1)

    @staticmethod
    def backward(ctx, g):
        parts = torch.tensor([1e4 / 3**k for k in range(BLOCKS)])
        total = torch.zeros(())
        for k in torch.randperm(BLOCKS).tolist():  # 1.0 or 0.99999994 in float32
            total = total + parts[k]
        return g[:, None].expand(-1, ctx.n) * (total / parts.sum())


def test_nondeterministic_gradients_are_caught():
    def impl_fn(x):
        return RandomOrderBackward.apply(x)

    impl = equivalent_to(row_sum_ref, inputs=rows(), deterministic=True)(impl_fn)
    with pytest.raises(equiv.EquivalenceFailure) as info:
        equiv.check(impl, settings=FAST, checks=("forward", "determinism"))
    found = [f for f in info.value.report.findings if f.check == "determinism"]
    assert found and "gradients w.r.t. 'x'" in found[0].headline, info.value.report.findings


# ---------------------------------------------------------------------- batch invariance
def split_above_four(x):
    """Row sums, by four chunked partial sums when the batch is 4 or more: another order."""
    if x.shape[0] >= 4:
        return x.reshape(x.shape[0], 4, -1).sum(-1).sum(-1)
    return x.sum(-1)


def always_plain(x):
    return x.sum(-1)


def batch_inputs():
    return st.tuples(tensors(shape=(6, 1000), dtype=torch.float32, requires_grad=True))


def test_a_batch_dependent_reduction_order_is_caught():
    impl = equivalent_to(row_sum_ref, inputs=batch_inputs(), batch_invariant=0)(
        split_above_four)
    with pytest.raises(equiv.EquivalenceFailure) as info:
        equiv.check(impl, settings=FAST)
    found = [f for f in info.value.report.findings if f.check == "batch-invariance"]
    assert found, info.value.report.findings
    assert "of dim 0 of output differs from the implementation called on that entry alone" \
        in found[0].headline
    assert "batch of 6 along dim 0" in found[0].details and found[0].max_abs > 0


def test_the_batch_invariant_twin_passes_with_weights_whole():
    alone = []

    def scaled(x, w):
        alone.append(x.shape[0] == 1)
        return always_plain(x * w)

    def scaled_ref(x, w):
        return (x * w).sum(-1)

    inputs = st.tuples(tensors(shape=(5, 8), dtype=torch.float32, requires_grad=True),
                       tensors(shape=(8,), dtype=torch.float32, requires_grad=True, salt=1))
    impl = equivalent_to(scaled_ref, inputs=inputs, batch_invariant=0)(scaled)
    assert equiv.check(impl, settings=FAST).ok
    assert sum(alone) >= 5  # entries called alone, with the weight whole


def test_batch_invariant_option_is_validated():
    with pytest.raises(equiv.InvalidArgument, match="batch_invariant=-1"):
        equivalent_to(row_sum_ref, batch_invariant=-1)
    with pytest.raises(equiv.InvalidArgument, match="deterministic='yes'"):
        equivalent_to(row_sum_ref, deterministic="yes")


# ---------------------------------------------------------------------- autocast modes
def matmul_ref(x, w):
    return x @ w


class AutocastUnaware(torch.autograd.Function):
    """No custom_fwd/custom_bwd: backward runs outside autocast, on a half-precision
    grad_output and the float32 saved inputs."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w.T, x.T @ g


class AutocastAware(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu")
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w.T, x.T @ g


def matmul_inputs():
    return st.tuples(tensors(shape=(4, 8), dtype=torch.float32, requires_grad=True),
                     tensors(shape=(8, 3), dtype=torch.float32, requires_grad=True, salt=1))


@pytest.mark.parametrize("mode", ["autocast[bfloat16]", "autocast[float16]"])
def test_an_autocast_unaware_function_is_caught(mode):
    impl = equivalent_to(matmul_ref, inputs=matmul_inputs())(AutocastUnaware)
    with pytest.raises(equiv.GradientMismatch) as info:
        equiv.check(impl, settings=equiv.settings(FAST, max_examples=5), modes=(mode,))
    f = info.value.report.findings[0]
    assert f.check == "gradients" and f.mode == mode, f
    assert "backward raised RuntimeError where the reference's did not" in f.headline
    assert "same dtype" in f.details, f.render()


class AutocastOff(torch.autograd.Function):
    """cast_inputs=float32 turns autocast off inside forward: a float32 result where the
    reference's matmul returns the low-precision dtype."""

    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w.T, x.T @ g


def test_a_function_computing_outside_autocast_is_caught():
    impl = equivalent_to(matmul_ref, inputs=matmul_inputs())(AutocastOff)
    with pytest.raises(equiv.OutputMismatch) as info:
        equiv.check(impl, settings=equiv.settings(FAST, max_examples=5),
                    modes=("autocast[bfloat16]",))
    f = info.value.report.findings[0]
    assert f.check == "forward" and "bfloat16" in f.details and "float32" in f.details, f.render()


@pytest.mark.parametrize("mode", ["autocast[bfloat16]", "autocast[float16]"])
def test_an_autocast_aware_function_passes(mode):
    impl = equivalent_to(matmul_ref, inputs=matmul_inputs())(AutocastAware)
    report = equiv.check(impl, settings=equiv.settings(FAST, max_examples=5), modes=(mode,))
    assert report.ok and report.runs[0].mode == mode and report.runs[0].status == "passed"


def test_autocast_mode_names_are_validated():
    from equiv.modes import parse_mode

    assert parse_mode("autocast[bfloat16]").dtype == "bfloat16"
    with pytest.raises(equiv.InvalidArgument, match="unknown mode 'autocast\\[float32\\]'"):
        parse_mode("autocast[float32]")
