"""Gradients against references autograd cannot check: finite differences judged by their own
error (NumPy references, a kink of the derivative, NaN), double backward at a kink of the
reference's derivative, and a float64 oracle that is another function (a dropout mask drawn in
the compute dtype). Each correct, tricky twin passes; each buggy one still fails."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import strategies as st

import equiv
from equiv import check, equivalent_to
from equiv.strategies import Layout, tensors

from conftest import FAST

SECOND_BACKWARDS = equiv.settings(FAST, costly_share=1.0)


def _planted(value: float, at: int = 0):
    """A function setting element ``at`` (row-major) of a drawn leaf to ``value``."""
    def plant(t: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            t.view(-1)[at] = value
        return t
    return plant


def _numpy(fn):
    """``fn`` (a NumPy function) as a reference: no autograd history."""
    def ref(x):
        return torch.from_numpy(fn(x.detach().numpy()))
    ref.__name__ = f"{fn.__name__}_numpy"
    return ref


def _fd_finding(report):
    assert not report.ok
    f = report.findings[0]
    assert f.check == "gradients" and "finite differences" in f.headline, f
    assert "allowed" in f.details and "estimated from the two steps" in f.details
    return f


# -- finite differences: the error of the difference, the rounding of the terms ---------------
def _softmax_np(a):
    e = np.exp(a - a.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


class _Softmax(torch.autograd.Function):
    scale = 1.0

    @staticmethod
    def forward(ctx, x):
        y = torch.softmax(x, -1)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return _Softmax.scale * y * (g - (g * y).sum(-1, keepdim=True))


def _softmax_spec(scale: float):
    # rows constant along the softmax dim (expanded, stride 0): the gradient w.r.t. the storage
    # cancels to 0, which float32 reaches only up to the rounding of its terms
    rows = st.tuples(tensors(shape=(3, 8), dtype=torch.float32, requires_grad=True,
                             layout=Layout("expanded", dim=1)))

    @equivalent_to(_numpy(_softmax_np), inputs=rows)
    def softmax(x):
        _Softmax.scale = scale
        return _Softmax.apply(x)

    return softmax


def test_a_float32_softmax_against_numpy_passes_where_its_gradient_cancels():
    """The allowance includes float32 rounding of the gradient's terms, not only of its sum."""
    report = check(_softmax_spec(1.0), settings=FAST, raise_on_failure=False)
    assert report.ok, report.findings[:1]


def test_a_softmax_backward_off_by_one_percent_still_fails_against_numpy():
    f = _fd_finding(check(_softmax_spec(1.01), settings=FAST, raise_on_failure=False))
    assert "rounding of the gradient's terms" in f.details


def _var_np(a):
    return a.var(-1)


class _Var(torch.autograd.Function):
    """Population variance over the last dim with a chosen backward formula."""
    mean = "float32"

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.var(x, -1, correction=0)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        n = x.shape[-1]
        if _Var.mean == "missing":
            return g[..., None] * 2 * x / n
        mean = x.mean(-1, keepdim=True) if _Var.mean == "float32" else \
            x.bfloat16().mean(-1, keepdim=True).float()
        return g[..., None] * 2 * (x - mean) / n


def _var_spec(mean: str | None):
    # rows constant along the variance's dim (expanded, stride 0): the gradient is exactly 0
    # in float64; float32 rounds x - mean(x), so a correct kernel returns ~eps * |x| per row
    rows = st.tuples(tensors(shape=(4, 129), dtype=torch.float32, requires_grad=True,
                             layout=Layout("expanded", dim=1), elements=st.floats(-3, 3)))

    @equivalent_to(_numpy(_var_np), inputs=rows, name=f"var_{mean}")
    def var(x):
        if mean is None:
            return torch.var(x, -1, correction=0)
        _Var.mean = mean
        return _Var.apply(x)

    return var


def test_float32_var_of_constant_rows_passes_at_its_own_rounding():
    """x - mean(x) cancels inside the implementation's backward: the allowance is the spread of
    its gradient with each intermediate moved by one float32 rounding."""
    for mean in (None, "float32"):
        report = check(_var_spec(mean), settings=FAST, raise_on_failure=False)
        assert report.ok, report.findings[:1]


def test_a_var_backward_missing_the_mean_still_fails_on_constant_rows():
    _fd_finding(check(_var_spec("missing"), settings=FAST, raise_on_failure=False))


def test_a_var_backward_taking_the_mean_in_bfloat16_still_fails():
    """The perturbation is one float32 rounding: a bfloat16 intermediate is not widened to its
    own (coarser) rounding."""
    _fd_finding(check(_var_spec("bfloat16"), settings=FAST, raise_on_failure=False))


def _softsign_np(a):
    return a / (1 + np.abs(a))


class _Softsign(torch.autograd.Function):
    scale = 1.0

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x / (1 + x.abs())

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return _Softsign.scale * g / (1 + x.abs()) ** 2


def _softsign_spec(scale: float):
    at_zero = st.tuples(tensors(shape=(5,), dtype=torch.float64, requires_grad=True)
                        .map(_planted(0.0)))

    @equivalent_to(_numpy(_softsign_np), inputs=at_zero)
    def softsign(x):
        _Softsign.scale = scale
        return _Softsign.apply(x)

    return softsign


def test_softsign_at_zero_passes_where_central_differences_are_first_order():
    """softsign's second derivative jumps at 0: central differences are O(h) there, which the
    two step sizes measure."""
    report = check(_softsign_spec(1.0), settings=FAST, raise_on_failure=False)
    assert report.ok, report.findings[:1]


def test_a_softsign_backward_off_by_one_percent_still_fails_at_zero():
    _fd_finding(check(_softsign_spec(1.01), settings=FAST, raise_on_failure=False))


class _Sqrt(torch.autograd.Function):
    scale = 1.0

    @staticmethod
    def forward(ctx, x):
        y = torch.sqrt(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return _Sqrt.scale * g / (2 * y)


def _sqrt_spec(scale: float):
    values = st.tuples(st.builds(lambda: torch.tensor([-1.0, 0.5, 1.5, 2.0, 3.0, 4.5],
                                                      requires_grad=True)))

    @equivalent_to(_numpy(np.sqrt), inputs=values)
    def sqrt(x):
        _Sqrt.scale = scale
        return _Sqrt.apply(x)

    return sqrt


def test_nan_gradient_where_the_reference_is_nan_passes():
    """sqrt(-1) is NaN on both sides: NaN equals NaN, the other elements are compared."""
    report = check(_sqrt_spec(1.0), settings=FAST, raise_on_failure=False)
    assert report.ok, report.findings[:1]


def test_a_wrong_sqrt_backward_still_fails_beside_a_nan():
    f = _fd_finding(check(_sqrt_spec(1.01), settings=FAST, raise_on_failure=False))
    assert "1 inf/NaN gradient element(s) left out" in f.details


def test_a_nan_gradient_where_the_reference_is_finite_fails():
    class NanBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.sin()

        @staticmethod
        def backward(ctx, g):
            return g * torch.full_like(g, float("nan"))

    @equivalent_to(_numpy(np.sin), inputs=st.tuples(tensors(shape=(4,), dtype=torch.float64,
                                                            requires_grad=True)))
    def sin(x):
        return NanBackward.apply(x)

    report = check(sin, settings=FAST, raise_on_failure=False)
    assert not report.ok and report.findings[0].check == "gradients"
    assert "inf/NaN at 4 element(s) where the reference's outputs are finite" in \
        report.findings[0].details


_OVERFLOWING = st.tuples(st.just(torch.arange(1.0, 41.0, requires_grad=True)))  # 40! > 3e38


def test_a_gradient_overflowing_where_the_reference_overflows_in_the_dtype_is_not_judged():
    """float32 cumprod of 1..40 overflows on both sides; float64 finite differences are finite.
    The inf/NaN gradient is the dtype's overflow, not a wrong backward: not compared, said."""
    @equivalent_to(_numpy(lambda a: np.cumprod(a, -1)), inputs=_OVERFLOWING)
    def cumprod(x):
        return torch.cumprod(x, -1)

    report = check(cumprod, settings=FAST, raise_on_failure=False)
    assert report.ok, report.findings[:1]
    assert any("overflow there" in n for n in report.notes), report.notes


def test_an_inf_gradient_where_the_reference_is_finite_in_the_dtype_still_fails():
    class InfBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return torch.cumprod(x, -1)

        @staticmethod
        def backward(ctx, g):
            return g * float("inf")

    @equivalent_to(_numpy(lambda a: np.cumprod(a, -1)),
                   inputs=st.just((torch.arange(1.0, 5.0, requires_grad=True),)))
    def cumprod(x):
        return InfBackward.apply(x)

    report = check(cumprod, settings=FAST, raise_on_failure=False)
    assert not report.ok and report.findings[0].check == "gradients"
    assert "inf/NaN at 4 element(s) where the reference's outputs are finite" in \
        report.findings[0].details


def test_finite_differences_say_the_second_backwards_were_not_compared():
    """Both kinds of reference finite differences judge (no autograd history; a backward that
    raises) name the second backward and the double backward as not compared."""
    class Sin(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x.sin()

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * x.cos()

    class NoBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.sin()

        @staticmethod
        def backward(ctx, g):
            raise NotImplementedError("no backward")

    inputs = st.tuples(tensors(shape=(5,), dtype=torch.float32, requires_grad=True))
    for ref, why in ((_numpy(np.sin), "its result has no autograd history"),
                     (NoBackward.apply, "its backward raised NotImplementedError")):
        impl = equivalent_to(ref, inputs=inputs, name=f"sin-{why[:8]}")(lambda x: Sin.apply(x))
        report = check(impl, settings=SECOND_BACKWARDS, raise_on_failure=False)
        assert report.ok, report.findings[:1]
        for name, what in (("repeated-backward", "a second backward, with a new cotangent"),
                           ("double-backward", "double backward (second-order gradients)")):
            assert any(n.startswith(f"{name} not compared: the reference cannot differentiate "
                                    f"({why}), and finite differences judge the first backward "
                                    f"only ({what}") for n in report.notes), report.notes


# -- double backward at a kink of the reference's derivative ----------------------------------
def _abs_squared(z):
    return z.abs().pow(2)


class _Square(torch.autograd.Function):
    """|z|^2 for real z, saving only its input: its second derivative is 2 everywhere, where
    autograd's through ``z.abs().pow(2)`` is ``2 * sign(z)**2``: 0 at z = 0."""
    scale = 1.0

    @staticmethod
    def forward(ctx, z):
        ctx.save_for_backward(z)
        return z * z

    @staticmethod
    def backward(ctx, g):
        (z,) = ctx.saved_tensors
        return _Square.scale * 2 * z * g


class _SquareSavingIntermediate(torch.autograd.Function):
    """The right first derivative through ``2 z`` saved in forward without history: half of
    the second derivative is missing."""

    @staticmethod
    def forward(ctx, z):
        ctx.save_for_backward(z, 2 * z)
        return z * z

    @staticmethod
    def backward(ctx, g):
        z, twice = ctx.saved_tensors
        return (z + twice / 2) * g


_AT_ZERO = st.tuples(tensors(shape=(6,), dtype=torch.float32, requires_grad=True)
                     .map(_planted(0.0)))


def test_a_square_function_passes_double_backward_at_the_kink_of_abs():
    @equivalent_to(_abs_squared, inputs=_AT_ZERO)
    def square(z):
        _Square.scale = 1.0
        return _Square.apply(z)

    report = check(square, settings=SECOND_BACKWARDS, raise_on_failure=False)
    assert report.ok, report.findings[:1]
    assert any(n.startswith("double-backward: second-order gradient w.r.t. 'z' not compared at "
                            "z") and "the reference's derivative has a kink there" in n
               for n in report.notes), report.notes


def test_a_square_function_with_a_wrong_backward_still_fails_double_backward():
    @equivalent_to(_abs_squared, inputs=_AT_ZERO)
    def square(z):
        _Square.scale = 1.01
        return _Square.apply(z)

    report = check(square, settings=SECOND_BACKWARDS, raise_on_failure=False)
    by_check = {f.check: f for f in report.findings}
    assert set(by_check) == {"gradients", "double-backward"}
    f = by_check["double-backward"]
    assert f.headline == ("second-order gradient (double backward) w.r.t. 'z' differs from the "
                          "reference.")
    assert "partly differentiable" not in (f.likely_cause or "")
    assert "first-order gradients already differ" in f.likely_cause


def test_a_square_function_saving_an_intermediate_is_partly_differentiable():
    @equivalent_to(_abs_squared, inputs=_AT_ZERO)
    def square(z):
        return _SquareSavingIntermediate.apply(z)

    report = check(square, settings=SECOND_BACKWARDS, raise_on_failure=False)
    assert {f.check for f in report.findings} == {"double-backward"}
    f = report.findings[0]
    assert "_SquareSavingIntermediate's backward is only partly differentiable" in \
        f.likely_cause
    assert "saved tensor #1" in f.likely_cause


def test_a_detach_in_backward_fails_double_backward_without_claiming_a_saved_value():
    class SquareDetaching(torch.autograd.Function):
        @staticmethod
        def forward(ctx, z):
            ctx.save_for_backward(z)
            return z * z

        @staticmethod
        def backward(ctx, g):
            (z,) = ctx.saved_tensors
            return (z + z.detach()) * g

    @equivalent_to(_abs_squared, inputs=_AT_ZERO)
    def square(z):
        return SquareDetaching.apply(z)

    report = check(square, settings=SECOND_BACKWARDS, raise_on_failure=False)
    assert {f.check for f in report.findings} == {"double-backward"}
    assert report.findings[0].likely_cause is None


# -- a float64 oracle that is another function --------------------------------------------------
_P = 0.5


def _mask(x: torch.Tensor) -> torch.Tensor:
    """A dropout mask drawn in ``x``'s dtype from a seeded generator (float32 and float64 draw
    different masks from one seed)."""
    return torch.rand(x.shape, generator=torch.Generator().manual_seed(0), dtype=x.dtype) >= _P


def _dropout_ref(x):
    return x * _mask(x) / (1 - _P)


class _Dropout(torch.autograd.Function):
    scale = 1.0

    @staticmethod
    def forward(ctx, x):
        m = _mask(x)
        ctx.save_for_backward(m)
        return x * m / (1 - _P)

    @staticmethod
    def backward(ctx, g):
        (m,) = ctx.saved_tensors
        return g * m * (_Dropout.scale / (1 - _P))


def _dropout_spec(scale: float):
    @equivalent_to(_dropout_ref, inputs=st.tuples(tensors(shape=(4, 8), dtype=torch.float32,
                                                          requires_grad=True)))
    def dropout(x):
        _Dropout.scale = scale
        return _Dropout.apply(x)

    return dropout


def test_a_dropout_kernel_drawing_the_references_mask_passes():
    report = check(_dropout_spec(1.0), settings=FAST, raise_on_failure=False)
    assert report.ok, report.findings[:1]


def test_a_dropout_kernel_with_a_wrong_gradient_scale_fails_against_the_float32_reference():
    """The float64 reference draws another mask: it cannot judge, the float32 reference does."""
    report = check(_dropout_spec(1.5), settings=FAST, raise_on_failure=False)
    assert not report.ok
    f = report.findings[0]
    assert f.check == "gradients" and f.headline == ("gradient w.r.t. 'x' differs from the "
                                                     "reference on backward #1.")
    assert "the float64 reference is not a valid oracle for this example" in f.details
    assert "judged against the reference in float32" in f.details
    assert not f.rounding_level
    assert any("not a valid oracle" in n for n in report.notes)
