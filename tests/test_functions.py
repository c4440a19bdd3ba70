"""Custom autograd.Functions and torch.library custom ops (equiv.checks.function): each buggy
Function is caught with the right finding, each correct-but-tricky twin passes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
from torch.autograd.function import once_differentiable

import equiv
from equiv import equivalent_to
from equiv.checks import needs_input_grad as fn_checks
from equiv.numerics import round_to
from equiv.execution import graph as fn_graph
from equiv.strategies import tensors
from tests.conftest import FAST

ROOT = Path(__file__).resolve().parent.parent


def one(shape=(3, 4), requires_grad=True):
    return st.tuples(tensors(shape=shape, dtype=torch.float64, requires_grad=requires_grad))


def two(shape=(3,)):
    return st.tuples(tensors(shape=shape, dtype=torch.float64, requires_grad=True),
                     tensors(shape=shape, dtype=torch.float64, requires_grad=True, salt=1))


def failure(impl, expected=equiv.EquivalenceFailure, **kw):
    with pytest.raises(expected) as info:
        equiv.check(impl, settings=FAST, **kw)
    return info.value.report


def finding(report, check):
    found = [f for f in report.findings if f.check == check]
    assert found, f"no {check!r} finding in:\n{report.render()}"
    return found[0]


# --------------------------------------------------------------------------- registration
class MulSaved(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, scale: float = 1.0):
        ctx.save_for_backward(a, b)
        ctx.scale = scale
        return a * b * scale

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g * b * ctx.scale, g * a * ctx.scale, None


class MulNewStyle(torch.autograd.Function):
    @staticmethod
    def forward(a, b):
        return a * b

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g * b, g * a


def test_a_function_class_registers_directly_with_forwards_signature():
    """@equivalent_to on an autograd.Function subclass checks Fn.apply; ctx is not a parameter."""
    equivalent_to(lambda a, b, scale=1.0: a * b * scale)(MulSaved)
    spec = MulSaved.__equiv_spec__
    assert list(spec.signature.parameters) == ["a", "b", "scale"]
    assert spec.implementation.endswith("MulSaved.apply")
    report = equiv.check(MulSaved, settings=FAST)
    assert report.ok and report.examples_run > 0


def test_a_new_style_function_keeps_all_of_forwards_parameters():
    equivalent_to(lambda a, b: a * b)(MulNewStyle)
    assert list(MulNewStyle.__equiv_spec__.signature.parameters) == ["a", "b"]
    assert equiv.check(MulNewStyle, settings=FAST).ok


def test_a_function_without_a_readable_forward_is_a_clear_registration_error():
    class Opaque(torch.autograd.Function):
        forward = staticmethod(torch.relu)  # a builtin: no Python signature

        @staticmethod
        def backward(ctx, g):
            return g

    with pytest.raises(equiv.InvalidArgument, match="cannot read the signature of .*Opaque"
                                                    r"\.forward .*calls .*Opaque\.apply"):
        equivalent_to(torch.relu)(Opaque)


def test_a_subclass_does_not_inherit_its_parents_spec():
    equivalent_to(lambda a, b, scale=1.0: a * b * scale)(MulSaved)

    class MulSubclass(MulSaved):
        pass

    with pytest.raises(equiv.InvalidArgument, match="has no equiv spec"):
        equiv.check(MulSubclass, settings=FAST)
    assert equiv.check(MulSaved.apply, settings=FAST).ok  # the Reproduce line's spelling


def test_a_wrong_function_class_is_named_in_the_example():
    class MulWrong(MulSaved):
        @staticmethod
        def backward(ctx, g):
            a, b = ctx.saved_tensors
            return g * a, g * b, None

    equivalent_to(lambda a, b, scale=1.0: a * b * scale, inputs=two())(MulWrong)
    report = failure(MulWrong, equiv.GradientMismatch)
    f = finding(report, "gradients")
    assert "MulWrong.apply(a=f64[3] cpu grad, b=f64[3] cpu grad)" in f.example


# --------------------------------------------------------------------------- aliased slots
class MulDoubleCounts(torch.autograd.Function):
    """Correct unless a is b: then it 'pre-aggregates' into a but still returns b's share."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        ctx.same = a is b
        return a * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        if ctx.same:
            return 2 * g * a, g * a
        return g * b, g * a


class MulDedupByStorage(torch.autograd.Function):
    """Treats 'same storage' as 'same tensor': right for a is b, wrong for overlapping views."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        ctx.same = a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        return a * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        if ctx.same:
            return 2 * g * a, None
        return g * b, g * a


def same_tensor_twice():
    return one(shape=(4,)).map(lambda t: (t[0], t[0]))


def overlapping_views():
    base = tensors(shape=(4,), dtype=torch.float64, requires_grad=True)
    return base.map(lambda b: (b[:3], b[1:]))


def test_aliased_slots_catch_double_counting_when_a_is_b():
    @equivalent_to(lambda a, b: a * b, inputs=same_tensor_twice())
    def square(a, b):
        return MulDoubleCounts.apply(a, b)

    report = failure(square, equiv.GradientMismatch)
    f = finding(report, "gradients")
    assert f.headline == "gradient w.r.t. 'a' differs from the reference on backward #1."
    assert "square(a=f64[4] cpu grad, b=<same tensor as a>)" in f.example


def test_aliased_slots_pass_dedup_by_storage_when_a_is_b():
    # the claim is about a is b only: the runner's aliasing variants would (rightly) make a and b
    # overlapping views, where dedup by storage is wrong (the next test)
    @equivalent_to(lambda a, b: a * b, inputs=same_tensor_twice(), variants=("layouts",))
    def square(a, b):
        return MulDedupByStorage.apply(a, b)

    assert equiv.check(square, settings=FAST).ok


def test_aliased_slots_catch_dedup_by_storage_on_overlapping_views():
    @equivalent_to(lambda a, b: a * b, inputs=overlapping_views())
    def shifted_product(a, b):
        return MulDedupByStorage.apply(a, b)

    report = failure(shifted_product, equiv.GradientMismatch)
    f = finding(report, "gradients")
    assert "gradient w.r.t. 'storage shared by a, b' differs from the reference" in f.headline
    assert "b=f64[3] cpu grad (overlaps a (2 shared elements), storage offset 1, non-leaf)" in f.example


def test_the_seeds_function_passes_in_eager_with_k_in_two_slots():
    """examples/seed_attention.py: backward returns None for v because it pre-aggregates into k."""
    path = ROOT / "examples" / "seed_attention.py"
    spec = importlib.util.spec_from_file_location("seed_attention_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    report = equiv.check(module.attention, settings=FAST)
    assert report.ok and report.examples_run > 0
    # the aliased call really has the Function in its graph: the Function checks ran
    q, k = torch.randn(3, requires_grad=True), torch.randn(3, requires_grad=True)
    assert fn_graph.function_nodes(module.attention(q, k))


# --------------------------------------------------------------------------- mark_dirty
class ScaleNoDirty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 2


class ScaleDirty(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 2


def test_mark_dirty_catches_an_in_place_write_in_forward_without_it():
    @equivalent_to(lambda x: x * 2, mutates={"x": "out"}, inputs=one())
    def scale_(x):
        return ScaleNoDirty.apply(x)

    # an example drawn with a zero cotangent shows no gradient difference in the core's
    # backward, so the schedules (their own cotangents) may report the bug there too
    report = failure(scale_)
    assert {g.failure_class for g in report.findings} <= {equiv.GradientMismatch,
                                                          equiv.ScheduleMismatch}
    f = finding(report, "mark-dirty")
    assert f.argument == "x"
    assert f.headline == ("argument 'x' was written in place inside ScaleNoDirty.forward without "
                          "ctx.mark_dirty(x).")
    assert "version counter 0 -> 1 during the call" in f.details
    assert "Gradient consequence on this example: gradient w.r.t. 'x' differs" in f.details
    assert "call ctx.mark_dirty(x) in forward" in f.message
    assert "gradients" in {g.check for g in report.findings}


def test_mark_dirty_catches_the_write_on_an_undeclared_argument_too():
    """A pure contract: the write is also a mutation finding; the leaf is not rebased either."""

    @equivalent_to(lambda x: x * 2, inputs=one())
    def scale(x):
        return ScaleNoDirty.apply(x) * 1

    report = failure(scale)
    f = finding(report, "mark-dirty")
    assert "inside ScaleNoDirty.forward without ctx.mark_dirty(x)" in f.headline
    assert "a leaf" in f.details
    assert "No gradient difference on this example" in f.details  # x's new value is not compared
    assert "mutation" in {g.check for g in report.findings}


def test_mark_dirty_passes_a_correct_in_place_function_on_an_intermediate():
    @equivalent_to(lambda x: x * 4, inputs=one())
    def quadruple(x):
        return ScaleDirty.apply(x * 2)

    assert equiv.check(quadruple, settings=FAST).ok


def test_mark_dirty_passes_a_correct_in_place_function_on_a_declared_argument():
    @equivalent_to(lambda x: x * 2, mutates={"x": "out"}, inputs=one())
    def scale_(x):
        return ScaleDirty.apply(x)

    assert equiv.check(scale_, settings=FAST).ok


# --------------------------------------------------------------------------- needs_input_grad
def gated(first: int, second: int):
    class MulGated(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return a * b

        @staticmethod
        def backward(ctx, g):
            a, b = ctx.saved_tensors
            da = g * b if ctx.needs_input_grad[first] else None
            db = g * a if ctx.needs_input_grad[second] else None
            return da, db

    return MulGated


def test_needs_input_grad_catches_a_gate_on_the_wrong_index():
    """With every input requiring grad the bug is invisible (core passes); one pattern shows it."""
    wrong = gated(1, 0)

    @equivalent_to(lambda a, b: a * b, inputs=two())
    def product(a, b):
        return wrong.apply(a, b)

    report = failure(product, equiv.GradientMismatch)
    assert {f.check for f in report.findings} == {"needs-input-grad"}
    f = report.findings[0]
    assert f.argument in ("a", "b")
    other = "b" if f.argument == "a" else "a"
    assert f.headline == (f"gradient w.r.t. {f.argument!r} differs from the reference when only "
                          f"{f.argument!r} requires grad ({other!r} not).")
    assert "wrong ctx.needs_input_grad index" in f.likely_cause


class MulShapeWhenAlone(torch.autograd.Function):
    """Returns a wrongly shaped gradient, but only when b does not require grad."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        if not ctx.needs_input_grad[1]:
            return (g * b).sum(0, keepdim=True), None
        return g * b, g * a


def test_needs_input_grad_names_a_slot_error_that_only_one_pattern_hits():
    @equivalent_to(lambda a, b: a * b, inputs=two(shape=(3, 2)))
    def product(a, b):
        return MulShapeWhenAlone.apply(a, b)

    report = failure(product, equiv.GradientMismatch)
    f = finding(report, "needs-input-grad")
    assert f.headline == ("When only 'a' requires grad ('b' not): MulShapeWhenAlone.backward "
                          "returned a gradient of shape [1, 2] for forward input 'a', which has "
                          "shape [3, 2].")
    assert f.traceback


def test_needs_input_grad_passes_the_right_index():
    right = gated(0, 1)

    @equivalent_to(lambda a, b: a * b, inputs=two())
    def product(a, b):
        return right.apply(a, b)

    assert equiv.check(product, settings=FAST).ok


def test_requires_grad_patterns_are_exhaustive_for_few_inputs_and_linear_beyond():
    assert fn_checks.requires_grad_patterns(1) == []
    assert fn_checks.requires_grad_patterns(2) == [(0,), (1,)]
    assert len(fn_checks.requires_grad_patterns(3)) == 6
    assert len(fn_checks.requires_grad_patterns(6)) == 12


def rms_norm_function(when_w_not_needed=None):
    """A float16 RMSNorm Function computing in float32; ``when_w_not_needed(g, w)``: the
    weighted cotangent its backward uses when w does not require grad (default: g * w)."""
    eps = 1e-5

    class RMSNormFn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            xf = x.float()
            rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
            ctx.save_for_backward(x, w, rstd)
            return (xf * rstd * w.float()).to(x.dtype)

        @staticmethod
        @once_differentiable
        def backward(ctx, g):
            x, w, rstd = ctx.saved_tensors
            xhat = x.float() * rstd
            gw = g.float() * w.float()
            if when_w_not_needed is not None and not ctx.needs_input_grad[1]:
                gw = when_w_not_needed(g.float(), w.float())
            gx = rstd * (gw - xhat * (gw * xhat).mean(-1, keepdim=True))
            gwt = (g.float() * xhat).reshape(-1, x.shape[-1]).sum(0)
            return gx.to(x.dtype), gwt.to(w.dtype)

    @equivalent_to(lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w)
    def rms_norm(x, w):
        return RMSNormFn.apply(x, w)

    return rms_norm


def expanded_rows(scale):
    """x: one float16 row of 512 values of size ``scale``, expanded to two rows (stride 0);
    w: float16 weights."""
    g = torch.Generator().manual_seed(2)
    row = torch.randn(512, dtype=torch.float64, generator=g) * scale
    w = torch.randn(512, dtype=torch.float64, generator=g) * 2
    x = round_to(row, torch.float16).requires_grad_().as_strided((2, 512), (0, 1), 0)
    return x, round_to(w, torch.float16).requires_grad_()


@pytest.mark.parametrize("scale", [0.003, 1.0])
def test_needs_input_grad_floors_an_expanded_gradient_as_the_gradients_check_does(scale):
    """An expanded x's gradient sums one term per view: for another requires_grad pattern its
    floor is taken at the size of the terms too, even where the float16 reference's gradient
    overflows (tiny rows)."""
    assert equiv.assert_equivalent(rms_norm_function(), *expanded_rows(scale)).ok


def test_needs_input_grad_still_catches_a_backward_that_forgets_w_when_w_needs_no_grad():
    rms_norm = rms_norm_function(when_w_not_needed=lambda g, w: g)
    with pytest.raises(equiv.GradientMismatch) as info:
        equiv.assert_equivalent(rms_norm, *expanded_rows(1.0))
    assert [(f.check, f.argument) for f in info.value.report.findings] == [
        ("needs-input-grad", "x")]


class MulWrongA(torch.autograd.Function):
    """a's gradient is twice the right one whichever inputs require grad."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return 2 * g * b, g * a if ctx.needs_input_grad[1] else None


class MulWrongAGatedB(MulWrongA):
    """The same, and b's gradient gated on a's needs_input_grad slot."""

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return 2 * g * b, g * a if ctx.needs_input_grad[0] else None


def test_needs_input_grad_leaves_a_gradient_the_gradients_check_reported_to_it():
    """A gradient wrong for every requires_grad pattern is the gradients check's finding alone."""
    @equivalent_to(lambda a, b: a * b, inputs=two())
    def product(a, b):
        return MulWrongA.apply(a, b)

    report = failure(product, equiv.GradientMismatch, checks=("gradients", "needs-input-grad"))
    assert {(f.check, f.argument) for f in report.findings} == {("gradients", "a")}


class MulRaises(MulWrongA):
    @staticmethod
    def backward(ctx, g):
        raise RuntimeError("backward not implemented")


def test_needs_input_grad_leaves_a_backward_that_always_raises_to_the_gradients_check():
    @equivalent_to(lambda a, b: a * b, inputs=two())
    def product(a, b):
        return MulRaises.apply(a, b)

    report = failure(product, equiv.GradientMismatch, checks=("gradients", "needs-input-grad"))
    assert [f.check for f in report.findings] == ["gradients"]


def test_needs_input_grad_still_reports_another_gradient_gated_on_the_wrong_index():
    @equivalent_to(lambda a, b: a * b, inputs=two())
    def product(a, b):
        return MulWrongAGatedB.apply(a, b)

    report = failure(product, equiv.GradientMismatch, checks=("gradients", "needs-input-grad"))
    assert {(f.check, f.argument) for f in report.findings} == {
        ("gradients", "a"), ("needs-input-grad", "b")}


def test_function_checks_run_only_with_a_custom_function_in_the_graph(monkeypatch):
    calls = []
    monkeypatch.setattr(fn_checks, "run", lambda *a: calls.append(a))

    @equivalent_to(lambda a, b: a * b, inputs=two())
    def plain(a, b):
        return a * b

    assert equiv.check(plain, settings=FAST).ok and calls == []
    right = gated(0, 1)
    equiv.check(equivalent_to(lambda a, b: a * b, inputs=two())(lambda a, b: right.apply(a, b)),
                settings=FAST)
    assert calls


# --------------------------------------------------------------------------- gradient slots
def with_backward(backward):
    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, flag: bool):
            ctx.save_for_backward(x)
            return x * x

    Square.backward = staticmethod(backward)
    return Square


def flagged():
    return st.tuples(tensors(shape=(3, 4), dtype=torch.float64, requires_grad=True),
                     st.booleans())


def square_of(fn_cls):
    @equivalent_to(lambda x, flag: x * x, inputs=flagged())
    def square(x, flag):
        return fn_cls.apply(x, flag)

    return square


def test_gradient_slots_name_a_gradient_for_a_non_tensor_argument():
    Square = with_backward(lambda ctx, g: (2 * g * ctx.saved_tensors[0], g.sum()))
    report = failure(square_of(Square), equiv.GradientMismatch)
    f = finding(report, "gradients")
    assert f.headline == ("Square.backward returned a gradient for forward input 'flag' "
                          "(position 2), which is not a tensor: only tensor inputs can receive a "
                          "gradient.")
    assert "return None in slot 2 of Square.backward's result" in f.fix
    assert "corresponding forward input was not a Variable" in f.details  # autograd's own words
    assert f.traceback


def test_gradient_slots_name_a_wrong_number_of_gradients():
    Square = with_backward(lambda ctx, g: 2 * g * ctx.saved_tensors[0])
    report = failure(square_of(Square), equiv.GradientMismatch)
    f = finding(report, "gradients")
    assert f.headline == ("Square.backward returned 1 gradients, but Square.forward takes 2 "
                          "inputs (x, flag): backward must return exactly one gradient per "
                          "forward input.")


def test_gradient_slots_name_a_gradient_of_the_wrong_shape():
    Square = with_backward(lambda ctx, g: ((2 * g * ctx.saved_tensors[0]).sum(0), None))
    report = failure(square_of(Square), equiv.GradientMismatch)
    f = finding(report, "gradients")
    assert f.headline == ("Square.backward returned a gradient of shape [4] for forward input "
                          "'x', which has shape [3, 4].")


def test_a_gradient_of_the_wrong_dtype_is_cast_by_autograd_and_caught_by_its_values():
    """Autograd silently casts a float16 gradient to the float64 input's dtype (no error to
    explain); the digits lost are a gradients finding at float64's tolerance."""
    Square = with_backward(lambda ctx, g: ((2 * g * ctx.saved_tensors[0]).half(), None))
    report = failure(square_of(Square), equiv.GradientMismatch)
    f = finding(report, "gradients")
    assert f.headline == "gradient w.r.t. 'x' differs from the reference on backward #1."
    assert 1e-7 < f.max_abs < 1e-1


def test_gradient_slots_pass_none_for_the_flag():
    Square = with_backward(lambda ctx, g: (2 * g * ctx.saved_tensors[0], None))
    assert equiv.check(square_of(Square), settings=FAST).ok


class TopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, k: int):
        values, indices = x.topk(k, dim=-1)
        ctx.mark_non_differentiable(indices)
        ctx.save_for_backward(indices)
        ctx.shape = x.shape
        return values, indices

    @staticmethod
    def backward(ctx, g_values, g_indices):
        (indices,) = ctx.saved_tensors
        grad = g_values.new_zeros(ctx.shape)
        return grad.scatter(-1, indices, g_values), None


def test_mark_non_differentiable_topk_passes():
    @equivalent_to(lambda x, k: tuple(torch.topk(x, k, dim=-1)),
                   inputs=st.tuples(tensors(shape=(3, 5), dtype=torch.float64,
                                            requires_grad=True), st.integers(1, 5)))
    def topk(x, k):
        return TopK.apply(x, k)

    assert equiv.check(topk, settings=FAST).ok


class MaxAndNorm(torch.autograd.Function):
    """Returns x * 2 and a float statistic it marks non-differentiable."""

    @staticmethod
    def forward(ctx, x):
        stat = x.abs().amax()
        ctx.mark_non_differentiable(stat)
        return x * 2, stat

    @staticmethod
    def backward(ctx, g, g_stat):
        return g * 2


def test_mark_non_differentiable_float_output_follows_the_reference():
    """Rule: the reference decides. A detached reference output passes; a differentiable one is a
    cut-gradient finding that names mark_non_differentiable."""

    @equivalent_to(lambda x: (x * 2, x.abs().amax().detach()), inputs=one())
    def declared(x):
        return MaxAndNorm.apply(x)

    assert equiv.check(declared, settings=FAST).ok

    @equivalent_to(lambda x: (x * 2, x.abs().amax()), inputs=one())
    def undeclared(x):
        return MaxAndNorm.apply(x)

    report = failure(undeclared, equiv.GradientMismatch)
    f = finding(report, "gradients")
    assert f.argument == "output[1]" and "the gradient flow is cut" in f.headline
    assert "ctx.mark_non_differentiable" in f.likely_cause
    assert "return it .detach()-ed" in f.fix


# --------------------------------------------------------------------------- double backward
class ExpSavingOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = x.exp()
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


class ExpOnce(ExpSavingOutput):
    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y


class ExpDetachedBackward(ExpSavingOutput):
    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        return g * y.detach()  # right value, but invisible to double backward


def test_exp_saving_its_output_passes_with_double_backward():
    equivalent_to(torch.exp, inputs=one())(ExpSavingOutput)
    report = equiv.check(ExpSavingOutput, settings=FAST)
    assert report.ok and not any("double backward" in n for n in report.notes)


def test_once_differentiable_is_a_note_not_a_failure():
    equivalent_to(torch.exp, inputs=one())(ExpOnce)
    report = equiv.check(ExpOnce, settings=FAST)
    assert report.ok
    assert ("double backward not supported by ExpOnce (@once_differentiable): second-order "
            "gradients not compared") in report.notes


def test_a_backward_computed_outside_autograd_is_a_note_like_once_differentiable():
    """No path from its gradient back to the input: double backward is not supported (silently),
    which is said, not compared."""
    equivalent_to(torch.exp, inputs=one())(ExpDetachedBackward)
    report = equiv.check(ExpDetachedBackward, settings=FAST)
    assert report.ok
    assert any(n.startswith("double backward not supported by ExpDetachedBackward: its backward "
                            "computes outside autograd") and "once_differentiable" in n
               for n in report.notes)


class SiLUSavingIntermediate(torch.autograd.Function):
    """Right first derivative; s is saved without history, so the second derivative through s
    is missing (only the path through the saved output y remains)."""

    @staticmethod
    def forward(ctx, x):
        s = torch.sigmoid(x)
        y = x * s
        ctx.save_for_backward(s, y)
        return y

    @staticmethod
    def backward(ctx, g):
        s, y = ctx.saved_tensors
        return g * (s + y * (1 - s))


class SiLURecomputing(torch.autograd.Function):
    """The twin: saves the input and recomputes s in backward with torch ops."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * torch.sigmoid(x)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return g * (s + x * s * (1 - s))


def silu_ref(x):
    return x * torch.sigmoid(x)


def test_double_backward_catches_a_partly_differentiable_backward():
    equivalent_to(silu_ref, inputs=one())(SiLUSavingIntermediate)
    report = failure(SiLUSavingIntermediate, equiv.GradientMismatch)
    assert {f.check for f in report.findings} == {"double-backward"}
    f = report.findings[0]
    assert f.headline == ("second-order gradient (double backward) w.r.t. 'x' differs from the "
                          "reference.")
    assert "SiLUSavingIntermediate's backward is only partly differentiable" in f.likely_cause
    assert "once_differentiable" in f.fix


def test_double_backward_passes_a_backward_recomputing_from_the_input():
    equivalent_to(silu_ref, inputs=one())(SiLURecomputing)
    report = equiv.check(SiLURecomputing, settings=FAST)
    assert report.ok and not any("double backward" in n for n in report.notes)


# --------------------------------------------------------------------------- custom ops
@torch.library.custom_op("equiv_tests::sin_wrong_grad", mutates_args=())
def sin_wrong_grad(x: torch.Tensor) -> torch.Tensor:
    return torch.sin(x)


@sin_wrong_grad.register_fake
def _(x):
    return torch.empty_like(x)


def _save_x(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _sin_backward_wrong(ctx, g):
    (x,) = ctx.saved_tensors
    return g * torch.sin(x)  # should be cos


sin_wrong_grad.register_autograd(_sin_backward_wrong, setup_context=_save_x)


@torch.library.custom_op("equiv_tests::cube_no_fake", mutates_args=())
def cube_no_fake(x: torch.Tensor) -> torch.Tensor:
    return x * x * x


def test_a_custom_op_with_a_wrong_backward_passes_opcheck_and_fails_equiv():
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    results = torch.library.opcheck(sin_wrong_grad, (x,), raise_exception=False)
    assert all(v == "SUCCESS" for v in results.values()), results  # opcheck is fooled

    equivalent_to(torch.sin, inputs=one())(sin_wrong_grad)  # the op itself, registered directly
    report = failure(sin_wrong_grad, equiv.GradientMismatch)
    f = finding(report, "gradients")
    assert f.headline == "gradient w.r.t. 'x' differs from the reference on backward #1."
    assert "torch.ops.equiv_tests.sin_wrong_grad(x=f64[3,4] cpu grad)" in f.example
    assert any(n.startswith("opcheck passed for custom op equiv_tests::sin_wrong_grad")
               for n in report.notes)
    assert "opcheck" not in {g.check for g in report.findings}
    assert f.reproduce == "equiv.check(torch.ops.equiv_tests.sin_wrong_grad, seed=1234)"
    again = equiv.check(torch.ops.equiv_tests.sin_wrong_grad, settings=FAST,
                        raise_on_failure=False)  # the Reproduce line works as written
    assert [g.headline for g in again.findings] == [g.headline for g in report.findings]


def test_opcheck_failures_of_ops_the_implementation_calls_are_findings():
    """The op is called from a plain function; the missing fake kernel fails opcheck."""

    @equivalent_to(lambda x: x ** 3 + 1, inputs=one(requires_grad=False))
    def cube_plus_one(x):
        return cube_no_fake(x) + 1

    report = failure(cube_plus_one)
    f = finding(report, "opcheck")
    assert f.headline.startswith("torch.library.opcheck failed for custom op "
                                 "equiv_tests::cube_no_fake: test_faketensor")
    assert "opcheck ran on the call equiv_tests::cube_no_fake(f64[3,4] cpu)" in f.details
    assert "register_fake" in f.fix
    assert {g.check for g in report.findings} == {"opcheck"}


def test_a_custom_op_is_registered_with_its_schema_signature():
    equivalent_to(torch.sin)(torch.ops.equiv_tests.sin_wrong_grad.default)
    spec = torch.ops.equiv_tests.sin_wrong_grad.default.__equiv_spec__
    assert list(spec.signature.parameters) == ["x"]
    assert spec.signature.parameters["x"].annotation is torch.Tensor
    assert spec.implementation == "torch.ops.equiv_tests.sin_wrong_grad"


# --------------------------------------------------------------------------- user tensors
@torch.library.custom_op("equiv_tests::double_", mutates_args=("x",))
def double_(x: torch.Tensor) -> None:
    x.mul_(2)


def test_the_function_checks_never_modify_the_users_tensors():
    """Explicit examples go through mark-dirty, the patterns, double backward and opcheck (which
    runs a mutating op) on copies: the caller's tensors keep their values and versions."""
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    y = torch.randn(3, 4, dtype=torch.float64)
    before = (x.detach().clone(), y.clone(), x._version, y._version)

    @equivalent_to(lambda x, y: (x * 2 * y * 2, y * 2), mutates={"y": 1},
                   examples=[(x, y)],
                   inputs=st.tuples(tensors(shape=(2,), dtype=torch.float64, requires_grad=True),
                                    tensors(shape=(2,), dtype=torch.float64)))
    def scale_both(x, y):
        double_(y)
        return ScaleNoDirty.apply(x * 1) * y, y

    report = equiv.check(scale_both, settings=FAST, max_examples=2, raise_on_failure=False)
    assert report.examples_run >= 1 and report.ok, report.render()
    assert any("opcheck passed for custom op equiv_tests::double_" in n for n in report.notes)
    assert torch.equal(x.detach(), before[0]) and torch.equal(y, before[1])
    assert (x._version, y._version) == before[2:]
