"""Registration mistakes fail at decoration time with an error naming the argument and the fix;
the public surface is small and stable; the user's tensors are never modified."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
import torch

import equiv
from equiv import equivalent_to
from equiv.strategies import tensors
from tests.conftest import FAST


def ref1(x):
    return x * 2


def ref2(x, y):
    return x + y


def impl1(x):
    return x * 2


def impl2(x, y):
    return x + y


def impl_flag(x, flag: object):
    return x


INVALID = [
    ("ref not callable", lambda: equivalent_to(42)(impl1), "must be the pure reference function"),
    ("mutates unknown name", lambda: equivalent_to(ref1, mutates={"y": "out"})(impl1),
     "names 'y', which is not a parameter"),
    ("mutates not a mapping", lambda: equivalent_to(ref1, mutates=["x"])(impl1),
     "must map argument names"),
    ("mutates bad location", lambda: equivalent_to(ref1, mutates={"x": 1.5})(impl1),
     "the location must be 'out'"),
    ("mutates out twice", lambda: equivalent_to(ref2, mutates={"x": "out", "y": "out"})(impl2),
     "cannot be combined with other mutated arguments"),
    ("ref signature", lambda: equivalent_to(ref1)(impl2),
     "cannot take the arguments of"),
    ("inputs not a strategy", lambda: equivalent_to(ref1, inputs=[torch.ones(2)])(impl1),
     "must be a Hypothesis strategy"),
    ("half tolerance", lambda: equivalent_to(ref1, rtol=1e-3)(impl1),
     "give both rtol and atol"),
    ("negative tolerance", lambda: equivalent_to(ref1, rtol=-1, atol=0)(impl1),
     "give a number >= 0"),
    ("underivable inputs", lambda: equivalent_to(lambda x, flag: x)(impl_flag),
     "cannot derive inputs for"),
    ("examples not a list", lambda: equivalent_to(ref1, examples=torch.ones(2))(impl1),
     "takes a list of argument tuples"),
    ("example does not fit", lambda: equivalent_to(ref1, examples=[(1, 2)])(impl1),
     "does not fit"),
    ("settings wrong type", lambda: equivalent_to(ref1, settings={"max_examples": 3})(impl1),
     "takes an equiv.settings object"),
    ("settings unknown option", lambda: equiv.settings(max_example=3),
     "unknown option"),
    ("settings bad value", lambda: equiv.settings(max_examples=0),
     "give a positive integer"),
    ("settings unknown check", lambda: equiv.settings(checks=("forwards",)),
     "unknown check"),
    ("unknown profile", lambda: equiv.settings.load_profile("fastest"),
     "no equiv settings profile named 'fastest'"),
]


@pytest.mark.parametrize("label,make,message", INVALID, ids=[i[0] for i in INVALID])
def test_invalid_registration_fails_clearly(label, make, message):
    """Each mistake raises InvalidArgument (also a TypeError) with a message naming the fix."""
    with pytest.raises(equiv.InvalidArgument, match=message) as info:
        make()
    assert isinstance(info.value, TypeError)


def test_check_on_an_undecorated_function_names_the_decorator():
    with pytest.raises(equiv.InvalidArgument, match="decorate it with @equivalent_to"):
        equiv.check(impl1)


def test_unknown_mode_is_a_usage_error():
    @equivalent_to(ref1)
    def twice(x):
        return x * 2

    with pytest.raises(equiv.InvalidArgument, match="unknown mode 'jit'"):
        equiv.check(twice, modes=("jit",), settings=FAST)


def test_a_strategy_producing_non_tuples_is_a_usage_error():
    @equivalent_to(ref1, inputs=tensors(shape=(2,)))
    def twice(x):
        return x * 2

    with pytest.raises(equiv.InvalidArgument, match="produced a bad example"):
        equiv.check(twice, settings=FAST)


def test_a_reference_result_that_does_not_fit_mutates_is_reported():
    @equivalent_to(lambda m, v: (m * 2, v), mutates={"m": 0, "v": 2})
    def update_(m, v):
        m.mul_(2)

    with pytest.raises(equiv.InvalidArgument, match=r"says the final value of 'v' is at \[2\] "
                       r".* returned a tuple of 2: index 2 is out of range"):
        equiv.check(update_, settings=FAST)

    @equivalent_to(lambda m, v: (m * 2, v), mutates={"m": "output[0]", "v": "output[1]"})
    def named_(m, v):
        m.mul_(2)
        return m, v

    with pytest.raises(equiv.InvalidArgument, match=r"returned a tuple of 2, whose elements are "
                       r"found by int index: mutates=\{'m': 0, 'v': 1\}"):
        equiv.check(named_, settings=FAST)

    @equivalent_to(lambda m: m.sum(), mutates={"m": "out"})
    def reduce_(m):
        m.mul_(2)

    with pytest.raises(equiv.InvalidArgument, match="does not fit the argument's shape"):
        equiv.check(reduce_, settings=FAST)


def test_decorator_returns_the_implementation_unchanged_and_registers_it():
    @equivalent_to(ref1)
    def twice(x):
        return x * 2

    assert twice(torch.ones(2)).tolist() == [2.0, 2.0]
    spec = twice.__equiv_spec__
    assert spec.impl is twice and spec.ref is ref1
    assert equiv.registry()[spec.name] is spec
    assert spec.derived_inputs


def test_public_surface():
    """`equiv` re-exports a small, explicit API and nothing private."""
    assert sorted(equiv.__all__) == sorted([
        "Args", "AliasingMismatch", "EquivError", "EquivalenceFailure", "ErrorMismatch",
        "Finding", "GradientMismatch", "InternalError", "InvalidArgument", "MemoryMismatch",
        "MutationMismatch",
        "OutputMismatch", "Report", "Schedule", "ScheduleMismatch", "Spec", "check",
        "assert_equivalent", "bench", "equivalent_to",
        "registry", "settings",
        "Mode", "ModeResult", "compiled",  # execution modes
    ])
    for name in equiv.__all__:
        assert getattr(equiv, name).__module__.startswith("equiv")
    assert issubclass(equiv.EquivalenceFailure, AssertionError)
    assert issubclass(equiv.GradientMismatch, equiv.EquivalenceFailure)


def test_import_does_not_load_dynamo_or_initialise_cuda():
    import subprocess
    import sys

    code = ("import sys, equiv, equiv.strategies; import torch; "
            "print('torch._dynamo' in sys.modules, 'torch._inductor' in sys.modules, "
            "torch.cuda.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False", "False"]


def test_user_tensors_are_never_modified():
    """An in-place implementation run on the user's own example tensors leaves them intact."""
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, dtype=torch.float64)
    base = torch.randn(10, dtype=torch.float64)
    view = base[2:6]
    before = [t.detach().clone() for t in (x, w, base)]
    versions = [t._version for t in (x, w, base)]

    def ref(x, w, v):
        return x * w + v.sum(), x * 2

    @equivalent_to(ref, mutates={"x": 1}, examples=[(x, w, view)],
                   inputs=st.just((x, w, view)))
    def fused_(x, w, v):
        out = x * w + v.sum()
        x.mul_(2)
        return out, x

    assert equiv.check(fused_, settings=equiv.settings(FAST, max_examples=2)).ok
    for t, b, v in zip((x, w, base), before, versions):
        assert torch.equal(t.detach(), b) and t._version == v
    assert x.grad is None


def test_derived_inputs_use_the_signature():
    """Without inputs=, plain tensor parameters get tensors of one shape (or, sometimes,
    mutually broadcastable shapes); defaults are kept."""
    seen = []

    def ref(x, y, alpha: float = 2.0):
        return x + alpha * y

    @equivalent_to(ref)
    def axpy(x, y, alpha: float = 2.0):
        torch.broadcast_shapes(x.shape, y.shape)  # raises if they do not broadcast
        seen.append((x.shape == y.shape, x.requires_grad, alpha))
        return torch.add(x, y, alpha=alpha)

    assert equiv.check(axpy, settings=FAST).ok
    assert seen and all(s[2] == 2.0 for s in seen)
    assert sum(s[0] for s in seen) > len(seen) / 2  # mostly one shape
    # inputs require grad, except on the no-grad path (the no-grad check's own calls)
    assert sum(s[1] for s in seen) > len(seen) / 2 and not all(s[1] for s in seen)


def test_findings_and_failures_pickle():
    import pickle

    @equivalent_to(ref1)
    def off(x):
        return x * 2 + 1

    with pytest.raises(equiv.OutputMismatch) as info:
        equiv.check(off, settings=FAST)
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is equiv.OutputMismatch
    assert again.report == info.value.report and str(again) == str(info.value)


def test_report_renders_seed_tolerance_and_reproduce_line():
    @equivalent_to(ref1)
    def off(x):
        return x * 2 + 1

    report = equiv.check(off, settings=FAST, raise_on_failure=False)
    text = report.render()
    assert "seed 1234" in text
    assert "tolerance: default for the dtype" in text
    assert "Reproduce: equiv.check(off, seed=1234)" in text
    assert report.to_dict()["schema"] == "equiv.report/1"


def test_equivalent_to_takes_module_options_for_module_pairs():
    """nn.Module pairs go through the same decorator; the options are keyword-only extras."""
    import inspect

    from torch import nn

    params = inspect.signature(equiv.equivalent_to).parameters
    assert params["module_options"].kind is inspect.Parameter.VAR_KEYWORD
    with pytest.raises(equiv.InvalidArgument, match="unexpected keyword argument"):
        equiv.equivalent_to(lambda x: x, state_mapp=None)
    assert equiv.modules.is_module_side(nn.LayerNorm)
