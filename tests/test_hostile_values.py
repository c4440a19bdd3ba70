"""Hostile values: outputs equiv cannot compare (meta, nested, tensor subclasses) are a clean
InvalidArgument naming the side, the output and the fix; outputs it can (complex32, a bool
against an int) are compared, a difference being a finding; a user exception whose ``__str__``
raises is shown as ``<unprintable ...>`` and compared as such. Each broken case has a correct
twin that passes."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch

import equiv
from equiv import equivalent_to
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
