"""Each core check catches a deliberately buggy implementation (asserting the finding's content)
and passes a correct, tricky twin."""

from __future__ import annotations

import re

import hypothesis.strategies as st
import pytest
import torch

import equiv
from equiv import equivalent_to
from equiv.strategies import tensors
from tests.conftest import FAST


def one(shape=(3, 4), dtype=torch.float64, requires_grad=True):
    return st.tuples(tensors(shape=shape, dtype=dtype, requires_grad=requires_grad))


def two(shape=(3, 4), dtype=torch.float64):
    return st.tuples(tensors(shape=shape, dtype=dtype, requires_grad=True),
                     tensors(shape=shape, dtype=dtype, requires_grad=True, salt=1))


def failure(impl, expected=equiv.EquivalenceFailure, **kw):
    with pytest.raises(expected) as info:
        equiv.check(impl, settings=FAST, **kw)
    return info.value.report


def checks_of(report):
    return {f.check for f in report.findings}


# --------------------------------------------------------------------------- forward
def softmax_ref(x):
    return torch.exp(x) / torch.exp(x).sum(-1, keepdim=True)


def test_forward_catches_a_wrong_output_with_numbers():
    """A kernel off by a little where x > 1 is a forward finding with the numbers and index."""

    @equivalent_to(softmax_ref, inputs=one())
    def softmax_bad(x):
        y = torch.softmax(x, -1)
        return y + 1e-3 * (x > 1)

    report = failure(softmax_bad, equiv.OutputMismatch)
    f = next(f for f in report.findings if f.check == "forward")
    assert f.argument == "output"
    assert "Greatest absolute difference" in f.message and "at index" in f.message
    assert f.max_abs == pytest.approx(1e-3, rel=1e-3)
    assert "check: forward" in f.message and "dtype: torch.float64" in f.message
    assert "softmax_bad(x=f64[3,4] cpu grad)" in f.message


def test_forward_passes_an_op_correct_only_within_float32_tolerance():
    """A numerically different but stable softmax passes within float32's default tolerance."""

    @equivalent_to(softmax_ref, inputs=one(dtype=torch.float32))
    def softmax_stable(x):
        z = x - x.amax(-1, keepdim=True)
        return torch.exp(z - torch.logsumexp(z, -1, keepdim=True))

    assert equiv.check(softmax_stable, settings=FAST).ok


def pair_ref(x):
    return {"y": x * 2, "n": 3, "none": None, "parts": (x.sum(), x.mean())}


def test_forward_compares_pytrees_and_names_the_leaf():
    """Outputs may be dicts/tuples with None and Python numbers; the differing leaf is named."""

    @equivalent_to(pair_ref, inputs=one())
    def pair_good(x):
        return {"y": x + x, "n": 3, "none": None, "parts": (x.sum(), x.sum() / x.numel())}

    @equivalent_to(pair_ref, inputs=one())
    def pair_bad(x):
        return {"y": x + x, "n": 4, "none": None, "parts": (x.sum(), x.mean())}

    assert equiv.check(pair_good, settings=FAST).ok
    report = failure(pair_bad, equiv.OutputMismatch)
    assert any("output['n']" in f.headline for f in report.findings)


def test_forward_reports_a_structure_difference():
    @equivalent_to(lambda x: (x, x * 2), inputs=one())
    def tuple_short(x):
        return (x.clone(),)

    report = failure(tuple_short)
    assert "structure differs" in report.findings[0].details


# --------------------------------------------------------------------------- mutation
def relu_ref(x):
    return torch.relu(x)


def test_mutation_passes_a_declared_in_place_kernel():
    @equivalent_to(relu_ref, mutates={"x": "out"}, inputs=one())
    def relu_(x):
        return x.clamp_(min=0)

    assert equiv.check(relu_, settings=FAST).ok


def test_mutation_catches_an_undeclared_write_that_keeps_values():
    """`relu_` on positive inputs leaves values equal but moves the version counter."""

    def pos_ref(x):
        return x * 1.0

    @equivalent_to(pos_ref, inputs=st.tuples(tensors(shape=(4,), dtype=torch.float64)
                                            .map(lambda t: t.abs() + 0.1)))
    def pos_sneaky(x):
        x.relu_()  # a no-op on positive values, still a write
        return x * 1.0

    report = failure(pos_sneaky, equiv.MutationMismatch)
    f = report.findings[0]
    assert f.check == "mutation" and f.argument == "x"
    assert "version counter 0 -> 1" in f.headline
    assert "mutates={'x': ...}" in f.message


def test_mutation_catches_an_undeclared_write_on_a_leaf_as_an_error_with_a_hint():
    def add_ref(x, y):
        return x + y

    @equivalent_to(add_ref, inputs=two())
    def add_into_x(x, y):
        return x.add_(y)

    report = failure(add_into_x)
    f = report.findings[0]
    assert f.check == "error-parity"
    assert "leaf Variable that requires grad" in f.details
    assert "declare it with mutates=" in f.message
    assert "x.add_(y)" in f.traceback


def test_mutation_catches_a_wrong_final_value_of_a_declared_argument():
    def ema_ref(avg, x):
        return avg * 0.9 + x * 0.1

    @equivalent_to(ema_ref, mutates={"avg": "out"}, inputs=two())
    def ema_bad(avg, x):
        return avg.mul_(0.9).add_(x, alpha=0.01)

    report = failure(ema_bad)
    assert "mutation" in checks_of(report)
    f = next(f for f in report.findings if f.check == "mutation")
    assert f.headline.startswith("the final value of mutated argument 'avg'")


def adam_ref(p, g, m, v):
    m2 = 0.9 * m + 0.1 * g
    v2 = 0.999 * v + 0.001 * g * g
    return p - 0.01 * m2 / (v2.sqrt() + 1e-8), m2, v2


def adam_inputs():
    t = lambda salt, f=lambda t: t: tensors(shape=(5,), dtype=torch.float64, salt=salt).map(f)
    return st.tuples(t(0), t(1), t(2), t(3, lambda t: t.abs()))


def test_mutation_passes_an_in_place_update_returning_nothing():
    """Adam-style: all of the reference's result is consumed by mutates, impl returns None."""

    @equivalent_to(adam_ref, mutates={"p": 0, "m": 1, "v": 2}, inputs=adam_inputs())
    def adam_(p, g, m, v):
        m.mul_(0.9).add_(g, alpha=0.1)
        v.mul_(0.999).addcmul_(g, g, value=0.001)
        p.addcdiv_(m, v.sqrt().add_(1e-8), value=-0.01)

    assert equiv.check(adam_, settings=FAST).ok


def test_mutation_catches_an_update_that_forgets_one_argument():
    @equivalent_to(adam_ref, mutates={"p": 0, "m": 1, "v": 2}, inputs=adam_inputs())
    def adam_forgets_v(p, g, m, v):
        m.mul_(0.9).add_(g, alpha=0.1)
        v2 = v * 0.999 + 0.001 * g * g
        p.addcdiv_(m, v2.sqrt() + 1e-8, value=-0.01)

    report = failure(adam_forgets_v, equiv.MutationMismatch)
    assert any(f.argument == "v" for f in report.findings)


def strided(kinds=("sliced", "window")):
    """One f64[3,4] tensor laid out as a view into a larger storage (gaps hold 77.0)."""
    return st.tuples(tensors(shape=(3, 4), dtype=torch.float64,
                             layout=st.sampled_from(kinds)))


def raw_storage(x):
    """The whole storage under ``x``, through a tensor with its own version counter."""
    return torch.empty(0, dtype=x.dtype).set_(x.untyped_storage())


@pytest.mark.parametrize("mutates", [None, {"x": "out"}])
def test_mutation_catches_a_write_outside_the_arguments_view(mutates):
    """Writing storage element 0 under a sliced x (outside x, no version counter moved) is a
    finding, whether or not x is declared mutated."""

    @equivalent_to(relu_ref, mutates=mutates, inputs=strided(("sliced",)))
    def relu_scribbles(x):
        if x.storage_offset() > 0:
            raw_storage(x)[0] = 123.0
        return x.clamp_(min=0) if mutates else x.clamp(min=0)

    report = failure(relu_scribbles, equiv.MutationMismatch)
    f = next(f for f in report.findings if "outside" in f.headline)
    assert f.check == "mutation" and f.argument == "x"
    assert ("wrote outside its arguments: storage element 0 of x's storage (not part of x) "
            "changed from 77.0 to 123.0") in f.headline


def test_mutation_passes_a_kernel_writing_only_inside_a_strided_view():
    """A declared write through the raw storage, only at x's own elements, passes."""

    @equivalent_to(relu_ref, mutates={"x": "out"}, inputs=strided())
    def relu_through_storage(x):
        raw_storage(x).as_strided(x.shape, x.stride(), x.storage_offset()).clamp_(min=0)
        return x

    assert equiv.check(relu_through_storage, settings=FAST).ok


def scaled_ref(x, lst):
    return x * len(lst)


def with_value(value):
    return st.tuples(tensors(shape=(3,), dtype=torch.float64), st.just(value))


def _append(lst):
    lst.append(1)


def _set_key(d):
    d["b"] = 1


def _nested_int(lst):
    lst[1][0] += 1


@pytest.mark.parametrize("value, write, after", [
    ([1, 2], _append, "[1, 2] -> [1, 2, 1]"),
    ({"a": 1}, _set_key, "{'a': 1} -> {'a': 1, 'b': 1}"),
    ([1, [2, 3]], _nested_int, "[1, [2, 3]] -> [1, [3, 3]]"),
])
def test_mutation_catches_a_changed_non_tensor_argument(value, write, after):
    """An append, a new dict key or an int changed inside a nested list is a finding."""

    @equivalent_to(scaled_ref, inputs=with_value(value))
    def scaled_writes(x, lst):
        out = x * len(lst)
        write(lst)
        return out

    report = failure(scaled_writes, equiv.MutationMismatch)
    f = report.findings[0]
    assert f.check == "mutation" and f.argument == "lst"
    assert f"the implementation changed the non-tensor argument 'lst': {after}" in f.headline


def test_mutation_catches_a_tensor_replaced_in_a_list_argument():
    """Swapping the list's tensor for another (same values) changes the caller's list."""

    def first_ref(xs):
        return xs[0] * 2

    @equivalent_to(first_ref, inputs=st.tuples(st.tuples(
        tensors(shape=(3,), dtype=torch.float64)).map(list)))
    def first_swaps(xs):
        xs[0] = xs[0] * 1
        return xs[0] * 2

    report = failure(first_swaps, equiv.MutationMismatch)
    f = next(f for f in report.findings if f.argument == "xs")
    assert "changed the containers or non-tensor values of argument 'xs'" in f.headline
    assert "[f64[3] cpu] -> [f64[3] cpu]" in f.headline


class Opaque:
    """A value with identity equality: each side gets its own deep copy."""


def test_mutation_passes_a_kernel_reading_its_non_tensor_arguments():
    """Reading a list (with a NaN and an opaque object in it), even changing and restoring
    it or replacing values by equal ones, leaves it as it was."""

    def count_ref(x, lst):
        return x * (len(lst) - 1)

    @equivalent_to(count_ref, inputs=with_value([float("nan"), Opaque(), {"k": [1]}]))
    def count(x, lst):
        lst.append(0)
        lst.pop()
        lst[0] = lst[0] * 1.0  # another NaN object
        lst[2]["k"] = list(lst[2]["k"])  # an equal new list
        return x * sum(1 for v in lst if not isinstance(v, float))

    assert equiv.check(count, settings=FAST).ok


def test_mutation_passes_a_declared_mutated_list():
    """A list declared in mutates= may change: its tensor, and the count it resets."""

    def step_ref(state):
        return [state[0] + 1, 0]

    @equivalent_to(step_ref, mutates={"state": "out"}, inputs=st.tuples(
        tensors(shape=(3,), dtype=torch.float64).map(lambda t: [t, 5])))
    def step_(state):
        state[0].add_(1)
        state[1] = 0
        return state

    assert equiv.check(step_, settings=FAST).ok


# --------------------------------------------------------------------------- aliasing
def test_aliasing_catches_a_fast_path_returning_the_input():
    @equivalent_to(relu_ref, inputs=one())
    def relu_fast_path(x):
        if bool((x >= 0).all()):
            return x
        return x.clamp(min=0)

    positive = torch.rand(3, 4, dtype=torch.float64) + 0.1
    relu_fast_path.__equiv_spec__ = relu_fast_path.__equiv_spec__.__class__(
        **{**relu_fast_path.__equiv_spec__.__dict__, "examples": (equiv.Args(positive),)})
    report = failure(relu_fast_path, equiv.AliasingMismatch)
    f = report.findings[0]
    assert f.check == "aliasing"
    assert "output shares storage with input x" in f.headline
    assert "mutates={'x': 'out'}" in f.message


def test_aliasing_passes_a_view_when_the_reference_returns_a_view_too():
    @equivalent_to(lambda x: x.t(), inputs=one())
    def transpose(x):
        return x.transpose(0, 1)

    assert equiv.check(transpose, settings=FAST).ok


def test_aliasing_catches_two_outputs_overlapping_in_one_buffer():
    @equivalent_to(lambda x: (x * 2, (x * 2)[:1]), inputs=one())
    def shared_out(x):
        y = x * 2
        return y, y[:1]  # the second output is part of the first: a write to one moves both

    report = failure(shared_out, equiv.AliasingMismatch)
    assert "overlap in memory, but the reference's do not" in report.findings[0].headline


def test_aliasing_passes_disjoint_views_of_one_buffer():
    @equivalent_to(lambda x: (x * 2, x * 3), inputs=one())
    def stacked(x):
        y = torch.stack([x * 2, x * 3])
        return y[0], y[1]  # one storage, disjoint elements: no write through one reaches the other

    assert equiv.check(stacked, settings=FAST, raise_on_failure=False).ok


# --------------------------------------------------------------------------- gradients
class SinWrongBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.sin()  # should be cos


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


def test_gradients_catch_a_wrong_backward_formula():
    @equivalent_to(torch.sin, inputs=one())
    def sin_(x):
        return SinWrongBackward.apply(x)

    report = failure(sin_, equiv.GradientMismatch)
    f = report.findings[0]
    assert f.check == "gradients" and f.argument == "x"
    assert "gradient w.r.t. 'x' differs from the reference on backward #1" in f.message
    assert f.max_abs is not None and f.max_abs > 1e-3


def test_gradients_pass_a_function_saving_its_output():
    @equivalent_to(torch.exp, inputs=one())
    def exp_(x):
        return ExpSavingOutput.apply(x)

    assert equiv.check(exp_, settings=FAST).ok


def test_gradients_catch_a_cut_gradient_flow():
    @equivalent_to(lambda x: x * 2, inputs=one())
    def doubled_detached(x):
        return x.detach() * 2

    report = failure(doubled_detached, equiv.GradientMismatch)
    assert "does not require grad in the implementation" in report.findings[0].headline


class MulPair(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return g * b, g * a


def test_gradients_pass_the_same_tensor_in_two_slots():
    """x*x through a Function given one tensor twice: both slot contributions accumulate."""

    @equivalent_to(lambda a, b: a * b, inputs=one().map(lambda t: (t[0], t[0])))
    def mul_pair(a, b):
        return MulPair.apply(a, b)

    report = equiv.check(mul_pair, settings=FAST)
    assert report.ok and report.examples_run > 0


class MulPairDedup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        ctx.same = a is b
        return a * b

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        if ctx.same:  # wrong: "pre-aggregates" but still returns both slots
            return 2 * g * b, g * a
        return g * b, g * a


def test_gradients_catch_double_counting_when_slots_alias():
    @equivalent_to(lambda a, b: a * b, inputs=one().map(lambda t: (t[0], t[0])))
    def mul_pair_dedup(a, b):
        return MulPairDedup.apply(a, b)

    report = failure(mul_pair_dedup, equiv.GradientMismatch)
    f = report.findings[0]
    assert f.argument == "a" and "b=<same tensor as a>" in f.example


# --------------------------------------------------------------------------- repeated backward
class SquareCorruptsSaved(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x.clone())
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.mul_(2)  # correct the first time (2x), then 4x, ...


class SquareCorruptsSavedUntracked(SquareCorruptsSaved):
    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        x.data.mul_(2)  # hidden from the version counter
        return g * x


def test_repeated_backward_catches_a_backward_that_writes_a_saved_tensor():
    """A tracked write: autograd raises on backward #2, reported with the traceback."""

    @equivalent_to(lambda x: x * x, inputs=one())
    def square(x):
        return SquareCorruptsSaved.apply(x)

    report = failure(square, equiv.GradientMismatch)
    f = next(f for f in report.findings if f.check == "repeated-backward")
    assert "a second backward through the retained graph raised RuntimeError" in f.headline
    assert "modified by an inplace operation" in f.details


def test_repeated_backward_catches_an_untracked_write_to_a_saved_tensor():
    """Through .data the version counter does not move: backward #2 (a second cotangent)
    silently differs from the reference, and the timeline shows backward #1's write."""

    @equivalent_to(lambda x: x * x, inputs=one())
    def square_untracked(x):
        return SquareCorruptsSavedUntracked.apply(x)

    report = failure(square_untracked, equiv.GradientMismatch)
    f = next(f for f in report.findings if f.check == "repeated-backward")
    assert "differs from the reference on backward #2 (a second cotangent" in f.headline
    assert "Likely cause" in f.message
    assert "(backward #1; version NOT bumped: untracked write), then read by backward #2" \
        in f.likely_cause, f.likely_cause


class DoubleAccumulates(torch.autograd.Function):
    """Backward sums every cotangent it was given into a buffer inside a list on ctx (the
    timeline follows tensors saved or stashed on ctx, not ones inside containers)."""

    @staticmethod
    def forward(ctx, x):
        ctx.state = [torch.zeros_like(x)]
        return x * 2

    @staticmethod
    def backward(ctx, g):
        ctx.state[0] += g * 2
        return ctx.state[0].clone()


class DoubleMemoized(torch.autograd.Function):
    """Backward computes once and returns that result for every later cotangent."""

    @staticmethod
    def forward(ctx, x):
        ctx.memo = None
        return x * 2

    @staticmethod
    def backward(ctx, g):
        if ctx.memo is None:
            ctx.memo = g * 2
        return ctx.memo


def _repeat_finding(function: type) -> equiv.Finding:
    """The repeated-backward finding of ``function`` (an x * 2 Function) on one example."""

    @equivalent_to(lambda x: x * 2, inputs=one())
    def double(x):
        return function.apply(x)

    return next(f for f in failure(double, equiv.GradientMismatch).findings
                if f.check == "repeated-backward")


def test_repeated_backward_names_a_buffer_reused_across_backwards():
    """Backward #2 differs from the reference; backward #3 (the first cotangent again)
    differs from #1, so the finding says backward #1 changed a value backward uses."""

    f = _repeat_finding(DoubleAccumulates)
    assert "on backward #2 (a second cotangent" in f.headline
    assert "backward #3 (the first cotangent again) differs from backward #1: Mismatched" \
        in f.message, f.message


def test_repeated_backward_does_not_blame_state_for_a_memoized_backward():
    """A backward that ignores later cotangents is wrong on backward #2, but returns the same
    as #1 for the first cotangent again: no claim of a modified value."""

    f = _repeat_finding(DoubleMemoized)
    assert "on backward #2 (a second cotangent" in f.headline
    assert "first cotangent again" not in f.message, f.message


class ScaleWritesGradOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 3

    @staticmethod
    def backward(ctx, g):
        return g.mul_(3)


def test_gradients_catch_a_backward_writing_into_grad_output():
    @equivalent_to(lambda x: x * 3, inputs=one())
    def triple(x):
        return ScaleWritesGradOutput.apply(x)

    report = failure(triple)
    assert any("modified the caller's cotangent (grad_output)" in f.headline
               for f in report.findings)


class ScaleInPlace(torch.autograd.Function):
    """A correct in-place Function: writes its input and marks it dirty."""

    @staticmethod
    def forward(ctx, x):
        x.mul_(2)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, g):
        return g * 2


def test_repeated_backward_passes_a_correct_mark_dirty_function():
    @equivalent_to(lambda x: x * 2, mutates={"x": "out"}, inputs=one())
    def scale_(x):
        return ScaleInPlace.apply(x)

    assert equiv.check(scale_, settings=FAST).ok


# --------------------------------------------------------------------------- output stability
_WORKSPACE: dict[tuple, torch.Tensor] = {}


def test_output_stability_catches_a_reused_workspace():
    @equivalent_to(lambda x: x * 2, inputs=one(requires_grad=False))
    def double_into_workspace(x):
        buf = _WORKSPACE.setdefault(tuple(x.shape), torch.empty_like(x))
        return torch.mul(x, 2, out=buf)

    report = failure(double_into_workspace, equiv.OutputMismatch)
    f = report.findings[0]
    assert f.check == "output-stability"
    assert "a second call to the implementation changed output" in f.headline
    assert "reused workspace" in f.message


def test_output_stability_passes_a_fresh_result():
    @equivalent_to(lambda x: x * 2, inputs=one(requires_grad=False))
    def double(x):
        return torch.mul(x, 2)

    assert equiv.check(double, settings=FAST).ok


# --------------------------------------------------------------------------- error parity
def checked_sqrt_ref(x):
    if bool((x < 0).any()):
        raise ValueError("negative input")
    return x.sqrt()


def sometimes_negative():
    return st.tuples(tensors(shape=(3,), dtype=torch.float64), st.booleans()).map(
        lambda p: ((p[0].abs() if p[1] else p[0]).requires_grad_(),))


def test_error_parity_rejects_examples_both_sides_refuse():
    @equivalent_to(checked_sqrt_ref, inputs=sometimes_negative())
    def checked_sqrt(x):
        if bool((x < 0).any()):
            raise ValueError("sqrt of a negative number")
        return torch.sqrt(x)

    report = equiv.check(checked_sqrt, settings=FAST, raise_on_failure=False)
    assert report.ok, report.render()
    assert report.invalid_examples > 0 and report.examples_run > report.invalid_examples


def test_error_parity_catches_an_implementation_that_accepts_invalid_input():
    @equivalent_to(checked_sqrt_ref, inputs=sometimes_negative())
    def lenient_sqrt(x):
        return x.abs().sqrt()

    report = failure(lenient_sqrt, equiv.ErrorMismatch)
    assert "the reference raised ValueError but the implementation returned normally" in \
        report.findings[0].headline


def test_error_parity_of_another_exception_type_names_both_fixes():
    """Both sides refuse a negative input, with other exception types: a finding, whose fix
    also names inputs= (the input may be outside the kernel's contract)."""
    @equivalent_to(checked_sqrt_ref, inputs=sometimes_negative())
    def typed_sqrt(x):
        if bool((x < 0).any()):
            raise TypeError("sqrt of a negative number")
        return torch.sqrt(x)

    f = failure(typed_sqrt, equiv.ErrorMismatch).findings[0]
    assert f.headline.startswith("the reference raised ValueError but the implementation "
                                 "raised TypeError"), f.headline
    assert "raise the same exception type as the reference" in f.fix
    assert "draw only valid inputs (inputs=...)" in f.fix, f.fix


def test_error_parity_catches_an_implementation_that_raises_with_its_traceback():
    @equivalent_to(lambda x: x.sum(0), inputs=one())
    def broken_sum(x):
        return x.view(-1, 5).sum(0)

    report = failure(broken_sum, equiv.ErrorMismatch)
    f = report.findings[0]
    assert "the implementation raised RuntimeError where the reference returned" in f.headline
    assert "x.view(-1, 5)" in f.traceback


def test_no_valid_example_is_a_usage_error_not_a_pass():
    def always_refuses(x):
        raise ValueError("never")

    @equivalent_to(always_refuses, inputs=one())
    def refuses_too(x):
        raise ValueError("never")

    with pytest.raises(equiv.InvalidArgument, match=r"every drawn example was invalid input "
                       r"\(last: the reference raised ValueError: never\)"):
        equiv.check(refuses_too, settings=FAST)


# --------------------------------------------------------------------------- reference contract
def test_a_mutating_reference_is_a_registration_error():
    def impure_ref(x):
        return x.clamp_(min=0)

    @equivalent_to(impure_ref, inputs=one(requires_grad=False))
    def relu_copy(x):
        return x.clamp(min=0)

    with pytest.raises(equiv.InvalidArgument, match="modified its argument 'x'"):
        equiv.check(relu_copy, settings=FAST)


def test_a_reference_changing_its_list_argument_is_a_registration_error():
    def appending_ref(x, lst):
        lst.append(0)
        return x * 2

    @equivalent_to(appending_ref, inputs=with_value([1]))
    def double(x, lst):
        return x * 2

    with pytest.raises(equiv.InvalidArgument, match=r"modified its argument 'lst' \(\[1\] -> "
                                                    r"\[1, 0\]"):
        equiv.check(double, settings=FAST)


class _DoublingRef(torch.autograd.Function):
    """A reference Function whose backward doubles the cotangent it is handed in place: its
    gradient is right, and the cotangent it was given changes."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g.mul_(2)


def _doubling(scale):
    class Doubling(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * scale

    return Doubling


@pytest.mark.parametrize("trusted", [False, True])
def test_a_reference_backward_writing_its_cotangent_spoils_no_verdict(trusted, monkeypatch):
    """The reference's VJP never writes the values the implementation's backward gets: a
    correct implementation passes, a wrong backward fails on its own numbers. ``trusted``: the
    Function is taken for torch's own formulas, so it is handed the values themselves; its
    write moves their version counter, and the values are drawn again for a copy."""
    if trusted:
        monkeypatch.setattr("equiv.execution.record.builtin_only", lambda *trees: True)
    def doubled_ref(x):
        return _DoublingRef.apply(x)

    @equivalent_to(doubled_ref, inputs=one())
    def double(x):
        return _doubling(2).apply(x)

    @equivalent_to(doubled_ref, inputs=one())
    def double_bad_backward(x):
        return _doubling(3).apply(x)

    assert equiv.check(double, settings=FAST).ok
    report = failure(double_bad_backward)
    f = next(f for f in report.findings if f.check == "gradients")
    assert "gradient w.r.t. 'x' differs from the reference on backward #1" in f.headline
    assert "forward" not in checks_of(report)


# --------------------------------------------------------------------------- several findings
def test_several_distinct_findings_are_all_reported():
    @equivalent_to(relu_ref, inputs=one())
    def many_bugs(x):
        x.detach().add_(0)  # undeclared write
        return x.detach().clamp(min=0)  # cut gradient

    report = failure(many_bugs)
    assert {"mutation", "gradients"} <= checks_of(report)
    assert "[1/" in report.render()


# --------------------------------------------------------------------------- flakiness
def test_a_nondeterministic_implementation_is_reported_as_flaky():
    """A failure that does not reproduce on replay is a 'flaky' finding, not a plain pass."""
    seen: list[tuple[float, ...]] = []
    fired = {"once": False}

    @equivalent_to(lambda x: x * 2, inputs=one(requires_grad=False))
    def sometimes_wrong(x):
        # wrong exactly once: on the first call with the 2nd example's values (the multiset of
        # x's whole storage, so the shuffled stability call -- which reverses the storage, gaps
        # of a sliced layout included -- and any extra call on one example count as the same),
        # however many times equiv calls the implementation per example
        storage = torch.empty(0, dtype=x.dtype).set_(x.untyped_storage())
        key = tuple(sorted(storage.tolist()))
        if key not in seen:
            seen.append(key)
        wrong = len(seen) == 2 and not fired["once"]
        fired["once"] |= wrong
        return x * 2 + (1.0 if wrong else 0.0)

    report = equiv.check(sometimes_wrong, settings=FAST, raise_on_failure=False)
    assert not report.ok
    assert report.findings[0].check == "flaky"
    assert "failed once and passed when replayed" in report.findings[0].headline


# --------------------------------------------------------------------------- tolerances
def test_settings_tolerances_override_the_dtype_default():
    """A float64 result off by 1e-6 fails the default table and passes a looser per-dtype one."""

    @equivalent_to(lambda x: x * 2, inputs=one())
    def nearly_double(x):
        return x * 2 + 1e-6

    failure(nearly_double, equiv.OutputMismatch)
    loose = equiv.settings(FAST, tolerances={"float64": (1e-3, 1e-5)})
    assert equiv.check(nearly_double, settings=loose).ok
    tight = equiv.settings(FAST, tolerances={"float32": (1e-3, 1e-5)})  # another dtype: no effect
    assert not equiv.check(nearly_double, settings=tight, raise_on_failure=False).ok


def test_settings_dtypes_choose_the_dtypes_of_derived_inputs():
    """settings(dtypes=...) decides the dtype of inputs derived from the signature."""
    seen = set()

    @equivalent_to(lambda x: x * 2)
    def double(x):
        seen.add(x.dtype)
        return x * 2

    equiv.check(double, settings=equiv.settings(FAST, dtypes=("float64",)))
    assert seen == {torch.float64}
    seen.clear()
    equiv.check(double, settings=equiv.settings(FAST, dtypes=("bfloat16",)))
    assert seen == {torch.bfloat16}


# --------------------------------------------------------------------------- kinks
@pytest.mark.parametrize("x, noted", [
    ([0.5, 1.0, -2.0, 3.0], "at x[1] (from above) the reference is not differentiable"),
    ([1.0] * 6 + [0.5, -2.0], " (from above) and 2 more elements the reference is not "
                              "differentiable")])
def test_a_one_sided_derivative_at_a_kink_of_the_reference_passes_with_a_note(x, noted):
    """clamp passes the gradient at its bounds, hardtanh does not: at exactly x = 1 each takes
    the derivative from one side (the reference's from below, hardtanh's from above), both
    correct. The gradient passes, and a note says where the one-sided derivative was taken.
    With six elements at the bound (integer-valued inputs, activations clamped before) every
    one is a point where the reference is not differentiable (its one-sided derivatives
    differ), so all six are accepted, not only the first four."""
    @equivalent_to(lambda x: torch.clamp(x, -1.0, 1.0), mutates={"x": "out"},
                   examples=[(torch.tensor(x, requires_grad=True),)])
    def hardtanh_(x):
        return torch.nn.functional.hardtanh_(x)

    report = equiv.check(hardtanh_, settings=equiv.settings(FAST, max_examples=1),
                         raise_on_failure=False)
    assert report.ok, report.render()
    assert any(noted in n for n in report.notes), report.notes


def _zeros_among(n: int, zeros: int = 40) -> torch.Tensor:
    """``zeros`` exact zeros, then ``n - zeros`` values well above 0."""
    return torch.cat([torch.zeros(zeros), 0.5 + torch.arange(n - zeros) / n])


def test_kinks_of_a_small_gradient_are_each_probed():
    """relu_ against clamp(min=0) on post-ReLU activations: 40 exact zeros, where relu takes
    the derivative from below (0) and clamp's autograd the one from above (1); hardtanh
    against clamp at its bound. A small gradient's kinks are each probed: the runs pass."""
    def run(impl, ref, t, **kw):
        spec = equivalent_to(ref, examples=[(t,)], **kw)(impl)
        return equiv.check(spec, settings=equiv.settings(FAST, max_examples=1),
                           raise_on_failure=False)

    x = _zeros_among(42).requires_grad_()
    report = run(lambda x: x.relu_(), lambda x: torch.clamp(x, min=0), x, mutates={"x": "out"})
    assert report.ok, report.render()
    assert any(" and 36 more elements the reference is not differentiable" in n
               for n in report.notes), report.notes
    bounds = torch.tensor([[0.0] * 8] * 3 + [[0.0] * 7 + [1.0], [1.0] * 8], requires_grad=True)
    clamped = run(lambda x: torch.nn.functional.hardtanh(x), lambda x: torch.clamp(x, -1, 1),
                  bounds, variants=False)
    assert clamped.ok, clamped.render()


def test_more_kinks_than_are_probed_one_by_one_are_probed_together():
    """40 exact zeros among 10000 elements (too many to probe each: each probe runs the
    reference on all of them): beyond the first eight the zeros are probed together, and
    relu against clamp(min=0) passes, as does 0.5 at each zero (a subgradient between the
    sides), and on an expanded argument (its 40 stored zeros). A backward giving 1.5 at a few
    zeros (neither side) still fails, and so does a max whose backward gives the whole
    cotangent to each of 40 ties (each alone is the derivative from above; together they are
    not)."""
    def run(impl, ref, t):
        spec = equivalent_to(ref, examples=[(t,)], variants=False)(impl)
        return equiv.check(spec, settings=equiv.settings(FAST, max_examples=1,
                                                         checks=("forward", "gradients")),
                           raise_on_failure=False)

    def clamp(x):
        return torch.clamp(x, min=0)

    x = _zeros_among(10_000).requires_grad_()
    report = run(lambda x: torch.relu(x), clamp, x)
    assert report.ok, report.render()
    assert any(" and 36 more elements the reference is not differentiable" in n
               for n in report.notes), report.notes

    def half_at_zero(x):
        return torch.relu(x) + 0.5 * (x - x.detach()) * (x.detach() == 0)

    assert run(half_at_zero, clamp, x).ok

    def past_one_at_some_zeros(x):  # 1.5 at four zeros, 0 (from below) at the others
        some = torch.zeros_like(x).index_fill_(0, torch.arange(36, 40), 1.5)
        return torch.relu(x) + (x - x.detach()) * some

    wrong = run(past_one_at_some_zeros, clamp, x)
    assert [f.check for f in wrong.roots()] == ["gradients"], wrong.render()
    expanded = _zeros_among(10_000)[None].expand(3, -1).requires_grad_()  # stored once
    shared = run(lambda x: torch.relu(x), clamp, expanded)
    assert shared.ok, shared.render()

    def every_tie(x):
        top = x.detach().amax(0)
        return top + ((x - x.detach()) * (x.detach() == top)).sum(0)

    ties = torch.cat([torch.ones(40), torch.zeros(9960)]).requires_grad_()
    maxed = run(every_tie, lambda x: torch.amax(x, 0), ties)
    assert [f.check for f in maxed.roots()] == ["gradients"], maxed.render()


def _windows_max(x):
    """2x2 max pooling as an ``amax`` over each window (ties share the gradient evenly)."""
    n, c, h, w = x.shape
    windows = x.reshape(n, c, h // 2, 2, w // 2, 2).permute(0, 1, 2, 4, 3, 5)
    return windows.reshape(n, c, h // 2, w // 2, 4).amax(-1)


def test_ties_of_a_max_among_many_elements_are_probed_toward_the_chosen_one():
    """max_pool2d on a ReLU'd map of 12288 elements with all-zero windows: the pooling routes
    each window's cotangent to one element, the reference (amax) splits it evenly. Moved
    together the ties stay tied, so the rest are moved toward the implementation's choice (up
    where it gives more than the reference's share, down elsewhere): the run passes."""
    gen = torch.Generator().manual_seed(0)
    x = torch.relu(torch.randn(1, 3, 64, 64, generator=gen) - 1.0).requires_grad_()

    @equivalent_to(_windows_max, examples=[(x,)], variants=False)
    def max_pool(x):
        return torch.nn.functional.max_pool2d(x, 2)

    report = equiv.check(max_pool, settings=equiv.settings(FAST, max_examples=1,
                                                           checks=("forward", "gradients")),
                         raise_on_failure=False)
    assert report.ok, report.render()


def test_a_reference_whose_float64_gradient_is_nan_at_every_element_of_a_small_example():
    """``1 / (1 + exp(-x))`` at x = -1000: exp overflows in float64 too, so the reference's
    gradient is NaN (inf / inf) at all 40 elements while its value is 0 on both sides of
    each. ``torch.sigmoid``'s 0 is the derivative: every element of a small example is
    probed, and the run passes. A backward giving 1 there still fails."""
    x = torch.full((40,), -1000.0, requires_grad=True)

    def ref(x):
        return 1 / (1 + torch.exp(-x))

    def check(impl):
        spec = equivalent_to(ref, examples=[(x,)], variants=False)(impl)
        return equiv.check(spec, settings=equiv.settings(FAST, max_examples=1),
                           raise_on_failure=False)

    report = check(lambda x: torch.sigmoid(x))
    assert report.ok, report.render()
    assert any(" and 36 more elements the reference is not differentiable" in n
               for n in report.notes), report.notes
    wrong = check(lambda x: torch.sigmoid(x) + (x - x.detach()))
    assert [f.check for f in wrong.roots()] == ["gradients"], wrong.render()


class _EveryTie(torch.autograd.Function):
    """A row max whose backward gives the whole cotangent to every tie (the classic max-pool
    backward bug: ``(x == out) * grad``)."""

    @staticmethod
    def forward(ctx, x):
        out = x.amax(-1)
        ctx.save_for_backward(x, out)
        return out

    @staticmethod
    def backward(ctx, g):
        x, out = ctx.saved_tensors
        return (x == out[..., None]) * g[..., None]


TIES = [(torch.tensor([[1.0, 1.0, 0.5], [2.0, -1.0, 2.0]], requires_grad=True),)]


def test_a_max_backward_counting_every_tie_fails_where_one_tie_passes():
    """At a tie each element alone has the derivative from above (moving it up makes it the
    max), so the one-by-one probe accepted the whole cotangent at every tie; together the
    ties move as one max, and the gradient sums to twice the cotangent: a finding. Routing it
    to one tie (torch.max) or splitting it evenly (amax) passes."""
    def check(impl):
        spec = equivalent_to(lambda x: torch.amax(x, -1), examples=TIES, variants=False)(impl)
        return equiv.check(spec, settings=equiv.settings(FAST, max_examples=1),
                           raise_on_failure=False)

    wrong = check(lambda x: _EveryTie.apply(x))
    assert [f.check for f in wrong.roots()] == ["gradients"], wrong.render()
    assert check(lambda x: torch.max(x, -1).values).ok
    assert check(lambda x: torch.amax(x, -1)).ok


def test_a_large_gradient_where_the_reference_has_none_says_so():
    """The same overflowing reference on 2100 elements: past the probe's budget the mismatch
    stays, and its likely cause says the reference's own float64 gradient is NaN there."""
    x = torch.full((2100,), -1000.0, requires_grad=True)

    @equivalent_to(lambda x: 1 / (1 + torch.exp(-x)), examples=[(x,)], variants=False)
    def sigmoid(x):
        return torch.sigmoid(x)

    report = equiv.check(sigmoid, settings=equiv.settings(FAST, max_examples=1,
                                                          checks=("forward", "gradients")),
                         raise_on_failure=False)
    (f,) = report.roots()
    assert f.check == "gradients", report.render()
    assert re.match(r"the reference's own gradient at x\[\d+\] is NaN in float64 too",
                    f.likely_cause), f.likely_cause


def test_a_reference_whose_autograd_is_wrong_at_many_smooth_points_is_still_a_finding():
    """``log1p(exp(-|x|)) + relu(-x)`` is smooth at 0, but autograd takes abs's and relu's 0
    there: at one zero softplus's 0.5 is accepted (the reference's own derivative from either
    side), at five zeros the finding stands (the probe accepts a few such points, not a
    reference whose backward disagrees with its derivative everywhere)."""
    def ref(x):
        return torch.log1p(torch.exp(-x.abs())) + torch.relu(x)

    def verdict(zeros: int) -> bool:
        x = torch.tensor([0.0] * zeros + [0.5, -2.0], requires_grad=True)

        @equivalent_to(ref, examples=[(x,)])
        def softplus(x):
            return torch.nn.functional.softplus(x)

        return equiv.check(softplus, settings=equiv.settings(FAST, max_examples=1),
                           raise_on_failure=False).ok

    assert verdict(1)
    assert not verdict(5)


def test_a_gradient_at_a_kink_that_neither_side_gives_says_where_the_kink_is():
    """At x = 1 the reference's derivative is 1 from below and 0 from above; 2 is neither:
    the finding stands, and says that x[1] is where the reference is not differentiable."""
    @equivalent_to(lambda x: torch.clamp(x, -1.0, 1.0),
                   examples=[(torch.tensor([0.5, 1.0, -2.0, 3.0], requires_grad=True),)])
    def hardtanh(x):
        at_bound = (x.detach().abs() == 1).to(x.dtype)
        return torch.nn.functional.hardtanh(x) + 2 * (x - x.detach()) * at_bound

    report = equiv.check(hardtanh, settings=equiv.settings(FAST, max_examples=1),
                         raise_on_failure=False)
    f = next(f for f in report.findings if f.check == "gradients")
    assert f.likely_cause.startswith("x[1] = 1 is a point where the reference is not "
                                     "differentiable"), f.likely_cause


def _sqrt_of_square(x):
    return torch.sqrt(x * x)  # |x|, with autograd's 0/0 = NaN at 0


ZERO = [(torch.tensor([0.0, 1.0, -2.0], requires_grad=True),)]


def test_a_subgradient_between_the_sides_passes_where_the_reference_gives_nan():
    """|x| at 0: the reference's autograd says NaN, its derivative is -1 from below and 1 from
    above; abs's 0 lies between (a subgradient). Passes, with a note."""
    @equivalent_to(_sqrt_of_square, examples=ZERO)
    def absolute(x):
        return x.abs()

    report = equiv.check(absolute, settings=equiv.settings(FAST, max_examples=1),
                         raise_on_failure=False)
    assert report.ok, report.render()
    assert any("at x[0] (between the one-sided derivatives)" in n for n in report.notes)


def test_notes_of_one_kind_from_many_examples_are_one_note_with_a_count():
    """Three examples of |x| with zeros at other elements (the reference's autograd NaN there,
    abs's 0 a subgradient): one note per kind (backward #1, backward #2), naming at most four
    elements and how many more, and how many more such notes other examples made."""
    zeros = [torch.tensor([0.0] * k + [0.5] * (8 - k), requires_grad=True) for k in (6, 5, 7)]

    @equivalent_to(_sqrt_of_square, examples=[(t,) for t in zeros])
    def absolute(x):
        return x.abs()

    report = equiv.check(absolute, settings=equiv.settings(FAST, max_examples=3),
                         raise_on_failure=False)
    assert report.ok, report.render()
    first = [n for n in report.notes if n.startswith("gradient w.r.t. 'x': at ")]
    second = [n for n in report.notes if n.startswith("backward #2: gradient w.r.t. 'x': at ")]
    assert len(first) == len(second) == 1, report.notes
    side = "(between the one-sided derivatives)"
    assert re.match(re.escape(f"gradient w.r.t. 'x': at x[0] {side}, x[1] {side}, x[2] {side}, "
                              f"x[3] {side} and ") + "[123] more elements the reference is not "
                    "differentiable", first[0]), first
    assert first[0].endswith(" (and 2 more like it from other examples)"), first


def test_every_element_of_an_expanded_constant_at_a_kink_is_probed():
    """std of rows that are one repeated value (x expanded along the reduced dim): as a
    function of each of the 8 stored values std is constant 0, its autograd through the
    decomposition 0 * inf = NaN; ATen's 0 is the derivative at all 8 elements, each probed."""
    import torch._refs as refs

    storage = torch.linspace(-3.5, 3.5, 8, dtype=torch.float64).requires_grad_()
    x = storage.as_strided((8, 2), (1, 0))

    @equivalent_to(lambda t: refs.std(t, -1), examples=[(x,)], variants=False)
    def std(t):
        return torch.std(t, -1)

    report = equiv.check(std, settings=equiv.settings(FAST, max_examples=1),
                         raise_on_failure=False)
    assert report.ok, report.render()
    assert any("the reference is not differentiable" in n and "t[3] (from above) and 4 more "
               "elements" in n
               for n in report.notes), report.notes


def test_a_gradient_outside_the_one_sided_derivatives_is_a_finding():
    """3 at |x|'s kink is outside [-1, 1]: not a subgradient."""
    @equivalent_to(_sqrt_of_square, examples=ZERO)
    def absolute(x):
        return x.abs() + 3 * (x - x.detach()) * (x.detach() == 0).to(x.dtype)

    report = equiv.check(absolute, settings=equiv.settings(FAST, max_examples=1),
                         raise_on_failure=False)
    f = next(f for f in report.findings if f.check == "gradients")
    assert "x[0] = 0 is a point where the reference is not differentiable" in f.likely_cause


def test_a_wrong_gradient_at_a_smooth_point_names_no_kink():
    class Wrong(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x.sin()

        @staticmethod
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(inputs[0])

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * x.sin()  # not cos

    @equivalent_to(torch.sin)
    def sin(x):
        return Wrong.apply(x)

    report = equiv.check(sin, settings=FAST, raise_on_failure=False)
    f = next(f for f in report.findings if f.check == "gradients")
    assert "not differentiable" not in (f.likely_cause or "")


class _TripleBackward(torch.autograd.Function):
    """x * 2 with the gradient of x * 3 (x saved, so the timeline has events)."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * 3 + x * 0


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
def test_a_wrong_gradient_on_a_transposed_input_names_no_kink(dtype):
    """The kink probe perturbs a row-major copy of a non-contiguous argument (a transposed one
    is smooth everywhere for x * 2), and a complex argument has no kink line at all."""
    x = torch.arange(1.0, 7.0, dtype=torch.float64).to(dtype).reshape(2, 3).t().requires_grad_()

    @equivalent_to(lambda x: x * 2, inputs=st.just((x,)), variants=())
    def double(x):
        return _TripleBackward.apply(x)

    report = equiv.check(double, settings=equiv.settings(FAST, max_examples=1),
                         raise_on_failure=False)
    f = next(f for f in report.findings if f.check == "gradients")
    assert "not differentiable" not in (f.likely_cause or ""), f.likely_cause
    # the timeline replays what the gradients check ran: one backward, not the repeats
    phases = {e.get("phase") for e in f.timeline}
    assert "backward #1" in phases and "backward #2" not in phases, phases


def test_a_wrong_first_backward_is_reported_once():
    """A backward wrong from the start is the gradients check's finding; the repeated backward
    through the same graph does not report it again."""

    @equivalent_to(lambda x: x * 2, inputs=one())
    def double(x):
        return _TripleBackward.apply(x)

    report = failure(double, equiv.GradientMismatch)
    checks = [f.check for f in report.findings]
    assert "gradients" in checks and "repeated-backward" not in checks, checks


def test_gradients_after_a_wrong_forward_point_to_the_forward_finding():
    """The tanh approximation of gelu differs in forward and backward: the gradient finding
    says the forward already differs, so the user fixes that first."""

    @equivalent_to(torch.nn.functional.gelu, inputs=one())
    def gelu(x):
        return torch.nn.functional.gelu(x, approximate="tanh")

    report = failure(gelu, equiv.EquivalenceFailure)
    assert {"forward", "gradients"} <= checks_of(report), checks_of(report)
    f = next(f for f in report.findings if f.check == "gradients")
    assert f.likely_cause.startswith("the forward values already differ on this example")
