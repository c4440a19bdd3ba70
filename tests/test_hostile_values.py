"""Hostile exceptions: a user exception whose ``__str__`` raises is shown as
``<unprintable E: __str__ raised RuntimeError>`` and compared as such (error parity, ``match=``,
``error_inputs=`` messages), never an internal error of equiv. Each broken case has a correct
twin that passes."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch

import equiv
from equiv import equivalent_to
from equiv.strategies import tensors
from tests.conftest import FAST

X3 = st.tuples(tensors(shape=(3,)))
FIXED = equiv.settings(FAST, max_examples=5)
UNPRINTABLE = "<unprintable Unprintable: __str__ raised RuntimeError>"


def check(fn):
    """The report of a short eager run of ``fn``'s spec (no raise on findings)."""
    return equiv.check(fn, settings=FIXED, modes=("eager",), raise_on_failure=False)


def passes(fn) -> None:
    report = check(fn)
    assert report.ok, [f.headline for f in report.findings]


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
