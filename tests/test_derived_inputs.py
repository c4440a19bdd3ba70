"""Derived inputs that reach the cases real kernels break on: complex values (opt-in dtypes),
exact zeros and ties (only where the reference is smooth), lengths that straddle a tile size,
broadcast shapes, and the row-and-column aliasing variant. Each bug is caught through
``equiv.check`` from inputs derived from the signature alone; each correct twin passes.

The tests at the end exercise the engine's side: cotangent variants (layouts, zeros, undefined
gradients of unused outputs), batched gradients in the vmap mode, write-only buffers poisoned
with NaN, and ``equiv.assert_equivalent`` inside a user's own ``@given`` test."""

from __future__ import annotations

import hypothesis
import pytest
import torch
from hypothesis import given, strategies as st

import equiv
import equiv.strategies as es
from equiv import equivalent_to

#: fixed seeds, no database, the default budget of 60 examples (bench/detection_inputs.py
#: measures the detection rate over 20 seeds)
SEEDS = (0, 1)
BUDGET = 60


def run(impl, seed: int = 0, budget: int = BUDGET, **options) -> equiv.Report:
    options = {"modes": ("eager",), **options}
    cfg = equiv.settings(seed=seed, max_examples=budget,
                         hypothesis_settings=hypothesis.settings(database=None), **options)
    return equiv.check(impl, settings=cfg, raise_on_failure=False)


def caught(impl, check: str, *lines: str, **options) -> equiv.Finding:
    """``impl`` is caught on every seed, by ``check``, with ``lines`` in the message."""
    for seed in SEEDS:
        report = run(impl, seed, **options)
        assert not report.ok, f"seed {seed}: not caught in {report.examples_run} examples"
        f = next((f for f in report.findings if f.check == check), None)
        assert f is not None, report.render()
        for line in lines:
            assert line in f.message, f.message
    return f


def passes(impl, **options) -> None:
    for seed in SEEDS:
        report = run(impl, seed, **options)
        assert report.ok, report.render()
        assert report.examples_run >= 40


# -- complex: the conjugate convention -----------------------------------------------------------
def cmul_ref(x, y):
    return x * y


def _complex_mul(conjugate: bool):
    class CMul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            ctx.save_for_backward(x, y)
            return x * y

        @staticmethod
        def backward(ctx, grad):
            x, y = ctx.saved_tensors
            if conjugate:  # torch's convention: grad_x = grad * conj(dy/dx)
                return grad * y.conj(), grad * x.conj()
            return grad * y, grad * x
    return CMul


COMPLEX = ("float32", "complex64")


def test_complex_multiply_missing_the_conjugate_is_caught():
    """Real inputs cannot see it (conj is the identity there): complex64 from the opt-in
    ``settings(dtypes=...)`` does."""
    fn = _complex_mul(conjugate=False)

    @equivalent_to(cmul_ref, settings=equiv.settings(dtypes=COMPLEX))
    def cmul(x, y):
        return fn.apply(x, y)

    f = caught(cmul, "gradients", "GradientMismatch", "dtype: torch.complex64",
               "differs from the reference")
    assert "c64[" in f.example


def test_complex_multiply_twin_passes():
    fn = _complex_mul(conjugate=True)

    @equivalent_to(cmul_ref, settings=equiv.settings(dtypes=COMPLEX))
    def cmul(x, y):
        return fn.apply(x, y)

    passes(cmul)


def test_real_inputs_miss_the_conjugate_bug():
    """The control: without complex dtypes the bug is invisible."""
    fn = _complex_mul(conjugate=False)

    @equivalent_to(cmul_ref)
    def cmul(x, y):
        return fn.apply(x, y)

    assert run(cmul).ok


# -- exact zeros: a backward that divides by the input -------------------------------------------
def cumprod_ref(x):
    return torch.cumprod(x, dim=-1)


class CumprodDivides(torch.autograd.Function):
    """d/dx_i of sum_j g_j * prod_{k<=j} x_k = (sum_{j>=i} g_j y_j) / x_i: nan at x_i = 0."""

    @staticmethod
    def forward(ctx, x):
        y = torch.cumprod(x, dim=-1)
        ctx.save_for_backward(x, y)
        return y

    @staticmethod
    def backward(ctx, grad):
        x, y = ctx.saved_tensors
        if x.dim() == 0:
            return grad
        return (grad * y).flip(-1).cumsum(-1).flip(-1) / x


class CumprodExact(torch.autograd.Function):
    """The same forward; backward through the product itself (no division)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return torch.cumprod(x, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            leaf = x.detach().requires_grad_(True)
            return torch.autograd.grad(torch.cumprod(leaf, dim=-1), leaf, grad)[0]


def test_cumprod_backward_dividing_by_the_input_is_caught_via_exact_zeros():
    @equivalent_to(cumprod_ref)
    def cumprod(x):
        return CumprodDivides.apply(x)

    f = caught(cumprod, "gradients", "GradientMismatch", "input variant: exact zeros in x")
    assert "0.0" in f.example_code


def test_cumprod_twin_passes_with_zeros():
    @equivalent_to(cumprod_ref)
    def cumprod(x):
        return CumprodExact.apply(x)

    passes(cumprod)


def test_zeros_stay_out_of_a_reference_kink():
    """``clamp(min=0)`` and ``relu`` disagree on the gradient at exactly 0 (1 vs 0): both are
    valid subgradients, so zeros are never planted where the reference has that kink."""
    @equivalent_to(lambda x: torch.relu(x))
    def relu(x):
        return x.clamp(min=0)

    passes(relu)


def test_ties_stay_out_of_a_max_kink():
    """``amax`` splits the gradient between tied maxima; ``max`` gives it to one: both valid."""
    @equivalent_to(lambda x: x.amax())
    def largest(x):
        return x.reshape(-1).max() if x.numel() else x.amax()

    passes(largest)


def test_planted_values_probe():
    """The smoothness probe: kinks and jumps refuse a plant, smooth references keep it."""
    from equiv.strategies._derived import smooth_at

    x = torch.tensor([0.0, 1.5])
    assert not smooth_at(torch.relu, [x], {}, {0: [0]})
    assert not smooth_at(torch.sign, [x], {}, {0: [0]})            # a jump in the forward
    assert smooth_at(lambda t: torch.cumprod(t, 0), [x], {}, {0: [0]})
    assert smooth_at(lambda t: t * t, [x], {}, {0: [0]})
    tie = torch.tensor([1.5, 1.5])
    assert not smooth_at(lambda t: t.max(), [tie], {}, {0: [1]})
    assert not smooth_at(lambda t: 1 / t, [x], {}, {0: [0]})       # inf at the plant


# -- ties across arguments: clamp with tensor bounds -------------------------------------------
def clamp_ref(x, lo, hi):
    return torch.minimum(torch.maximum(x, lo), hi)


def test_ties_across_arguments_stay_out_of_a_clamp_kink():
    """Simple values repeat across arguments (``x == lo == hi``), and the alias variants make
    ``lo`` and ``hi`` one tensor; ``clamp_`` and ``minimum(maximum(...))`` split the gradient
    differently there. Both are valid: with default settings the correct kernel passes."""
    @equivalent_to(clamp_ref, mutates={"x": "out"})
    def clamp_(x, lo, hi):
        return x.clamp_(lo, hi)

    cfg = equiv.settings(seed=0, hypothesis_settings=hypothesis.settings(database=None))
    report = equiv.check(clamp_, settings=cfg, raise_on_failure=False)
    assert report.ok, report.render()


def test_a_clamp_losing_the_bound_gradient_is_still_caught():
    @equivalent_to(clamp_ref, mutates={"x": "out"})
    def clamp_(x, lo, hi):
        return x.clamp_(lo.detach(), hi)  # no gradient for lo

    caught(clamp_, "gradients", "GradientMismatch", "gradient w.r.t. 'lo'")


def test_ties_across_arguments_are_found_and_broken():
    from equiv.strategies._derived import break_ties, cross_ties

    x, lo, hi = torch.tensor([0.5, 1.5]), torch.tensor([0.5, -0.5]), torch.tensor([0.5])
    values = [x, lo, 2.0, hi, torch.ones(3)]  # a scalar and a shape that does not broadcast
    ties = cross_ties(values)
    assert ties == {1: [0], 3: [0]}
    break_ties(values, ties)
    assert cross_ties(values) == {} and x.tolist() == [0.5, 1.5]
    assert lo[0] != hi[0] and 0.5 < float(lo[0]) < 1.0 and 0.5 < float(hi[0]) < 1.0


TIED = (torch.tensor([0.5, 1.5], requires_grad=True),
        torch.tensor([0.5, -1.0], requires_grad=True),
        torch.tensor([2.0, 3.0], requires_grad=True))


def test_a_tie_across_arguments_drawn_anyway_passes_where_one_side_is_taken():
    """x[0] == lo[0]: torch.clamp sends the gradient to x, the reference to lo; each is the
    reference's derivative from one side of the tie. Accepted, with a note."""
    @equivalent_to(clamp_ref, inputs=st.just(TIED), variants=False)
    def clamp(x, lo, hi):
        return torch.clamp(x, lo, hi)

    for seed in SEEDS:
        report = run(clamp, seed)
        assert report.ok, report.render()
        assert any("the implementation takes the reference's own one-sided derivative" in n
                   for n in report.notes), report.notes


def test_a_tie_across_arguments_where_neither_side_is_taken_is_named_in_the_likely_cause():
    """Sending the gradient at the tie to both x and lo counts it twice: neither side's
    derivative. The finding names the tie."""
    @equivalent_to(clamp_ref, inputs=st.just(TIED), variants=False)
    def clamp(x, lo, hi):
        tie = (x.detach() == lo.detach()).to(x.dtype)
        return torch.clamp(x, lo, hi) + (x - x.detach()) * tie

    f = caught(clamp, "gradients", "GradientMismatch")
    assert f.likely_cause.startswith("x[0] = 0.5 and ties lo[0] (equal values in two "
                                     "arguments; moving the tied value changes the "
                                     "reference's gradient)"), f.likely_cause


# -- tile sizes: a reduction wrong only off a multiple of its block --------------------------------
def rowsum_ref(x):
    return x.sum(-1)


def _tiled_sum(x: torch.Tensor, block: int, drop_tail: bool) -> torch.Tensor:
    """Row sums in blocks of ``block``; a row shorter than one block takes a fast path. Half
    inputs accumulate their partial sums in float32 (as a correct low-precision kernel does)."""
    n = x.shape[-1] if x.dim() else 1
    if x.dim() == 0 or n <= block:
        return x.sum(-1)
    acc = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
    full = n // block * block
    total = acc[..., :full].reshape(*x.shape[:-1], n // block, block).sum(-1).sum(-1)
    if not drop_tail:
        total = total + acc[..., full:].sum(-1)
    return total.to(x.dtype)


def test_tiled_reduction_dropping_the_tail_is_caught_with_block_sizes():
    @equivalent_to(rowsum_ref, block_sizes=(32,))
    def rowsum(x):
        return _tiled_sum(x, 32, drop_tail=True)

    f = caught(rowsum, "forward", "OutputMismatch")
    length = int(f.example.split("[")[1].split("]")[0].split(",")[-1])
    assert length > 32 and length % 32, f.example


def test_tiled_reduction_dropping_the_tail_is_caught_with_default_lengths():
    """Without block_sizes=: the default lengths 2^k +- 1 straddle a block of 32 too."""
    @equivalent_to(rowsum_ref)
    def rowsum(x):
        return _tiled_sum(x, 32, drop_tail=True)

    f = caught(rowsum, "forward", "OutputMismatch")
    length = int(f.example.split("[")[1].split("]")[0].split(",")[-1])
    assert length > 32 and length % 32, f.example


def test_tiled_reduction_twin_passes():
    @equivalent_to(rowsum_ref, block_sizes=(32,))
    def rowsum(x):
        return _tiled_sum(x, 32, drop_tail=False)

    passes(rowsum)


@pytest.mark.parametrize("value, match", [
    ((1,), "block_sizes"), ("64", "block_sizes"), ((64.0,), "from 2 to 2048"), (3, "tuple")])
def test_bad_block_sizes_fail_at_decoration(value, match):
    with pytest.raises(equiv.InvalidArgument, match=match):
        equivalent_to(rowsum_ref, block_sizes=value)


def test_tile_lengths():
    assert es.tile_lengths((64,)) == (63, 64, 65, 127, 128, 129, 191, 192, 193)
    assert {1, 2, 3, 7, 8, 9, 2047, 2048, 2049} <= set(es.TILE_LENGTHS)


# -- broadcasting: several tensor arguments ------------------------------------------------------
def add_ref(x, y):
    return x + y


def test_broadcast_bug_is_caught_and_named():
    """A kernel that keeps x's shape: it sums the result back down (as a gradient would)."""
    @equivalent_to(add_ref)
    def add(x, y):
        out = x + y
        return out.sum_to_size(x.shape) if out.shape != x.shape else out

    caught(add, "forward", "input variant: broadcast shapes: x (")


def test_broadcast_refusing_implementation_is_excused():
    """An implementation that refuses to broadcast may raise ("must raise or match")."""
    @equivalent_to(add_ref)
    def add(x, y):
        if x.shape != y.shape:
            raise ValueError("add: x and y must have the same shape")
        return x + y

    passes(add)


def test_a_reference_that_does_not_broadcast_gets_the_shared_shape():
    """The reference refusing broadcast shapes costs no rejected examples."""
    def dot_ref(x, y):
        assert x.shape == y.shape
        return (x * y).sum()

    @equivalent_to(dot_ref)
    def dot(x, y):
        return (x * y).sum()

    for seed in SEEDS:
        report = run(dot, seed)
        assert report.ok and report.examples_run >= BUDGET - 2, report.render()


def test_mutated_argument_keeps_the_full_broadcast_shape():
    @equivalent_to(lambda x, y: x + y, mutates={"x": "out"})
    def add_(x, y):
        return x.add_(y)

    passes(add_)


# -- independent lengths: attention's query and key lengths ---------------------------------------
def _attention(q, k, v, bottom_right: bool):
    """Causal attention over the last two dims; with ``bottom_right`` the last query sees every
    key (the alignment for a query block at the end of a longer key sequence), else query i
    sees keys 0..i (top-left). Equal lengths hide the difference."""
    lq, lk = q.shape[-2], k.shape[-2]
    scores = q @ k.transpose(-2, -1)
    i = torch.arange(lq)[:, None]
    j = torch.arange(lk)[None, :]
    seen = j <= i + (lk - lq if bottom_right else 0)
    scores = scores.masked_fill(~seen, torch.finfo(scores.dtype).min)
    return torch.softmax(scores, dim=-1) @ v


def attention_ref(q, k, v):
    lq, lk = q.shape[-2], k.shape[-2]
    mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)  # bottom-right aligned
    scores = (q @ k.transpose(-2, -1)).masked_fill(~mask, torch.finfo(q.dtype).min)
    return torch.softmax(scores, dim=-1) @ v


def test_causal_mask_aligned_at_the_wrong_corner_is_caught_with_independent_lengths():
    """Shared shapes give q and k one length, where both corners coincide; the reference
    refuses broadcast shapes (``k.transpose(-2, -1)`` of a 1-D k), so the derived inputs also
    draw another length for some arguments along one dim: examples where q is shorter than k
    are drawn, and on one the wrong corner fails the forward check. (How often a run of 60
    examples draws one: ``bench/detection_inputs.py``, about nine runs in ten.)"""
    import inspect
    from equiv.strategies import arguments_for

    @equivalent_to(attention_ref)
    def attention(q, k, v):
        return _attention(q, k, v, bottom_right=False)

    drawn = hypothesis.find(
        arguments_for(inspect.signature(attention_ref), reference=attention_ref),
        lambda a: a.args[0].dim() >= 2 and 1 <= a.args[0].shape[-2] < a.args[1].shape[-2]
        and all(t.numel() for t in a.args),  # empty features: no output for a mask to move
        settings=hypothesis.settings(database=None, max_examples=2000))
    q, k, v = (t.detach() for t in drawn.args)
    with pytest.raises(equiv.OutputMismatch) as found:
        equiv.assert_equivalent(attention, q, k, v)
    assert found.value.report.findings[0].check == "forward", found.value


def test_causal_mask_aligned_at_the_right_corner_passes():
    @equivalent_to(attention_ref)
    def attention(q, k, v):
        return _attention(q, k, v, bottom_right=True)

    passes(attention)


def test_independent_lengths_keep_the_shapes_the_reference_accepts():
    """Every candidate the plan offers changes one dim of a proper subset of the arguments;
    index 0 of each choice is the first dim, the first subset, the shortest other length."""
    from equiv.strategies._derived import independent_lengths

    def smallest(base):
        return hypothesis.find(st.composite(lambda draw: independent_lengths(draw, base, 3))(),
                               lambda s: True, settings=hypothesis.settings(database=None))

    shapes = smallest((2, 3, 4))
    assert shapes[0] == ((1, 3, 4), (2, 3, 4), (2, 3, 4))
    for cand in shapes:
        changed = [s != (2, 3, 4) for s in cand]
        assert any(changed) and not all(changed)
        assert len({d for s in cand for d, (a, b) in enumerate(zip(s, (2, 3, 4))) if a != b}) == 1
    assert ((2, 3, 4), (2, 1, 4), (2, 1, 4)) in shapes
    assert smallest(()) == []


# -- extremes: large and non-finite values (opt-in variant) --------------------------------------
EXTREMES = ("layouts", "aliasing", "half-float32", "extremes")


def clip_ref(g):
    """Scale ``g`` to norm at most 1; a non-finite norm skips the step (zeros), as AMP does."""
    with torch.no_grad():
        norm = torch.linalg.vector_norm(g)
        scale = torch.clamp(1.0 / (norm + 1e-6), max=1.0)
        return torch.where(torch.isfinite(norm), g * scale, torch.zeros_like(g))


def _clip_unguarded(g):
    """Scale to norm at most 1 without the non-finite check: an inf or NaN spreads NaN."""
    with torch.no_grad():
        return g * torch.clamp(1.0 / (torch.linalg.vector_norm(g) + 1e-6), max=1.0)


def _clip_guarded(g):
    """The guard in Python and the scale as a Python float. The norm is vector_norm's: a
    hand-written ``g.square().sum().sqrt()`` overflows where vector_norm does not (one element
    near float32's max; 127 float16 elements of magnitude ~60), which is a real bug."""
    with torch.no_grad():
        norm = torch.linalg.vector_norm(g)
        if not torch.isfinite(norm):
            return torch.zeros_like(g)
        return g * min(1.0, 1.0 / (float(norm) + 1e-6))


def test_grad_clipping_missing_the_non_finite_check_is_caught_with_extremes():
    @equivalent_to(clip_ref, variants=EXTREMES)
    def clip(g):
        return _clip_unguarded(g)

    caught(clip, "forward", "input variant: extremes in g:")


def test_grad_clipping_with_the_non_finite_check_passes_with_extremes():
    @equivalent_to(clip_ref, variants=EXTREMES)
    def clip(g):
        return _clip_guarded(g)

    passes(clip)


def test_moderate_values_miss_the_missing_non_finite_check():
    """The control: without the variant the bug is invisible."""
    @equivalent_to(clip_ref)
    def clip(g):
        return _clip_unguarded(g)

    assert run(clip).ok


class _StableSoftplus(torch.autograd.Function):
    """softplus without overflow in float16: ``x + log1p(exp(-x))`` past 10."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        big = x > 10
        return torch.where(big, x + torch.log1p(torch.exp(-x.clamp(min=10))),
                           torch.log1p(torch.exp(x.clamp(max=10))))

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad * torch.sigmoid(x)


HALF = equiv.settings(dtypes=("float16",))


def test_naive_softplus_overflowing_in_float16_is_caught_with_extremes():
    @equivalent_to(torch.nn.functional.softplus, variants=EXTREMES, settings=HALF)
    def softplus(x):
        return _naive_softplus(x)

    caught(softplus, "forward", "dtype: torch.float16")
    # the plain float16 values reach past 11.09 too: shrinking keeps the extremes variant only
    # where no plain example fails, as on seed 0
    f = next(f for f in run(softplus, 0).findings if f.check == "forward")
    assert "input variant: extremes in x:" in f.message, f.message


def _naive_softplus(x):
    """``log(1 + exp(x))`` with exp in the input's dtype (log1p in float32): overflows past
    11.09 in float16, and is otherwise within rounding."""
    return torch.log1p(torch.exp(x).float()).to(x.dtype)


def test_stable_softplus_passes_with_extremes_in_float16():
    @equivalent_to(torch.nn.functional.softplus, variants=EXTREMES, settings=HALF)
    def softplus(x):
        return _StableSoftplus.apply(x)

    passes(softplus)


def test_extremes_are_kept_only_where_the_reference_stays_comparable():
    from equiv.strategies._extremes import comparable, extreme_values

    assert extreme_values(torch.float16)[:4] == (11.5, -11.5, 12.0, -12.0)
    assert extreme_values(torch.float32)[2] == 89.0 and extreme_values(torch.float32)[-3:-1] == (
        float("inf"), float("-inf"))
    big = torch.tensor([3e38, 1.0])
    assert comparable(torch.exp, [torch.tensor([float("inf"), 1.0])], {})  # inf at both
    assert not comparable(lambda x: x * x, [big], {})       # overflows in float32 only
    assert comparable(lambda x: x * 0.5, [big], {})
    assert not comparable(None, [big], {})
    def strict(x):
        if not torch.isfinite(x * x).all():
            raise ValueError("non-finite")
        return x

    assert not comparable(strict, [big], {})   # raises in float32 only
    assert comparable(strict, [torch.tensor([float("nan")])], {})  # raises at both


# -- aliasing: the row and the column of one base ------------------------------------------------
def _dedup_mul(key):
    class Mul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            ctx.save_for_backward(x, y)
            if key(x) == key(y):  # "the same tensor twice": square once
                return x.square()
            return x * y

        @staticmethod
        def backward(ctx, grad):
            x, y = ctx.saved_tensors
            return grad * y, grad * x
    return Mul


def test_function_deduplicating_by_data_ptr_is_caught_with_row_and_column_views():
    fn = _dedup_mul(lambda t: t.data_ptr())

    @equivalent_to(cmul_ref)
    def mul(x, y):
        return fn.apply(x, y)

    # found on row-and-column views, or on another variant with one start address (same
    # tensor is handled correctly, so it is never that one)
    f = caught(mul, "forward", "OutputMismatch", "input variant: ")
    assert "as_strided" in f.example_code and "same tensor" not in f.message


def test_function_deduplicating_by_full_geometry_passes():
    fn = _dedup_mul(lambda t: (t.data_ptr(), t.shape, t.stride()))

    @equivalent_to(cmul_ref)
    def mul(x, y):
        return fn.apply(x, y)

    passes(mul)


def test_row_and_column_views_share_the_start_address_only():
    from equiv.variants import _row_and_column

    x, y = torch.arange(1.0, 4.0), torch.arange(10.0, 13.0)
    r, c = _row_and_column(x, y)
    assert r.data_ptr() == c.data_ptr() and r.stride() != c.stride()
    assert r.tolist() == [1.0, 2.0, 3.0] and c.tolist() == [1.0, 11.0, 12.0]


# -- strategy-level properties -------------------------------------------------------------------
def test_hard_cases_off_draws_the_plain_examples():
    import inspect

    def f(x, y):
        pass

    sig = inspect.signature(f)
    plain = hypothesis.find(es.arguments_for(sig, hard_cases=False), lambda a: True,
                            settings=hypothesis.settings(database=None))
    assert plain.args[0].shape == plain.args[1].shape


@hypothesis.settings(max_examples=150, database=None, deadline=None,
                     suppress_health_check=[hypothesis.HealthCheck.too_slow])
@given(st.data())
def test_tile_shapes_stay_bounded(data):
    import inspect

    def f(x):
        pass

    ex = data.draw(es.arguments_for(inspect.signature(f), block_sizes=(1000,)))
    assert ex.args[0].numel() <= 4096


# -- cotangents, batched gradients, write-only buffers, assert_equivalent ---------------------------------------------------------------------------
def double_ref(x):
    return x * 2


def _double(backward):
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            return backward(grad)

    @equivalent_to(double_ref)
    def double(x):
        return Double.apply(x)
    return double


def test_backward_assuming_a_contiguous_cotangent_is_caught():
    """Reads grad's memory as if it were row-major: the minimal example is a strided cotangent
    (every other element of a buffer: the lowest non-contiguous layout)."""
    def backward(grad):
        flat = grad.as_strided((grad.numel(),), (1,), grad.storage_offset())
        return flat.reshape(grad.shape) * 2

    f = caught(_double(backward), "gradients", "GradientMismatch",
               "cotangent: strided (output: strides (2,), offset 1)")
    assert "differs from the reference on backward #1" in f.headline


def test_backward_viewing_the_cotangent_is_caught_and_names_the_layout():
    """``grad.view(-1)`` raises on a transposed or expanded cotangent (a strided 1-D one views
    fine): the finding names the layout and its strides."""
    def backward(grad):
        return grad.view(-1).view(grad.shape) * 2

    f = caught(_double(backward), "gradients", "backward raised RuntimeError", "cotangent: ",
               "strides (")
    assert "cotangent: transposed" in f.message or "cotangent: expanded" in f.message, f.message


def test_backward_handling_any_cotangent_layout_passes():
    passes(_double(lambda grad: grad.reshape(-1).reshape(grad.shape) * 2))


def _both(backward):
    class Both(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.set_materialize_grads(False)
            return x * 2, x * 3

        @staticmethod
        def backward(ctx, g1, g2):
            return backward(g1, g2)

    @equivalent_to(lambda x: (x * 2, x * 3))
    def both(x):
        return Both.apply(x)
    return both


def test_backward_wrong_on_an_undefined_gradient_is_caught():
    # crashes when the second output is unused (g2 is None)
    f = caught(_both(lambda g1, g2: g1 * 2 + g2 * 3), "gradients",
               "cotangent: None for output[1] (undefined", "TypeError")
    assert "backward raised TypeError" in f.headline


def test_backward_handling_undefined_gradients_passes():
    def backward(g1, g2):
        if g1 is None and g2 is None:
            return None
        return sum(g * k for g, k in ((g1, 2), (g2, 3)) if g is not None)

    passes(_both(backward))


def test_backward_zeroing_an_undefined_gradient_wrongly_is_caught():
    """Treating an undefined gradient as ones (not zeros) is wrong only when it is undefined."""
    def backward(g1, g2):
        g2 = torch.ones_like(g1) if g2 is None else g2
        return g1 * 2 + g2 * 3

    caught(_both(backward), "gradients", "GradientMismatch", "cotangent: None for output[1]")


def _double_batched(backward):
    class Double(torch.autograd.Function):
        generate_vmap_rule = True

        @staticmethod
        def forward(x):
            return x * 2

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.shape = inputs[0].shape

        @staticmethod
        def backward(ctx, grad):
            return backward(ctx, grad)

    @equivalent_to(double_ref)
    def double(x):
        return Double.apply(x)
    return double


def test_batched_gradient_bug_is_caught_in_vmap_mode():
    def backward(ctx, grad):
        out = torch.zeros(ctx.shape, dtype=grad.dtype)
        out.copy_(grad * 2)  # a preallocated unbatched buffer: breaks under vmap
        return out

    f = caught(_double_batched(backward), "gradients", "batched gradient",
               "aten::copy_", modes=("vmap",))
    assert f.mode == "vmap" and "backward raised RuntimeError" in f.headline


def test_batched_gradient_twin_passes_in_vmap_mode():
    passes(_double_batched(lambda ctx, grad: torch.zeros_like(grad).copy_(grad * 2)),
           modes=("vmap",))


def add_out_ref(x, y, out):
    return x + y


def _add_out(kernel, **options):
    @equivalent_to(add_out_ref, mutates={"out": "out"}, **options)
    def add_out(x, y, out):
        return kernel(x, y, out)
    return add_out


def _reads_out(x, y, out):
    return out.mul_(0).add_(x + y)  # reads out: 0 * stale is 0 unless stale is nan/inf


def test_out_kernel_reading_its_buffer_is_caught_by_poisoning():
    f = caught(_add_out(_reads_out, write_only=("out",)), "mutation",
               "write-only argument 'out' was read")
    assert "final value of mutated argument" in f.headline


def test_out_kernel_reading_its_buffer_passes_without_write_only():
    """The control: with the drawn (finite) values in the buffer the bug is invisible."""
    passes(_add_out(_reads_out))


def test_out_kernel_overwriting_its_buffer_passes_poisoned():
    passes(_add_out(lambda x, y, out: out.copy_(x + y), write_only=("out",)))


def test_poisoning_leaves_the_callers_tensors_and_the_reference_alone():
    seen = []

    def ref(x, y, out):
        seen.append(bool(out.isnan().any()))
        return x + y

    @equivalent_to(ref, mutates={"out": "out"}, write_only=("out",),
                   examples=[(torch.ones(2), torch.ones(2), torch.zeros(2))])
    def add_out(x, y, out):
        assert out.isnan().all()
        return out.copy_(x + y)

    assert run(add_out, budget=5).ok
    assert seen and not any(seen)


def test_poisoned_buffer_is_restored_when_both_sides_raise():
    """Raising before writing is no partial write: the NaN was equiv's, not the kernel's."""
    def ref(x, y, out):
        if x.dim() == 0:
            raise ValueError("add_out: 0-d inputs are not supported")
        return x + y

    @equivalent_to(ref, mutates={"out": "out"}, write_only=("out",), raises=ValueError)
    def add_out(x, y, out):
        if x.dim() == 0:
            raise ValueError("add_out: 0-d inputs are not supported")
        return out.copy_(x + y)

    passes(add_out)


@pytest.mark.parametrize("value, match", [
    (("y",), r"\['y'\] not declared in mutates="), ((3,), "tuple of argument names")])
def test_bad_write_only_fails_at_decoration(value, match):
    with pytest.raises(equiv.InvalidArgument, match=match):
        equivalent_to(add_out_ref, mutates={"out": "out"}, write_only=value)


def test_assert_equivalent_inside_a_users_given_test():
    @equivalent_to(double_ref)
    def double(x):
        return x + x if x.dim() < 2 else x * 2.5  # wrong for 2-d and more

    # deadline=None: the first call loads torch's autograd machinery (hundreds of ms)
    @hypothesis.settings(max_examples=20, database=None, deadline=None)
    @given(es.tensors(shape=es.shapes(), requires_grad=True))
    def user_test(x):
        equiv.assert_equivalent(double, x)

    with pytest.raises(equiv.OutputMismatch) as e:
        user_test()
    # Hypothesis shrinks the user's example: the smallest failing one is 2-d of one element
    assert "x=f32[1,1] cpu" in e.value.report.findings[0].example


def test_assert_equivalent_passes_a_correct_twin_and_leaves_the_tensors_alone():
    @equivalent_to(lambda x, out: x * 2, mutates={"out": "out"}, write_only=("out",))
    def double_out(x, out):
        return out.copy_(x * 2)

    @hypothesis.settings(max_examples=20, database=None, deadline=None)
    @given(es.tensors(shape=es.shapes(), requires_grad=True))
    def user_test(x):
        out = torch.zeros(x.shape)
        before = x.detach().clone()
        report = equiv.assert_equivalent(double_out, x, out)
        assert report.ok and report.examples_run == 1
        assert torch.equal(x, before) and not out.any()

    user_test()


def test_assert_equivalent_raises_the_findings_class_with_the_example():
    class Wrong(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * 3

    @equivalent_to(double_ref)
    def double(x):
        return Wrong.apply(x)

    with pytest.raises(equiv.GradientMismatch) as e:
        equiv.assert_equivalent(double, torch.ones(2, requires_grad=True))
    f = e.value.report.findings[0]
    assert f.check == "gradients" and "x=f32[2]" in f.example
    assert "equiv.assert_equivalent(double" in f.reproduce


def test_complex_values_are_judged_against_a_complex128_oracle():
    """A complex64 kernel is judged like a float32 one: against the reference in complex128,
    not the per-dtype default with a "no float64 oracle" note."""
    fn = _complex_mul(conjugate=False)
    x = torch.tensor([0.5 + 0.5j, 1.5 - 0.5j], dtype=torch.complex64, requires_grad=True)
    y = torch.tensor([-0.5 + 1.5j, 0.5 + 0.5j], dtype=torch.complex64, requires_grad=True)

    @equivalent_to(cmul_ref, inputs=st.just((x, y)), variants=())
    def mul(x, y):
        return fn.apply(x, y)

    report = equiv.check(mul, settings=equiv.settings(max_examples=1, modes=("eager",)),
                         raise_on_failure=False)
    f = next(f for f in report.findings if f.check == "gradients")
    assert f.rule == "baseline" and "vs complex128" in f.message, f.message
    verdict = next(ln for ln in f.render().splitlines() if "verdict:" in ln)
    assert "vs complex128" in verdict, verdict
    assert not any("no float64 oracle" in n for n in report.notes), report.notes
