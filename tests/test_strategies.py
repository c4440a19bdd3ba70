"""Property tests of equiv.strategies themselves: options honoured, layouts keep values,
aliasing patterns really share storage, values are dense."""

from __future__ import annotations

import collections

import hypothesis
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import equiv.strategies as es

PROPS = hypothesis.settings(max_examples=60, derandomize=True, database=None, deadline=None,
                            suppress_health_check=[hypothesis.HealthCheck.too_slow])

ALL_DTYPES = es.FLOATING + es.HALF + es.COMPLEX + es.INTEGER + (torch.bool,)


def draw_one(strategy):
    """One example of a strategy (quietly; ``.example()`` warns outside the REPL)."""
    return hypothesis.find(strategy, lambda _: True, settings=hypothesis.settings(database=None))


def elements_of(t: torch.Tensor) -> set[int]:
    """Storage positions a tensor reads."""
    if t.numel() == 0:
        return set()
    probe = torch.arange(t.untyped_storage().nbytes() // t.element_size())
    return set(probe.as_strided(t.shape, t.stride(), t.storage_offset()).reshape(-1).tolist())


def test_public_surface():
    """The module exports exactly its documented names."""
    assert sorted(es.__all__) == sorted([
        "ALIAS_PATTERNS", "LAYOUT_KINDS", "SPECIAL_VALUES", "TILE_LENGTHS", "Layout",
        "aliased_arguments", "arguments_for", "devices", "dtypes", "layouts", "scalars", "shapes",
        "tensors", "tile_lengths"])
    import equiv.strategies
    assert equiv.strategies is es


@PROPS
@given(st.data())
def test_tensors_honour_shape_dtype_device_grad(data):
    """shape, dtype, device and requires_grad are what was asked, for every dtype family."""
    shape = data.draw(es.shapes())
    dtype = data.draw(st.sampled_from(ALL_DTYPES))
    device = data.draw(es.devices())
    rg = data.draw(st.booleans())
    t = data.draw(es.tensors(shape=shape, dtype=dtype, device=device, requires_grad=rg,
                             layout=es.layouts()))
    assert tuple(t.shape) == shape
    assert t.dtype == dtype
    assert t.device.type == device.type
    assert t.requires_grad == (rg and (dtype.is_floating_point or dtype.is_complex))
    assert t.is_leaf


@PROPS
@given(es.shapes())
def test_shapes_default_bounds(shape):
    """Default shapes are 0-D to 3-D with sides 0..4."""
    assert 0 <= len(shape) <= 3
    assert all(0 <= d <= 4 for d in shape)


def test_shapes_cover_edge_cases():
    """0-d, size-0 and size-1 dims all occur among default shapes."""
    seen = collections.Counter()

    @hypothesis.settings(max_examples=300, derandomize=True, database=None)
    @given(es.shapes())
    def run(shape):
        seen["0-d"] += len(shape) == 0
        seen["size-0"] += 0 in shape
        seen["size-1"] += 1 in shape

    run()
    assert seen["0-d"] and seen["size-0"] and seen["size-1"], seen


@PROPS
@given(es.shapes(compile_friendly=True, max_dims=3, max_side=8))
def test_compile_friendly_shapes(shape):
    """Compile-friendly shapes: two ndims at most (here 2 or 3), sides >= 2 from buckets."""
    assert len(shape) in (2, 3)
    assert all(d in (2, 4, 8) for d in shape)


@PROPS
@given(st.data())
def test_layouts_preserve_values(data):
    """Every layout but expanded keeps values exactly and makes a fresh storage; the layouts
    really differ from contiguous where the shape allows."""
    t = data.draw(es.tensors(shape=es.shapes(min_dims=1, max_dims=4),
                             dtype=st.sampled_from(ALL_DTYPES)))
    lay = data.draw(es.layouts(kinds=[k for k in es.LAYOUT_KINDS if k != "expanded"]))
    out = lay.apply(t)
    assert out.shape == t.shape and out.dtype == t.dtype
    assert torch.equal(out, t)
    if t.numel():
        assert out.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
    eff = lay.effective(t.shape)
    if eff.kind in ("transposed", "permuted", "channels_last"):
        assert not out.is_contiguous() or t.numel() <= 1
    if eff.kind in ("sliced", "window"):
        assert out.storage_offset() == eff.offset
        assert out.untyped_storage().nbytes() > out.numel() * out.element_size()


@PROPS
@given(es.tensors(shape=es.shapes(min_dims=1), layout="expanded", dtype=es.dtypes()))
def test_expanded_tensors_have_stride_zero(t):
    """An expanded tensor has a stride-0 dim of size > 1, or no dim of size > 1 at all."""
    if any(d > 1 for d in t.shape):
        assert any(s == 0 and d > 1 for d, s in zip(t.shape, t.stride()))
    if any(d > 1 for d in t.shape) and t.numel():
        assert t.untyped_storage().nbytes() < t.numel() * t.element_size()


def test_expanded_layout_repeats_the_first_slice():
    """Layout('expanded').apply keeps values constant along the dim and repeats slice 0."""
    t = torch.arange(6.0).reshape(2, 3)
    out = es.Layout("expanded", dim=1).apply(t)
    assert out.stride() == (1, 0)
    assert torch.equal(out, t[:, :1].expand(2, 3))
    const = torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]])
    assert torch.equal(es.Layout("expanded", dim=1).apply(const), const)


@PROPS
@given(st.data())
def test_aliasing_patterns_share_storage(data):
    """Each pattern has the promised storage identity and element overlap."""
    pattern = data.draw(st.sampled_from(es.ALIAS_PATTERNS))
    count = data.draw(st.integers(2, 3))
    ts = data.draw(es.aliased_arguments(count, pattern=pattern, requires_grad=True))
    assert len(ts) == count
    ptrs = {t.untyped_storage().data_ptr() for t in ts}
    elems = [elements_of(t) for t in ts]
    if pattern == "none":
        assert len(ptrs) == count
        return
    assert len(ptrs) == 1, "all slots must live in one storage"
    if pattern == "same":
        assert all(t is ts[0] for t in ts)
    elif pattern == "overlapping":
        assert all(t.shape == ts[0].shape for t in ts)
        assert all(elems[k] & elems[k + 1] for k in range(count - 1))
        assert all(elems[k] != elems[k + 1] for k in range(count - 1))
    elif pattern == "view-and-base":
        assert ts[0].is_leaf and all(t._base is ts[0] for t in ts[1:])
        assert all(e <= elems[0] and e != elems[0] for e in elems[1:])
    elif pattern == "disjoint":
        assert all(not (elems[i] & elems[j]) for i in range(count) for j in range(i + 1, count))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16,
                                   torch.complex64])
def test_values_are_dense(dtype):
    """Most common value of a 16x16 float tensor: at most 5% of elements (extra.numpy's
    background fill reaches a median of 99%)."""
    worst = 0.0

    @hypothesis.settings(max_examples=40, derandomize=True, database=None)
    @given(es.tensors(shape=(16, 16), dtype=dtype))
    def run(t):
        nonlocal worst
        counts = collections.Counter(t.reshape(-1).tolist())
        worst = max(worst, counts.most_common(1)[0][1] / t.numel())

    run()
    assert worst <= 0.05, worst


def test_integer_values_are_dense():
    """Integer tensors: the most common value is at most 25% of a 16x16 tensor."""
    worst = 0.0

    @hypothesis.settings(max_examples=40, derandomize=True, database=None)
    @given(es.tensors(shape=(16, 16), dtype=st.sampled_from(es.INTEGER)))
    def run(t):
        nonlocal worst
        worst = max(worst, collections.Counter(t.reshape(-1).tolist()).most_common(1)[0][1] / 256)

    run()
    assert worst <= 0.25, worst


def test_default_values_are_tie_free():
    """float32/float64 default values have no repeated element and no exact zero (no kinks);
    in half precision continuous values may collide (few representable values), so at most
    a tenth of the elements repeat one."""
    @hypothesis.settings(max_examples=60, derandomize=True, database=None)
    @given(es.tensors(shape=es.shapes(), dtype=st.sampled_from(es.FLOATING + es.HALF)))
    def run(t):
        flat = t.reshape(-1).float()
        if 0 < t.numel() <= 64:
            distinct = len(set(flat.tolist()))
            if t.dtype in es.FLOATING:
                assert distinct == t.numel()
                assert not (flat == 0).any()
            else:
                assert distinct >= 0.9 * t.numel()

    run()


def test_special_values_on_request():
    """special= plants each requested value somewhere across examples; none otherwise."""
    seen: set[str] = set()

    @hypothesis.settings(max_examples=80, derandomize=True, database=None)
    @given(es.tensors(shape=(4,), dtype=torch.float32, special=True))
    def run(t):
        seen.update(name for name, hit in [
            ("nan", t.isnan().any()), ("inf", (t == float("inf")).any()),
            ("-inf", (t == float("-inf")).any()),
            ("-0.0", ((t == 0) & t.signbit()).any()),
            ("subnormal", ((t != 0) & (t.abs() < torch.finfo(t.dtype).smallest_normal)).any()),
            ("large", (t.abs() > 1e37).any() & t.isfinite().all())] if hit)

    run()
    assert seen == set(es.SPECIAL_VALUES), seen


def test_elements_strategy_draws_each_element():
    t = draw_one(es.tensors(shape=(2, 3), dtype=torch.float64, elements=st.just(1.5)))
    assert torch.equal(t, torch.full((2, 3), 1.5, dtype=torch.float64))


@given(st.data())
def test_each_dimension_of_a_shape_may_be_a_strategy(data):
    n = data.draw(st.integers(1, 5))
    t = data.draw(es.tensors(shape=(st.integers(1, 4), n)))
    assert t.dim() == 2 and 1 <= t.shape[0] <= 4 and t.shape[1] == n


@pytest.mark.parametrize("bad, match", [
    (dict(layout="diagonal"), "unknown layout kind"),
    (dict(dtype="float32"), "give a torch.dtype"),
    (dict(special=["nan", "huge"]), "unknown"),
    (dict(shape=3), r"tensors\(shape=3\): give a tuple of ints"),
    (dict(shape=(2, "a")), "each dimension must be an int >= 0"),
    (dict(shape=(st.just(-1),)), r"drew the shape \(-1,\)"),
])
def test_bad_options_name_the_argument(bad, match):
    from equiv.errors import InvalidArgument

    options = {"shape": (2,), **bad}
    exc = InvalidArgument if "shape" in bad else (ValueError, TypeError)
    with pytest.raises(exc, match=match):
        draw_one(es.tensors(**options))


def test_dtypes_families_and_order():
    """dtypes() puts float64 first (the shrink target) and honours family flags."""
    assert es.dtypes().elements[0] == torch.float64
    assert set(es.dtypes(floating=False, half=False, integer=True).elements) == set(es.INTEGER)
    assert torch.bool in es.dtypes(boolean=True).elements
    with pytest.raises(ValueError, match="switched off"):
        es.dtypes(floating=False, half=False)


def test_devices_only_existing():
    devs = set(es.devices().elements)
    assert torch.device("cpu") in devs
    assert (torch.device("cuda") in devs) == torch.cuda.is_available()


def test_simple_values_shrink_target():
    """The minimal tensor is the ascending half-integers (simple, distinct, no zero)."""
    t = draw_one(es.tensors(shape=(2, 2), dtype=torch.float32))
    assert t.tolist() == [[-1.5, -0.5], [0.5, 1.5]]


def test_big_continuous_values_are_drawn_cheaply_and_still_differ_and_look_normal():
    from strategies._tensors import CHEAP_VALUES_ABOVE, _values

    shape = (CHEAP_VALUES_ABOVE // 100 + 3, 101)
    v = _values(1, 7, shape, torch.float64, 2.0)
    assert v.shape == shape and v.dtype == torch.float64
    assert v.unique().numel() == v.numel()
    assert torch.equal(v, _values(1, 7, shape, torch.float64, 2.0))  # seeded
    assert not torch.isclose(v, _values(1, 8, shape, torch.float64, 2.0)).any()
    assert 1.8 < v.std().item() < 2.2 and abs(v.mean().item()) < 0.3
    c = _values(1, 7, shape, torch.complex64, 2.0)
    assert c.dtype == torch.complex64 and c.real.unique().numel() > 0.99 * c.numel()
