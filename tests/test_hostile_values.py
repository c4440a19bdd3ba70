"""Hostile values: outputs equiv cannot compare (meta, nested, tensor subclasses) are a clean
InvalidArgument naming the side, the output and the fix; outputs it can (complex32, a bool
against an int) are compared, a difference being a finding; a user exception whose ``__str__``
raises is shown as ``<unprintable ...>`` and compared as such; ``SystemExit`` from user code is
a finding or a clean InvalidArgument, never a raw exception group of equiv's signals, while
``KeyboardInterrupt`` still propagates. Each broken case has a correct twin that passes."""

from __future__ import annotations

import io
import sys
import textwrap

import hypothesis.strategies as st
import pytest
import torch

import equiv
from equiv import equivalent_to
from equiv.cli import main
from equiv.strategies import tensors
from tests.conftest import FAST

pytestmark = pytest.mark.filterwarnings("ignore:.*prototype stage:UserWarning",
                                        "ignore:ComplexHalf support:UserWarning")

X3 = st.tuples(tensors(shape=(3,)))
FIXED = equiv.settings(FAST, max_examples=5)
UNPRINTABLE = "<unprintable Unprintable: __str__ raised RuntimeError>"


def check(fn):
    """The report of a short eager run of ``fn``'s spec (no raise on findings)."""
    return equiv.check(fn, settings=FIXED, modes=("eager",), raise_on_failure=False)


def passes(fn) -> None:
    report = check(fn)
    assert report.ok, [f.headline for f in report.findings]


# -- outputs equiv cannot compare ----------------------------------------------------------------
def _meta_ref(x):
    return torch.empty(3, device="meta")


def test_a_meta_output_is_invalid_naming_the_side_and_the_fix():
    @equivalent_to(_meta_ref, inputs=X3, grads=False)
    def on_meta(x):
        return torch.empty(3, device="meta")

    with pytest.raises(equiv.InvalidArgument) as info:
        check(on_meta)
    text = str(info.value)
    assert "the reference" in text and "meta device" in text and "at output:" in text
    assert "(t.shape, t.dtype)" in text


def test_a_meta_output_of_the_implementation_alone_is_invalid_naming_it():
    @equivalent_to(lambda x: x * 2, inputs=X3)
    def on_meta(x):
        return torch.empty(3, device="meta")

    with pytest.raises(equiv.InvalidArgument, match="the implementation .* meta device"):
        check(on_meta)


def test_meta_shapes_compared_through_a_wrapper_pass():
    def ref(x):
        t = torch.empty(3, device="meta")
        return t.shape, t.dtype

    @equivalent_to(ref, inputs=X3, grads=False)
    def shapes_only(x):
        t = torch.empty(3, device="meta")
        return t.shape, t.dtype

    passes(shapes_only)


def _nested(x):
    return torch.nested.nested_tensor([x.detach(), x.detach()[:2]])


def test_a_nested_output_is_invalid_naming_the_fix():
    @equivalent_to(_nested, inputs=X3, grads=False)
    def nested(x):
        return torch.nested.nested_tensor([x.detach(), x.detach()[:2]])

    with pytest.raises(equiv.InvalidArgument, match=r"nested tensor at output.*\.unbind\(\)"):
        check(nested)


def test_a_jagged_nested_output_is_invalid_naming_the_fix():
    def ref(x):
        return torch.nested.nested_tensor([x.detach(), x.detach()[:2]], layout=torch.jagged)

    @equivalent_to(ref, inputs=X3, grads=False)
    def jagged(x):
        return torch.nested.nested_tensor([x.detach(), x.detach()[:2]], layout=torch.jagged)

    with pytest.raises(equiv.InvalidArgument, match=r"nested tensor at output.*\.unbind\(\)"):
        check(jagged)


def test_nested_outputs_unbound_pass():
    @equivalent_to(lambda x: _nested(x).unbind(), inputs=X3, grads=False)
    def unbound(x):
        return torch.nested.nested_tensor([x.detach(), x.detach()[:2]]).unbind()

    passes(unbound)


def _masked(x):
    return torch.masked.masked_tensor(x.detach(), x.detach() > 0)


def test_a_masked_tensor_output_is_invalid_naming_the_subclass():
    @equivalent_to(_masked, inputs=X3, grads=False)
    def masked(x):
        return torch.masked.masked_tensor(x.detach(), x.detach() > 0)

    with pytest.raises(equiv.InvalidArgument) as info:
        check(masked)
    text = str(info.value)
    assert "returned a MaskedTensor" in text and "at output:" in text
    assert ".get_data() and .get_mask()" in text


def test_masked_tensor_parts_pass():
    def ref(x):
        m = _masked(x)
        return m.get_data(), m.get_mask()

    @equivalent_to(ref, inputs=X3, grads=False)
    def parts(x):
        return x.detach().clone(), x.detach() > 0

    passes(parts)


# -- outputs equiv compares ----------------------------------------------------------------------
def test_complex32_outputs_that_differ_are_a_finding_with_numbers():
    @equivalent_to(lambda x: x.detach().to(torch.complex32), inputs=X3, grads=False)
    def shifted(x):
        return (x.detach() + 1).to(torch.complex32)

    report = check(shifted)
    (f,) = report.findings
    assert f.check == "forward" and f.kind == "OutputMismatch"
    assert "Greatest absolute difference: 1.0" in f.details


def test_complex32_outputs_within_complex32_tolerance_pass():
    @equivalent_to(lambda x: x.detach().to(torch.complex32), inputs=X3, grads=False)
    def rounded(x):
        return (x.detach() * (1 + 2e-4)).to(torch.complex32)

    passes(rounded)


def test_a_bool_against_an_int_is_an_output_mismatch_about_the_type():
    @equivalent_to(lambda x: True, inputs=X3, grads=False)
    def one(x):
        return 1

    with pytest.raises(equiv.OutputMismatch) as info:
        equiv.check(one, settings=FIXED, modes=("eager",))
    f = info.value.report.findings[0]
    assert f.check == "forward"
    assert "types do not match: expected bool True, got int 1" in f.details


def test_the_same_bool_passes():
    @equivalent_to(lambda x: True, inputs=X3, grads=False)
    def true(x):
        return True

    passes(true)


class _ExitsOnEq:
    def __eq__(self, other):
        raise SystemExit(5)

    __hash__ = object.__hash__


def test_an_output_whose_eq_exits_compares_by_identity():
    @equivalent_to(lambda x: _ExitsOnEq(), inputs=X3, grads=False)
    def other(x):
        return _ExitsOnEq()

    (f,) = check(other).findings
    assert f.check == "forward" and "compared with ==" in f.details


# -- user exceptions whose __str__ raises ---------------------------------------------------------
class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("str broke")


def _raises(x):
    raise Unprintable("boom")


def test_error_text_names_an_unprintable_exception():
    from equiv.errors import error_text

    assert error_text(Unprintable("boom")) == UNPRINTABLE
    assert error_text(ValueError("fine")) == "fine"


def test_an_unprintable_error_of_the_implementation_is_an_error_parity_finding():
    @equivalent_to(lambda x: x * 2, inputs=X3)
    def impl(x):
        raise Unprintable("boom")

    (f,) = check(impl).findings
    assert f.check == "error-parity" and "implementation raised Unprintable" in f.headline
    assert UNPRINTABLE in f.details


def test_an_unprintable_error_of_the_reference_is_an_error_parity_finding():
    @equivalent_to(_raises, inputs=X3)
    def impl(x):
        return x * 2

    (f,) = check(impl).findings
    assert f.check == "error-parity" and "reference raised Unprintable" in f.headline
    assert UNPRINTABLE in f.details


def test_unprintable_errors_of_both_sides_are_an_invalid_input_naming_them():
    @equivalent_to(_raises, inputs=X3)
    def impl(x):
        raise Unprintable("boom")

    with pytest.raises(equiv.InvalidArgument, match="no valid example") as info:
        check(impl)
    assert UNPRINTABLE in str(info.value)


def test_unprintable_errors_of_another_type_are_a_finding():
    def ref(x):
        raise ValueError("bad x")

    @equivalent_to(ref, inputs=X3)
    def impl(x):
        raise Unprintable("boom")

    (f,) = check(impl).findings
    assert f.check == "error-parity" and "raised Unprintable" in f.headline
    assert UNPRINTABLE in f.headline + f.details


def test_unprintable_errors_compare_by_their_shown_text():
    @equivalent_to(_raises, inputs=X3, raises=Unprintable, match="unprintable Unprintable")
    def impl(x):
        raise Unprintable("boom")

    passes(impl)


def _unprintable_on_str(x):
    if isinstance(x, str):
        raise Unprintable("reference")
    return x * 2


def test_unprintable_error_inputs_compare_by_their_shown_text():
    @equivalent_to(_unprintable_on_str, inputs=X3, error_inputs=st.just(("bad",)))
    def impl(x):
        if isinstance(x, str):
            raise Unprintable("implementation")
        return x * 2

    passes(impl)


# -- SystemExit from user code --------------------------------------------------------------------
def _run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = main(list(argv), out=out, err=err)
    return code, out.getvalue(), err.getvalue()


EXITING_REFERENCE = '''
    import sys
    from equiv import equivalent_to

    def ref(x):
        raise SystemExit

    @equivalent_to(ref)
    def impl(x):
        return x * 2
'''


def test_a_reference_raising_system_exit_on_derived_inputs_is_one_clean_finding(tmp_path):
    path = tmp_path / "exiting_reference.py"
    path.write_text(textwrap.dedent(EXITING_REFERENCE))
    code, out, err = _run_cli("check", str(path), "--modes", "eager", "--max-examples", "15",
                              "--seed", "1234")
    assert code == 1, out + err
    assert "ErrorMismatch: the reference raised SystemExit" in out
    assert "ExceptionGroup" not in out + err and "_Found" not in out + err


def test_a_reference_raising_system_exit_is_an_error_parity_finding():
    def ref(x):
        sys.exit(2)

    @equivalent_to(ref)
    def impl(x):
        return x * 2

    with pytest.raises(equiv.ErrorMismatch) as info:
        equiv.check(impl, settings=FIXED, modes=("eager",))
    assert all(f.check == "error-parity" for f in info.value.report.findings)


def test_a_strategy_raising_system_exit_is_invalid_naming_it():
    @equivalent_to(lambda x: x * 2, inputs=X3.map(lambda a: sys.exit(4)))
    def impl(x):
        return x * 2

    with pytest.raises(equiv.InvalidArgument) as info:
        check(impl)
    text = str(info.value)
    assert "raised SystemExit (4)" in text and "test_hostile_values.py" in text
    assert "raise an exception instead" in text
    assert isinstance(info.value.__cause__, SystemExit)


def test_a_reference_exit_where_derived_inputs_probe_it_is_not_smooth():
    from equiv.strategies._derived import smooth_at

    def exits(x):
        raise SystemExit(1)

    assert smooth_at(exits, [torch.zeros(3)], {}, {0: [1]}) is False


def test_a_reference_exit_where_broadcast_inputs_probe_it_rejects_them():
    import inspect

    from equiv._args import Args
    from equiv.strategies import _accepts

    def exits(x):
        raise SystemExit(1)

    assert _accepts(exits, Args(torch.zeros(3)), inspect.signature(exits), {}) is False


def test_a_strategy_exiting_in_the_compile_probe_is_left_to_the_run():
    from equiv.strategies._compile import prefer_sides_of_two

    exiting = X3.map(lambda a: sys.exit(4))
    assert prefer_sides_of_two(exiting) is exiting


def test_a_reference_exiting_in_float64_only_leaves_no_oracle():
    def ref(x):
        if x.dtype == torch.float64:
            sys.exit(1)
        return x * 3

    @equivalent_to(ref, inputs=X3, grads=False)
    def impl(x):
        return x * 3 + 1e-3  # beyond the default tolerance: the verdict asks the oracle

    report = check(impl)
    assert [f.check for f in report.findings] == ["forward"]
    assert any("no float64 oracle" in n and "SystemExit" in n for n in report.notes)


def test_run_reference_keeps_a_reference_exit_as_its_error():
    from equiv.numerics import run_reference

    def exits(x):
        raise SystemExit(2)

    runs = run_reference(exits, (torch.zeros(3, dtype=torch.float64),))
    assert isinstance(runs.oracle_error, SystemExit) and runs.oracle is None


class _ExitsInDoubleBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: the double backward's first pass
            sys.exit(6)
        return 2 * x * g


def test_a_backward_exiting_under_double_backward_is_a_finding():
    @equivalent_to(lambda x: x * x, inputs=st.tuples(tensors(shape=(3,), requires_grad=True)))
    def square(x):
        return _ExitsInDoubleBackward.apply(x)

    findings = check(square).findings
    assert [f.check for f in findings] == ["double-backward"]
    assert "raised SystemExit" in findings[0].headline


def test_a_module_constructor_exiting_or_unprintable_is_invalid_naming_it():
    from torch import nn

    class Linear(nn.Module):
        def __init__(self, dim):
            super().__init__()
            self.lin = nn.Linear(dim, dim)

        def forward(self, x):
            return self.lin(x)

    class Exits(Linear):
        def __init__(self, dim):
            sys.exit(3)

    class Broken(Linear):
        def __init__(self, dim):
            raise Unprintable("no")

    with pytest.raises(equiv.InvalidArgument, match=r"Exits\(\*\*init\) raised SystemExit: 3"):
        equivalent_to(Linear, init=dict(dim=3))(Exits)
    with pytest.raises(equiv.InvalidArgument, match="raised Unprintable") as info:
        equivalent_to(Linear, init=dict(dim=3))(Broken)
    assert UNPRINTABLE in str(info.value)


def _fails_on_large(args):
    if float(args[0].abs().max()) > 1:
        raise ValueError("strategy broke")
    return args


def test_a_strategy_error_propagates_as_itself():
    @equivalent_to(lambda x: x * 2, inputs=X3.map(_fails_on_large))
    def wrong(x):
        return x * 3

    with pytest.raises(ValueError, match="strategy broke"):
        check(wrong)


def _drive_raising(error: BaseException) -> None:
    """equiv.run._drive on a Hypothesis test that raised ``error`` beside a finding."""
    from equiv.modes import parse_mode
    from equiv.report import Finding
    from equiv.run import _drive, _signal
    from equiv.spec import get_spec

    @equivalent_to(lambda x: x * 2, inputs=X3)
    def impl(x):
        return x * 2

    finding = Finding(check="forward", headline="output differs", spec="s", implementation="i",
                      reference="r", mode="eager", device="cpu")

    def wrapped():
        raise BaseExceptionGroup("two bugs", [_signal("forward")([finding]), error])

    _drive(get_spec(impl), parse_mode("eager"), "cpu", wrapped, [])


def test_an_exit_beside_a_finding_is_invalid_naming_it_without_equivs_signals():
    with pytest.raises(equiv.InvalidArgument, match=r"raised SystemExit \(3\)") as info:
        _drive_raising(SystemExit(3))
    assert isinstance(info.value.__cause__, SystemExit)


def test_a_user_error_beside_a_finding_is_raised_alone():
    with pytest.raises(ValueError, match="strategy broke"):
        _drive_raising(ValueError("strategy broke"))


def test_keyboard_interrupt_from_the_reference_still_propagates():
    def ref(x):
        raise KeyboardInterrupt

    @equivalent_to(ref)
    def impl(x):
        return x * 2

    with pytest.raises(KeyboardInterrupt):
        check(impl)


def test_keyboard_interrupt_from_a_strategy_still_propagates():
    def interrupt(a):
        raise KeyboardInterrupt

    @equivalent_to(lambda x: x * 2, inputs=X3.map(interrupt))
    def impl(x):
        return x * 2

    with pytest.raises(KeyboardInterrupt):
        check(impl)
