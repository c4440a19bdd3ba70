"""The runner's automatic input variants: with inputs derived from signatures only, equiv
catches layout-, aliasing-, batch- and dtype-specific bugs within the default number of examples,
names the variant, shrinks well, and passes correct tricky twins."""

from __future__ import annotations

import hypothesis
import pytest
import torch

import equiv
from equiv import equivalent_to

#: fixed seeds, no example database; the default profile's budget of 60 examples. Measured
#: (20 seeds each, bugs of this file): at 30 examples each variant-specific bug is caught in
#: about 85-100% of runs -- Hypothesis spends about half of a small budget on mutations of
#: earlier examples, so only ~14 of 30 are independent draws; at 60 the misses mostly vanish.
SEEDS = (0, 1)
BUDGET = 60


def default(seed: int) -> equiv.settings:
    return equiv.settings(seed=seed, max_examples=BUDGET, modes=("eager",),
                          hypothesis_settings=hypothesis.settings(database=None))


def run(impl, seed: int = 0) -> equiv.Report:
    return equiv.check(impl, settings=default(seed), raise_on_failure=False)


def caught(impl, check: str, *lines: str) -> equiv.Finding:
    """``impl`` is caught on every seed, by ``check``, with ``lines`` in the message."""
    for seed in SEEDS:
        report = run(impl, seed)
        assert not report.ok, f"seed {seed}: not caught in {report.examples_run} examples"
        f = next((f for f in report.findings if f.check == check), None)
        assert f is not None, report.render()
        for line in lines:
            assert line in f.message, f.message
    return f


def passes(impl) -> None:
    for seed in SEEDS:
        report = run(impl, seed)
        assert report.ok, report.render()
        assert report.examples_run >= 20


# -- a layout bug: wrong only for transposed (permuted) memory ---------------------------------
def double_ref(x):
    return x * 2


def test_transposed_only_bug_is_caught_and_named():
    """empty_like keeps x's strides; writing the result in row-major order transposes it."""
    @equivalent_to(double_ref)
    def double(x):
        out = torch.empty_like(x)
        out.as_strided((x.numel(),), (1,)).copy_((x * 2).reshape(-1))
        return out

    f = caught(double, "forward", "input variant: x transposed", "transposed, strides (1, 2)",
               "x = storage0.as_strided((2, 2), (1, 2), 0)")
    assert f.failure_class is equiv.OutputMismatch


def test_transposed_twin_passes():
    """The same kernel with a contiguous output is correct for every layout."""
    @equivalent_to(double_ref)
    def double(x):
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
        out.as_strided((x.numel(),), (1,)).copy_((x * 2).reshape(-1))
        return out

    passes(double)


def test_transposed_bug_shrinks_to_2x2_transposed():
    """Shrinks to a 2-D transposed tensor of at most 2x2 (here exactly 2x2)."""
    @equivalent_to(double_ref)
    def double(x):
        out = torch.empty_like(x)
        out.as_strided((x.numel(),), (1,)).copy_((x * 2).reshape(-1))
        return out

    for seed in SEEDS:
        f = run(double, seed).findings[0]
        assert "double(x=f32[2,2] cpu grad (transposed, strides (1, 2)))" in f.example, f.example


# -- wrong only for expanded (stride-0) input ---------------------------------------------------
def _broadcast_dim(x):
    return next((i for i, (s, n) in enumerate(zip(x.stride(), x.shape)) if s == 0 and n > 1),
                None)


def test_expanded_only_bug_is_caught():
    @equivalent_to(double_ref)
    def double(x):
        d = _broadcast_dim(x)
        if d is not None:  # broadcast fast path: compute one slice, expand it
            return x.narrow(d, 0, 1).expand_as(x).clone()  # bug: forgot the * 2
        return x * 2

    f = caught(double, "forward", "input variant: x expanded (stride 0 along dim", "expanded, "
               "strides", "in a storage of")
    assert ", 0" in f.example or "(0," in f.example


def test_expanded_twin_passes():
    """A correct broadcast fast path that returns a stride-0 output."""
    @equivalent_to(double_ref)
    def double(x):
        d = _broadcast_dim(x)
        if d is not None:
            return (x.narrow(d, 0, 1) * 2).expand_as(x)
        return x * 2

    passes(double)


def relu_ref(x):
    return torch.relu(x)


MUTATED = ("layouts", "aliasing", "aliasing-mutated")


def test_expanded_mutated_argument_must_raise_or_match():
    """With aliasing of mutated arguments allowed, x may be expanded: in-place into it raises in
    torch (accepted). Writing into a copy instead of x is caught (x's final value differs)."""
    @equivalent_to(relu_ref, mutates={"x": "out"}, variants=MUTATED)
    def relu_(x):
        return x.clamp_(min=0)

    passes(relu_)

    @equivalent_to(relu_ref, mutates={"x": "out"}, variants=MUTATED)
    def relu_copy_(x):
        if _broadcast_dim(x) is not None:
            return x.clamp(min=0)  # silently leaves x unchanged
        return x.clamp_(min=0)

    caught(relu_copy_, "mutation", "input variant: x expanded",
           "the final value of mutated argument 'x' differs")


# -- the same tensor in two slots / overlapping views ------------------------------------------
def mul_ref(x, y):
    return x * y


def test_same_tensor_bug_is_caught():
    """A "square" fast path keyed on storage and offset, with a wrong formula."""
    @equivalent_to(mul_ref)
    def mul(x, y):
        if (x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
                and x.storage_offset() == y.storage_offset()):
            return x * x.abs()  # wrong for negatives
        return x * y

    caught(mul, "forward", "input variant: y is the same tensor as x", "y=<same tensor as x>",
           "    mul(x, x)")


def test_same_tensor_twin_passes():
    @equivalent_to(mul_ref)
    def mul(x, y):
        if x is y:
            return x.square()
        return x * y

    passes(mul)


def test_same_tensor_bug_shrinks_to_smallest_pair():
    """Shrinks to the smallest aliased pair: one one-element float32 tensor in both slots."""
    @equivalent_to(mul_ref)
    def mul(x, y):
        if x is y:
            return x.square() + 1
        return x * y

    for seed in SEEDS:
        f = run(mul, seed).findings[0]
        assert f.example == "mul(x=f32[1] cpu grad, y=<same tensor as x>)", f.example
        assert f.example_code.endswith("mul(x, x)")


def test_overlapping_views_bug_is_caught():
    """Same storage taken to mean same tensor: wrong for overlapping views."""
    @equivalent_to(mul_ref)
    def mul(x, y):
        if x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr():
            return x * x
        return x * y

    # both overlapping forms share a storage; the row and column of one base is the simplest
    f = caught(mul, "forward", "the row and the column of one base", "overlaps x")
    assert "storage0.as_strided" in f.example_code


def test_overlapping_bug_shrinks_to_smallest_pair():
    @equivalent_to(mul_ref)
    def mul(x, y):
        if x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr() and x is not y:
            return x * x
        return x * y

    for seed in SEEDS:
        # the forward finding (the row-and-column variant may add a gradient finding: with
        # equal values in x and y the forward happens to agree there)
        f = next(f for f in run(mul, seed).findings if f.check == "forward")
        assert f.example == ("mul(x=f32[2] cpu grad (non-leaf), y=f32[2] cpu grad (overlaps x "
                             "(1 shared elements), strides (2,), non-leaf))"), f.example


def test_overlapping_twin_passes():
    @equivalent_to(mul_ref)
    def mul(x, y):
        same = (x.untyped_storage().data_ptr() == y.untyped_storage().data_ptr()
                and x.storage_offset() == y.storage_offset() and x.stride() == y.stride()
                and x.shape == y.shape)
        return x.square() if same else x * y

    passes(mul)


def test_differently_shaped_arguments_become_views_of_one_base():
    """Overlapping, row-column and every-other views of arguments with different shapes keep
    each argument's shape and values outside the shared elements."""
    from equiv.variants import _every_other, _overlapping, _row_and_column

    x, y = torch.arange(6.0).view(2, 3), torch.arange(10.0, 14.0)
    a, b = _overlapping(x, y, 4)
    assert (a.shape, b.shape) == (x.shape, y.shape) and torch.equal(a, x)
    assert b.tolist() == [4.0, 5.0, 12.0, 13.0]  # two shared elements, then y's own
    a, b = _row_and_column(x, y)
    assert a.data_ptr() == b.data_ptr() and torch.equal(a, x)
    assert b.tolist() == [0.0, 11.0, 12.0, 13.0] and b.stride() == (6,)
    a, b = _every_other(x, y)
    assert a.data_ptr() == b.data_ptr() and b.tolist() == [0.0, 2.0, 4.0, 13.0]
    a, b = _row_and_column(y, x)  # the longer argument first
    assert torch.equal(a, y) and b.tolist() == [[10.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


@hypothesis.settings(max_examples=5, database=None)
@hypothesis.given(hypothesis.strategies.data())
def test_row_and_column_base_stays_bounded_for_a_long_second_argument(data):
    """A square base for a 2-element argument and a 5000-element one would hold 25M elements:
    past 1024 elements on either side the pair starts at one address with a stride of 2."""
    from equiv.variants import _alias

    values = {"x": torch.randn(2), "y": torch.randn(5000)}
    variant = _alias(data.draw, "row-column", values, [("x", "y")], frozenset())
    assert values["x"].data_ptr() == values["y"].data_ptr()
    assert values["y"].untyped_storage().nbytes() <= 4 * 2 * 5000, variant.description
    assert "base[::2]" in variant.description


def add_bias_ref(x, bias):
    return x + bias


def _add_bias(key):
    @equivalent_to(add_bias_ref, inputs=_bias_inputs())
    def add_bias(x, bias):
        if key(x) == key(bias):  # "bias is x": add x to itself
            return x + x
        return x + bias
    return add_bias


def _bias_inputs():
    from hypothesis import strategies as st

    from equiv.strategies import tensors
    return st.integers(2, 5).flatmap(
        lambda n: st.tuples(tensors(shape=(n, n)), tensors(shape=(n,))))


def test_dedup_by_data_ptr_is_caught_on_differently_shaped_arguments():
    """x (n, n) and bias (n,) never have one shape: only views of one base with different
    shapes share a start address."""
    f = caught(_add_bias(lambda t: t.data_ptr()), "forward", "one start address")
    assert "storage0.as_strided" in f.example_code


def test_dedup_by_geometry_passes_on_differently_shaped_arguments():
    passes(_add_bias(lambda t: (t.data_ptr(), t.shape, t.stride())))


# -- aliasing a mutated argument (opt-in) -----------------------------------------------------
def add_scaled_ref(x, y):
    return 2 * x + y


def test_mutated_aliasing_bug_is_caught_when_allowed():
    """x.mul_(2).add_(y) reads y after writing x: wrong when y is x. Only explored with
    variants including 'aliasing-mutated'; the default leaves mutated arguments unaliased."""
    def bug(x, y):
        return x.mul_(2).add_(y)

    quiet = equivalent_to(add_scaled_ref, mutates={"x": "out"})(bug)
    passes(quiet)
    loud = equivalent_to(add_scaled_ref, mutates={"x": "out"},
                         variants=("layouts", "aliasing", "aliasing-mutated"))(
        lambda x, y: bug(x, y))
    caught(loud, "mutation", "y is the same tensor as x")


def test_mutated_aliasing_twin_passes():
    """Computes the whole result before writing x: right whatever y shares with x (the same
    tensor, a broadcast row of its memory)."""
    @equivalent_to(add_scaled_ref, mutates={"x": "out"},
                   variants=("layouts", "aliasing", "aliasing-mutated"))
    def add_scaled_(x, y):
        return x.copy_(2 * x + y)

    passes(add_scaled_)


def test_an_elementwise_write_reading_a_broadcast_alias_is_caught():
    """x.add_(y) reads each element of y before writing that position, but a broadcast y is
    read at several positions: where y overlaps x, an element is read after a write changed it
    (torch does not refuse that overlap)."""
    @equivalent_to(add_scaled_ref, mutates={"x": "out"},
                   variants=("layouts", "aliasing", "aliasing-mutated"))
    def add_scaled_(x, y):
        return x.add_(y, alpha=0.5).mul_(2)

    f = next(f for f in run(add_scaled_, 0).findings if f.check == "mutation")
    assert "final value of mutated argument 'x' differs" in f.headline
    assert "(overlaps x" in f.message


# -- a batch of one, float16 ---------------------------------------------------------------------
def center_ref(x):
    return x - x.mean(dim=0, keepdim=True)


def test_batch_of_one_bug_is_caught():
    """squeeze() also drops a batch of one, so the mean runs over features."""
    @equivalent_to(center_ref)
    def center(x):
        y = x.squeeze()
        return (y - y.mean(dim=0, keepdim=True)).reshape(x.shape)

    f = caught(center, "forward", "Mismatched elements")
    assert "x=f32[1," in f.example, f.example


def test_batch_of_one_twin_passes():
    @equivalent_to(center_ref)
    def center(x):
        y = x.flatten(1) if x.dim() >= 2 else x  # keeps the batch dim, even of size 1
        return (y - y.mean(dim=0, keepdim=True)).reshape(x.shape)

    passes(center)


HALF = ("layouts", "aliasing", "half")


def test_float16_bug_is_caught():
    """With the "half" variant (on by default for derived inputs)."""
    @equivalent_to(double_ref, variants=HALF)
    def double(x):
        if x.dtype == torch.float16:
            return x * 2.004  # a half kernel with a mis-rounded constant (0.2% off)
        return x * 2

    f = caught(double, "forward", "dtype: torch.float16", "input variant: x cast to float16")
    assert "f16[" in f.example


def test_float16_twin_passes():
    @equivalent_to(double_ref, variants=HALF)
    def double(x):
        if x.dtype in (torch.float16, torch.bfloat16):
            return (x.float() * 2).to(x.dtype)  # upcast: exact
        return x * 2

    passes(double)


# -- the variants option ----------------------------------------------------------------------
def test_variants_off_misses_the_layout_bug():
    """variants=False explores the drawn (contiguous) inputs only: the transposed bug hides."""
    @equivalent_to(double_ref, variants=False)
    def double(x):
        out = torch.empty_like(x)
        out.as_strided((x.numel(),), (1,)).copy_((x * 2).reshape(-1))
        return out

    passes(double)


@pytest.mark.parametrize("value, match", [
    ("transposed", r"unknown variant kind\(s\) \['transposed'\]"),
    (("layouts", "aliases"), r"unknown variant kind\(s\) \['aliases'\]"),
    (3, "give True"),
])
def test_bad_variants_option_fails_at_decoration(value, match):
    with pytest.raises(equiv.InvalidArgument, match=match):
        equivalent_to(double_ref, variants=value)(lambda x: x * 2)


def test_variants_option_is_normalised():
    f = equivalent_to(double_ref, variants="layouts")(lambda x: x * 2)
    assert f.__equiv_spec__.variants == ("layouts",)
    from hypothesis import strategies as st

    from equiv.strategies import tensors

    g = equivalent_to(double_ref)(lambda x: x * 2)  # derived inputs: half examples too
    assert g.__equiv_spec__.variants == ("layouts", "aliasing", "half-float32")
    h = equivalent_to(double_ref, inputs=st.tuples(tensors(shape=(2,))))(lambda x: x * 2)
    assert h.__equiv_spec__.variants == ("layouts", "aliasing")


def test_raising_on_a_variant_of_an_unmutated_argument_is_a_finding():
    """Only mutated arguments get "must raise or match": view(-1) failing on a transposed input
    is an error-parity finding that names the variant."""
    @equivalent_to(double_ref)
    def double(x):
        return (x.view(-1) * 2).view(x.shape)

    f = caught(double, "error-parity", "the implementation raised RuntimeError",
               "input variant: x ", "view size is not compatible")
    assert f.failure_class is equiv.ErrorMismatch


def test_variants_never_touch_the_users_tensors():
    """Variants re-lay out and alias copies: the user's example tensors keep values and
    versions, even against an in-place implementation."""
    import hypothesis.strategies as st

    x = torch.tensor([[1.5, -2.5], [0.5, 3.5]])
    y = torch.tensor([[0.5, 1.5], [2.5, -0.5]])
    before = (x.clone(), y.clone(), x._version, y._version)

    @equivalent_to(add_scaled_ref, mutates={"x": "out"}, inputs=st.just((x, y)),
                   variants=("layouts", "aliasing", "aliasing-mutated"))
    def add_scaled_(x, y):
        return x.add_(y, alpha=0.5).mul_(2)

    passes(add_scaled_)
    assert torch.equal(x, before[0]) and torch.equal(y, before[1])
    assert (x._version, y._version) == before[2:]


def _rms_ref(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def test_no_variant_builds_a_storage_past_four_times_the_example(monkeypatch):
    """A (1, 1000) matrix and its (1000,) weight as the row and the column of one base would
    live in a 1000 x 1000 storage: 500x the example. Every executed example's storages stay
    within ~4x its elements, and the two still overlap with one start address."""
    import math

    import hypothesis.strategies as st

    import equiv.run as runner
    from equiv.strategies import tensors

    seen = []
    real = runner.execute_example

    def spy(*args, **options):
        outcome = real(*args, **options)
        if outcome.template is not None:
            seen.append(outcome.template)
        return outcome

    monkeypatch.setattr(runner, "execute_example", spy)
    inputs = st.tuples(tensors(shape=(1, 1000), requires_grad=True),
                       tensors(shape=(1000,), requires_grad=True, salt=1))

    @equivalent_to(_rms_ref, inputs=inputs, name="variants.rms_bounded")
    def rms(x, w):
        return torch.rms_norm(x, (1000,), w, 1e-6)

    report = equiv.check(rms, settings=equiv.settings(
        seed=0, max_examples=30, modes=("eager",),
        hypothesis_settings=hypothesis.settings(database=None)), raise_on_failure=False)
    assert report.ok, report.render()
    one_start = 0
    for t in seen:
        elements = sum(math.prod(s.size) for s in t.slots)
        stored = sum(g.values.numel() for g in t.groups)
        assert stored <= 4 * elements + 16, (stored, elements, t.describe("rms"))
        shared = [g for g in t.groups if len(g.slots) == 2]
        one_start += any(t.slots[g.slots[0]].offset == t.slots[g.slots[1]].offset
                         for g in shared)
    assert one_start >= 3, f"{one_start} of {len(seen)} examples overlap x and w at one address"


@hypothesis.settings(max_examples=10, database=None)
@hypothesis.given(hypothesis.strategies.data())
def test_row_and_column_views_only_where_the_base_stays_small(data):
    """Row-and-column views of two 3-element arguments (a 3 x 3 base); of two 1000-element
    ones, the one-start-address views in a 2000-element base instead of a 1000 x 1000 one."""
    from equiv.variants import _alias

    small = {"x": torch.randn(3), "y": torch.randn(3)}
    variant = _alias(data.draw, "row-column", small, [("x", "y")], frozenset())
    if "row and the column" in variant.description:
        assert small["y"].untyped_storage().nbytes() == 4 * 9
    big = {"x": torch.randn(1000), "y": torch.randn(1000)}
    variant = _alias(data.draw, "row-column", big, [("x", "y")], frozenset())
    assert big["y"].untyped_storage().nbytes() <= 4 * 4 * 2000, variant.description
    if "base[::2]" in variant.description:
        assert big["x"].data_ptr() == big["y"].data_ptr()
