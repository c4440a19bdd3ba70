"""Contracts both ways: views required and returned arguments (aliasing), errors with their
messages and side effects (error-parity, error_inputs=), the no-grad path, state across calls
(interleaved forwards, caches keyed by identity) and the default memory bound. Each buggy
implementation is caught (class, check, key lines); each correct, tricky twin passes."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch

import equiv
from equiv import Schedule, equivalent_to
from equiv.strategies import tensors
from tests.conftest import FAST


def one(shape=(3, 4)):
    return st.tuples(tensors(shape=shape, dtype=torch.float64, requires_grad=True))


def failure(impl, expected, check, **kw):
    with pytest.raises(expected) as info:
        equiv.check(impl, settings=kw.pop("settings", FAST), **kw)
    findings = [f for f in info.value.report.findings if f.check == check]
    assert findings, info.value.report.render()
    return findings[0]


def passes(impl, **kw):
    report = equiv.check(impl, settings=kw.pop("settings", FAST), raise_on_failure=False, **kw)
    assert report.ok, report.render()
    return report


# --------------------------------------------------------------------------- 1. views both ways
def test_a_copy_where_the_reference_returns_a_view_is_caught():
    @equivalent_to(lambda x: x.t(), inputs=one())
    def t_copy(x):
        return x.t().contiguous()

    f = failure(t_copy, equiv.AliasingMismatch, "aliasing")
    assert "output is a new tensor, but the reference returns a view of input x" in f.headline
    assert "write goes nowhere" in f.details


def test_a_view_where_the_reference_returns_a_view_passes():
    @equivalent_to(lambda x: x.t(), inputs=one())
    def t_view(x):
        return x.transpose(0, 1)

    passes(t_view)


def test_aliases_declares_a_copy_or_a_view_explicitly():
    @equivalent_to(lambda x: x[1:], inputs=one(), aliases={"out": None})
    def tail_copy(x):
        return x[1:].clone()

    passes(tail_copy)

    @equivalent_to(lambda x: x.reshape(-1) * 1, inputs=one(), aliases={"out": "x"})
    def flat_copy(x):
        return x.reshape(-1).clone()

    f = failure(flat_copy, equiv.AliasingMismatch, "aliasing")
    assert "aliases= declares output a view of x" in f.headline


def test_an_inplace_kernel_returning_a_temporary_is_caught():
    @equivalent_to(torch.relu, mutates={"x": "out"}, inputs=one())
    def relu_tmp_(x):
        out = torch.relu(x)
        x.copy_(out)
        return out

    f = failure(relu_tmp_, equiv.AliasingMismatch, "aliasing")
    assert "returns a new tensor holding its final values, not x itself" in f.headline
    assert "y = kernel_(x); y.add_(1)" in f.details


def test_an_inplace_kernel_returning_its_argument_passes():
    @equivalent_to(torch.relu, mutates={"x": "out"}, inputs=one())
    def relu_(x):
        return x.relu_()

    passes(relu_)


def _with_first_column(y):
    return y, y[:, 0]


def test_an_output_the_reference_returns_as_a_view_of_another_must_stay_one():
    @equivalent_to(lambda x: _with_first_column(x * 2), inputs=one())
    def doubled_and_column(x):
        y = x * 2
        return y, y[:, 0].clone()  # a write through output[0] no longer reaches output[1]

    f = failure(doubled_and_column, equiv.AliasingMismatch, "aliasing")
    assert f.headline.startswith("output[1] and output[0] are separate tensors, but the "
                                 "reference returns output[1] as a view of output[0]")
    assert "aliases={1: None}" in f.fix


def test_a_view_of_a_mutated_arguments_final_value_may_be_a_view_of_the_argument():
    """mutates={"x": 0} and a reference returning (y, y[:, 0]): the kernel's x[:, 0] is the
    view the reference returns, and a copy there is the bug."""
    @equivalent_to(lambda x: _with_first_column(torch.relu(x)), mutates={"x": 0}, inputs=one())
    def relu_and_column_(x):
        x.relu_()
        return x, x[:, 0]

    passes(relu_and_column_)

    @equivalent_to(lambda x: _with_first_column(torch.relu(x)), mutates={"x": 0}, inputs=one())
    def relu_and_column_copy_(x):
        x.relu_()
        return x, x[:, 0].clone()

    f = failure(relu_and_column_copy_, equiv.AliasingMismatch, "aliasing")
    assert "reference returns output[1] as a view of output[0]" in f.headline


def test_aliases_declares_a_copy_of_another_outputs_view():
    @equivalent_to(lambda x: _with_first_column(x * 2), inputs=one(), aliases={1: None})
    def doubled_and_column_copy(x):
        y = x * 2
        return y, y[:, 0].clone()

    passes(doubled_and_column_copy)


def _qkv_inputs():
    return st.tuples(tensors(shape=(2, 4), dtype=torch.float64, requires_grad=True),
                     tensors(shape=(4, 12), dtype=torch.float64, requires_grad=True, salt=1))


def test_fused_qkv_disjoint_chunk_views_pass():
    def qkv_ref(x, w):
        return x @ w[:, :4], x @ w[:, 4:8], x @ w[:, 8:]

    @equivalent_to(qkv_ref, inputs=_qkv_inputs())
    def qkv_fused(x, w):
        return (x @ w).chunk(3, dim=-1)  # three views of one buffer, disjoint elements

    passes(qkv_fused)


# --------------------------------------------------------------------------- 2. errors
def _index_inputs():
    return st.tuples(tensors(shape=(5, 3), dtype=torch.float64, requires_grad=True),
                     st.lists(st.integers(0, 6), min_size=3, max_size=3).map(torch.tensor),
                     tensors(shape=(3, 3), dtype=torch.float64, requires_grad=True, salt=1))


def index_add_ref(x, idx, src):
    if bool((idx >= x.shape[0]).any()):
        raise IndexError("index out of range")
    return x.index_add(0, idx, src)


def test_a_partial_write_before_raising_is_caught():
    @equivalent_to(index_add_ref, mutates={"x": "out"}, inputs=_index_inputs())
    def index_add_rows_(x, idx, src):
        for i, j in enumerate(idx.tolist()):
            if j >= x.shape[0]:
                raise IndexError("index out of range")
            x[j] += src[i]  # rows before the bad index are already written
        return x

    f = failure(index_add_rows_, equiv.ErrorMismatch, "error-parity")
    assert "both sides raised IndexError, but the implementation wrote into x before " \
           "raising; the reference left it unchanged" in f.headline
    assert "validate the inputs" in f.fix


def test_a_reference_validated_error_with_no_partial_write_passes():
    @equivalent_to(index_add_ref, mutates={"x": "out"}, inputs=_index_inputs())
    def index_add_checked_(x, idx, src):
        if bool((idx >= x.shape[0]).any()):
            raise IndexError("index out of range")
        for i, j in enumerate(idx.tolist()):
            x[j] += src[i]
        return x

    report = passes(index_add_checked_)
    assert report.invalid_examples > 0  # incidental errors stay invalid input


def rowbias_ref(x, b):
    return x + b[:, None]


_ROWBIAS = st.sampled_from([(3, 4), (2, 2), (3,)]).flatmap(lambda shp: st.tuples(
    tensors(shape=shp, dtype=torch.float64, requires_grad=True),
    tensors(shape=shp[:1], dtype=torch.float64, requires_grad=True)))


def test_an_inplace_kernel_raising_where_no_write_in_place_fits_the_reference_passes():
    """On a 1-d x the reference's x + b[:, None] is (n, n): no write into x leaves that, so the
    implementation raising there is invalid input, not an error-parity finding."""
    @equivalent_to(rowbias_ref, mutates={"x": "out"}, inputs=_ROWBIAS)
    def rowbias_(x, b):
        if x.dim() != 2:
            raise ValueError("x must be 2-d")
        return x.add_(b[:, None])

    report = passes(rowbias_)
    assert report.invalid_examples > 0


def test_an_inplace_kernel_raising_where_the_reference_fits_is_still_caught():
    @equivalent_to(rowbias_ref, mutates={"x": "out"}, inputs=_ROWBIAS)
    def rowbias_wrong_dim_(x, b):
        if x.dim() != 2:
            raise ValueError("x must be 2-d")
        return x.add_(b)  # broadcasts b along the rows: raises for (3, 4)

    f = failure(rowbias_wrong_dim_, equiv.EquivalenceFailure, "error-parity")
    assert "raised RuntimeError where the reference returned normally" in f.headline


def test_no_example_where_a_write_in_place_fits_the_reference_is_an_error_naming_it():
    @equivalent_to(rowbias_ref, mutates={"x": "out"},
                   inputs=st.tuples(tensors(shape=(3,), dtype=torch.float64),
                                    tensors(shape=(3,), dtype=torch.float64)))
    def rowbias_1d_(x, b):
        raise ValueError("x must be 2-d")

    with pytest.raises(equiv.InvalidArgument, match=r"every drawn example was invalid input "
                       r"\(last: the reference's final value of 'x' is float64\[3, 3\] but "
                       r"the argument is float64\[3\]"):
        equiv.check(rowbias_1d_, settings=FAST)


def checked_log_ref(x):
    if bool((x <= 0).any()):
        raise ValueError(f"log of a non-positive value: {x.min().item():.3g}")
    return x.log()


_POSITIVE = st.tuples(tensors(shape=(4,), dtype=torch.float64, requires_grad=True)).map(
    lambda a: ((a[0].detach().abs() + 0.5).requires_grad_(),))
_NEGATIVE = st.tuples(tensors(shape=(4,), dtype=torch.float64)).map(
    lambda a: (-(a[0].abs() + 0.5),))


def test_error_inputs_with_a_wrong_message_are_caught():
    @equivalent_to(checked_log_ref, inputs=_POSITIVE, error_inputs=_NEGATIVE, raises=ValueError,
                   match="non-positive")
    def log_bad_message(x):
        if bool((x <= 0).any()):
            raise ValueError("bad input")
        return x.log()

    f = failure(log_bad_message, equiv.ErrorMismatch, "error-parity")
    assert "the implementation's ValueError message does not match match='non-positive'" \
        in f.headline


def test_error_inputs_without_match_use_the_reference_message_as_prefix():
    @equivalent_to(checked_log_ref, inputs=_POSITIVE, error_inputs=_NEGATIVE)
    def log_other_message(x):
        if bool((x <= 0).any()):
            raise ValueError("invalid")
        return x.log()

    f = failure(log_other_message, equiv.ErrorMismatch, "error-parity")
    assert "message does not start with the reference's" in f.headline

    @equivalent_to(checked_log_ref, inputs=_POSITIVE, error_inputs=_NEGATIVE)
    def log_same_message(x):
        if bool((x <= 0).any()):
            raise ValueError(f"log of a non-positive value: {x.min().item():.3g}")
        return x.log()

    passes(log_same_message)


def test_error_inputs_the_implementation_accepts_are_caught():
    @equivalent_to(checked_log_ref, inputs=_POSITIVE, error_inputs=_NEGATIVE, raises=ValueError)
    def log_lenient(x):
        return x.abs().log()

    f = failure(log_lenient, equiv.ErrorMismatch, "error-parity")
    assert "the reference raised ValueError but the implementation returned normally" \
        in f.headline


def test_a_spec_that_declares_its_reference_always_raises_passes():
    def refuses(x):
        raise ValueError("never valid")

    @equivalent_to(refuses, inputs=one(), raises=ValueError, match="never")
    def refuses_too(x):
        raise ValueError("never valid here either")

    report = passes(refuses_too)
    assert report.invalid_examples == 0


def test_contract_options_are_validated():
    with pytest.raises(equiv.InvalidArgument, match="aliases"):
        equivalent_to(torch.sin, aliases={"out": "nope"})(lambda x: x)
    with pytest.raises(equiv.InvalidArgument, match="raises"):
        equivalent_to(torch.sin, raises="ValueError")(lambda x: x)
    with pytest.raises(equiv.InvalidArgument, match="match"):
        equivalent_to(torch.sin, match="(")(lambda x: x)
    with pytest.raises(equiv.InvalidArgument, match="error_inputs"):
        equivalent_to(torch.sin, error_inputs=[1])(lambda x: x)


# --------------------------------------------------------------------------- 3. no-grad path
def test_a_wrong_inference_fast_path_is_caught():
    @equivalent_to(torch.tanh, inputs=one())
    def tanh_fast(x):
        if not torch.is_grad_enabled() or not x.requires_grad:
            return x.clamp(-1, 1)  # a "fast path" that is not tanh
        return torch.tanh(x)

    f = failure(tanh_fast, equiv.OutputMismatch, "no-grad")
    assert "output with no input requiring grad differs from the reference." in f.headline
    assert "inference fast path" in f.likely_cause


def test_an_inference_path_returning_its_input_is_caught():
    @equivalent_to(lambda x: x * 1, inputs=one())
    def ident(x):
        return x if not torch.is_grad_enabled() else x * 1

    f = failure(ident, equiv.OutputMismatch, "no-grad")
    assert "under torch.no_grad() shares storage with x; with gradients it shares storage " \
           "with no input" in f.headline


def test_a_correct_inference_fast_path_passes():
    @equivalent_to(torch.tanh, inputs=one())
    def tanh_fast_ok(x):
        if not torch.is_grad_enabled() or not x.requires_grad:
            return (2 * x).sigmoid() * 2 - 1  # tanh by another formula
        return torch.tanh(x)

    passes(tanh_fast_ok)


# --------------------------------------------------------------------------- 4. state across calls
class StashOnClass(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        StashOnClass.saved = x.detach().clone()  # shared by every call: the classic bug
        return x.sin()

    @staticmethod
    def backward(ctx, g):
        return g * StashOnClass.saved.cos()


class KeepOnCtx(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sin()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.cos()


def test_interleaved_forwards_catch_state_stashed_on_the_class():
    equivalent_to(torch.sin, inputs=one())(StashOnClass)
    f = failure(StashOnClass, equiv.ScheduleMismatch, "schedule")
    assert "schedule 'interleaved-forwards': gradient w.r.t. 'x' on backward #1 differs" \
        in f.headline
    assert "schedule: forward -> forward -> backward 1 -> backward 2" in f.details
    assert f.likely_cause.startswith("state shared between calls: the second forward overwrote")
    assert "never on the class, the module or a global" in f.fix


def test_interleaved_forwards_pass_a_function_keeping_everything_on_ctx():
    equivalent_to(torch.sin, inputs=one())(KeepOnCtx)
    passes(KeepOnCtx)


def test_schedule_grammar_takes_several_forwards():
    s = Schedule(("forward", "forward", "backward 1", "backward 2"))
    assert s.name == "forward -> forward -> backward 1 -> backward 2"
    Schedule(("forward", "write x", "backward"))  # the one-forward grammar still works
    with pytest.raises(equiv.InvalidArgument, match="comes before forward #2"):
        Schedule(("forward", "backward 2", "forward"))
    with pytest.raises(equiv.InvalidArgument, match="must start with 'forward'"):
        Schedule(("backward",))


def test_a_user_schedule_with_several_forwards_runs():
    @equivalent_to(torch.sin, inputs=one(), schedules=[
        Schedule(("forward", "forward", "backward 2", "backward 1", "backward"),
                 expect="match")])
    def sin_fn(x):
        return StashOnClass.apply(x)

    f = failure(sin_fn, equiv.ScheduleMismatch, "schedule")
    assert "interleaved-forwards" in f.headline or "backward 2 -> backward 1" in f.headline


def _scaled_ref(x, w):
    return x * w.softmax(0)


def _xw():
    return st.tuples(tensors(shape=(4,), dtype=torch.float64, requires_grad=True),
                     tensors(shape=(4,), dtype=torch.float64, requires_grad=True, salt=1))


def test_a_cache_keyed_by_tensor_identity_is_caught():
    @equivalent_to(_scaled_ref, inputs=_xw())
    def scaled_cached(x, w):
        cached = getattr(w, "_softmax_cache", None)  # kept on the tensor: blind to updates
        if cached is None:
            cached = w._softmax_cache = w.softmax(0)
        return x * cached

    f = failure(scaled_cached, equiv.OutputMismatch, "state-across-calls")
    assert "of a second call, after the same tensors were updated in place, differs from a " \
           "first call on new tensors holding the new values." in f.headline
    assert "keyed by tensor identity" in f.likely_cause


def test_a_cache_keyed_by_data_ptr_and_version_is_caught_through_data_copy():
    """A write through ``.data`` (EMA swaps, weight reloads) keeps data_ptr and _version."""
    cache: dict = {}

    @equivalent_to(_scaled_ref, inputs=_xw())
    def scaled_versioned(x, w):
        key = (w.data_ptr(), w._version)
        if cache.get("key") != key:
            cache.update(key=key, value=w.softmax(0))
        return x * cache["value"]

    f = failure(scaled_versioned, equiv.OutputMismatch, "state-across-calls")
    assert "of a call after the same tensors got new values through .data.copy_() (no " \
           "version bump) differs from the reference on those values." in f.headline
    assert "keyed by (data_ptr, _version)" in f.likely_cause
    assert "through .data.copy_() (same tensors, same data_ptr, version counters not " \
           "bumped)" in f.details


def test_a_cache_holding_a_view_of_the_old_storage_is_caught_through_data_assignment():
    """Keyed by the tensor object and reading through a kept view: blind to ``p.data = new``."""
    cache: dict = {}

    @equivalent_to(_scaled_ref, inputs=_xw())
    def scaled_view(x, w):
        if cache.get("w") is not w:
            cache.update(w=w, view=w.view(-1))
        return x * cache["view"].view(w.shape).softmax(0)

    f = failure(scaled_view, equiv.OutputMismatch, "state-across-calls")
    assert "a call after new tensors were assigned to the arguments' .data (new storage)" \
        in f.headline
    assert "update through .data =" in f.likely_cause


def test_a_cache_keyed_by_the_values_passes():
    cache: dict = {}

    @equivalent_to(_scaled_ref, inputs=_xw())
    def scaled_by_value(x, w):
        kept = cache.get("values")  # the same tensor (its graph) holding the same values
        if cache.get("w") is not w or kept.shape != w.shape or not torch.equal(kept, w.detach()):
            cache.update(w=w, values=w.detach().clone(), value=w.softmax(0))
        return x * cache["value"]

    passes(scaled_by_value)


# --------------------------------------------------------------------------- 5. default memory bound
class SavesWorkspaceView(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        buf = torch.empty(1 << 19, dtype=x.dtype)  # a 4 MiB workspace
        buf[: x.numel()] = x.detach().flatten()
        ctx.save_for_backward(buf[: x.numel()].view(x.shape))  # keeps all of buf alive
        return x.sin()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g * x.cos()


class SavesCompactCopy(SavesWorkspaceView):
    @staticmethod
    def forward(ctx, x):
        buf = torch.empty(1 << 19, dtype=x.dtype)
        buf[: x.numel()] = x.detach().flatten()
        ctx.save_for_backward(buf[: x.numel()].view(x.shape).clone())
        return x.sin()


_MEM = equiv.settings(FAST, max_examples=30)


def test_a_saved_view_of_a_huge_workspace_is_caught_by_default():
    equivalent_to(torch.sin, inputs=one())(SavesWorkspaceView)
    f = failure(SavesWorkspaceView, equiv.MemoryMismatch, "memory", settings=_MEM)
    assert "the graph keeps 4,194,304 B alive after forward" in f.headline
    assert "saved view keeps 4,194,304 bytes of storage alive" in f.details
    assert any("keeps 4,194,304 B of storage alive" in line
               for line in equiv.timeline.render(f.timeline).splitlines())


def test_a_compact_copy_and_a_declared_contract_pass():
    equivalent_to(torch.sin, inputs=one())(SavesCompactCopy)
    passes(SavesCompactCopy, settings=_MEM)

    @equivalent_to(torch.sin, inputs=one(), max_retained_bytes=8 << 20)
    def declared(x):
        return SavesWorkspaceView.apply(x)

    passes(declared, settings=_MEM)
