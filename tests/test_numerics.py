"""Baseline-relative numerics (equiv.numerics): ULPs and rounding, the verdict, its message,
finite-difference VJPs; and end-to-end acceptance through equiv.check."""

from __future__ import annotations

import dataclasses
import math

import hypothesis
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import strategies as st

import equiv
from equiv import check, equivalent_to
from equiv.compare import DEFAULT_TOLERANCES, dtype_tolerance, dtype_tolerances
from equiv.numerics import (K_DEFAULTS, NumericMismatch, Observed, cast_args, check_vjp_fd,
                            judge, judge_example, oracle_dtype, random_direction, round_to,
                            run_reference, ulp, upcast)
from equiv.strategies import tensors

from conftest import FAST, execution

F64 = torch.float64


def _draw(shape, dtype, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return round_to(torch.randn(shape, generator=g, dtype=F64) * scale, dtype)


def _matmul_acc(a, b, acc):
    """a @ b accumulating the K products one by one in ``acc``; the result in a's dtype."""
    out = torch.zeros(a.shape[0], b.shape[1], dtype=acc)
    for i in range(a.shape[1]):
        out = out + a[:, i:i + 1].to(acc) * b[i:i + 1, :].to(acc)
    return out.to(a.dtype)


def _split_k(a, b, block=256, drop_last=False):
    """a @ b as a sum of per-block matmuls over K; ``drop_last`` forgets the last block."""
    starts = list(range(0, a.shape[1], block))
    if drop_last and len(starts) > 1:
        starts = starts[:-1]
    out = torch.zeros(a.shape[0], b.shape[1], dtype=a.dtype)
    for s in starts:
        out = out + a[:, s:s + block] @ b[s:s + block]
    return out


# -- dtypes, ULPs, rounding -----------------------------------------------------------------
def test_oracle_dtype_is_float64_or_complex128_and_float32_on_mps():
    """The oracle runs in float64 (complex128), float32 where the device has no float64."""
    assert oracle_dtype(torch.bfloat16) == F64
    assert oracle_dtype(torch.complex64) == torch.complex128
    assert oracle_dtype(torch.float16, "mps") == torch.float32
    assert oracle_dtype(torch.int64) == torch.int64


def test_ulp_is_the_dtype_spacing_including_subnormals():
    """ulp(1) = eps, ulp doubles at each binade, below the smallest normal it is tiny*eps."""
    x = torch.tensor([1.0, 1.5, 2.0, 3.9, 0.0, 1e-40], dtype=F64)
    eps = torch.finfo(torch.float32).eps
    assert ulp(x, torch.float32).tolist() == [eps, eps, 2 * eps, 2 * eps, 2.0 ** -149, 2.0 ** -149]
    assert ulp(torch.tensor([1.0], dtype=F64), torch.bfloat16).item() == 2.0 ** -7


def test_round_to_rounds_once_where_tensor_to_rounds_twice():
    """float64 -> float16/bfloat16 rounds once to nearest (ties to even), unlike Tensor.to."""
    above_half = torch.tensor([1 + 2 ** -11 + 2 ** -40], dtype=F64)  # just above a tie
    assert above_half.to(torch.float16).item() == 1.0  # torch: through float32, then the tie
    assert round_to(above_half, torch.float16).item() == 1 + 2 ** -10
    assert round_to(torch.tensor([1 + 2 ** -8 + 2 ** -40], dtype=F64),
                    torch.bfloat16).item() == 1 + 2 ** -7
    tie = torch.tensor([1 + 2 ** -11, 1 + 3 * 2 ** -11], dtype=F64)  # exact ties: to even
    assert round_to(tie, torch.float16).tolist() == [1.0, 1 + 2 * 2 ** -10]


def test_round_to_matches_numpy_float16_everywhere():
    """Against NumPy's single-rounding float16 cast: normals, subnormals, overflow, non-finite."""
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(20000, generator=g, dtype=F64) * 10.0 ** torch.randint(
        -9, 5, (20000,), generator=g).double(), torch.tensor(
        [65504.0, 65519.99, 65520.0, -7e4, math.inf, -math.inf, math.nan, 0.0, -0.0], dtype=F64)])
    mine = round_to(x, torch.float16).double().numpy()
    with np.errstate(over="ignore"):
        theirs = x.numpy().astype(np.float16).astype(np.float64)
    np.testing.assert_array_equal(mine, theirs)


def test_cast_args_rounds_floating_leaves_only():
    """cast_args rounds float (and complex) tensors; integers and scalars pass through."""
    args = (torch.tensor([1 + 2 ** -11 + 2 ** -40], dtype=F64), torch.tensor([3]), 2.5)
    out = cast_args(args, torch.float16)
    assert out[0].dtype == torch.float16 and out[0].item() == 1 + 2 ** -10
    assert out[1] is args[1] and out[2] == 2.5
    assert upcast(out)[0].dtype == F64


def test_default_tolerances_match_torch_testing():
    """compare.DEFAULT_TOLERANCES is torch.testing's table; dtype_tolerances overrides it."""
    from torch.testing._comparison import default_tolerances

    for dtype, tol in DEFAULT_TOLERANCES.items():
        if dtype == torch.complex32:
            continue  # experimental dtype: torch warns on creation
        assert default_tolerances(torch.empty(0, dtype=dtype)) == tol
    with dtype_tolerances({torch.float16: (1e-2, 1e-3)}):
        assert dtype_tolerance(torch.float16) == (1e-2, 1e-3)
    assert dtype_tolerance(torch.float16) == (1e-3, 1e-5)


# -- the verdict ----------------------------------------------------------------------------
def test_float16_accumulation_in_float16_fails_and_float32_accumulation_passes():
    """Both errors in the message; the float32-accumulating twin is within 2x + floor."""
    a, b = _draw((4, 512), torch.float16, 1), _draw((512, 4), torch.float16, 2)
    oracle, baseline = a.double() @ b.double(), a @ b
    m = judge(_matmul_acc(a, b, torch.float16), oracle, baseline, k=2)
    assert isinstance(m, NumericMismatch) and m.rule == "baseline"
    assert m.impl_error > 2 * m.baseline_error and m.baseline_error > 0
    assert m.rounding_level  # a precision bug: never blamed on a schedule or a saved value
    first = m.message.splitlines()[0]
    assert first.startswith(f"implementation max error {m.impl_error:.3g} vs float64, the "
                            f"float16 reference's own error {m.baseline_error:.3g}, allowed 2x + ")
    assert "ULP distance from float64 (in float16 ulps): max" in m.message
    assert judge(_matmul_acc(a, b, torch.float32), oracle, baseline, k=2) is None


def test_bfloat16_silu_formula_passes_and_a_wrong_constant_fails():
    """x*sigmoid(x) in bfloat16 against F.silu passes; x*sigmoid(1.702x) (GELU's) does not."""
    x = _draw((4096,), torch.bfloat16, 3, scale=4.0)
    oracle, baseline = F.silu(x.double()), F.silu(x)
    assert judge(x * torch.sigmoid(x), oracle, baseline, k=2) is None
    m = judge(x * torch.sigmoid(1.702 * x), oracle, baseline, k=2)
    assert m is not None and not m.rounding_level and m.ulp_p99 is not None


@pytest.mark.parametrize("K", [256, 1024, 4096])
def test_split_k_float32_matmul_passes_and_dropping_the_last_block_fails(K):
    """Split-K over K (4x4 outputs, 50 draws) passes; forgetting the last block is caught."""
    for seed in range(50):
        a, b = _draw((4, K), torch.float32, seed), _draw((K, 4), torch.float32, 1000 + seed)
        oracle, baseline = a.double() @ b.double(), a @ b
        assert judge(_split_k(a, b), oracle, baseline, k=2) is None, seed
    a, b = _draw((4, K + 100), torch.float32, 7), _draw((K + 100, 4), torch.float32, 8)
    m = judge(_split_k(a, b, drop_last=True), a.double() @ b.double(), a @ b, k=2)
    assert m is not None and not m.rounding_level and m.mismatched == 16


def test_floor_accepts_a_result_when_the_baseline_is_exact():
    """A baseline with zero error still allows floor_ulps ULPs, and not more."""
    x = _draw((100,), torch.float32, 4)
    oracle, baseline = x.double() * 2, x * 2  # exact
    one_ulp = x * 2 + ulp(x * 2, torch.float32).float()
    assert judge(one_ulp, oracle, baseline, k=2, floor_ulps=2) is None
    assert judge(x * 2 * (1 + 1e-4), oracle, baseline, k=2, floor_ulps=2) is not None


def test_never_stricter_than_the_dtype_default_against_the_oracle():
    """An error the float32 default tolerance accepts (about 10 ulps) passes at k=2."""
    x = _draw((100,), torch.float32, 5)
    eight_ulps = x * (1 + 8 * 2.0 ** -23)
    assert judge(eight_ulps, x.double(), x, k=2, floor_ulps=2) is None
    assert judge(x * (1 + 100 * 2.0 ** -23), x.double(), x, k=2, floor_ulps=2) is not None


def test_nonfinite_values_must_match_the_oracle_or_the_baseline():
    """inf where the baseline overflows is fine; NaN where both references are finite is not."""
    x = torch.tensor([1.0, 12.0, 2.0], dtype=torch.float16)
    oracle, baseline = torch.exp(x.double()), torch.exp(x)  # exp(12) overflows float16
    assert math.isinf(baseline[1].item())
    assert judge(torch.exp(x), oracle, baseline, k=2) is None
    bad = torch.exp(x).clone()
    bad[2] = math.nan
    m = judge(bad, oracle, baseline, k=2)
    assert m is not None and m.index == (2,) and math.isinf(m.impl_error)


def test_rounding_level_predicate_separates_rounding_from_wrong_values():
    """3x the reference's error is rounding-level; a 10% error is not."""
    x = _draw((1000,), torch.float16, 6)
    oracle = torch.sin(x.double())
    baseline = torch.sin(x)
    three_x = round_to(oracle + 3 * (baseline.double() - oracle) + 3 * ulp(oracle, torch.float16),
                       torch.float16)
    m = judge(three_x, oracle, baseline, k=1, floor_ulps=0.5)
    assert m is not None and m.rounding_level
    assert "rounding-level" in m.message
    wrong = judge(torch.sin(x) * 1.1, oracle, baseline, k=1)
    assert wrong is not None and not wrong.rounding_level


def test_judge_falls_back_to_the_dtype_default_without_an_oracle():
    """oracle=None: torch.testing's default against the baseline, and the message says why."""
    x = _draw((10,), torch.float32, 7)
    assert judge(x + 1e-7, None, x, why="the reference raised in float64") is None
    m = judge(x + 1e-3, None, x, why="the reference raised in float64")
    assert m is not None and m.rule == "dtype-default" and not m.rounding_level
    assert "per-dtype default rtol=1.3e-06, atol=1e-05: the reference raised in float64" \
        in m.message


def test_complex_results_are_judged_by_modulus():
    """Complex64 against complex128: the twin passes, a conjugated result fails."""
    z = torch.complex(_draw((64,), torch.float32, 8), _draw((64,), torch.float32, 9))
    oracle, baseline = torch.exp(z.to(torch.complex128)), torch.exp(z)
    assert judge(torch.exp(z), oracle, baseline) is None
    m = judge(torch.exp(z).conj(), oracle, baseline)
    assert m is not None and m.message.splitlines()[0].split(" vs ")[1].startswith("complex128")


def test_judge_rejects_mismatched_shapes():
    """Structure is compared before numerics: judge refuses to broadcast."""
    with pytest.raises(ValueError, match="shapes differ"):
        judge(torch.zeros(2), torch.zeros(3, dtype=F64), torch.zeros(3))


# -- finite differences ---------------------------------------------------------------------
def _numpy_sin(x):
    return torch.from_numpy(np.sin(x.detach().numpy()))


class _Sin(torch.autograd.Function):
    scale = 1.0

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.sin(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * _Sin.scale * torch.cos(x)


def _impl_vjp(x, cot, scale):
    _Sin.scale = scale
    x = x.detach().requires_grad_()
    (g,) = torch.autograd.grad(_Sin.apply(x), x, cot)
    return g


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_fd_vjp_passes_a_right_backward_and_catches_wrong_ones(dtype):
    """NumPy reference np.sin: backward cos passes; -cos and 2*cos are caught."""
    x, cot = _draw((5, 7), dtype, 10, scale=2.0), _draw((5, 7), dtype, 11)
    right = check_vjp_fd(_numpy_sin, (x,), cot, (_impl_vjp(x, cot, 1.0),), dtype=dtype)
    assert right.ok, right
    for scale in (-1.0, 2.0):
        wrong = check_vjp_fd(_numpy_sin, (x,), cot, (_impl_vjp(x, cot, scale),), dtype=dtype)
        assert not wrong.ok, wrong
        if dtype != torch.bfloat16:
            assert abs(wrong.value - wrong.analytic) > 10 * wrong.tolerance


def test_fd_vjp_does_not_perturb_integer_or_complex_arguments():
    """Integer and complex arguments are held fixed and listed as skipped."""
    def ref(x, n, z):
        return torch.from_numpy(np.sin(x.numpy()) * n.numpy()) + z.real.sum()

    x = _draw((4,), F64, 12)
    n, z = torch.tensor([1, 2, 3, 4]), torch.tensor([1 + 1j], dtype=torch.complex128)
    cot = torch.ones(4, dtype=F64)
    fd = check_vjp_fd(ref, (x, n, z), cot, (torch.cos(x) * n, None, None), dtype=F64)
    assert fd.ok and fd.skipped == ("[1]", "[2]")
    direction = random_direction((x, n, z))
    assert direction[1] is None and direction[2] is None
    assert math.isclose(float(direction[0].norm()), 1.0)


# -- the per-example prototype ---------------------------------------------------------------
def _pair(result):
    return {"output": result}


def test_judge_example_judges_outputs_and_oracle_gradients():
    """One oracle call + its VJP: the buggy float16 accumulation fails outputs and gradients."""
    a, b = _draw((4, 256), torch.float16, 13), _draw((256, 4), torch.float16, 14)
    cot = _draw((4, 4), torch.float16, 15)
    a64, b64 = upcast(a).requires_grad_(), upcast(b).requires_grad_()

    def side(fn):
        x, y = a.clone().requires_grad_(), b.clone().requires_grad_()
        out = fn(x, y)
        ga, gb = torch.autograd.grad(out, (x, y), cot)
        return Observed({"output": out.detach()}, {"a": ga, "b": gb})

    baseline = side(torch.matmul)
    right = judge_example(torch.matmul, (a64, b64), side(lambda x, y: _matmul_acc(
        x, y, torch.float32)), baseline, pair=_pair, leaves={"a": a64, "b": b64},
        cotangent={"output": cot})
    assert right.mismatches == [] and right.rule == "baseline"
    wrong = judge_example(torch.matmul, (a64, b64), side(lambda x, y: _matmul_acc(
        x, y, torch.float16)), baseline, pair=_pair, leaves={"a": a64, "b": b64},
        cotangent={"output": cot})
    assert [m.path for m in wrong.mismatches][:1] == ["output"]
    assert wrong.mismatches[0].k == K_DEFAULTS["outputs"]


def test_judge_example_falls_back_and_notes_it_when_float64_raises():
    """A reference that refuses float64 gives the dtype-default rule and a note."""
    def ref(x):
        if x.dtype == F64:
            raise TypeError("no float64 kernel")
        return x * 2

    x = _draw((8,), torch.float32, 16)
    verdict = judge_example(ref, (upcast(x),), Observed({"output": x * 2 + 1}),
                            Observed({"output": x * 2}), pair=_pair)
    assert verdict.rule == "dtype-default"
    assert verdict.notes and "raised TypeError in float64" in verdict.notes[0]
    (m,) = verdict.mismatches
    assert m.rule == "dtype-default" and "no float64 kernel" in m.why
    runs = run_reference(ref, (upcast(x),), (x,))
    assert isinstance(runs.oracle_error, TypeError) and runs.baseline_error is None


# -- end to end through equiv.check ---------------------------------------------------------
_ENGINE_ORACLE = "needs the engine: the oracle/baseline verdict (numerics.judge_example) in checks"
_ENGINE_FD = "needs the engine: finite-difference VJPs (numerics.check_vjp_fd) for references " \
             "that cannot differentiate"


def _matmul_inputs(dtype, ks=(64, 128, 256)):
    return st.sampled_from(ks).flatmap(lambda k: st.tuples(
        tensors(shape=(4, k), dtype=dtype, scale=1.0),
        tensors(shape=(k, 4), dtype=dtype, scale=1.0)))


def _fp16_specs():
    def mm_ref(a, b):
        return a @ b

    @equivalent_to(mm_ref, inputs=_matmul_inputs(torch.float16))
    def mm_fp16_acc(a, b):
        return _matmul_acc(a, b, torch.float16)

    @equivalent_to(mm_ref, inputs=_matmul_inputs(torch.float16))
    def mm_fp32_acc(a, b):
        return _matmul_acc(a, b, torch.float32)

    return mm_fp16_acc, mm_fp32_acc


def test_e2e_float16_accumulation_in_float16_is_caught():
    """Accumulating a float16 matmul in float16 is a forward finding today already."""
    buggy, _ = _fp16_specs()
    report = check(buggy, settings=FAST, modes=("eager",), checks=("forward",),
                   raise_on_failure=False)
    assert not report.ok
    assert report.findings[0].check == "forward"


def test_e2e_float16_accumulation_message_shows_both_errors():
    """The finding states the implementation's and the float16 reference's own error."""
    buggy, _ = _fp16_specs()
    report = check(buggy, settings=FAST, modes=("eager",), checks=("forward",),
                   raise_on_failure=False)
    text = report.findings[0].details
    assert "vs float64, the float16 reference's own error" in text and "allowed 2x" in text


def test_e2e_float16_accumulation_in_float32_passes():
    """The same kernel accumulating in float32 passes (today within float16's default too)."""
    _, correct = _fp16_specs()
    assert check(correct, settings=FAST, modes=("eager",), checks=("forward",)).ok


def test_e2e_bfloat16_silu_formula_passes_by_default():
    """x * sigmoid(x) in bfloat16 against F.silu passes without tolerances or options."""
    def silu_ref(x):
        return F.silu(x)

    @equivalent_to(silu_ref, inputs=st.tuples(tensors(shape=(64,), dtype=torch.bfloat16,
                                                      requires_grad=True, scale=4.0)))
    def silu_formula(x):
        return x * torch.sigmoid(x)

    assert check(silu_formula, settings=FAST, modes=("eager",)).ok
    # 100 examples with seed 0 draw an expanded x (64 views of one element): its gradient sums
    # 64 terms, each rounding two parts of the derivative that nearly cancel (a precision
    # difference at rounding level, passed with a note)
    report = check(silu_formula, settings=equiv.settings(
        seed=0, max_examples=100, modes=("eager",),
        hypothesis_settings=hypothesis.settings(database=None)), raise_on_failure=False)
    assert report.ok, report.render()


def _split_k_specs():
    def mm_ref(a, b):
        return a @ b

    inputs = _matmul_inputs(torch.float32, ks=(256, 1024, 4096, 1000))

    @equivalent_to(mm_ref, inputs=inputs)
    def mm_split_k(a, b):
        return _split_k(a, b)

    @equivalent_to(mm_ref, inputs=inputs)
    def mm_split_k_drop(a, b):
        return _split_k(a, b, drop_last=True)

    return mm_split_k, mm_split_k_drop


def test_e2e_split_k_dropping_the_last_block_is_caught():
    """A split-K matmul that forgets the last (partial) block is a forward finding."""
    _, buggy = _split_k_specs()
    report = check(buggy, settings=FAST, modes=("eager",), checks=("forward",),
                   raise_on_failure=False)
    assert not report.ok and report.findings[0].check == "forward"


@pytest.mark.slow
def test_e2e_split_k_float32_passes_200_examples():
    """Split-K over K in {256, 1024, 4096}: no false alarm in 200 examples."""
    correct, _ = _split_k_specs()
    cfg = equiv.settings(max_examples=200, seed=1234, hypothesis_settings=FAST.hypothesis_settings)
    assert check(correct, settings=cfg, modes=("eager",), checks=("forward",)).ok


def _numpy_sin_specs():
    class NumpySinBackward(torch.autograd.Function):
        scale = 1.0

        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return torch.sin(x)

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * NumpySinBackward.scale * torch.cos(x)

    def sin_numpy_ref(x):
        return torch.from_numpy(np.sin(x.detach().numpy()))

    inputs = st.tuples(tensors(shape=(6,), dtype=torch.float64, requires_grad=True))

    @equivalent_to(sin_numpy_ref, inputs=inputs)
    def sin_right(x):
        NumpySinBackward.scale = 1.0
        return NumpySinBackward.apply(x)

    @equivalent_to(sin_numpy_ref, inputs=inputs)
    def sin_wrong(x):
        NumpySinBackward.scale = -1.0
        return NumpySinBackward.apply(x)

    return sin_right, sin_wrong


def test_e2e_numpy_reference_with_a_wrong_backward_is_caught_by_finite_differences():
    """A NumPy reference cannot differentiate: central differences catch -cos."""
    _, wrong = _numpy_sin_specs()
    report = check(wrong, settings=FAST, modes=("eager",), raise_on_failure=False)
    assert not report.ok and report.findings[0].check == "gradients"
    assert "finite differences" in report.findings[0].details


def test_e2e_numpy_reference_with_the_right_backward_passes():
    """The right backward passes (today the gradient is not compared at all; then by FD)."""
    right, _ = _numpy_sin_specs()
    assert check(right, settings=FAST, modes=("eager",)).ok


# -- the verdict in reports, options and fallbacks --------------------------------------------
def test_e2e_finding_carries_the_numbers_and_renders_the_verdict():
    """The float16 accumulation finding has rule/impl_error/baseline_error/allowed, in JSON too."""
    from equiv._results import finding_dict

    buggy, _ = _fp16_specs()
    report = check(buggy, settings=FAST, modes=("eager",), checks=("forward",),
                   raise_on_failure=False)
    f = report.findings[0]
    assert f.rule == "baseline" and f.k == K_DEFAULTS["outputs"]
    assert f.impl_error > f.allowed >= 2 * f.baseline_error
    assert "  verdict: baseline-relative (k=2): implementation error" in f.render()
    numbers = finding_dict(f)["numbers"]
    assert numbers["rule"] == "baseline" and numbers["impl_error"] == f.impl_error


def _half_only_ref(x):
    if x.dtype == F64:
        raise TypeError("no float64 kernel here")
    return x * 3


_F32 = st.tuples(tensors(shape=(8,), dtype=torch.float32))


def test_e2e_no_oracle_falls_back_to_the_dtype_default_and_says_so():
    """A reference that refuses float64: the per-dtype default decides, and a note says why."""
    @equivalent_to(_half_only_ref, inputs=_F32)
    def off(x):
        return x * 3 * (1 + 1e-3)

    report = check(off, settings=FAST, modes=("eager",), checks=("forward",),
                   raise_on_failure=False)
    f = report.findings[0]
    assert f.rule == "dtype-default" and f.baseline_error is None
    assert "the reference raised TypeError in float64: no float64 kernel here" in f.details
    assert any(n.startswith("forward: no float64 oracle") for n in report.notes)


def test_e2e_no_oracle_twin_passes():
    @equivalent_to(_half_only_ref, inputs=_F32)
    def same(x):
        return x * 3

    assert check(same, settings=FAST, modes=("eager",), checks=("forward",)).ok


def test_spec_rtol_atol_keep_the_absolute_comparison():
    """rtol/atol on the spec: no oracle, exactly those tolerances (a 1e-3 error fails at 1e-4)."""
    @equivalent_to(torch.sin, inputs=_F32, rtol=1e-4, atol=1e-4)
    def sin_off(x):
        return torch.sin(x) + 1e-3

    report = check(sin_off, settings=FAST, modes=("eager",), checks=("forward",),
                   raise_on_failure=False)
    assert report.findings[0].rule is None and report.findings[0].rtol == 1e-4

    @equivalent_to(torch.sin, inputs=_F32, rtol=1e-2, atol=1e-2)
    def sin_close(x):
        return torch.sin(x) + 1e-3

    assert check(sin_close, settings=FAST, modes=("eager",), checks=("forward",)).ok


def _logsumexp_ref(x):
    return torch.log(torch.exp(x).sum(-1))


_BIG = st.tuples(tensors(shape=(2, 3), dtype=torch.float32, scale=60.0))


def test_reference_dtype_as_a_spec_option_exposes_an_overflow():
    """equivalent_to(reference_dtype=torch.float64): the float64 reference decides, so an
    overflow the float32 reference shares is a finding; without the option it passes."""
    @equivalent_to(_logsumexp_ref, inputs=_BIG)
    def lse_plain(x):
        return torch.log(torch.exp(x).sum(-1))

    assert check(lse_plain, settings=FAST, modes=("eager",), checks=("forward",)).ok

    @equivalent_to(_logsumexp_ref, inputs=_BIG, reference_dtype=torch.float64,
                   reference_device="cpu")
    def lse_naive(x):
        return torch.log(torch.exp(x).sum(-1))

    report = check(lse_naive, settings=FAST, modes=("eager",), checks=("forward",),
                   raise_on_failure=False)
    assert not report.ok and "reference run on cpu in torch.float64" in report.render()


def test_reference_dtype_option_is_validated():
    with pytest.raises(equiv.InvalidArgument, match="reference_dtype=torch.int64"):
        equivalent_to(torch.sin, reference_dtype=torch.int64)(lambda x: torch.sin(x))


def test_cli_reference_dtype_flag(tmp_path):
    """--reference-dtype float64 runs the references in float64 (a finding for the overflow)."""
    from equiv.cli import main

    mod = tmp_path / "lse_specs.py"
    mod.write_text(
        "import torch\nfrom hypothesis import strategies as st\n"
        "from equiv import equivalent_to\nfrom equiv.strategies import tensors\n\n"
        "def ref(x):\n    return torch.log(torch.exp(x).sum(-1))\n\n"
        "@equivalent_to(ref, inputs=st.tuples(tensors(shape=(2, 3), dtype=torch.float32, "
        "scale=60.0)))\ndef lse(x):\n    return torch.log(torch.exp(x).sum(-1))\n")
    import io

    args = ["check", str(mod), "--modes", "eager", "--max-examples", "15", "--seed", "1",
            "--progress", "off"]
    assert main(args, out=io.StringIO(), err=io.StringIO()) == 0
    assert main(args + ["--reference-dtype", "float64"], out=io.StringIO(),
                err=io.StringIO()) == 1
    assert main(args + ["--reference-dtype", "int8"], out=io.StringIO(),
                err=io.StringIO()) == 2


class _RaisingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, g):
        raise NotImplementedError("no backward in the reference")


def _sin_no_backward_ref(x):
    return _RaisingBackward.apply(x)


_GRAD64 = st.tuples(tensors(shape=(5,), dtype=torch.float32, requires_grad=True))


def test_e2e_reference_whose_backward_raises_is_checked_by_finite_differences():
    """The reference's backward raises: a wrong implementation backward is still caught."""
    class WrongSin(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x.sin()

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return 2 * g * x.cos()

    @equivalent_to(_sin_no_backward_ref, inputs=_GRAD64)
    def sin_wrong(x):
        return WrongSin.apply(x)

    report = check(sin_wrong, settings=FAST, modes=("eager",), checks=("gradients",),
                   raise_on_failure=False)
    f = report.findings[0]
    assert f.check == "gradients" and "finite differences" in f.headline
    assert "reference backward raised NotImplementedError" in f.headline

    @equivalent_to(_sin_no_backward_ref, inputs=_GRAD64)
    def sin_right(x):
        return x.sin()

    assert check(sin_right, settings=FAST, modes=("eager",), checks=("gradients",)).ok


def test_rounding_level_gradient_mismatch_gets_no_schedule_cause():
    """A float16 backward that accumulates in float16 is a gradient finding at rounding level:
    no timeline replay and no likely cause about saved values."""
    class Fp16Sum(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return a @ b

        @staticmethod
        def backward(ctx, g):
            a, b = ctx.saved_tensors
            return _matmul_acc(g, b.t(), torch.float16), _matmul_acc(a.t(), g, torch.float16)

    def mm_ref(a, b):
        return a @ b

    # one fixed example (and the engine's cotangent for it) where the error is rounding-level
    example = (_draw((4, 4), torch.float16, 27).requires_grad_(),
               _draw((4, 256), torch.float16, 28).requires_grad_())

    @equivalent_to(mm_ref, inputs=st.just(example), variants=False, examples=[example])
    def mm_fp16_backward(a, b):
        return Fp16Sum.apply(a, b)

    report = check(mm_fp16_backward, settings=equiv.settings(FAST, max_examples=1),
                   modes=("eager",), checks=("gradients",), raise_on_failure=False)
    f = next(f for f in report.findings if f.check == "gradients")
    assert f.rule == "baseline" and f.rounding_level
    assert f.likely_cause is None and not f.timeline


# -- gradient terms that cancel exactly for a structured cotangent ------------------------------
def _ln_ref(x):
    return torch.nn.functional.layer_norm(x, x.shape[-1:])


def _bf16_rows():
    return st.tuples(tensors(shape=st.tuples(st.integers(1, 8), st.integers(2, 300)),
                             dtype=torch.bfloat16, requires_grad=True))


def _layer_norm_f32(x, eps=1e-5):
    xf = x.float()
    mu = xf.mean(-1, keepdim=True)
    var = xf.var(-1, unbiased=False, keepdim=True)
    return ((xf - mu) * torch.rsqrt(var + eps)).to(x.dtype)


def test_a_bf16_layer_norm_computing_in_float32_passes_on_constant_rows():
    """An expanded (constant) row and a constant cotangent make every term of the gradient
    cancel exactly in float64, while a float32 kernel rounds terms of size 1/sqrt(eps): the
    floor is taken at the size of the terms for a random cotangent too."""
    @equivalent_to(_ln_ref, inputs=_bf16_rows())
    def layer_norm_bf16(x):
        return _layer_norm_f32(x)

    for seed in (0, 4, 5):  # seeds that draw such an example within the budget
        report = equiv.check(layer_norm_bf16, settings=equiv.settings(
            seed=seed, modes=("eager",), hypothesis_settings=hypothesis.settings(database=None)),
            raise_on_failure=False)
        assert report.ok, report.render()


def test_a_bf16_layer_norm_with_the_wrong_epsilon_fails():
    @equivalent_to(_ln_ref, inputs=_bf16_rows())
    def layer_norm_bf16(x):
        return _layer_norm_f32(x, eps=1e-3)

    report = equiv.check(layer_norm_bf16, settings=equiv.settings(
        seed=1, modes=("eager",), hypothesis_settings=hypothesis.settings(database=None)),
        raise_on_failure=False)
    assert not report.ok
    assert report.findings[0].check in ("forward", "gradients"), report.render()



# -- a constant cotangent (what .sum() feeds back) through a gradient that cancels ---------------
def _every_cotangent_expanded(monkeypatch):
    import equiv.run
    from equiv.variants import CotangentVariant

    monkeypatch.setattr(equiv.run, "cotangent_variants",
                        lambda: st.just(CotangentVariant("expanded")))


def _softmax_rows():
    return st.tuples(tensors(shape=st.tuples(st.integers(1, 4), st.integers(2, 64)),
                             dtype=torch.float16, requires_grad=True))


def _softmax_composite(x):
    e = (x - x.amax(-1, keepdim=True)).exp()
    return e / e.sum(-1, keepdim=True)


def test_a_float16_softmax_composite_passes_a_constant_cotangent(monkeypatch):
    """A constant cotangent makes softmax's gradient cancel to exactly 0 (the reference's, in
    float64 and at float16), while a float16 composite rounds terms of the size of s * c: the
    floor is taken at the size the gradient has for a random cotangent of the same size."""
    _every_cotangent_expanded(monkeypatch)

    @equivalent_to(lambda x: torch.softmax(x, -1), inputs=_softmax_rows())
    def softmax(x):
        return _softmax_composite(x)

    # the forward computes exp and the sum in float16 (3.3 ulps where torch's is within 0.5):
    # a forward finding in half precision; the gradients are what this test judges
    gradient_checks = tuple(c for c in equiv.settings().checks if c != "forward")
    for seed in (0, 1):
        report = equiv.check(softmax, settings=equiv.settings(
            seed=seed, max_examples=40, modes=("eager",), checks=gradient_checks,
            hypothesis_settings=hypothesis.settings(database=None)), raise_on_failure=False)
        assert report.ok, report.render()


class _SoftmaxDropsTheSum(torch.autograd.Function):
    """softmax's backward without the ``- sum(s * c)`` term: exact for a cotangent that sums
    to 0, wrong for a constant one."""

    @staticmethod
    def forward(ctx, x):
        s = _softmax_composite(x)
        ctx.save_for_backward(s)
        return s

    @staticmethod
    def backward(ctx, g):
        (s,) = ctx.saved_tensors
        return s * g


def test_a_float16_softmax_backward_missing_a_term_fails_a_constant_cotangent(monkeypatch):
    _every_cotangent_expanded(monkeypatch)

    @equivalent_to(lambda x: torch.softmax(x, -1), inputs=_softmax_rows())
    def softmax(x):
        return _SoftmaxDropsTheSum.apply(x)

    report = equiv.check(softmax, settings=equiv.settings(
        seed=0, max_examples=40, modes=("eager",),
        hypothesis_settings=hypothesis.settings(database=None)), raise_on_failure=False)
    f = next(f for f in report.findings if f.check == "gradients")
    assert "cotangent: expanded" in f.message and "differs from the reference" in f.headline


# -- float32 precision differences pass; half precision bugs and float32 wrong values do not -----
def _rows(dtype):
    return st.tuples(tensors(shape=st.tuples(st.integers(1, 4), st.integers(2, 200)),
                             dtype=dtype, requires_grad=True))


def _seq_cumsum(x):
    acc, cols = torch.zeros(x.shape[:-1], dtype=x.dtype), []
    for i in range(x.shape[-1]):
        acc = acc + x[..., i]
        cols.append(acc)
    return torch.stack(cols, -1)


def _settings(seed=1):
    return equiv.settings(seed=seed, modes=("eager",),
                          hypothesis_settings=hypothesis.settings(database=None))


def test_a_float16_sequential_accumulation_still_fails_at_rounding_level():
    """A rounding-level divergence is a finding in half precision (accumulation bugs are)."""
    @equivalent_to(lambda x: torch.cumsum(x, -1), inputs=_rows(torch.float16))
    def cumsum_fp16(x):
        return _seq_cumsum(x)

    report = equiv.check(cumsum_fp16, settings=_settings(), raise_on_failure=False)
    f = next(f for f in report.findings if f.check == "forward")
    assert "dtype: torch.float16" in f.message and "the float16 reference's own error" in f.message


def test_a_float32_value_off_by_more_than_rounding_still_fails():
    @equivalent_to(lambda x: torch.cumsum(x, -1), inputs=_rows(torch.float32))
    def cumsum_off(x):
        return torch.cumsum(x, -1) * (1 + 3e-5)

    report = equiv.check(cumsum_off, settings=_settings(), raise_on_failure=False)
    assert any(f.check == "forward" for f in report.findings), report.render()
    assert "precision difference" not in " ".join(report.notes)


def test_a_numeric_finding_lists_each_line_once():
    """The baseline-relative verdict's lines and assert_close's are joined without repeats."""
    @equivalent_to(lambda x: x * 2, inputs=st.just((torch.tensor([0.5, 1.5]),)), variants=())
    def off(x):
        return x * 2 + 1

    report = equiv.check(off, settings=equiv.settings(max_examples=1, modes=("eager",)),
                         raise_on_failure=False)
    f = next(f for f in report.findings if f.check == "forward")
    lines = f.details.splitlines()
    assert sum(ln.startswith("Mismatched elements") for ln in lines) == 1, f.details


def test_a_half_rounding_level_finding_says_why_it_is_still_reported():
    """float16 accumulation is rounding-level against float64: the finding stands and says
    why, instead of calling it "not a wrong value"."""
    from equiv.numerics import NumericMismatch, describe

    m = NumericMismatch(path="output", message="", impl_error=6e-4, baseline_error=6e-5,
                        allowed=5e-4, k=2.0, floor=1e-5, floor_ulps=2.0, dtype="float16",
                        mismatched=1, elements=65, ulp_max=7.3, baseline_ulp_max=1.0)
    assert m.rounding_level
    text = describe(m)
    assert "not a wrong value" not in text
    assert ("in float16 a precision bug (accumulating or rounding intermediates in float16) "
            "looks like this, so it is reported") in text
    assert "that is how accumulating in float16 shows" not in text  # no diagnosis from numbers


def test_the_probe_magnitude_of_a_complex_gradient_is_its_modulus():
    """The gradient floor's probe of a complex gradient is |g| (no cast that drops the
    imaginary part, and warns, on the way to float64)."""
    import warnings

    @equivalent_to(lambda x: x * (1 + 2j))
    def rotate(x):
        return x * (1 + 2j)

    ex = execution(rotate, torch.randn(6, dtype=torch.complex64, requires_grad=True), seed=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = ex.oracle.probe_magnitude(1, ex.template.groups[0])
    assert m is not None and m.dtype == torch.float64 and bool((m > 0).all())


def _rounding_line(m):
    from equiv.numerics import describe

    return next(ln for ln in describe(m).splitlines() if ln.startswith("rounding-level"))


def test_the_rounding_level_line_states_its_criterion_when_the_floor_dominates():
    """14x the reference's own error is rounding-level because the ULP floor dominates the
    allowance: the line states the criterion with its numbers."""
    m = NumericMismatch(path="output", message="", impl_error=7.48, baseline_error=0.519,
                        allowed=3.56, k=3.0, floor=2.0, floor_ulps=4.0, dtype="float16",
                        mismatched=1, elements=64, ulp_max=15.0, baseline_ulp_max=1.0)
    assert m.rounding_level
    line = _rounding_line(m)
    assert line.startswith("rounding-level: error 7.48 within 10x (the reference's own error "
                           "0.519 + the 4-ulp floor 2) = 25.2, and 15 ulps within 10x the "
                           "floor's 4 ulps; in float16 a precision bug "), line
    assert "within 10x the reference's own error;" not in line


def test_the_rounding_level_line_of_a_float32_value_states_only_its_criterion():
    m = NumericMismatch(path="output", message="", impl_error=3e-6, baseline_error=1e-6,
                        allowed=2.5e-6, k=2.0, floor=1e-7, floor_ulps=2.0, dtype="float32",
                        mismatched=1, elements=64, ulp_max=20.0, baseline_ulp_max=8.0)
    assert _rounding_line(m) == ("rounding-level: error 3e-06 within 10x (the reference's own "
                                 "error 1e-06 + the 2-ulp floor 1e-07) = 1.1e-05, and 20 ulps "
                                 "within 10x the reference's 8 ulps")


def test_a_reference_that_overflows_everywhere_has_no_finite_error_in_the_message():
    """The float16 reference is inf where float64 is finite: its error is not 0, it has none."""
    oracle = torch.tensor([1.0, 2.0, 3.0], dtype=F64)
    baseline = torch.full((3,), math.inf, dtype=torch.float16)
    m = judge(torch.tensor([1.5, 2.0, 3.0], dtype=torch.float16), oracle, baseline)
    assert m is not None and m.baseline_overflow == 3
    first = m.message.splitlines()[0]
    assert ("vs float64, the float16 reference has no finite error (inf/NaN at all 3 "
            "elements), allowed 2x + ") in first
    assert "own error 0" not in m.message


def test_a_reference_that_overflows_somewhere_says_where_its_error_is_taken():
    oracle = torch.tensor([1.0, 2.0, 3.0], dtype=F64)
    baseline = torch.tensor([math.inf, 2.0, 3.0], dtype=torch.float16)
    m = judge(torch.tensor([1.0, 2.5, 3.0], dtype=torch.float16), oracle, baseline)
    assert m is not None and m.baseline_overflow == 1
    assert ("the float16 reference's own error 0 (inf/NaN at 1 of 3 elements, left out), "
            "allowed") in m.message


@hypothesis.settings(max_examples=60, deadline=None, derandomize=True)
@hypothesis.given(n=st.integers(1, 40), seed=st.integers(0, 2**16), chunk=st.integers(1, 9),
                  half=st.booleans(), given=st.sampled_from(["none", "magnitude", "rounding"]),
                  explain=st.booleans())
def test_chunked_verdict_is_the_whole_tensors_verdict(n, seed, chunk, half, given, explain):
    """The verdict read in chunks of any size says what it says over the whole tensor: the
    same mismatch, worst element, allowance, errors and ULP figures (NaN, inf and exact zeros
    of the oracle included), the same numbers of a mismatch against the default tolerance, and
    the same disagreement of the oracle with the baseline."""
    from equiv import _explain, compare, numerics
    g = torch.Generator().manual_seed(seed)
    dtype = torch.float16 if half else torch.float32
    oracle = torch.randn(n, 3, generator=g, dtype=torch.float64)
    oracle[torch.rand(n, 3, generator=g) < 0.2] = 0.0
    baseline = (oracle * (1 + 1e-3 * torch.randn(n, 3, generator=g, dtype=torch.float64))
                ).to(dtype)
    actual = (oracle + 1e-2 * torch.randn(n, 3, generator=g, dtype=torch.float64)
              * (torch.rand(n, 3, generator=g) < 0.5)).to(dtype)
    special = torch.rand(n, 3, generator=g)
    actual[special < 0.05] = math.nan
    actual[(special >= 0.05) & (special < 0.08)] = math.inf
    baseline[special < 0.03] = math.nan
    extra = torch.rand(n, 3, generator=g, dtype=torch.float64) * 0.1
    options = dict(dtype=dtype, default_floor=not half,
                   magnitude=extra if given == "magnitude" else None,
                   rounding=extra if given == "rounding" else None)
    with _explain.verdict_only(not explain):
        whole = numerics.judge(actual, oracle, baseline, **options)
        rejected = numerics.rejects(actual, oracle, baseline, **options)
        numbers = compare._numbers(actual, baseline)
        disagreement = numerics.oracle_disagreement(oracle, baseline, dtype, extra, 0.5)
        saved = numerics.CHUNK, compare._CHUNK
        numerics.CHUNK = compare._CHUNK = chunk
        try:
            chunked = numerics.judge(actual, oracle, baseline, **options)
            assert numerics.rejects(actual, oracle, baseline, **options) == rejected
            assert compare._numbers(actual, baseline) == numbers
            assert numerics.oracle_disagreement(oracle, baseline, dtype, extra,
                                                0.5) == disagreement
        finally:
            numerics.CHUNK, compare._CHUNK = saved
    assert rejected == (whole is not None)
    assert (chunked is None) == (whole is None)
    if whole is not None:  # field by field, NaN equal to NaN (a percentile of infinities)
        for f in dataclasses.fields(whole):
            a, b = getattr(chunked, f.name), getattr(whole, f.name)
            assert a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)), f.name
